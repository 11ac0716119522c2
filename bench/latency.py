"""Single-stream latency: every system on the same prompts, interleaved run by run (``python -m bench.latency``,
``latency.json``); ``python -m bench.latency breakdown`` is where a served step's time goes (``bench.breakdown``).

Systems, all on the shipped pair, one dtype and one torch thread per engine: splitspec served over HTTP
(speculation off, the default policy, fixed k); the in-process reference loop (``core.loop``: the same engines, no
RPC), whose per-call engine timings give the zero-overhead bound; transformers ``generate`` (plain and assisted);
vLLM (``bench.vllm.VllmPeer``). Each (repeat, prompt) runs every system once, in an order rotated per repeat;
ratios are taken within a (repeat, prompt) before the median. The bound at k: E(k) = (1 - a^(k+1)) / (1 - a)
tokens per step at the measured per-token acceptance a, over one step's cost with no overhead (k drafter passes
and one (k + 1)-token verification, timed in the engines) in plain one-token forwards; the textbook variant
assumes the verification costs one plain forward (docs/benchmarks.md, Method).
"""


from __future__ import annotations

import argparse
import contextlib
import sys
import time

from bench.client import Scenario, add_arguments, complete, completion_body, floats, ints, serving
from bench.common import PEER_K, expected_tokens, log, median, per_token_acceptance, rnd, vllm_python, write_json

SERVED_STAT_FIELDS = ("mean_step_ms", "mean_exposed_ms", "mean_verify_rest_ms", "mean_handoff_ms", "mean_loop_ms",
                      "mean_transit_ms", "mean_forward_ms", "mean_draft_ms", "mean_draft_engine_ms", "mean_emit_ms",
                      "pre_draft_hits", "pre_draft_misses", "acceptance_rate", "mean_acceptance_length", "steps",
                      "drafter_recomputes", "verifier_recomputes", "state_recomputes", "aux_bytes_per_token")


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.latency",
                                 description="Single-stream latency of splitspec and its peers on the shipped model pair "
                                             "(`python -m bench.latency breakdown --help`: where a served step's time goes).")
    add_arguments(ap, prompts=3)
    ap.add_argument("--repeats", type=int, default=2, help="runs of each (system, prompt)")
    ap.add_argument("--temperatures", type=floats, default=[0.0, 0.8])
    ap.add_argument("--sweep-temperatures", type=floats, default=[0.0],
                    help="temperatures that get the full k sweep (the others: k = default k only)")
    ap.add_argument("--ks", type=ints, default=list(range(1, 9)), help="k sweep, e.g. 1-8 or 1,2,4")
    ap.add_argument("--hf-ks", type=ints, default=[PEER_K], help="k of transformers assisted generation")
    ap.add_argument("--vllm-ks", type=ints, default=[PEER_K], help="k of vLLM speculation (one engine each)")
    ap.add_argument("--no-serve", action="store_true")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-vllm", action="store_true")
    return ap.parse_args(argv)


def served(client, url: str, k: int | None):
    """A served system's run(prompt ids, max tokens, temperature, seed)."""
    def run(ids, max_tokens, temperature, seed):
        r = complete(client, url, completion_body(ids, max_tokens, temperature, seed, k))
        return {"wall_s": r["latency_s"], "tokens": r["tokens"], "stats": r["speculation"], "output_ids": r["token_ids"]}
    return run


def build_systems(args, temperature: float, urls, client, ref, hf, vllms) -> list[dict]:
    """The systems measured at one temperature: id, label, family, k, policy and run(prompt, max_tokens, seed)."""
    # off the sweep: the policy's ceiling and the peers' k, so the default is compared with both
    ks = sorted(set(args.ks if temperature in args.sweep_temperatures else [PEER_K]) | {args.default_k})
    out = []

    def add(id_, label, family, k, policy, fn):
        out.append({"id": id_, "label": label, "family": family, "k": k, "policy": policy, "run": fn})

    if urls:
        add("splitspec_off", "splitspec served, speculation off (fast path)", "splitspec", 0, "off",
            served(client, urls["adaptive"], 0))
        add("splitspec_default", f"splitspec served, default policy (adaptive, k<={args.default_k})", "splitspec",
            args.default_k, "adaptive", served(client, urls["adaptive"], None))
        for k in ks:
            add(f"splitspec_k{k}", f"splitspec served, fixed k={k}", "splitspec", k, "fixed", served(client, urls["fixed"], k))
    add("reference_off", "reference loop, in-process, no speculation", "reference", 0, "off",
        lambda p, m, t, sd: ref.run(p, m, t, sd, 0))
    for k in ks:
        add(f"reference_k{k}", f"reference loop, in-process, k={k}", "reference", k, "fixed",
            lambda p, m, t, sd, k=k: ref.run(p, m, t, sd, k))
    if hf is not None:
        add("transformers_off", "transformers generate", "transformers", 0, "off", lambda p, m, t, sd: hf.run(p, m, t, sd, 0))
        for k in args.hf_ks:
            add(f"transformers_k{k}", f"transformers assisted generation, k={k}", "transformers", k, "fixed",
                lambda p, m, t, sd, k=k: hf.run(p, m, t, sd, k))
    for k, peer in sorted(vllms.items()):
        label = "vLLM, no speculation" if k == 0 else f"vLLM in-engine speculation (draft_model), k={k}"
        add("vllm_off" if k == 0 else f"vllm_k{k}", label, "vllm", k, "off" if k == 0 else "fixed", peer.run)
    return out


def measure(args, systems, prompts, temperature: float) -> dict:
    """Interleaved runs; per system the per-run ms/token and what each run reported."""
    runs = {s["id"]: [] for s in systems}
    # warm-up: one short run each (first-call costs: allocation, compilation, connection)
    for s in systems:
        s["run"](prompts[0][1], min(16, args.max_tokens), temperature, 7)
    for rep in range(args.repeats):
        order = systems[rep % len(systems):] + systems[: rep % len(systems)]
        for i, (_, ids) in enumerate(prompts):
            seed = 1000 + 100 * rep + i
            for s in order:
                r = s["run"](ids, args.max_tokens, temperature, seed)
                r["pair"] = (rep, i)
                r["ms_per_token"] = 1000 * r["wall_s"] / max(1, r["tokens"])
                runs[s["id"]].append(r)
            log(f"T={temperature} repeat {rep + 1}/{args.repeats} prompt {i + 1}/{len(prompts)}: " + ", ".join(
                f"{s['id']} {runs[s['id']][-1]['ms_per_token']:.1f}" for s in systems))
    return runs


def summarise(args, systems, runs, temperature: float) -> dict:
    by_id = {s["id"]: s for s in systems}
    res = {}
    for sid, rs in runs.items():
        s = by_id[sid]
        entry = {"label": s["label"], "family": s["family"], "k": s["k"], "policy": s["policy"],
                 "ms_per_token": rnd(median([r["ms_per_token"] for r in rs]), 3),
                 "ms_per_token_runs": [rnd(r["ms_per_token"], 3) for r in rs],
                 "tokens": median([r["tokens"] for r in rs]), "runs": len(rs)}
        counts = _acceptance_counts(s, rs)
        if counts:
            entry.update(counts)
        if s["family"] == "splitspec" and s["k"] > 0:
            for f in SERVED_STAT_FIELDS:
                vals = [r["stats"].get(f) for r in rs if r.get("stats") and r["stats"].get(f) is not None]
                if vals:
                    entry[f"median_{f}"] = rnd(median(vals), 4)
            fr = [r["stats"]["mean_exposed_ms"] / r["stats"]["mean_step_ms"] for r in rs
                  if r.get("stats") and r["stats"].get("mean_step_ms")]
            entry["exposed_fraction_of_step"] = rnd(median(fr), 4)
        if s["family"] == "reference":
            entry["forward_ms_decode"] = rnd(1000 * median([x for r in rs for x in r["forward_s"][1:]]), 4)
            # what the router reports for a served request (median over requests of the mean per step,
            # the prefill step included), to set beside the served rows' median_mean_forward_ms
            entry["median_mean_forward_ms"] = rnd(1000 * median([sum(r["forward_s"]) / len(r["forward_s"]) for r in rs
                                                                 if r["forward_s"]]), 4)
            if s["k"] > 0:
                entry["draft_ms_decode"] = rnd(1000 * median([x for r in rs for x in r["draft_s"][1:]]), 4)
        res[sid] = entry
    # fastest plain decoding among the peers one would use instead
    plain = [sid for sid in res if res[sid]["k"] == 0 and res[sid]["family"] in ("splitspec", "vllm", "transformers")]
    best = min(plain, key=lambda sid: res[sid]["ms_per_token"]) if plain else "reference_off"
    base = {r["pair"]: r["ms_per_token"] for r in runs[best]}
    for sid, rs in runs.items():
        ratios = [base[r["pair"]] / r["ms_per_token"] for r in rs if r["pair"] in base]
        res[sid]["speedup_vs_best_plain"] = rnd(median(ratios), 4)
    # outputs identical to the reference loop (greedy is deterministic; a check, not a timing)
    if temperature == 0.0:
        ref_out = {r["pair"]: r.get("output_ids") for r in runs["reference_off"]}
        for sid, rs in runs.items():
            if rs and "output_ids" in rs[0]:
                res[sid]["same_tokens_as_reference"] = all(r["output_ids"] == ref_out.get(r["pair"]) for r in rs)
    out = {"best_plain": {"system": best, "ms_per_token": res[best]["ms_per_token"]}, "systems": res}
    out["bound"] = bound(res)
    return out


def _acceptance_counts(s, rs) -> dict:
    """Pooled acceptance of a fixed-k system (per-token a needs a known k per step)."""
    if s["k"] == 0:
        return {}
    nd = na = ndt = full = 0
    for r in rs:
        st = r.get("stats") or {}
        if s["family"] == "vllm":
            sp = r.get("spec") or {}
            if not sp:
                continue
            nd += sp.get("spec_decode_num_drafts", 0)
            ndt += sp.get("spec_decode_num_draft_tokens", 0)
            na += sp.get("spec_decode_num_accepted_tokens", 0)
            pos = sp.get("spec_decode_num_accepted_tokens_per_pos") or []
            full += pos[s["k"] - 1] if len(pos) >= s["k"] else 0
        elif st.get("num_drafts"):
            nd += st["num_drafts"]
            ndt += st["num_draft_tokens"]
            na += st["num_accepted_tokens"]
            pos = st.get("accepted_per_pos") or []
            full += pos[s["k"] - 1] if len(pos) >= s["k"] else 0
    if not nd:
        return {}
    out = {"num_drafts": nd, "num_draft_tokens": ndt, "num_accepted_tokens": na,
           "acceptance_rate": rnd(na / ndt if ndt else 0.0), "mean_acceptance_length": rnd(1 + na / nd)}
    if s["policy"] == "fixed":
        # (the last steps before max_tokens may draft fewer than k; their share is small)
        out["per_token_acceptance"] = rnd(per_token_acceptance(nd, na, full))
    return out


def bound(res: dict) -> dict:
    """The zero-overhead bound per k, from the reference loop's engine timings and acceptance."""
    ref0 = res.get("reference_off")
    if not ref0 or not ref0.get("forward_ms_decode"):
        return {}
    t1 = ref0["forward_ms_decode"]
    per_k = []
    for sid, e in sorted(res.items(), key=lambda kv: kv[1]["k"]):
        if e["family"] != "reference" or e["k"] == 0 or e.get("per_token_acceptance") is None or "eagle3" in sid:
            continue
        k, a = e["k"], e["per_token_acceptance"]
        E = expected_tokens(a, k)
        draft_ms, verify_ms = e["draft_ms_decode"], e["forward_ms_decode"]
        cost = (draft_ms + verify_ms) / t1  # one step, in plain target forwards
        c = draft_ms / k / t1
        row = {"k": k, "per_token_acceptance": a, "expected_tokens_per_step": rnd(E),
               "measured_tokens_per_step": e.get("mean_acceptance_length"),
               "draft_ms": draft_ms, "verify_forward_ms": verify_ms, "plain_forward_ms": t1,
               "verify_cost_vs_plain": rnd(verify_ms / t1), "draft_cost_per_token_vs_plain": rnd(c),
               "step_cost_vs_plain": rnd(cost), "bound": rnd(E / cost), "textbook": rnd(E / (1 + k * c)),
               # how fast each measured system ran relative to zero-overhead plain decoding (t1 per token)
               "reference_speedup_vs_t1": rnd(t1 / e["ms_per_token"])}
        served = res.get(f"splitspec_k{k}")
        if served:
            row["served_speedup_vs_t1"] = rnd(t1 / served["ms_per_token"])
            row["served_fraction_of_bound"] = rnd(row["served_speedup_vs_t1"] / row["bound"])
        row["reference_fraction_of_bound"] = rnd(row["reference_speedup_vs_t1"] / row["bound"])
        per_k.append(row)
    out = {"plain_forward_ms": t1, "per_k": per_k}
    if per_k:
        best = max(per_k, key=lambda r: r["bound"])
        out["best_k"] = best["k"]
        out["best_bound"] = best["bound"]
        d = res.get("splitspec_default")
        if d:
            out["default_speedup_vs_t1"] = rnd(t1 / d["ms_per_token"])
            out["default_fraction_of_best_bound"] = rnd(out["default_speedup_vs_t1"] / best["bound"])
    return out


def start_vllm(args, stack, skipped: dict) -> tuple[dict, str | None]:
    """vLLM's engines, plain and at each --vllm-ks, started one after the other before anything is timed;
    ({} and why in ``skipped``) when vLLM is off, missing or fails to start."""
    from bench.vllm import VllmPeer

    vpy = None if args.no_vllm else vllm_python()
    if vpy is None:
        skipped["vllm"] = "skipped: --no-vllm" if args.no_vllm else "skipped: vllm not importable"
        return {}, None
    vllms = {}
    try:
        for k in [0] + sorted(set(args.vllm_ks)):
            log(f"starting vLLM engine k={k} ({vpy})")
            vllms[k] = VllmPeer(vpy, k, args.threads, dtype=args.dtype)
            stack.callback(vllms[k].close)
        # loaded before Serve starts: on a 2-core machine Serve's proxy, starting beside two loading
        # engines, can miss its readiness checks (3 x 5 s) and be killed
        for k, peer in vllms.items():
            peer.wait_ready()
            log(f"vLLM engine k={k} ready after {peer.info.get('load_s', 0):.0f} s")
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        skipped["vllm"] = f"failed: {str(e)[-2000:]}"
        return {}, vpy
    return vllms, vpy


def run(args, urls: dict | None = None) -> dict:
    """Measure everything; ``urls`` = {"adaptive": ..., "fixed": ...} of already deployed apps
    (else, unless --no-serve, they are deployed here)."""
    import httpx

    from bench.inproc import Reference, Transformers

    sc, t0, skipped = Scenario.from_args(args), time.perf_counter(), {}
    with contextlib.ExitStack() as stack:
        vllms, vpy = start_vllm(args, stack, skipped)
        if urls is None and not args.no_serve:
            urls = stack.enter_context(serving({"adaptive": sc.app("adaptive"),
                                                "fixed": sc.app("fixed", max(args.ks + [args.default_k]))}, args.threads))
        client = stack.enter_context(httpx.Client(timeout=600))
        log("loading in-process engines")
        ref = Reference(args.threads, args.dtype)
        hf = None if args.no_hf else Transformers(args.threads, args.dtype)
        if args.no_hf:
            skipped["transformers"] = "skipped: --no-hf"
        wls = sc.load(ref.tokenizer)
        per_workload = {}
        for wl in wls:
            log(f"workload {wl.name}: {len(wl.prompts)} prompts")
            temps = {}
            for t in args.temperatures:
                systems = build_systems(args, t, None if args.no_serve else urls, client, ref, hf, vllms)
                temps[f"{t:g}"] = summarise(args, systems, measure(args, systems, wl.prompts, t), t)
            per_workload[wl.name] = {"workload": wl.describe(), "temperatures": temps}
    config = {"repeats": args.repeats, "temperatures": args.temperatures, "sweep_temperatures": args.sweep_temperatures,
              "ks": args.ks, "hf_ks": args.hf_ks, "vllm_ks": args.vllm_ks, "vllm_python": vpy,
              "vllm_version": next(iter(vllms.values())).info.get("vllm") if vllms else None}
    # ``temperatures``: the first workload's figures (the report's plots); ``workloads``: each one's
    return sc.record("latency", wls, t0, config=config, skipped=skipped,
                     temperatures=per_workload[wls[0].name]["temperatures"], workloads=per_workload)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["breakdown"]:
        from bench import breakdown

        return breakdown.main(argv[1:])
    args = parse(argv)
    data = run(args)
    log(f"wrote {write_json(args.out, 'latency', data)} ({data['duration_s']} s)")
    return data


if __name__ == "__main__":
    main()
