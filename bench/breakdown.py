"""Where the time of a speculative step goes, per k (served, streaming, one stream): ``python -m bench.latency
breakdown`` (``breakdown.json``). From each response's ``speculation`` timings, per step on the router's critical
path: drafting (its drafter-engine part, the rest the channel), the verify forward, the rest until the verify answer
arrived, and applying, detokenising and streaming between steps; medians over requests, per workload, and the share
of steps a pre-draft hid (``bench.plan check`` reads these). The same run serves each drafter head at fixed k
(``--head-ks``): the EAGLE-3 head and every ``--head DIR[=METHOD]``, on the first workload, each at its best k.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from pathlib import Path

import httpx

from bench.client import Scenario, add_arguments, completion_body, serving, stream_completion
from bench.common import EAGLE3, ROOT, ints, log, median, rnd, write_json

COMPONENT_NOTES = {"draft_ms": "drafter engine time on the critical path (0 when the pre-draft hit)",
                   "verify_forward_ms": "verifier's batched forward pass",
                   "rpc_queue_ms": "rest of the step until the verify answer arrived: RPC, queueing, "
                                   "(de)serialisation, accept/reject",
                   "detok_stream_ms": "between steps: apply the result, detokenise, stream the chunk"}
COMPONENTS = tuple(COMPONENT_NOTES)
FIELDS = ("step_ms", *COMPONENTS, "tokens_per_step", "ms_per_token", "mean_k", "pre_draft_hit_rate", "draft_engine_ms",
          "pre_draft_hidden_share", "steps")


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.latency breakdown",
                                 description="Per-step time breakdown of served speculative decoding, per k.")
    add_arguments(ap, prompts=2)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ks", type=ints, default=list(range(1, 9)))
    ap.add_argument("--head", action="append", default=[], metavar="DIR[=METHOD]",
                    help="also serve this drafter head (a directory the drafter pool loads) at --head-ks; repeatable")
    ap.add_argument("--head-ks", type=ints, default=[2, 3, 4], help="the heads' fixed k range")
    args = ap.parse_args(argv)
    args.heads = [("eagle3", EAGLE3, "eagle3")] + [head_spec(h) for h in args.head]
    return args


def head_spec(text: str) -> tuple[str, str, str]:
    """``DIR`` or ``DIR=METHOD``: (a name for the rows, the directory, the drafter method). Without METHOD the head's
    ``speculators_config.algorithm`` (as the published heads carry it), else its config's ``method``."""
    path, _, method = text.partition("=")
    p = Path(path)
    if not (p / "config.json").is_file():
        raise SystemExit(f"--head {text}: no config.json in {path}")
    if not method:
        cfg = json.loads((p / "config.json").read_text())
        method = (cfg.get("speculators_config") or {}).get("algorithm") or cfg.get("method") or \
            cfg.get("speculators_model_type")
        if not method:
            raise SystemExit(f"--head {text}: its config names no method; give --head {path}=METHOD")
    return p.name, str(p), method


def request_parts(name: str, r: dict) -> dict:
    """One streamed request's step parts, its ms/token, mean k and pre-draft hit rate."""
    s = r["speculation"]
    if not s or "mean_forward_ms" not in s:
        raise RuntimeError(f"{name}: the response carries no per-step timings: {s}")
    step, draft, fwd, steps = s["mean_step_ms"], s.get("mean_draft_ms", 0.0), s["mean_forward_ms"], s.get("steps") or 0
    return {"step_ms": step, "draft_ms": draft, "verify_forward_ms": fwd, "rpc_queue_ms": max(0.0, step - draft - fwd),
            "detok_stream_ms": s.get("mean_emit_ms", 0.0), "tokens_per_step": s.get("mean_acceptance_length"),
            "draft_engine_ms": s.get("mean_draft_engine_ms"), "steps": steps or None,
            "pre_draft_hidden_share": s.get("pre_draft_hits", 0) / steps if steps else None,
            "ms_per_token": 1000 * r["latency_s"] / max(1, r["tokens"]),
            "mean_k": s["num_draft_tokens"] / s["num_drafts"] if s.get("num_drafts") else 0.0,
            "pre_draft_hit_rate": s["pre_draft_hits"] / max(1, s["pre_draft_hits"] + s["pre_draft_misses"])}


def config_row(rs: list[dict], k: int | None, default_k: int) -> dict:
    """A config's medians over its requests, and the share of a step exposed outside the two engines."""
    e = {"k": k if k is not None else default_k, "policy": "adaptive" if k is None else "fixed", "requests": len(rs),
         **{f: rnd(median([r[f] for r in rs]), 3) for f in FIELDS}}
    step = e["step_ms"]
    e["exposed_fraction"] = rnd((e["rpc_queue_ms"] + e["detok_stream_ms"]) / (step + e["detok_stream_ms"])) if step \
        else None
    e["exposed_fraction_router"] = rnd(e["rpc_queue_ms"] / step) if step else None
    return e


async def _measure(urls, prompts, args, configs=None) -> dict:
    configs = configs or [("default", urls["adaptive"], None)] + [(f"k{k}", urls["fixed"], k) for k in args.ks]
    rows = {name: [] for name, _, _ in configs}
    async with httpx.AsyncClient(timeout=600) as client:
        for _, url, k in configs:  # warm-up
            await stream_completion(client, url, completion_body(prompts[0][1], 16, args.temperature, 7, k, True))
        for i, (_, ids) in enumerate(prompts):
            for name, url, k in configs:
                body = completion_body(ids, args.max_tokens, args.temperature, 500 + i, k, True)
                rows[name].append(request_parts(name, await stream_completion(client, url, body)))
            log(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(
                f"{n} {rows[n][-1]['step_ms']:.1f} ms/step" for n, _, _ in configs))
    return {name: config_row(rows[name], k, args.default_k) for name, _, k in configs}


def heads_summary(per: dict, heads: dict) -> dict:
    """Per drafter: its rows by k (ms/token, drafting on the path per step, tokens/step) and its best k."""
    fields = ("ms_per_token", "draft_ms", "draft_engine_ms", "verify_forward_ms", "step_ms", "tokens_per_step",
              "pre_draft_hit_rate", "requests")
    by_k = {str(e["k"]): {f: e.get(f) for f in fields} for n, e in per.items() if n != "default"}
    out = {"draft_model": {"path": "models/tiny-code-drafter", "method": "draft_model", "by_k": by_k}}
    for name, (path, method, rows) in heads.items():
        with contextlib.suppress(ValueError):  # a head of the repository: its path from the root
            path = str(Path(path).resolve().relative_to(ROOT))
        out[name] = {"path": path, "method": method, "by_k": {str(k): {f: e.get(f) for f in fields}
                                                               for k, e in rows.items()}}
    for h in out.values():
        best = min(h["by_k"].items(), key=lambda kv: kv[1]["ms_per_token"], default=(None, None))
        h["best_k"], h["best"] = (int(best[0]) if best[0] is not None else None), best[1]
    return out


def run(args, urls: dict | None = None) -> dict:
    sc, t0 = Scenario.from_args(args), time.perf_counter()
    wls = sc.load(k_max=max(args.ks))
    # one app per head at the largest k: each request asks for its k (num_speculative_tokens), as for the draft model
    heads = {f"head_{n}": sc.app("fixed", max(args.head_ks), drafter=(method, path)) for n, path, method in args.heads}
    per_workload, head_rows = {}, {}
    with contextlib.ExitStack() as stack:
        urls = urls or stack.enter_context(serving({"adaptive": sc.app("adaptive"), "fixed": sc.app(
            "fixed", max(args.ks + [args.default_k])), **heads}, args.threads))
        for wl in wls:
            log(f"workload {wl.name}: {len(wl.prompts)} prompts")
            per_workload[wl.name] = {"workload": wl.describe(),
                                     "per_config": asyncio.run(_measure(urls, wl.prompts, args))}
        if args.heads and all(n in urls for n in heads):
            got = asyncio.run(_measure(urls, wls[0].prompts, args, [
                (f"head_{name}_k{k}", urls[f"head_{name}"], k) for name, _, _ in args.heads for k in args.head_ks]))
            head_rows = {name: (path, method, {k: got[f"head_{name}_k{k}"] for k in args.head_ks})
                         for name, path, method in args.heads}
    first = per_workload[wls[0].name]["per_config"]
    config = {"temperature": args.temperature, "ks": args.ks, "head_ks": args.head_ks,
              "heads": [{"name": n, "path": p, "method": m} for n, p, m in args.heads]}
    return sc.record("breakdown", wls, t0, config=config, components=COMPONENT_NOTES, per_config=first,
                     workloads=per_workload, heads={"workload": wls[0].name, "drafters": heads_summary(
                         first, head_rows)} if head_rows else None)


def main(argv=None):
    args = parse(argv)
    data = run(args)
    log(f"wrote {write_json(args.out, 'breakdown', data)} ({data['duration_s']} s)")
    return data
