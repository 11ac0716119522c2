"""Where the time of a speculative step goes, per k (served, streaming, one stream).

Each response's ``speculation`` stats give, per speculative step on the router's critical
path: the drafter's engine time when drafting was on the path (0 when the pipelined
pre-draft hit), the verifier's batched forward pass, the rest of the step until the
verify answer arrived (RPC, queueing, (de)serialisation, the verifier's accept/reject),
and the time between steps spent applying the result, detokenising and streaming it.
Medians over requests; ``bench.report`` draws them as stacked bars.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from bench.common import (BENCH_DTYPE, DEFAULT_K, DEFAULT_OUT, app_args, completion_body, environment, load_prompts, log, median,
                          rnd, serving, set_threads, stream_completion, write_json)
from bench.latency import ints

COMPONENTS = ("draft_ms", "verify_forward_ms", "rpc_queue_ms", "detok_stream_ms")


def parse(argv=None):
    ap = argparse.ArgumentParser(description="Per-step time breakdown of served speculative decoding, per k.")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--ks", type=ints, default=list(range(1, 9)))
    ap.add_argument("--default-k", type=int, default=DEFAULT_K)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default=BENCH_DTYPE, choices=["bfloat16", "float32"], help="every system's dtype")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    return ap.parse_args(argv)


def step_parts(stats: dict) -> dict:
    step = stats["mean_step_ms"]
    draft, fwd = stats.get("mean_draft_ms", 0.0), stats.get("mean_forward_ms", 0.0)
    return {"step_ms": step, "draft_ms": draft, "verify_forward_ms": fwd,
            "rpc_queue_ms": max(0.0, step - draft - fwd), "detok_stream_ms": stats.get("mean_emit_ms", 0.0),
            "tokens_per_step": stats.get("mean_acceptance_length")}


async def _measure(urls, prompts, args) -> dict:
    import httpx

    configs = [("default", urls["adaptive"], None)] + [(f"k{k}", urls["fixed"], k) for k in args.ks]
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
        for f in ("step_ms",) + COMPONENTS + ("tokens_per_step", "ms_per_token", "mean_k", "pre_draft_hit_rate"):
            e[f] = rnd(median([r[f] for r in rs]), 3)
        e["exposed_fraction"] = rnd((e["rpc_queue_ms"] + e["detok_stream_ms"]) /
                                    (e["step_ms"] + e["detok_stream_ms"]), 4) if e["step_ms"] else None
        e["exposed_fraction_router"] = rnd(e["rpc_queue_ms"] / e["step_ms"], 4) if e["step_ms"] else None
        out[name] = e
    return out


def run(args, urls: dict | None = None) -> dict:
    import contextlib

    from transformers import AutoTokenizer

    from bench.common import TARGET

    set_threads(args.threads)
    t0 = time.perf_counter()
    prompts = load_prompts(args.prompts, AutoTokenizer.from_pretrained(TARGET))
    with contextlib.ExitStack() as stack:
        if urls is None:
            urls = stack.enter_context(serving({
                "adaptive": app_args(args.threads, "adaptive", args.default_k, dtype=args.dtype),
                "fixed": app_args(args.threads, "fixed", max(args.ks + [args.default_k]), dtype=args.dtype)}, args.threads))
        per = asyncio.run(_measure(urls, prompts, args))
    return {"scenario": "breakdown",
            "config": {"prompts": args.prompts, "max_tokens": args.max_tokens, "temperature": args.temperature,
                       "ks": args.ks, "default_k": args.default_k, "threads": args.threads},
            "components": {"draft_ms": "drafter engine time on the critical path (0 when the pre-draft hit)",
                           "verify_forward_ms": "verifier's batched forward pass",
                           "rpc_queue_ms": "rest of the step until the verify answer arrived: RPC, queueing, "
                                           "(de)serialisation, accept/reject",
                           "detok_stream_ms": "between steps: apply the result, detokenise, stream the chunk"},
            "environment": environment(args.threads), "per_config": per,
            "duration_s": round(time.perf_counter() - t0, 1)}


def main(argv=None):
    args = parse(argv)
    data = run(args)
    path = write_json(args.out, "breakdown", data)
    log(f"wrote {path} ({data['duration_s']} s)")


if __name__ == "__main__":
    main()
