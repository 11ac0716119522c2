"""Where the time of a speculative step goes, per k (served, streaming, one stream), and where a
served step loses to the in-process loop.

``python -m bench.breakdown [options]`` (the per-k breakdown, ``breakdown.json``): each response's ``speculation`` stats
give, per speculative step on the router's critical
path: the drafter's engine time when drafting was on the path (0 when the pipelined
pre-draft hit), the verifier's batched forward pass, the rest of the step until the
verify answer arrived (RPC, queueing, (de)serialisation, the verifier's accept/reject),
and the time between steps spent applying the result, detokenising and streaming it.
Medians over requests, per workload (``--workload``: HumanEval and the held-out prompts by default,
or a JSONL file; ``workloads`` -> name -> ``per_config``; the top-level ``per_config`` is the first
workload's); ``bench.report`` draws them as stacked bars. Per config it also keeps the drafter's
engine time on the path (``draft_engine_ms``: the rest of ``draft_ms`` is the channel's round trip
and the drafts' transfer) and the share of steps a pre-draft hid (``pre_draft_hidden_share``: hits
over steps), which ``bench.plan check`` reads as the served drafter's terms.

The same run serves each drafter head at fixed k over a small range (``--head-ks``, 2-4): the
EAGLE-3 head (``models/tiny-code-eagle3``) and every ``--head DIR`` (any head directory the
drafter pool loads: its method from its ``speculators_config``, or ``--head DIR=METHOD``), on the
first workload; ``heads``: per drafter and k, ms/token and drafting on the critical path per step,
and each drafter's best k (the draft model's from the k sweep above).

``python -m bench.breakdown gap [options]`` (``served_gap.json``): the served step against the
in-process loop, variant by variant. Fixed k, one stream, greedy or (``--temperature``) seeded and Gumbel-coupled; each (repeat, prompt) runs the
in-process reference loop (the same engines in this process, no RPC) and then every served
variant, so ratios are paired:

- ``pool``: the shipped app (drafter pool, direct channel, pre-draft trees);
- ``pool_serial``: the same without pre-drafting (``pipeline_drafts: false``): drafting and
  verification never overlap;
- ``colocated_serial``: the drafter engine in the verifier replica, no pre-drafting: one process,
  everything in series, as in process, but behind Serve, the router and HTTP;
- ``..._chunks1s``: the same with ``stream_interval_ms: 1000``: about one stream item a second
  instead of one a step, so the router, proxy and client barely run during forwards;
- ``pool_chunks50ms``: the shipped app with ``stream_interval_ms: 50`` (about two steps an item);
- ``pool_collect20ms``: the shipped app with ``collect_interval_ms: 20``: non-streaming requests
  (``--no-stream``) sent as streams are, instead of about one chunk a second;
- ``pool_threaded``: the shipped app with ``verify_inline: false``: a lone stream's verify passes
  handed to the engine's thread and back instead of run on the replica's event loop.

Requests stream (SSE) unless ``--no-stream``: then the client waits for the whole body, as
``bench.latency`` does. Per variant: ms/token over the in-process loop's (paired, median), and the
medians over requests of the mean verify forward and the mean drafting on the critical path per
step, as the router reports them (``speculation.mean_forward_ms``, ``mean_draft_ms``: the first
step, which carries the prompt's prefill, included); the in-process loop's are computed the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path

from bench import workloads
from bench.common import (
    BENCH_DTYPE,
    DEFAULT_K,
    DEFAULT_OUT,
    EAGLE3,
    MAX_MODEL_LEN,
    ROOT,
    TARGET,
    app_args,
    complete,
    completion_body,
    environment,
    load_prompts,
    log,
    median,
    paired_ratio,
    rnd,
    serving,
    set_threads,
    stream_completion,
    write_json,
)
from bench.latency import ints

COMPONENTS = ("draft_ms", "verify_forward_ms", "rpc_queue_ms", "detok_stream_ms")


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.breakdown", description="Per-step time breakdown of served speculative "
                                 "decoding, per k (the subcommand `gap`: the served step against the in-process loop).")
    workloads.add_arguments(ap, prompts=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ks", type=ints, default=list(range(1, 9)))
    ap.add_argument("--default-k", type=int, default=DEFAULT_K)
    ap.add_argument("--head", action="append", default=[], metavar="DIR[=METHOD]",
                    help="also serve this drafter head (a directory the drafter pool loads) at --head-ks; repeatable")
    ap.add_argument("--head-ks", type=ints, default=[2, 3, 4], help="the heads' fixed k range")
    ap.add_argument("--no-eagle3", action="store_true", help="leave the shipped EAGLE-3 head out of the heads' rows")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default=BENCH_DTYPE, choices=["bfloat16", "float32"], help="every system's dtype")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    args.heads = ([] if args.no_eagle3 else [("eagle3", EAGLE3, "eagle3")]) + [head_spec(h) for h in args.head]
    return args


def head_spec(text: str) -> tuple[str, str, str]:
    """``DIR`` or ``DIR=METHOD``: (a name for the rows, the directory, the drafter method). Without METHOD the
    head's ``speculators_config.algorithm`` (as the published heads carry it), else its config's ``method``."""
    import json

    path, _, method = text.partition("=")
    p = Path(path)
    if not (p / "config.json").is_file():
        raise SystemExit(f"--head {text}: no config.json in {path}")
    if not method:
        cfg = json.loads((p / "config.json").read_text())
        method = (cfg.get("speculators_config") or {}).get("algorithm") or cfg.get("method") or cfg.get("speculators_model_type")
        if not method:
            raise SystemExit(f"--head {text}: its config names no method; give --head {path}=METHOD")
    return p.name, str(p), method


def head_app_args(threads: int, k: int, dtype: str, path: str, method: str) -> dict:
    """The shipped app with the drafter pool running the head at ``path`` (fixed k)."""
    a = app_args(threads, "fixed", k, dtype=dtype)
    pins = {"cpu_affinity": a["drafter"]["cpu_affinity"]} if "cpu_affinity" in a["drafter"] else {}
    a["drafter"] = {"method": method, "model": path, "num_speculative_tokens": k, "num_threads": threads,
                    "dtype": dtype, "max_model_len": MAX_MODEL_LEN, "cache_budget_mb": 8, **pins}
    return a


def step_parts(stats: dict) -> dict:
    step = stats["mean_step_ms"]
    draft, fwd = stats.get("mean_draft_ms", 0.0), stats.get("mean_forward_ms", 0.0)
    steps = stats.get("steps") or 0
    return {"step_ms": step, "draft_ms": draft, "verify_forward_ms": fwd,
            "rpc_queue_ms": max(0.0, step - draft - fwd), "detok_stream_ms": stats.get("mean_emit_ms", 0.0),
            "tokens_per_step": stats.get("mean_acceptance_length"),
            "draft_engine_ms": stats.get("mean_draft_engine_ms"),
            "pre_draft_hidden_share": stats.get("pre_draft_hits", 0) / steps if steps else None, "steps": steps or None}


FIELDS = ("step_ms",) + COMPONENTS + ("tokens_per_step", "ms_per_token", "mean_k", "pre_draft_hit_rate", "draft_engine_ms",
                                      "pre_draft_hidden_share", "steps")


async def _measure(urls, prompts, args, configs=None) -> dict:
    import httpx

    configs = configs or [("default", urls["adaptive"], None)] + [(f"k{k}", urls["fixed"], k) for k in args.ks]
    rows = {name: [] for name, _, _ in configs}
    async with httpx.AsyncClient(timeout=600) as client:
        for name, url, k in configs:  # warm-up
            await stream_completion(client, url, completion_body(prompts[0][1], 16, args.temperature, 7, k, True))
        for i, (_, ids) in enumerate(prompts):
            for name, url, k in configs:
                r = await stream_completion(client, url,
                                            completion_body(ids, args.max_tokens, args.temperature, 500 + i, k, True))
                if not r["speculation"] or "mean_forward_ms" not in r["speculation"]:
                    raise RuntimeError(f"{name}: the response carries no per-step timings: {r['speculation']}")
                parts = step_parts(r["speculation"])
                parts["ms_per_token"] = 1000 * r["latency_s"] / max(1, r["tokens"])
                parts["mean_k"] = (r["speculation"]["num_draft_tokens"] / r["speculation"]["num_drafts"]
                                   if r["speculation"].get("num_drafts") else 0.0)
                parts["pre_draft_hit_rate"] = (r["speculation"]["pre_draft_hits"] /
                                               max(1, r["speculation"]["pre_draft_hits"] + r["speculation"]["pre_draft_misses"]))
                rows[name].append(parts)
            log(f"prompt {i + 1}/{len(prompts)}: " + ", ".join(
                f"{n} {rows[n][-1]['step_ms']:.1f} ms/step" for n, _, _ in configs))
    out = {}
    for name, _, k in configs:
        rs = rows[name]
        e = {"k": k if k is not None else args.default_k, "policy": "adaptive" if k is None else "fixed",
             "requests": len(rs)}
        for f in FIELDS:
            e[f] = rnd(median([r[f] for r in rs]), 3)
        e["exposed_fraction"] = rnd((e["rpc_queue_ms"] + e["detok_stream_ms"]) /
                                    (e["step_ms"] + e["detok_stream_ms"]), 4) if e["step_ms"] else None
        e["exposed_fraction_router"] = rnd(e["rpc_queue_ms"] / e["step_ms"], 4) if e["step_ms"] else None
        out[name] = e
    return out


def heads_summary(per: dict, heads: dict) -> dict:
    """Per drafter: its rows by k (ms/token, drafting on the path per step, tokens/step) and its best k."""
    out = {"draft_model": {"path": "models/tiny-code-drafter", "method": "draft_model",
                           "by_k": {str(e["k"]): _head_row(e) for n, e in per.items() if n != "default"}}}
    for name, (path, method, rows) in heads.items():
        with contextlib.suppress(ValueError):  # a head of the repository: its path from the root
            path = str(Path(path).resolve().relative_to(ROOT))
        out[name] = {"path": path, "method": method, "by_k": {str(k): _head_row(e) for k, e in rows.items()}}
    for h in out.values():
        best = min(h["by_k"].items(), key=lambda kv: kv[1]["ms_per_token"], default=(None, None))
        h["best_k"] = int(best[0]) if best[0] is not None else None
        h["best"] = best[1]
    return out


def _head_row(e: dict) -> dict:
    return {f: e.get(f) for f in ("ms_per_token", "draft_ms", "draft_engine_ms", "verify_forward_ms", "step_ms",
                                  "tokens_per_step", "pre_draft_hit_rate", "requests")}


def run(args, urls: dict | None = None) -> dict:
    import contextlib

    from transformers import AutoTokenizer

    set_threads(args.threads)
    t0 = time.perf_counter()
    wls = workloads.load_all(workloads.workload_names(args.workload), args.prompts, AutoTokenizer.from_pretrained(TARGET),
                             args.workload_seed, MAX_MODEL_LEN - args.max_tokens - max(args.ks + [args.default_k]) - 1)
    # one app per head at the largest k: each request asks for its k (num_speculative_tokens), as for the draft model
    heads = {f"head_{name}": head_app_args(args.threads, max(args.head_ks), args.dtype, path, method)
             for name, path, method in args.heads}
    per_workload, head_rows = {}, {}
    with contextlib.ExitStack() as stack:
        if urls is None:
            urls = stack.enter_context(serving({
                "adaptive": app_args(args.threads, "adaptive", args.default_k, dtype=args.dtype),
                "fixed": app_args(args.threads, "fixed", max(args.ks + [args.default_k]), dtype=args.dtype),
                **heads}, args.threads))
        for wl in wls:
            log(f"workload {wl.name}: {len(wl.prompts)} prompts")
            per_workload[wl.name] = {"workload": wl.describe(), "per_config": asyncio.run(_measure(urls, wl.prompts, args))}
        if args.heads and all(n in urls for n in heads):
            wl = wls[0]
            got = asyncio.run(_measure(urls, wl.prompts, args, [(f"head_{name}_k{k}", urls[f"head_{name}"], k)
                                                                 for name, _, _ in args.heads for k in args.head_ks]))
            for name, path, method in args.heads:
                head_rows[name] = (path, method, {k: got[f"head_{name}_k{k}"] for k in args.head_ks})
    first = per_workload[wls[0].name]["per_config"]
    return {"scenario": "breakdown",
            "config": {"workloads": [wl.name for wl in wls], "prompts": args.prompts, "workload_seed": args.workload_seed,
                       "max_tokens": args.max_tokens, "temperature": args.temperature,
                       "ks": args.ks, "default_k": args.default_k, "threads": args.threads,
                       "heads": [{"name": n, "path": p, "method": m} for n, p, m in args.heads], "head_ks": args.head_ks},
            "components": {"draft_ms": "drafter engine time on the critical path (0 when the pre-draft hit)",
                           "verify_forward_ms": "verifier's batched forward pass",
                           "rpc_queue_ms": "rest of the step until the verify answer arrived: RPC, queueing, "
                                           "(de)serialisation, accept/reject",
                           "detok_stream_ms": "between steps: apply the result, detokenise, stream the chunk"},
            "environment": environment(args.threads), "per_config": first, "workloads": per_workload,
            "heads": {"workload": wls[0].name, "drafters": heads_summary(first, head_rows)} if head_rows else None,
            "duration_s": round(time.perf_counter() - t0, 1)}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["gap"]:
        return gap_main(argv[1:])
    args = parse(argv)
    data = run(args)
    path = write_json(args.out, "breakdown", data)
    log(f"wrote {path} ({data['duration_s']} s)")
    return data


# ------------------------------------------------------------------ gap
VARIANTS = ("pool", "pool_serial", "colocated_serial", "pool_chunks1s", "colocated_serial_chunks1s", "pool_chunks50ms",
            "pool_collect20ms", "pool_threaded")


def variant_args(name: str, k: int, dtype: str) -> dict:
    a = app_args(1, "fixed", k, dtype=dtype)
    if "serial" in name:
        a["pipeline_drafts"] = False
    if name.startswith("colocated"):
        a["drafter_placement"] = "verifier"
        cores = a["drafter"].pop("cpu_affinity", None)  # (the verifier's pinning covers the process)
        if cores and "cpu_affinity" in a["verifier"]:
            a["verifier"]["cpu_affinity"] = sorted(set(a["verifier"]["cpu_affinity"]) | set(cores))
    if name.endswith("chunks1s"):
        a["stream_interval_ms"] = 1000.0
    if name.endswith("chunks50ms"):
        a["stream_interval_ms"] = 50.0
    if name.endswith("collect20ms"):
        a["collect_interval_ms"] = 20.0
    if name.endswith("threaded"):
        a["verify_inline"] = False
    return a


def gap_main(argv=None):
    """``gap``: the served step against the in-process loop, variant by variant (see the module's docstring)."""
    from transformers import AutoTokenizer

    from bench.inproc import Reference

    ap = argparse.ArgumentParser(prog="python -m bench.breakdown gap",
                                 description="Where a served speculative step loses to the in-process loop, variant by variant.")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--dtype", default="float32", help="float32: every row emits the same text")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="> 0: seeded sampled requests, verified by Gumbel coupling in process and served (the app's "
                         "default), so every row still emits the same text")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--no-stream", action="store_true", help="non-streaming requests (the whole body at the end)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    names = [v for v in args.variants.split(",") if v]
    if any(v not in VARIANTS for v in names):
        raise SystemExit(f"--variants: any of {VARIANTS}")
    t0 = time.perf_counter()
    prompts = load_prompts(args.prompts, AutoTokenizer.from_pretrained(TARGET))
    ref = Reference(1, dtype=args.dtype)
    ref.run(prompts[0][1], 16, args.temperature, 0, args.k)  # warm-up
    rows: dict[str, list[dict]] = {"in_process": [], **{v: [] for v in names}}
    same = {v: 0 for v in names}

    async def one(url, ids, n, seed=0):
        import httpx

        if args.no_stream:
            with httpx.Client(timeout=600) as client:
                wall, tokens, spec, token_ids = complete(client, url, completion_body(ids, n, args.temperature, seed, args.k))
            return {"latency_s": wall, "tokens": tokens, "speculation": spec, "token_ids": token_ids,
                    "chunks": [None] * spec["replica_chunks"]}
        async with httpx.AsyncClient(timeout=600) as client:
            return await stream_completion(client, url, completion_body(ids, n, args.temperature, seed, args.k, True))

    with serving({v: variant_args(v, args.k, args.dtype) for v in names}, 1) as urls:
        for url in urls.values():
            asyncio.run(one(url, prompts[0][1], 16))
        for rep in range(args.repeats):
            for i, (_, ids) in enumerate(prompts):
                seed = 100 * rep + i
                r = ref.run(ids, args.max_tokens, args.temperature, seed, args.k)
                # the statistics the router reports for a served request: means over its steps, the
                # first (the prompt's prefill on both engines, about 8 decode forwards here) included
                rows["in_process"].append({"ms_per_token": 1000 * r["wall_s"] / r["tokens"],
                                           "forward_ms": 1000 * sum(r["forward_s"]) / len(r["forward_s"]),
                                           "draft_ms": 1000 * sum(r["draft_s"]) / len(r["forward_s"])})
                for v, url in urls.items():
                    x = asyncio.run(one(url, ids, args.max_tokens, seed))
                    s = x["speculation"]
                    same[v] += x["token_ids"] == r["output_ids"]
                    rows[v].append({"ms_per_token": 1000 * x["latency_s"] / x["tokens"], "forward_ms": s["mean_forward_ms"],
                                    "draft_ms": s.get("mean_draft_ms", 0.0), "step_ms": s["mean_step_ms"],
                                    "exposed_ms": s["mean_exposed_ms"], "chunks": len(x["chunks"]),
                                    # streaming: the first chunk's arrival, and the median gap between chunks
                                    **({"ttft_ms": 1000 * x["chunks"][0][0],
                                        "chunk_gap_ms": 1000 * median([b[0] - a[0] for a, b in zip(x["chunks"], x["chunks"][1:])])}
                                       if not args.no_stream and len(x["chunks"]) > 1 else {}),
                                    "pre_draft_hit_rate": s["pre_draft_hits"] / max(1, s["pre_draft_hits"] + s["pre_draft_misses"])})
                log(f"repeat {rep} prompt {i}: " + ", ".join(f"{v} {rows[v][-1]['ms_per_token']:.2f}" for v in rows))
    base = rows["in_process"]
    out = {}
    for v, rs in rows.items():
        out[v] = {f: rnd(median([r[f] for r in rs])) for f in rs[0]}
        out[v]["over_in_process"] = paired_ratio(rs, base)
        out[v]["forward_over_in_process"] = paired_ratio(rs, base, "forward_ms")
        if v in same:
            out[v]["same_tokens_as_in_process"] = same[v] / len(rs)
    result = {"scenario": "served_gap", "config": vars(args), "variants": out, "environment": environment(1),
              "duration_s": round(time.perf_counter() - t0, 1)}
    write_json(Path(args.out), "served_gap", result)
    print("| variant | ms/token | / in process (paired) | verify forward ms | / in process | drafting on the path ms "
          "| exposed ms | stream chunks | first chunk ms | median gap between chunks ms |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for v, r in out.items():
        print(f"| {v} | {r['ms_per_token']:.2f} | {r['over_in_process']:.2f} | {r['forward_ms']:.2f} | "
              f"{r['forward_over_in_process']:.2f} | {r['draft_ms']:.2f} | {r.get('exposed_ms', '')} | {r.get('chunks', '')} | "
              f"{r.get('ttft_ms', '')} | {r.get('chunk_gap_ms', '')} |")
    return result




if __name__ == "__main__":
    main()
