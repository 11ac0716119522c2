"""Single-stream latency: every system on the same prompts, interleaved run by run (``latency.json``);
``python -m bench.latency breakdown``: where a served step's time goes (``bench.breakdown``).

Systems, on the shipped pair, one dtype and one torch thread per engine: splitspec served (speculation off, the
default policy, fixed k); the in-process reference loop, whose engine timings give the zero-overhead bound; vLLM
(``bench.vllm.VllmPeer``). Method: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import httpx

from bench import common
from bench.client import Scenario, add_arguments, complete, completion_body, serving
from bench.common import PEER_K, expected_tokens, floats, ints, log, median, per_token_acceptance, rnd, wrote

SERVED_STAT_FIELDS = ("mean_step_ms", "mean_exposed_ms", "mean_verify_rest_ms", "mean_handoff_ms", "mean_loop_ms",
                      "mean_transit_ms", "mean_forward_ms", "mean_draft_ms", "mean_draft_engine_ms", "mean_emit_ms",
                      "pre_draft_hits", "pre_draft_misses", "acceptance_rate", "mean_acceptance_length", "steps",
                      "drafter_recomputes", "verifier_recomputes", "state_recomputes", "aux_bytes_per_token")


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.latency", description="Single-stream latency of splitspec and "
                                 "its peers (`python -m bench.latency breakdown --help`: where a served step's time "
                                 "goes).")
    add_arguments(ap, prompts=3)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each (system, prompt)")
    ap.add_argument("--temperatures", type=floats, default=[0.0, 0.8])
    ap.add_argument("--sweep-temperatures", type=floats, default=[0.0],
                    help="temperatures that get the full k sweep (the others: k = default k and the peers' only)")
    ap.add_argument("--ks", type=ints, default=list(range(1, 9)), help="k sweep, e.g. 1-8 or 1,2,4")
    ap.add_argument("--vllm-ks", type=ints, default=[PEER_K], help="k of vLLM speculation (one engine each)")
    ap.add_argument("--no-vllm", action="store_true")
    return ap.parse_args(argv)


def served(client, url: str, k: int | None):
    """A served system's run(prompt ids, max tokens, temperature, seed)."""
    def run(ids, max_tokens, temperature, seed):
        r = complete(client, url, completion_body(ids, max_tokens, temperature, seed, k))
        return {"wall_s": r["latency_s"], "tokens": r["tokens"], "stats": r["speculation"],
                "output_ids": r["token_ids"]}
    return run


def build_systems(args, temperature: float, urls, client, ref, vllms) -> list[dict]:
    """The systems measured at one temperature: id, label, family, k, policy and run(prompt, max_tokens, seed)."""
    # off the sweep: the policy's ceiling and the peers' k, so the default is compared with both
    ks = sorted(set(args.ks if temperature in args.sweep_temperatures else [PEER_K]) | {args.default_k})

    def system(id_, label, family, k, policy, fn):
        return {"id": id_, "label": label, "family": family, "k": k, "policy": policy, "run": fn}

    def local(engine, k):
        return lambda p, m, t, sd: engine.run(p, m, t, sd, k)

    out = [system("splitspec_off", "splitspec served, speculation off (fast path)", "splitspec", 0, "off",
                  served(client, urls["adaptive"], 0)),
           system("splitspec_default", f"splitspec served, default policy (adaptive, k<={args.default_k})",
                  "splitspec", args.default_k, "adaptive", served(client, urls["adaptive"], None))]
    out += [system(f"splitspec_k{k}", f"splitspec served, fixed k={k}", "splitspec", k, "fixed",
                   served(client, urls["fixed"], k)) for k in ks]
    out += [system("reference_off", "reference loop, in-process, no speculation", "reference", 0, "off", local(ref, 0))]
    out += [system(f"reference_k{k}", f"reference loop, in-process, k={k}", "reference", k, "fixed", local(ref, k))
            for k in ks]
    for k, peer in sorted(vllms.items()):
        label = "vLLM, no speculation" if k == 0 else f"vLLM in-engine speculation (draft_model), k={k}"
        out.append(system("vllm_off" if k == 0 else f"vllm_k{k}", label, "vllm", k, "off" if k == 0 else "fixed",
                          peer.run))
    return out


def measure(args, systems, prompts, temperature: float) -> dict:
    """Interleaved runs, the order rotated per repeat; per system the per-run ms/token and what each run reported."""
    runs = {s["id"]: [] for s in systems}
    for s in systems:  # warm-up: one short run each (first-call costs: allocation, compilation, connection)
        s["run"](prompts[0][1], min(16, args.max_tokens), temperature, 7)
    for rep in range(args.repeats):
        order = systems[rep % len(systems):] + systems[: rep % len(systems)]
        for i, (_, ids) in enumerate(prompts):
            for s in order:
                r = s["run"](ids, args.max_tokens, temperature, 1000 + 100 * rep + i)
                r["pair"], r["ms_per_token"] = (rep, i), 1000 * r["wall_s"] / max(1, r["tokens"])
                runs[s["id"]].append(r)
            log(f"T={temperature} repeat {rep + 1}/{args.repeats} prompt {i + 1}/{len(prompts)}: " + ", ".join(
                f"{s['id']} {runs[s['id']][-1]['ms_per_token']:.1f}" for s in systems))
    return runs


def _entry(s: dict, rs: list[dict]) -> dict:
    """One system's figures over its runs."""
    entry = {"label": s["label"], "family": s["family"], "k": s["k"], "policy": s["policy"],
             "ms_per_token": rnd(median([r["ms_per_token"] for r in rs]), 3),
             "ms_per_token_runs": [rnd(r["ms_per_token"], 3) for r in rs],
             "tokens": median([r["tokens"] for r in rs]), "runs": len(rs), **_acceptance_counts(s, rs)}
    stats = [r["stats"] for r in rs if r.get("stats")]
    if s["family"] == "splitspec" and s["k"] > 0:
        for f in SERVED_STAT_FIELDS:
            if vals := [st[f] for st in stats if st.get(f) is not None]:
                entry[f"median_{f}"] = rnd(median(vals))
        entry["exposed_fraction_of_step"] = rnd(median([st["mean_exposed_ms"] / st["mean_step_ms"] for st in stats
                                                        if st.get("mean_step_ms")]))
    if s["family"] == "reference":
        entry["forward_ms_decode"] = rnd(1000 * median([x for r in rs for x in r["forward_s"][1:]]))
        # as the router reports a served request's (the mean per step, the prefill step included)
        entry["median_mean_forward_ms"] = rnd(1000 * median([sum(r["forward_s"]) / len(r["forward_s"]) for r in rs
                                                             if r["forward_s"]]))
        if s["k"] > 0:
            entry["draft_ms_decode"] = rnd(1000 * median([x for r in rs for x in r["draft_s"][1:]]))
    return entry


def summarise(args, systems, runs, temperature: float) -> dict:
    res = {s["id"]: _entry(s, runs[s["id"]]) for s in systems}
    # the fastest plain decoding among the peers one would use instead
    plain = [sid for sid, e in res.items() if e["k"] == 0 and e["family"] in ("splitspec", "vllm")]
    best = min(plain, key=lambda sid: res[sid]["ms_per_token"]) if plain else "reference_off"
    base = {r["pair"]: r["ms_per_token"] for r in runs[best]}
    ref_out = {r["pair"]: r.get("output_ids") for r in runs["reference_off"]}
    for sid, rs in runs.items():
        res[sid]["speedup_vs_best_plain"] = rnd(median([base[r["pair"]] / r["ms_per_token"] for r in rs
                                                        if r["pair"] in base]))
        if temperature == 0.0 and rs and "output_ids" in rs[0]:  # greedy is deterministic: a check, not a timing
            res[sid]["same_tokens_as_reference"] = all(r["output_ids"] == ref_out.get(r["pair"]) for r in rs)
    return {"best_plain": {"system": best, "ms_per_token": res[best]["ms_per_token"]}, "systems": res,
            "bound": bound(res)}


VLLM_SYSTEMS = ("vllm",)  # the families whose runs carry vLLM's own counters


def _acceptance_counts(s, rs) -> dict:
    """Pooled acceptance of a speculating system (per-token a for a fixed k, known per step)."""
    nd = na = ndt = full = 0
    # a run's counters under the names its system reports them by: vLLM's spec_decode metrics, else splitspec's
    key, names = ("spec", ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                           "spec_decode_num_accepted_tokens_per_pos")) if s["family"] in VLLM_SYSTEMS else \
        ("stats", ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos"))
    for r in rs if s["k"] else []:
        got = r.get(key) or {}
        counts, pos = [got.get(x, 0) for x in names[:3]], got.get(names[3]) or []
        nd, ndt, na = nd + counts[0], ndt + counts[1], na + counts[2]
        full += pos[s["k"] - 1] if len(pos) >= s["k"] else 0
    if not nd:
        return {}
    out = {"num_drafts": nd, "num_draft_tokens": ndt, "num_accepted_tokens": na,
           "acceptance_rate": rnd(na / ndt if ndt else 0.0), "mean_acceptance_length": rnd(1 + na / nd)}
    if s["policy"] == "fixed":  # (the last steps before max_tokens may draft fewer than k; their share is small)
        out["per_token_acceptance"] = rnd(per_token_acceptance(nd, na, full))
    return out


def _bound_row(e: dict, t1: float, served: dict | None) -> dict:
    k, a = e["k"], e["per_token_acceptance"]
    E, draft_ms, verify_ms = expected_tokens(a, k), e["draft_ms_decode"], e["forward_ms_decode"]
    cost, c = (draft_ms + verify_ms) / t1, draft_ms / k / t1  # one step and a draft token, in plain target forwards
    row = {"k": k, "per_token_acceptance": a, "expected_tokens_per_step": rnd(E),
           "measured_tokens_per_step": e.get("mean_acceptance_length"), "draft_ms": draft_ms,
           "verify_forward_ms": verify_ms, "plain_forward_ms": t1, "verify_cost_vs_plain": rnd(verify_ms / t1),
           "draft_cost_per_token_vs_plain": rnd(c), "step_cost_vs_plain": rnd(cost), "bound": rnd(E / cost),
           "textbook": rnd(E / (1 + k * c)),
           # each measured system's speed relative to zero-overhead plain decoding (t1 per token)
           "reference_speedup_vs_t1": rnd(t1 / e["ms_per_token"])}
    if served:
        row["served_speedup_vs_t1"] = rnd(t1 / served["ms_per_token"])
        row["served_fraction_of_bound"] = rnd(row["served_speedup_vs_t1"] / row["bound"])
    row["reference_fraction_of_bound"] = rnd(row["reference_speedup_vs_t1"] / row["bound"])
    return row


def bound(res: dict) -> dict:
    """The zero-overhead bound per k, from the reference loop's engine timings and acceptance."""
    if not (t1 := (res.get("reference_off") or {}).get("forward_ms_decode")):
        return {}
    per_k = [_bound_row(e, t1, res.get(f"splitspec_k{e['k']}")) for e in sorted(res.values(), key=lambda e: e["k"])
             if e["family"] == "reference" and e["k"] > 0 and e.get("per_token_acceptance") is not None]
    out = {"plain_forward_ms": t1, "per_k": per_k}
    if per_k:
        best = max(per_k, key=lambda r: r["bound"])
        out.update(best_k=best["k"], best_bound=best["bound"])
        if d := res.get("splitspec_default"):
            out["default_speedup_vs_t1"] = rnd(t1 / d["ms_per_token"])
            out["default_fraction_of_best_bound"] = rnd(out["default_speedup_vs_t1"] / best["bound"])
    return out


def start_vllm(args, stack, skipped: dict) -> tuple[dict, str | None]:
    """vLLM's engines, plain and at each --vllm-ks, started before anything is timed; ({} and why in
    ``skipped``) when vLLM is off, missing or fails to start."""
    from bench.vllm import VllmPeer

    if (vpy := None if args.no_vllm else common.vllm_python()) is None:
        skipped["vllm"] = "skipped: --no-vllm" if args.no_vllm else "skipped: vllm not importable"
        return {}, None
    vllms = {}
    try:
        for k in [0] + sorted(set(args.vllm_ks)):
            log(f"starting vLLM engine k={k} ({vpy})")
            vllms[k] = stack.enter_context(VllmPeer(vpy, k, args.threads, dtype=args.dtype))
        # loaded before Serve starts: on a 2-core machine Serve's proxy, starting beside two loading engines, can
        # miss its readiness checks (3 x 5 s) and be killed
        for k, peer in vllms.items():
            log(f"vLLM engine k={k} ready after {peer.wait_ready().get('load_s', 0):.0f} s")
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        skipped["vllm"] = f"failed: {str(e)[-2000:]}"
        return {}, vpy
    return vllms, vpy


def run(args, urls: dict | None = None) -> dict:
    """Measure everything; ``urls`` = {"adaptive": ..., "fixed": ...} of apps already deployed (else deployed here)."""
    from bench.inproc import Reference

    sc, t0, skipped = Scenario.from_args(args), time.perf_counter(), {}
    with contextlib.ExitStack() as stack:
        vllms, vpy = start_vllm(args, stack, skipped)
        urls = urls or stack.enter_context(serving({"adaptive": sc.app("adaptive"), "fixed": sc.app(
            "fixed", max(args.ks + [args.default_k]))}, args.threads))
        client = stack.enter_context(httpx.Client(timeout=600))
        log("loading in-process engines")
        ref = Reference(args.threads, args.dtype)
        wls, per_workload = sc.load(ref.tokenizer), {}
        for wl in wls:
            log(f"workload {wl.name}: {len(wl.prompts)} prompts")
            temps = {}
            for t in args.temperatures:
                systems = build_systems(args, t, urls, client, ref, vllms)
                temps[f"{t:g}"] = summarise(args, systems, measure(args, systems, wl.prompts, t), t)
            per_workload[wl.name] = {"workload": wl.describe(), "temperatures": temps}
    config = {**{f: getattr(args, f) for f in ("repeats", "temperatures", "sweep_temperatures", "ks", "vllm_ks")},
              "vllm_python": vpy, "vllm_version": next(iter(vllms.values())).info.get("vllm") if vllms else None}
    # ``temperatures``: the first workload's figures (the report's plots); ``workloads``: each one's
    return sc.record("latency", wls, t0, config=config, skipped=skipped,
                     temperatures=per_workload[wls[0].name]["temperatures"], workloads=per_workload)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["breakdown"]:
        from bench import breakdown

        return breakdown.main(argv[1:])
    args = parse(argv)
    return wrote(args.out, "latency", run(args))


if __name__ == "__main__":
    main()
