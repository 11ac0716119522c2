"""Render the scenarios' JSON into one results.json, a Markdown report, meta.json and PNG plots.

``python -m bench.report --out DIR`` reads whichever of latency.json, breakdown.json, load.json,
acceptance.json, plan_check.json and plan.json exist in DIR; from load.json's throughput and a price
per pool replica-hour it writes cost.json ($ per million output tokens with speculation on and off);
then results.json (every figure), report.md (the machine and commit, the measurements and their
bounds, each with the command that measured it), meta.json (the machine and the code the figures
came from) and speedup_vs_k.png, breakdown.png, load.png. Goals and whether they are met belong to
the decision records and issues, not here.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from bench.common import DEFAULT_OUT, log, median, rnd

SCENARIOS = ("latency", "breakdown", "load", "acceptance", "plan_check", "plan", "vllm_structured")
# Example prices per replica-hour: an H100-class GPU for the verifier pool, an L4-class one for the drafter pool
# (on-demand list prices' order of magnitude in 2025); the throughput is this machine's, so the cost says what the
# ratio of the two modes costs, not what a GPU deployment would
VERIFIER_PRICE, DRAFTER_PRICE = 3.00, 0.80


def load_all(out: Path) -> dict:
    data = {}
    for name in SCENARIOS:
        p = out / f"{name}.json"
        if p.exists():
            data[name] = json.loads(p.read_text())
    return data


# ------------------------------------------------------------------ meta
UNKNOWN = "unknown"


def _one(values):
    """The value the scenarios agree on, the list of them where they differ, None where none recorded one."""
    seen = []
    for v in values:
        if v is not None and v not in seen:
            seen.append(v)
    return seen[0] if len(seen) == 1 else (seen or None)


def meta(data: dict, previous: dict | None = None) -> dict:
    """The machine and the code the figures came from, read off the scenarios' own records
    (``environment``, ``config``). A field they do not record (figures measured before they recorded
    it) keeps ``previous``'s value (an earlier meta.json, perhaps written by hand) where that describes
    the same run (the same date, or none), else "unknown"."""
    envs = [d["environment"] for d in data.values() if d.get("environment")]
    configs = [d.get("config") or {} for d in data.values()]
    # (the CPU's model name and flags are recorded since "cpu_flags" is; "cpu" alone was the architecture)
    cpu = [e for e in envs if "cpu_flags" in e]
    m = {"machine": _one(e.get("machine") for e in envs),
         "cpu_model": _one(e.get("cpu") for e in cpu),
         "cpu_flags": _one(e.get("cpu_flags") for e in cpu),
         "host_cpus": _one(e.get("host_cpus") for e in envs),
         "dtype": _one(c.get("dtype") for c in configs),
         "torch_threads_per_engine": _one(e.get("threads_per_engine") for e in envs),
         "commit": _one(e.get("git_commit") for e in envs),
         "date": min((e["time"] for e in envs if e.get("time")), default=None),
         "python": _one(e.get("python") for e in envs),
         "torch": _one(e.get("torch") for e in envs),
         "transformers": _one(e.get("transformers") for e in envs),
         "commands": {name: _command(d) for name, d in data.items() if _command(d)}}
    same_run = previous is not None and previous.get("date", m["date"]) == m["date"]
    for key, value in (previous or {}).items() if same_run else ():
        if m.get(key) in (None, UNKNOWN, {}) or key not in m:
            m[key] = value
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


def sweep_temperature(lat: dict) -> str | None:
    for t, v in lat["temperatures"].items():
        if v.get("bound", {}).get("per_k"):
            return t
    return None


# ------------------------------------------------------------------ cost
def cost(load: dict, verifier_price: float = VERIFIER_PRICE, drafter_price: float = DRAFTER_PRICE) -> dict:
    """$ per million output tokens from load.json's throughput: with speculation on both pools run, with it off
    only the verifier's (the drafter pool scales to zero); hourly cost / (tokens/s x 3600) x 1e6."""
    nv, nd = load["config"].get("verifier_replicas", 1), load["config"].get("drafter_replicas", 1)
    hourly_on, hourly_off = nv * verifier_price + nd * drafter_price, nv * verifier_price

    def per_million(hourly, tok_s):
        return hourly / (tok_s * 3600) * 1e6 if tok_s and tok_s > 0 else None

    def rows_of(levels):
        rows = []
        for lv in levels:
            on, off = lv["spec_on"]["throughput_tok_s"], lv["spec_off"]["throughput_tok_s"]
            c_on, c_off = per_million(hourly_on, on), per_million(hourly_off, off)
            rows.append({"concurrency": lv["concurrency"], "throughput_on_tok_s": on, "throughput_off_tok_s": off,
                         "usd_per_m_tokens_on": rnd(c_on, 4), "usd_per_m_tokens_off": rnd(c_off, 4),
                         "cost_ratio_on_vs_off": rnd(c_on / c_off, 4) if c_on and c_off else None})
        return rows

    return {"scenario": "cost", "workloads": {name: {"levels": rows_of(w["levels"])}
                                              for name, w in (load.get("workloads") or {}).items()},
            "prices": {"verifier_usd_per_hour": verifier_price, "drafter_usd_per_hour": drafter_price,
                       "verifier_replicas": nv, "drafter_replicas": nd, "hourly_on": hourly_on, "hourly_off": hourly_off},
            "note": "speculation off needs no drafter pool; throughput measured by the load scenario",
            "levels": rows_of(load["levels"])}


def policy_ratio(sy: dict) -> tuple[float, str, float] | None:
    """The default policy against the best fixed k (speculation off included): the fixed system with the lowest
    median ms/token over the workload's runs, as a user picking one k for the workload would; paired, the median
    of default / it in each (prompt, repeat). Beside it the per-run oracle: the best of every fixed k in each run,
    which no single setting reaches (the best k differs by prompt). (ratio, the best fixed system, oracle ratio)."""
    d = sy.get("splitspec_default")
    fixed = {sid: e for sid, e in sy.items() if sid == "splitspec_off" or
             (sid.startswith("splitspec_k") and sid[len("splitspec_k"):].isdigit())}
    runs = {sid: e.get("ms_per_token_runs") or [] for sid, e in fixed.items()}
    if not d or not fixed or not d.get("ms_per_token_runs") or any(len(r) != len(d["ms_per_token_runs"])
                                                                   for r in runs.values()):
        return None
    best = min(fixed, key=lambda sid: fixed[sid]["ms_per_token"])
    m = rnd(median([x / b for x, b in zip(d["ms_per_token_runs"], runs[best])]), 3)
    oracle = rnd(median([x / min(r[i] for r in runs.values()) for i, x in enumerate(d["ms_per_token_runs"])]), 3)
    return m, best, oracle


# ------------------------------------------------------------------ markdown
def _cmd(d: dict) -> str:
    took = f" ({d['duration_s'] / 60:.1f} min)" if d.get("duration_s") else ""
    return f"Command: `{_command(d)}`{took}.\n" if _command(d) else ""


def _listed(x) -> str:
    return ", ".join(map(str, x)) if isinstance(x, list) else str(x)


def workload_rows(g: dict) -> dict:
    """One workload's summary at one temperature: ms/token of the systems one would choose between and
    the default policy's acceptance; speed-ups are the paired medians against the best plain system."""
    sy = g["systems"]
    fixed = {sid: e for sid, e in sy.items() if sid.startswith("splitspec_k") and sid[len("splitspec_k"):].isdigit()}
    best = min(fixed, key=lambda sid: fixed[sid]["ms_per_token"], default=None)
    pick = {"off": "splitspec_off", "default": "splitspec_default", "best_fixed": best, "vllm_plain": "vllm_off",
            "vllm_spec": next((sid for sid in sy if sid.startswith("vllm_k")), None),
            "transformers_assisted": next((sid for sid in sy if sid.startswith("transformers_k")), None)}
    row = {name: ({"system": sid, "k": sy[sid]["k"], "ms_per_token": sy[sid]["ms_per_token"],
                   "speedup_vs_best_plain": sy[sid]["speedup_vs_best_plain"]} if sid in sy else None)
           for name, sid in pick.items()}
    d = sy.get("splitspec_default") or {}
    row["acceptance_rate"] = d.get("acceptance_rate")
    row["mean_acceptance_length"] = d.get("mean_acceptance_length")
    row["best_plain"] = g["best_plain"]
    return row


def workload_section(data: dict) -> list[str]:
    """Every workload side by side: served off, default, best fixed k, vLLM, transformers assisted, acceptance."""
    lat, ld = data.get("latency") or {}, data.get("load") or {}
    if not lat.get("workloads") and not ld.get("workloads"):
        return []
    L = ["## Per workload", "", "Single stream, ms/token (speed-up over the best plain system of the same workload in "
         "brackets); acceptance: the default policy's accepted / drafted tokens and tokens per step; default / best "
         "fixed k: the default policy's ms/token over the fixed setting (speculation off included) with the lowest "
         "median, paired per (prompt, repeat), and in brackets over the best of every fixed setting in each run.", "",
         "| workload | prompts | temperature | served, off | served, default | best fixed k | vLLM plain | vLLM in-engine "
         "| transformers assisted | acceptance rate | tokens/step | default / best fixed k |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def cell(x):
        return "n/a" if not x else (f"{_f(x['ms_per_token'])} ({_f(x['speedup_vs_best_plain'])}x)"
                                    + (f", k={x['k']}" if x["system"].startswith("splitspec_k") else ""))

    for name, w in (lat.get("workloads") or {}).items():
        for t, g in w["temperatures"].items():
            r, p = workload_rows(g), policy_ratio(g["systems"])
            L.append(f"| {name} | {w['workload']['prompts']} | {t} | {cell(r['off'])} | {cell(r['default'])} | "
                     f"{cell(r['best_fixed'])} | {cell(r['vllm_plain'])} | {cell(r['vllm_spec'])} | "
                     f"{cell(r['transformers_assisted'])} | {_f(r['acceptance_rate'], 3)} | {_f(r['mean_acceptance_length'])} | "
                     + (f"{_f(p[0], 3)} ({p[1]}; {_f(p[2], 3)}) |" if p else "n/a |"))
    L.append("")
    if ld.get("workloads"):
        L += ["Load: throughput with speculation on / off, per workload and number of streams.", "",
              "| workload | " + " | ".join(f"{lv['concurrency']} streams" for lv in ld["levels"]) + " |",
              "|---|" + "---|" * len(ld["levels"])]
        for name, w in ld["workloads"].items():
            L.append(f"| {name} | " + " | ".join(f"{_f(lv['throughput_ratio_on_vs_off'])}x" for lv in w["levels"]) + " |")
        L.append("")
    return L


def plan_section(pl: dict | None, rows: int = 6) -> list[str]:
    """bench.plan's deployment shapes on the GPU catalogue: the cheapest few and the recommendation (unvalidated)."""
    if not pl:
        return []
    t = pl["traffic"]
    L = ["## The planner on the GPU catalogue (unvalidated projections)", "",
         (f"`python -m bench.plan`: verifier `{pl['verifier']['name']}`, drafter "
          f"`{(pl.get('drafter') or {}).get('name', 'none')}`, acceptance {pl['acceptance']}; "
          + (f"{t['concurrency']} concurrent streams" if t["rate_rps"] is None else f"{t['rate_rps']} requests/s")
          + f", {t['prompt_tokens']} prompt and {t['output_tokens']} output tokens, target {pl['tpot_ms']} ms per output "
          f"token; the cheapest {rows} of {len(pl['shapes'])} shapes (all of them in plan.md, the recommendation's serve "
          "config in plan_serve.yaml). Datasheet figures and example prices (bench/gpus.yaml): no GPU has measured them."), "",
         "| shape | meets target | k | batch / replica | ms/token | verifier replicas | drafter replicas | $ / 1M output tokens |",
         "|---|---|---|---|---|---|---|---|"]
    for r in [r for r in pl["shapes"] if r["fits"]][:rows]:
        L.append(f"| {r['shape']} | {'yes' if r['meets_target'] else 'no'} | {r['k']} | {r['batch']} | {_f(r['tpot_ms'])} | "
                 f"{r['verifier_replicas']} | {r['drafter_replicas']} | {_f(r['usd_per_m_tokens'], 3)} |")
    rec = pl.get("recommendation")
    L += ["", f"Recommendation: {rec['shape']}, k = {rec['k']}." if rec else "No shape meets the target.", "",
          "![plan.png](plan.png)", ""]
    return L


def heads_section(bd: dict) -> list[str]:
    """The drafters served side by side (bench.breakdown's heads): each at its best fixed k, ms/token and drafting on the
    critical path per step from the responses' timing breakdown."""
    hd = bd.get("heads")
    if not hd:
        return []
    c = bd["config"]
    L = ["## Drafters served: the draft model and the heads", "",
         (f"The same run, {hd['workload']}, {c['prompts']} prompts x {c['max_tokens']} tokens, greedy, fixed k: the draft "
          f"model over k = {', '.join(map(str, c['ks']))}, each head over k = {', '.join(map(str, c['head_ks']))} "
          "(`--head DIR` adds one); each at its best k. Drafting on the path: the drafter's time on the router's critical "
          "path per step (0 when a pre-draft hid it), of which in the drafter engine; the rest is the channel."), "",
         "| drafter | method | best k | ms/token | drafting on the path ms/step | of which engine | verify forward ms | "
         "tokens/step | pre-draft hit rate | ms/token by k |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, h in hd["drafters"].items():
        b = h.get("best") or {}
        byk = ", ".join(f"k={k}: {_f(r['ms_per_token'])}" for k, r in h["by_k"].items())
        L.append(f"| {name} (`{h['path']}`) | {h['method']} | {h.get('best_k')} | {_f(b.get('ms_per_token'))} | "
                 f"{_f(b.get('draft_ms'))} | {_f(b.get('draft_engine_ms'))} | {_f(b.get('verify_forward_ms'))} | "
                 f"{_f(b.get('tokens_per_step'))} | {_f(b.get('pre_draft_hit_rate'))} | {byk} |")
    return L + [""]


def acceptance_section(acc: dict | None) -> list[str]:
    """bench.acceptance's figures: per workload, drafter and temperature, E(k) and the distribution."""
    if not acc:
        return []
    c = acc["config"]
    L = ["## Acceptance per workload", "", _cmd(acc),
         f"{acc['source'].replace('_', ' ')}, {c['prompts'] or 'all'} prompts per workload x {c['max_tokens']} tokens, "
         f"k-max {c['k_max']}; mean acceptance length (tokens per drafting step) at k = 1..{c['k_max']} derived from the "
         "k-max run, with the length measured at " + (", ".join(f"k = {k}" for k in c["measure_ks"]) or "no other k")
         + " beside it.", "",
         "| workload | drafter | T | acceptance rate | per-token a | E(k), k = 1.. | measured | accepted 0..k-max (share of steps) |",
         "|---|---|---|---|---|---|---|---|"]
    for r in acc["results"]:
        meas = ", ".join(f"k={k}: {v:.2f}" for k, v in (r.get("measured_mean_acceptance_length") or {}).items())
        L.append(f"| {r['workload']} | {r['drafter']} | {r['temperature']:g} | {_f(r['acceptance_rate'], 3)} | "
                 f"{_f(r['per_token_acceptance'], 3)} | {', '.join(f'{x:.2f}' for x in r['mean_acceptance_length_by_k'])} | "
                 f"{meas or 'n/a'} | {', '.join(f'{x:.2f}' for x in r['accepted_length_distribution'] if x is not None)} |")
    return L + ["", "![acceptance.png](acceptance.png)", ""]


def structured_section(st: dict | None) -> list[str]:
    """``bench.vllm structured``: JSON answers under a schema each, per system."""
    if not st:
        return []
    c = st["config"]
    return ["## Structured outputs (JSON schemas)", "", _cmd(st),
            f"{st['workload']['prompts']} prompts, a schema each, greedy, at most {c['max_tokens']} tokens, k = {c['k']}, "
            "one thread; `_forced`: the grammar's forced tokens drafted for free; vLLM's steps: tokens - accepted drafts.",
            "", "| system | tokens / step | ms / token | median ms / token | same tokens as off |", "|---|---|---|---|---|"] + [
        f"| {n} | {_f(r['tokens_per_step'])} | {_f(r['ms_per_token'])} | {_f(r['median_ms_per_token'])} | "
        f"{_f(r['same_tokens_as_off'])} |" for n, r in st["systems"].items()] + [""]


def latency_section(lat: dict | None) -> list[str]:
    """bench.latency's tables per temperature, each with its zero-overhead bound."""
    if not lat:
        return []
    L = []
    c = lat["config"]
    L += ["## Single-stream latency", "", _cmd(lat),
          (f"{', '.join(c['workloads'])}: {c['prompts'] or 'all'} prompts each (the tables below: the first)"
           if c.get("workloads") else f"{c['prompts']} held-out prompts")  # a run from before workloads
          + f" x {c['repeats']} repeats, {c['max_tokens']} new tokens (ignore_eos), "
          f"prompt lengths {c['prompt_tokens']} tokens; medians; speed-up = per-run ratio to the best plain system "
          f"in the same (repeat, prompt), then the median. vLLM {c.get('vllm_version') or 'n/a'}."
          + (f" Skipped: {lat['skipped']}." if lat.get("skipped") else ""), ""]
    for t, g in lat["temperatures"].items():
        L += [f"### temperature {t}", "", f"Best plain decoding: `{g['best_plain']['system']}` "
              f"({g['best_plain']['ms_per_token']} ms/token).", "",
              "| system | k | ms/token | speed-up vs best plain | acceptance rate | tokens/step | exposed/step | same tokens as reference |",
              "|---|---|---|---|---|---|---|---|"]
        for sid, e in g["systems"].items():
            L.append(f"| {e['label']} | {e['k']} | {_f(e['ms_per_token'])} | {_f(e['speedup_vs_best_plain'])}x | "
                     f"{_f(e.get('acceptance_rate'), 3)} | {_f(e.get('mean_acceptance_length'))} | "
                     f"{_f(e.get('exposed_fraction_of_step'), 3)} | "
                     f"{_f(e.get('same_tokens_as_reference')) if 'same_tokens_as_reference' in e else 'n/a'} |")
        b = g.get("bound", {})
        if b.get("per_k"):
            L += ["", f"Zero-overhead bound (plain 1-token forward: {b['plain_forward_ms']} ms). Speed-ups here are "
                  "relative to that bare forward pass, not to a measured system.", "",
                  "| k | per-token acceptance a | E tokens/step | measured tokens/step | verify cost (plain forwards) | "
                  "drafter cost/token | step cost | **bound** | textbook (verify = 1) | served | served / bound | reference loop / bound |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
            for r in b["per_k"]:
                L.append(f"| {r['k']} | {_f(r['per_token_acceptance'], 3)} | {_f(r['expected_tokens_per_step'])} | "
                         f"{_f(r['measured_tokens_per_step'])} | {_f(r['verify_cost_vs_plain'])} | "
                         f"{_f(r['draft_cost_per_token_vs_plain'], 3)} | {_f(r['step_cost_vs_plain'])} | "
                         f"**{_f(r['bound'])}x** | {_f(r['textbook'])}x | {_f(r.get('served_speedup_vs_t1'))}x | "
                         f"{_f(r.get('served_fraction_of_bound'))} | {_f(r.get('reference_fraction_of_bound'))} |")
            if b.get("default_fraction_of_best_bound") is not None:
                L.append(f"\nDefault policy: {_f(b['default_speedup_vs_t1'])}x over a bare forward = "
                         f"{_f(b['default_fraction_of_best_bound'])} of the best bound ({_f(b['best_bound'])}x at k={b['best_k']}).")
        L.append("")
    return L


def breakdown_section(bd: dict | None) -> list[str]:
    """bench.latency breakdown's parts of a served step per config, and the drafters side by side."""
    if not bd:
        return []
    L = []
    c = bd["config"]
    per_wl = {name: w["per_config"] for name, w in (bd.get("workloads") or {}).items()} or {None: bd["per_config"]}
    L += ["## Where the time goes (per speculative step, served, streaming)", "", _cmd(bd),
          f"{c['prompts']} prompts" + (" of each workload" if c.get("workloads") else "")
          + f" x {c['max_tokens']} tokens, temperature {c['temperature']}; medians over requests.", "",
          "| " + ("workload | " if len(per_wl) > 1 or None not in per_wl else "")
          + "config | mean k | step ms | drafting (critical path) | verify forward | RPC/queue/accept | detokenise/stream | "
          "tokens/step | ms/token | pre-draft hit rate | exposed fraction |",
          "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if None not in per_wl else "")]
    for wl, per in per_wl.items():
        for name, e in per.items():
            L.append("| " + (f"{wl} | " if wl is not None else "")
                     + f"{name} | {_f(e['mean_k'])} | {_f(e['step_ms'])} | {_f(e['draft_ms'])} | {_f(e['verify_forward_ms'])} | "
                     f"{_f(e['rpc_queue_ms'])} | {_f(e['detok_stream_ms'])} | {_f(e['tokens_per_step'])} | "
                     f"{_f(e['ms_per_token'])} | {_f(e['pre_draft_hit_rate'])} | {_f(e['exposed_fraction'], 3)} |")
    L.append("")
    L += heads_section(bd)
    return L


def load_section(ld: dict | None) -> list[str]:
    """bench.load's levels, speculation on and off."""
    if not ld:
        return []
    L = []
    c = ld["config"]
    L += ["## Load (streaming clients, closed loop)", "", _cmd(ld),
          f"{c['max_tokens']} tokens per request, temperature {c['temperature']}, at least {c['min_requests']} "
          f"requests per level, {c['verifier_replicas']} verifier + {c['drafter_replicas']} drafter replica. "
          "ITL = gap between streamed chunks; TPOT = (latency - TTFT) / (tokens - 1).", "",
          "| " + ("workload | " if ld.get("workloads") else "") + "streams | mode | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
          "TPOT p50 / p99 ms | tokens/chunk | mean k | on/off throughput |",
          "|---|---|---|---|---|---|---|---|---|" + ("---|" if ld.get("workloads") else "")]
    per_wl = {name: w["levels"] for name, w in (ld.get("workloads") or {}).items()} or {None: ld["levels"]}
    for wl, lv, mode in ((wl, lv, mode) for wl, levels in per_wl.items() for lv in levels for mode in ("spec_on", "spec_off")):
        e = lv[mode]
        L.append("| " + (f"{wl} | " if wl is not None else "") + f"{lv['concurrency']} | {mode} | "
                 f"{_f(e['throughput_tok_s'], 1)} | {_f(e['ttft_ms_p50'], 1)} / "
                 f"{_f(e['ttft_ms_p99'], 1)} | {_f(e['itl_ms_p50'], 1)} / {_f(e['itl_ms_p99'], 1)} | "
                 f"{_f(e['tpot_ms_p50'], 1)} / {_f(e['tpot_ms_p99'], 1)} | {_f(e['tokens_per_chunk'])} | "
                 f"{_f(e['mean_k'])} | {_f(lv['throughput_ratio_on_vs_off']) if mode == 'spec_on' else ''} |")
    L.append("")
    return L


def cost_section(co: dict | None) -> list[str]:
    """$ per million output tokens per level, speculation on and off."""
    if not co:
        return []
    L = []
    p = co["prices"]
    L += ["## Cost per million output tokens", "",
          f"Verifier pool {p['verifier_replicas']} x ${p['verifier_usd_per_hour']}/h, drafter pool "
          f"{p['drafter_replicas']} x ${p['drafter_usd_per_hour']}/h (speculation off needs no drafter pool); "
          "throughput as measured above.", "",
          "| streams | $/1M tokens, speculation on | off | on / off |", "|---|---|---|---|"]
    per_wl = {name: w["levels"] for name, w in (co.get("workloads") or {}).items()} or {None: co["levels"]}
    if None not in per_wl:
        L[-2:] = ["| workload | streams | $/1M tokens, speculation on | off | on / off |", "|---|---|---|---|---|"]
    for wl, levels in per_wl.items():
        for r in levels:
            L.append("| " + (f"{wl} | " if wl is not None else "") + f"{r['concurrency']} | {_f(r['usd_per_m_tokens_on'], 2)} | "
                     f"{_f(r['usd_per_m_tokens_off'], 2)} | {_f(r['cost_ratio_on_vs_off'], 3)} |")
    L.append("")
    return L


def markdown(data: dict, plots: list[str], m: dict | None = None) -> str:
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
    load = [d["environment"]["load_average_at_start"] for d in data.values()
            if (d.get("environment") or {}).get("load_average_at_start")]
    if load:
        L += ["Load average (1, 5, 15 min) when each scenario started: "
              + "; ".join(f"{a:.2f}, {b:.2f}, {c:.2f}" for a, b, c in load) + ".", ""]
    L += ["What `make bench` wrote here: one JSON per scenario (latency.json, breakdown.json, load.json, "
          "acceptance.json, plan_check.json, plan.json; cost.json from load.json's throughput), results.json (every "
          "figure), meta.json (the machine and the code the figures came from), this report and its plots. Each "
          "section names the command that measured it.", ""]
    L += workload_section(data)
    L += acceptance_section(data.get("acceptance"))
    L += structured_section(data.get("vllm_structured"))
    if data.get("plan_check"):
        from bench.plan import check_markdown

        L += ["## " + check_markdown(data["plan_check"]).lstrip("# ").replace("\n## ", "\n### "), ""]
    L += plan_section(data.get("plan"))
    L += latency_section(data.get("latency")) + breakdown_section(data.get("breakdown"))
    L += load_section(data.get("load")) + cost_section(data.get("cost"))
    if plots:
        L += ["## Plots", ""] + [f"![{p}]({p})" for p in plots] + [""]
    return "\n".join(L)


# ------------------------------------------------------------------ plots
def plot_all(data: dict, out: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")

    made = [plot_speedup(data.get("latency"), out), plot_breakdown(data.get("breakdown"), out),
            plot_load(data.get("load"), out)]
    return [p for p in made if p]


def plot_speedup(lat: dict | None, out: Path) -> str | None:
    """Speed-up over a bare plain forward by k: the bound, the textbook bound, each system."""
    import matplotlib.pyplot as plt

    t = sweep_temperature(lat) if lat else None
    if t is None:
        return None
    g = lat["temperatures"][t]
    b, sy = g["bound"], g["systems"]
    t1 = b["plain_forward_ms"]
    ks = [r["k"] for r in b["per_k"]]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(ks, [r["bound"] for r in b["per_k"]], "k-o", label="zero-overhead bound (measured step cost)")
    ax.plot(ks, [r["textbook"] for r in b["per_k"]], "k:", marker="x", label="textbook (verify = 1 plain step)")
    for fam, style, name in (("splitspec", "C0-s", "splitspec served, fixed k"), ("reference", "C1-^", "reference loop, in-process")):
        pts = sorted((e["k"], t1 / e["ms_per_token"]) for sid, e in sy.items()
                     if e["family"] == fam and e["k"] > 0 and e["policy"] == "fixed")
        if pts:
            ax.plot(*zip(*pts), style, label=name)
    for fam, marker, name in (("transformers", "D", "transformers assisted"), ("vllm", "*", "vLLM spec decode")):
        pts = [(e["k"], t1 / e["ms_per_token"]) for e in sy.values() if e["family"] == fam and e["k"] > 0]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, s=70, zorder=5, label=name)
    if "splitspec_default" in sy:
        ax.axhline(t1 / sy["splitspec_default"]["ms_per_token"], color="C0", ls="--", lw=1,
                   label="splitspec default policy")
    ax.axhline(t1 / g["best_plain"]["ms_per_token"], color="C3", ls="-.", lw=1,
               label=f"best plain ({g['best_plain']['system']})")
    ax.set_xlabel("k (draft tokens per step)")
    ax.set_ylabel("speed-up over a bare plain forward per token")
    ax.set_title(f"Single-stream speed-up vs k (temperature {t})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(out / "speedup_vs_k.png", dpi=80)
    plt.close(fig)
    return "speedup_vs_k.png"


def plot_breakdown(bd: dict | None, out: Path) -> str | None:
    """The parts of a speculative step per config, stacked."""
    import matplotlib.pyplot as plt

    if not bd:
        return None
    names = list(bd["per_config"])
    es = [bd["per_config"][n] for n in names]
    parts = [("draft_ms", "drafting (critical path)"), ("verify_forward_ms", "verify forward"),
             ("rpc_queue_ms", "RPC / queueing / accept"), ("detok_stream_ms", "detokenise / stream")]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    bottom = [0.0] * len(es)
    for f, label in parts:
        vals = [e[f] or 0.0 for e in es]
        ax.bar(names, vals, bottom=bottom, label=label)
        bottom = [a + v for a, v in zip(bottom, vals)]
    for i, e in enumerate(es):
        ax.text(i, bottom[i], f"{e['ms_per_token']:.1f}\nms/tok", ha="center", va="bottom", fontsize=7)
    ax.set_ylabel("ms per speculative step (median)")
    ax.set_title("Where a speculative step's time goes (served, streaming)")
    ax.set_ylim(0, max(bottom) * 1.25 if bottom else 1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "breakdown.png", dpi=80)
    plt.close(fig)
    return "breakdown.png"


def plot_load(ld: dict | None, out: Path) -> str | None:
    """Throughput, time to first token and inter-token latency by streams."""
    import matplotlib.pyplot as plt

    if not ld:
        return None
    lv = ld["levels"]
    x = [l["concurrency"] for l in lv]
    fig, axs = plt.subplots(1, 3, figsize=(11, 3.6))
    for mode, color, name in (("spec_on", "C0", "speculation on"), ("spec_off", "C3", "off")):
        axs[0].plot(x, [l[mode]["throughput_tok_s"] for l in lv], "-o", color=color, label=name)
        axs[1].plot(x, [l[mode]["ttft_ms_p50"] for l in lv], "-o", color=color, label=f"{name} p50")
        axs[1].plot(x, [l[mode]["ttft_ms_p99"] for l in lv], "--", color=color, label=f"{name} p99")
        axs[2].plot(x, [l[mode]["itl_ms_p50"] for l in lv], "-o", color=color, label=f"{name} ITL p50")
        axs[2].plot(x, [l[mode]["itl_ms_p99"] for l in lv], "--", color=color, label=f"{name} ITL p99")
        axs[2].plot(x, [l[mode]["tpot_ms_p50"] for l in lv], ":", marker="x", color=color, label=f"{name} TPOT p50")
    for a, title, yl in ((axs[0], "throughput", "output tokens/s"), (axs[1], "time to first token", "ms"),
                         (axs[2], "inter-token latency", "ms")):
        a.set_xscale("log", base=2)
        a.set_xticks(x)
        a.set_xticklabels([str(v) for v in x])
        a.set_xlabel("concurrent streams")
        a.set_ylabel(yl)
        a.set_title(title)
        a.grid(alpha=0.3)
        a.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "load.png", dpi=80)
    plt.close(fig)
    return "load.png"


def render(out: Path, verifier_price: float = VERIFIER_PRICE, drafter_price: float = DRAFTER_PRICE) -> dict:
    out = Path(out)
    data = load_all(out)
    if not data:
        raise SystemExit(f"no scenario results in {out}")
    if "load" in data:
        data["cost"] = cost(data["load"], verifier_price, drafter_price)
        (out / "cost.json").write_text(json.dumps(data["cost"], indent=1) + "\n")
    plots = plot_all(data, out)
    merged = {**data, "plots": plots}
    previous = json.loads((out / "meta.json").read_text()) if (out / "meta.json").exists() else None
    m = meta({k: v for k, v in data.items() if k != "cost"}, previous)
    (out / "results.json").write_text(json.dumps(merged, indent=1) + "\n")
    (out / "meta.json").write_text(json.dumps(m, indent=1) + "\n")
    (out / "report.md").write_text(markdown(data, plots, m))
    return merged


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.report",
                                 description="Render bench results (JSON) into report.md, results.json, cost.json and PNG plots.")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    ap.add_argument("--verifier-price", type=float, default=VERIFIER_PRICE, help="$ per hour of a verifier replica")
    ap.add_argument("--drafter-price", type=float, default=DRAFTER_PRICE, help="$ per hour of a drafter replica")
    args = ap.parse_args(argv)
    merged = render(Path(args.out), args.verifier_price, args.drafter_price)
    log(f"wrote {args.out}/report.md, results.json, meta.json and {', '.join(merged['plots'])}")


if __name__ == "__main__":
    main()
