"""Render the scenarios' JSON in a folder into results.json, report.md, meta.json and cost.json.

``python -m bench.report --out DIR`` reads whichever of the ``SCENARIOS`` exist in DIR; cost.json is $ per million
output tokens from load.json's throughput and a price per pool replica-hour. The report shows measurements and their
bounds, each section with the command that measured it; goals belong to the decision records and issues.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from bench.common import DEFAULT_OUT, log, median, rnd
from bench.plan import check_markdown, md_table

SCENARIOS = ("latency", "breakdown", "load", "acceptance", "plan_check", "plan")
# Example prices per replica-hour: an H100-class GPU for the verifier pool, an L4-class one for the drafter pool
# (on-demand list prices' order of magnitude in 2025); the throughput is this machine's, so the cost says what the
# ratio of the two modes costs, not what a GPU deployment would
VERIFIER_PRICE, DRAFTER_PRICE = 3.00, 0.80
UNKNOWN = "unknown"


def load_all(out: Path) -> dict:
    return {name: json.loads((out / f"{name}.json").read_text()) for name in SCENARIOS
            if (out / f"{name}.json").exists()}


# ------------------------------------------------------------------ meta
def _one(values):
    """The value the scenarios agree on, the list of them where they differ, None where none recorded one."""
    seen = []
    for v in values:
        if v is not None and v not in seen:
            seen.append(v)
    return seen[0] if len(seen) == 1 else (seen or None)


def meta(data: dict, previous: dict | None = None) -> dict:
    """The machine and the code the figures came from, read off the scenarios' records. A field they do not record
    (figures measured before they recorded it) keeps ``previous``'s value (an earlier meta.json, perhaps written by
    hand) where that describes the same run (the same date, or none), else "unknown"."""
    envs = [d["environment"] for d in data.values() if d.get("environment")]
    cpu = [e for e in envs if "cpu_flags" in e]  # (before "cpu_flags", "cpu" was the architecture)
    m = {"machine": _one(e.get("machine") for e in envs), "cpu_model": _one(e.get("cpu") for e in cpu),
         "cpu_flags": _one(e.get("cpu_flags") for e in cpu), "host_cpus": _one(e.get("host_cpus") for e in envs),
         "dtype": _one((d.get("config") or {}).get("dtype") for d in data.values()),
         "torch_threads_per_engine": _one(e.get("threads_per_engine") for e in envs),
         "commit": _one(e.get("git_commit") for e in envs),
         "date": min((e["time"] for e in envs if e.get("time")), default=None),
         **{k: _one(e.get(k) for e in envs) for k in ("python", "torch", "transformers")},
         "commands": {name: _command(d) for name, d in data.items() if _command(d)}}
    if previous is not None and previous.get("date", m["date"]) == m["date"]:
        m |= {key: value for key, value in previous.items() if m.get(key) in (None, UNKNOWN, {}) or key not in m}
    return {k: UNKNOWN if v is None else v for k, v in m.items()}


def _command(d: dict) -> str | None:
    """How a scenario was run, without its ``--out`` (the folder its report is in)."""
    cmd = (d.get("environment") or {}).get("command")
    return re.sub(r"\s--out(=|\s+)\S+", "", cmd) if cmd else None


def _f(x, nd=2, suffix=""):
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "**no**"
    return f"{x:.{nd}f}{suffix}"


def _cmd(d: dict) -> str:
    took = f" ({d['duration_s'] / 60:.1f} min)" if d.get("duration_s") else ""
    return f"Command: `{_command(d)}`{took}.\n" if _command(d) else ""


def _listed(x) -> str:
    return ", ".join(map(str, x)) if isinstance(x, list) else str(x)


# ------------------------------------------------------------------ cost
def cost(load: dict, verifier_price: float = VERIFIER_PRICE, drafter_price: float = DRAFTER_PRICE) -> dict:
    """$ per million output tokens from load.json's throughput: with speculation on both pools run, with it off
    only the verifier's (the drafter pool scales to zero); hourly cost / (tokens/s x 3600) x 1e6."""
    nv, nd = load["config"].get("verifier_replicas", 1), load["config"].get("drafter_replicas", 1)
    hourly_on, hourly_off = nv * verifier_price + nd * drafter_price, nv * verifier_price

    def per_million(hourly, tok_s):
        return hourly / (tok_s * 3600) * 1e6 if tok_s and tok_s > 0 else None

    def row(lv):
        on, off = lv["spec_on"]["throughput_tok_s"], lv["spec_off"]["throughput_tok_s"]
        c_on, c_off = per_million(hourly_on, on), per_million(hourly_off, off)
        return {"concurrency": lv["concurrency"], "throughput_on_tok_s": on, "throughput_off_tok_s": off,
                "usd_per_m_tokens_on": rnd(c_on), "usd_per_m_tokens_off": rnd(c_off),
                "cost_ratio_on_vs_off": rnd(c_on / c_off) if c_on and c_off else None}

    return {"scenario": "cost", "workloads": {name: {"levels": [row(lv) for lv in w["levels"]]}
                                              for name, w in (load.get("workloads") or {}).items()},
            "prices": {"verifier_usd_per_hour": verifier_price, "drafter_usd_per_hour": drafter_price,
                       "verifier_replicas": nv, "drafter_replicas": nd, "hourly_on": hourly_on,
                       "hourly_off": hourly_off},
            "note": "speculation off needs no drafter pool; throughput measured by the load scenario",
            "levels": [row(lv) for lv in load["levels"]]}


# ------------------------------------------------------------------ sections
def _fixed(sy: dict, off: bool) -> dict:
    return {sid: e for sid, e in sy.items() if (off and sid == "splitspec_off")
            or (sid.startswith("splitspec_k") and sid[len("splitspec_k"):].isdigit())}


def policy_ratio(sy: dict) -> tuple[float, str, float] | None:
    """The default policy over the best fixed k (speculation off included: the fixed setting with the lowest median,
    as a user picking one k would), paired per (prompt, repeat), and over the per-run oracle (the best of every fixed
    k in each run, which no one setting reaches). (ratio, the best fixed system, oracle ratio)."""
    d, fixed = sy.get("splitspec_default"), _fixed(sy, off=True)
    runs = {sid: e.get("ms_per_token_runs") or [] for sid, e in fixed.items()}
    if not d or not fixed or not d.get("ms_per_token_runs") or \
            any(len(r) != len(d["ms_per_token_runs"]) for r in runs.values()):
        return None
    best = min(fixed, key=lambda sid: fixed[sid]["ms_per_token"])
    m = rnd(median([x / b for x, b in zip(d["ms_per_token_runs"], runs[best])]), 3)
    oracle = rnd(median([x / min(r[i] for r in runs.values()) for i, x in enumerate(d["ms_per_token_runs"])]), 3)
    return m, best, oracle


def workload_rows(g: dict) -> dict:
    """One workload's systems one would choose between at one temperature, and the default policy's acceptance."""
    sy, fixed = g["systems"], _fixed(g["systems"], off=False)
    pick = {"off": "splitspec_off", "default": "splitspec_default", "vllm_plain": "vllm_off",
            "best_fixed": min(fixed, key=lambda sid: fixed[sid]["ms_per_token"], default=None),
            "vllm_spec": next((sid for sid in sy if sid.startswith("vllm_k")), None),
            "transformers_assisted": next((sid for sid in sy if sid.startswith("transformers_k")), None)}
    row = {name: {"system": sid, "k": sy[sid]["k"], "ms_per_token": sy[sid]["ms_per_token"],
                  "speedup_vs_best_plain": sy[sid]["speedup_vs_best_plain"]} if sid in sy else None
           for name, sid in pick.items()}
    d = sy.get("splitspec_default") or {}
    return {**row, "acceptance_rate": d.get("acceptance_rate"),
            "mean_acceptance_length": d.get("mean_acceptance_length"), "best_plain": g["best_plain"]}


def _cell(x) -> str:
    return "n/a" if not x else (f"{_f(x['ms_per_token'])} ({_f(x['speedup_vs_best_plain'])}x)"
                                + (f", k={x['k']}" if x["system"].startswith("splitspec_k") else ""))


def workload_section(data: dict) -> list[str]:
    """Every workload side by side: served off, default, best fixed k, vLLM, transformers assisted, acceptance."""
    if not (lat := data.get("latency") or {}).get("workloads"):
        return []
    rows = []
    for name, w in (lat.get("workloads") or {}).items():
        for t, g in w["temperatures"].items():
            r, p = workload_rows(g), policy_ratio(g["systems"])
            rows.append([name, w["workload"]["prompts"], t] + [_cell(r[c]) for c in (
                "off", "default", "best_fixed", "vllm_plain", "vllm_spec", "transformers_assisted")]
                + [_f(r["acceptance_rate"], 3), _f(r["mean_acceptance_length"]),
                   f"{_f(p[0], 3)} ({p[1]}; {_f(p[2], 3)})" if p else "n/a"])
    L = ["## Per workload", "", "Single stream, ms/token (speed-up over the best plain system of the same workload in "
         "brackets); acceptance: the default policy's accepted / drafted tokens and tokens per step; default / best "
         "fixed k: the default policy's ms/token over the fixed setting (speculation off included) with the lowest "
         "median, paired per (prompt, repeat), and in brackets over the best of every fixed setting in each run.", ""]
    L += md_table(["workload", "prompts", "temperature", "served, off", "served, default", "best fixed k", "vLLM plain",
                   "vLLM in-engine", "transformers assisted", "acceptance rate", "tokens/step",
                   "default / best fixed k"], rows) + [""]
    return L


def acceptance_section(acc: dict | None) -> list[str]:
    """bench.acceptance's figures: per workload, drafter and temperature, E(k) and the distribution."""
    if not acc:
        return []
    c = acc["config"]
    L = ["## Acceptance per workload", "", _cmd(acc),
         f"{acc['source'].replace('_', ' ')}, {c['prompts'] or 'all'} prompts per workload x {c['max_tokens']} "
         f"tokens, k-max {c['k_max']}; mean acceptance length (tokens per drafting step) at k = 1..{c['k_max']} "
         "derived from the k-max run, with the length measured at "
         + (", ".join(f"k = {k}" for k in c["measure_ks"]) or "no other k") + " beside it.", ""]

    def listed(xs):
        return ", ".join(f"{x:.2f}" for x in xs if x is not None)

    return L + md_table(
        ["workload", "drafter", "T", "acceptance rate", "per-token a", "E(k), k = 1..", "measured",
         "accepted 0..k-max (share of steps)"],
        [[r["workload"], r["drafter"], f"{r['temperature']:g}", _f(r["acceptance_rate"], 3),
          _f(r["per_token_acceptance"], 3), listed(r["mean_acceptance_length_by_k"]), ", ".join(
              f"k={k}: {v:.2f}" for k, v in (r.get("measured_mean_acceptance_length") or {}).items()) or "n/a",
          listed(r["accepted_length_distribution"])] for r in acc["results"]]) + [""]


def plan_section(pl: dict | None, rows: int = 6) -> list[str]:
    """bench.plan's deployment shapes on the GPU catalogue: the cheapest few and the recommendation (unvalidated)."""
    if not pl:
        return []
    t, rec = pl["traffic"], pl.get("recommendation")
    L = ["## The planner on the GPU catalogue (unvalidated projections)", "",
         (f"`python -m bench.plan`: verifier `{pl['verifier']['name']}`, drafter "
          f"`{(pl.get('drafter') or {}).get('name', 'none')}`, acceptance {pl['acceptance']}; "
          + (f"{t['concurrency']} concurrent streams" if t["rate_rps"] is None else f"{t['rate_rps']} requests/s")
          + f", {t['prompt_tokens']} prompt and {t['output_tokens']} output tokens, target {pl['tpot_ms']} ms per "
          f"output token; the cheapest {rows} of {len(pl['shapes'])} shapes (all of them in plan.md, the "
          "recommendation's serve config in plan_serve.yaml). Datasheet figures and example prices (bench/gpus.yaml): "
          "no GPU has measured them."),
         ""]
    L += md_table(["shape", "meets target", "k", "batch / replica", "ms/token", "verifier replicas", "drafter replicas",
                   "$ / 1M output tokens"],
                  [[r["shape"], "yes" if r["meets_target"] else "no", r["k"], r["batch"], _f(r["tpot_ms"]),
                    r["verifier_replicas"], r["drafter_replicas"], _f(r["usd_per_m_tokens"], 3)]
                   for r in [r for r in pl["shapes"] if r["fits"]][:rows]])
    return L + ["", f"Recommendation: {rec['shape']}, k = {rec['k']}." if rec else "No shape meets the target.", "",
                "![plan.png](plan.png)", ""]


def latency_section(lat: dict | None) -> list[str]:
    """bench.latency's tables per temperature, each with its zero-overhead bound."""
    if not lat:
        return []
    c = lat["config"]
    L = ["## Single-stream latency", "", _cmd(lat),
         (f"{', '.join(c['workloads'])}: {c['prompts'] or 'all'} prompts each (the tables below: the first)"
          if c.get("workloads") else f"{c['prompts']} held-out prompts")  # a run from before workloads
         + f" x {c['repeats']} repeats, {c['max_tokens']} new tokens (ignore_eos), "
         f"prompt lengths {c['prompt_tokens']} tokens; medians; speed-up = per-run ratio to the best plain system "
         f"in the same (repeat, prompt), then the median. vLLM {c.get('vllm_version') or 'n/a'}."
         + (f" Skipped: {lat['skipped']}." if lat.get("skipped") else ""), ""]
    for t, g in lat["temperatures"].items():
        L += [f"### temperature {t}", "", f"Best plain decoding: `{g['best_plain']['system']}` "
              f"({g['best_plain']['ms_per_token']} ms/token).", ""]
        L += md_table(["system", "k", "ms/token", "speed-up vs best plain", "acceptance rate", "tokens/step",
                       "exposed/step", "same tokens as reference"],
                      [[e["label"], e["k"], _f(e["ms_per_token"]), f"{_f(e['speedup_vs_best_plain'])}x",
                        _f(e.get("acceptance_rate"), 3), _f(e.get("mean_acceptance_length")),
                        _f(e.get("exposed_fraction_of_step"), 3), _f(e["same_tokens_as_reference"])
                        if "same_tokens_as_reference" in e else "n/a"] for e in g["systems"].values()])
        L += _bound_table(g.get("bound", {})) + [""]
    return L


def _bound_table(b: dict) -> list[str]:
    if not b.get("per_k"):
        return []
    L = ["", f"Zero-overhead bound (plain 1-token forward: {b['plain_forward_ms']} ms). Speed-ups here are "
         "relative to that bare forward pass, not to a measured system.", ""]
    L += md_table(["k", "per-token acceptance a", "E tokens/step", "measured tokens/step",
                   "verify cost (plain forwards)", "drafter cost/token", "step cost", "**bound**",
                   "textbook (verify = 1)", "served", "served / bound", "reference loop / bound"],
                  [[r["k"], _f(r["per_token_acceptance"], 3), _f(r["expected_tokens_per_step"]),
                    _f(r["measured_tokens_per_step"]), _f(r["verify_cost_vs_plain"]),
                    _f(r["draft_cost_per_token_vs_plain"], 3), _f(r["step_cost_vs_plain"]), f"**{_f(r['bound'])}x**",
                    f"{_f(r['textbook'])}x", f"{_f(r.get('served_speedup_vs_t1'))}x",
                    _f(r.get("served_fraction_of_bound")), _f(r.get("reference_fraction_of_bound"))]
                   for r in b["per_k"]])
    if b.get("default_fraction_of_best_bound") is not None:
        L.append(f"\nDefault policy: {_f(b['default_speedup_vs_t1'])}x over a bare forward = "
                 f"{_f(b['default_fraction_of_best_bound'])} of the best bound ({_f(b['best_bound'])}x at "
                 f"k={b['best_k']}).")
    return L


def breakdown_section(bd: dict | None) -> list[str]:
    """bench.latency breakdown's parts of a served step per config, and the drafters side by side."""
    if not bd:
        return []
    c = bd["config"]
    per_wl = {name: w["per_config"] for name, w in (bd.get("workloads") or {}).items()} or {None: bd["per_config"]}
    L = ["## Where the time goes (per speculative step, served, streaming)", "", _cmd(bd),
         f"{c['prompts']} prompts" + (" of each workload" if c.get("workloads") else "")
         + f" x {c['max_tokens']} tokens, temperature {c['temperature']}; medians over requests.", ""]
    L += md_table(([] if None in per_wl else ["workload"]) + [
        "config", "mean k", "step ms", "drafting (critical path)", "verify forward", "RPC/queue/accept",
        "detokenise/stream", "tokens/step", "ms/token", "pre-draft hit rate", "exposed fraction"],
        [([] if wl is None else [wl]) + [name] + [_f(e[f]) for f in (
            "mean_k", "step_ms", "draft_ms", "verify_forward_ms", "rpc_queue_ms", "detok_stream_ms", "tokens_per_step",
            "ms_per_token", "pre_draft_hit_rate")] + [_f(e["exposed_fraction"], 3)]
         for wl, per in per_wl.items() for name, e in per.items()])
    return L + [""] + heads_section(bd)


def heads_section(bd: dict) -> list[str]:
    """The drafters served side by side (bench.breakdown's heads), each at its best fixed k."""
    if not (hd := bd.get("heads")):
        return []
    c = bd["config"]
    L = ["## Drafters served: the draft model and the heads", "",
         (f"The same run, {hd['workload']}, {c['prompts']} prompts x {c['max_tokens']} tokens, greedy, fixed k: the "
          f"draft model over k = {', '.join(map(str, c['ks']))}, each head over k = "
          f"{', '.join(map(str, c['head_ks']))} (`--head DIR` adds one); each at its best k. Drafting on the path: the "
          "drafter's time on the router's critical path per step (0 when a pre-draft hid it), of which in the drafter "
          "engine; the rest is the channel."), ""]
    return L + md_table(
        ["drafter", "method", "best k", "ms/token", "drafting on the path ms/step", "of which engine",
         "verify forward ms", "tokens/step", "pre-draft hit rate", "ms/token by k"],
        [[f"{name} (`{h['path']}`)", h["method"], h.get("best_k")] + [_f((h.get("best") or {}).get(f)) for f in (
            "ms_per_token", "draft_ms", "draft_engine_ms", "verify_forward_ms", "tokens_per_step",
            "pre_draft_hit_rate")]
         + [", ".join(f"k={k}: {_f(r['ms_per_token'])}" for k, r in h["by_k"].items())]
         for name, h in hd["drafters"].items()]) + [""]


def load_section(ld: dict | None) -> list[str]:
    """bench.load's levels, speculation on and off."""
    if not ld:
        return []
    c, wl = ld["config"], bool(ld.get("workloads"))
    per_wl = {name: w["levels"] for name, w in (ld.get("workloads") or {}).items()} or {None: ld["levels"]}
    L = ["## Load (streaming clients, closed loop)", "", _cmd(ld),
         f"{c['max_tokens']} tokens per request, temperature {c['temperature']}, at least {c['min_requests']} "
         f"requests per level, {c['verifier_replicas']} verifier + {c['drafter_replicas']} drafter replica. "
         "ITL = gap between streamed chunks; TPOT = (latency - TTFT) / (tokens - 1).", ""]

    def pair(e, f):
        return f"{_f(e[f'{f}_p50'], 1)} / {_f(e[f'{f}_p99'], 1)}"

    return L + md_table(
        (["workload"] if wl else []) + ["streams", "mode", "tok/s", "TTFT p50 / p99 ms", "ITL p50 / p99 ms",
                                        "TPOT p50 / p99 ms", "tokens/chunk", "mean k", "on/off throughput"],
        [([name] if name is not None else []) + [lv["concurrency"], mode, _f(e["throughput_tok_s"], 1)]
         + [pair(e, f) for f in ("ttft_ms", "itl_ms", "tpot_ms")] + [_f(e["tokens_per_chunk"]), _f(e["mean_k"]),
                                                                     _f(lv["throughput_ratio_on_vs_off"])
                                                                     if mode == "spec_on" else ""]
         for name, levels in per_wl.items() for lv in levels
         for mode, e in ((m, lv[m]) for m in ("spec_on", "spec_off"))]) + [""]


def cost_section(co: dict | None) -> list[str]:
    """$ per million output tokens per level, speculation on and off."""
    if not co:
        return []
    p = co["prices"]
    per_wl = {name: w["levels"] for name, w in (co.get("workloads") or {}).items()} or {None: co["levels"]}
    L = ["## Cost per million output tokens", "",
         f"Verifier pool {p['verifier_replicas']} x ${p['verifier_usd_per_hour']}/h, drafter pool "
         f"{p['drafter_replicas']} x ${p['drafter_usd_per_hour']}/h (speculation off needs no drafter pool); "
         "throughput as measured above.", ""]
    return L + md_table(([] if None in per_wl else ["workload"]) + [
        "streams", "$/1M tokens, speculation on", "off", "on / off"],
        [([] if wl is None else [wl]) + [r["concurrency"], _f(r["usd_per_m_tokens_on"], 2),
                                         _f(r["usd_per_m_tokens_off"], 2), _f(r["cost_ratio_on_vs_off"], 3)]
         for wl, levels in per_wl.items() for r in levels]) + [""]


def markdown(data: dict, m: dict | None = None) -> str:
    m = m or meta(data)
    known = m["cpu_model"] != UNKNOWN
    cpu = _listed(m["cpu_model"]) if known else m.get("cpu_description") or "a CPU"
    L = [f"# splitspec benchmark report: {_listed(m['machine'])}", "",
         f"Measured {m['date']} at commit {_listed(m['commit'])} on {cpu} ("
         + ("" if known else "model name not recorded; ") + f"{m['host_cpus']} CPUs; the flags the "
         f"engines pick kernels by: {_listed(m['cpu_flags'])}), {_listed(m['dtype'])} for every system, "
         f"{_listed(m['torch_threads_per_engine'])} torch thread(s) per engine, "
         f"torch {_listed(m['torch'])}, transformers {_listed(m['transformers'])}."
         + (f" {m['notes']}" if m.get("notes") else ""), ""]
    if load := [d["environment"]["load_average_at_start"] for d in data.values()
                if (d.get("environment") or {}).get("load_average_at_start")]:
        L += ["Load average (1, 5, 15 min) when each scenario started: "
              + "; ".join(f"{a:.2f}, {b:.2f}, {c:.2f}" for a, b, c in load) + ".", ""]
    L += ["What `make bench` wrote here: one JSON per scenario (latency.json, breakdown.json, load.json, "
          "acceptance.json, plan_check.json, plan.json; cost.json from load.json's throughput), results.json (every "
          "figure), meta.json (the machine and the code the figures came from) and this report. Each "
          "section names the command that measured it.", ""]
    L += workload_section(data) + acceptance_section(data.get("acceptance"))
    if data.get("plan_check"):
        L += ["## " + check_markdown(data["plan_check"]).lstrip("# ").replace("\n## ", "\n### "), ""]
    L += plan_section(data.get("plan")) + latency_section(data.get("latency"))
    L += breakdown_section(data.get("breakdown"))
    L += load_section(data.get("load")) + cost_section(data.get("cost"))
    return "\n".join(L)


def render(out: Path, verifier_price: float = VERIFIER_PRICE, drafter_price: float = DRAFTER_PRICE) -> dict:
    out = Path(out)
    if not (data := load_all(out)):
        raise SystemExit(f"no scenario results in {out}")
    if "load" in data:
        data["cost"] = cost(data["load"], verifier_price, drafter_price)
        (out / "cost.json").write_text(json.dumps(data["cost"], indent=1) + "\n")
    previous = json.loads((out / "meta.json").read_text()) if (out / "meta.json").exists() else None
    m = meta({k: v for k, v in data.items() if k != "cost"}, previous)
    (out / "results.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "meta.json").write_text(json.dumps(m, indent=1) + "\n")
    (out / "report.md").write_text(markdown(data, m))
    return data


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.report", description="Render bench results (JSON) into "
                                 "report.md, results.json, meta.json and cost.json.")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--verifier-price", type=float, default=VERIFIER_PRICE, help="$ per hour of a verifier replica")
    ap.add_argument("--drafter-price", type=float, default=DRAFTER_PRICE, help="$ per hour of a drafter replica")
    args = ap.parse_args(argv)
    render(Path(args.out), args.verifier_price, args.drafter_price)
    log(f"wrote {args.out}/report.md, results.json, meta.json")


if __name__ == "__main__":
    main()
