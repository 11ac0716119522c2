"""``backend: vllm`` served (vLLM runs the loop, splitspec's proposer drafts from the drafter pool)
against vLLM's own decoding, issue #18's measurement.

Systems, greedy unless told, bf16, one thread per engine:
- ``vllm_plain`` and ``vllm_draft_model`` (k): vLLM alone, in its own process (``bench.vllm_peer``,
  no HTTP: its best case), one engine at a time;
- ``vllm_http_plain`` and ``vllm_http_draft_model`` (k): vLLM's own OpenAI server
  (``bench.vllm_peer.VllmServer``), measured through the same HTTP client as splitspec and
  interleaved with it, its engine's thread on the served verifier's core (issue #18 asks for
  this comparison: the same client for every system);
- ``served_spec`` (k) and ``served_off`` (k = 0, the same app and vLLM engine): splitspec over HTTP
  with ``configs/serve_vllm.yaml``'s verifier (backend vllm, vLLM's loop) and the shipped draft
  model on the drafter pool, the verifier and drafter replicas on cores of their own; interleaved
  by prompt.
Per (prompt, repeat) the ratio to ``vllm_draft_model`` and the speed-up over ``vllm_plain``, then
medians. ``--streams`` adds throughput at those concurrencies, speculation against off on the
served app (the same vLLM engine and client).

``python -m bench.vllm_served --out bench/results/vllm-served``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from pathlib import Path

from bench.common import (
    BENCH_DTYPE,
    DEFAULT_OUT,
    app_args,
    completion_body,
    environment,
    load_prompts,
    log,
    median,
    paired_ratio,
    rnd,
    serving,
    stream_completion,
    vllm_python,
    write_json,
)


def served_args(k: int, dtype: str, pin: bool = True, speculate: str = "measured") -> dict:
    """The shipped app with serve_vllm.yaml's verifier (vLLM's loop), k fixed, the bench's dtype."""
    args = app_args(1, "fixed", k, streams=64, dtype=dtype, pin=pin)
    v = args["verifier"]
    args["verifier"] = {"model": v["model"], "backend": "vllm", "dtype": dtype, "vllm_kv_cache_gib": 1.0,
                        "vllm_max_num_seqs": 128, "max_model_len": v["max_model_len"], "num_threads": 1,
                        "vllm_num_speculative_tokens": max(k, 1), "vllm_speculate": speculate, **({"cpu_affinity": v["cpu_affinity"]}
                                                                     if "cpu_affinity" in v else {})}
    return args


async def _one(client, url, ids, max_tokens, temperature, seed, k):
    r = await stream_completion(client, url, completion_body(ids, max_tokens, temperature, seed, k, stream=True))
    return r


async def _served_runs(url: str, prompts, args, http_peers: dict[str, str]) -> dict:
    """Every HTTP system interleaved by (repeat, prompt): the served app with speculation and
    without, and vLLM's own servers (``http_peers``: name -> base URL, requests without k)."""
    import httpx

    systems = [("served_spec", url, args.k), ("served_off", url, 0)] + [(n, u, None) for n, u in http_peers.items()]
    rows = {name: [] for name, _, _ in systems}
    outputs: dict[str, dict] = {name: {} for name in rows}
    async with httpx.AsyncClient(timeout=600) as client:
        for _, u, k in systems:
            await _one(client, u, prompts[0][1], 16, 0.0, 0, k)  # warm-up
        for rep in range(args.repeats):
            for i, (_, ids) in enumerate(prompts):
                for name, u, k in systems:
                    r = await _one(client, u, ids, args.max_tokens, 0.0, 0, k)
                    rows[name].append({"prompt": i, "repeat": rep, "ms_per_token": 1000 * r["latency_s"] / r["tokens"],
                                       "speculation": r["speculation"], "chunks": len(r["chunks"])})
                    outputs[name].setdefault(i, r["token_ids"])
        load = {}
        short = {"served_spec": "spec", "served_off": "off"}
        for n in args.streams:
            for name, u, k in systems:
                t0 = time.perf_counter()
                outs = await asyncio.gather(*(_one(client, u, prompts[j % len(prompts)][1], args.load_tokens, 0.0, 0, k)
                                              for j in range(2 * n)))
                wall = time.perf_counter() - t0
                load.setdefault(str(n), {})[short.get(name, name)] = {"tok_s": rnd(sum(o["tokens"] for o in outs) / wall),
                                                                      "requests": len(outs)}
            at = load[str(n)]
            at["spec_over_off"] = rnd(at["spec"]["tok_s"] / at["off"]["tok_s"])
            if "vllm_http_plain" in at:
                at["spec_over_vllm_http_plain"] = rnd(at["spec"]["tok_s"] / at["vllm_http_plain"]["tok_s"])
            log(f"{n} streams: {at}")
        from ray import serve

        stats = await serve.get_deployment_handle("Verifier", app_name="bench-vllm").stats.remote()
    # greedy: every system's tokens per prompt should be vLLM plain's (a near-tie would show here)
    ref = outputs.get("vllm_http_plain") or outputs["served_off"]
    same = {name: sum(o.get(i) == ref.get(i) for i in ref) / max(1, len(ref)) for name, o in outputs.items()}
    return {"rows": rows, "load": load, "verifier": stats, "same_tokens_as_reference": same}


def async_alone(argv=None):
    """vLLM's AsyncLLM alone (this package's vLLM engine, no speculation), in this process, no Ray or
    HTTP: the engine's own per-token cost on the async path the replica uses, to set against vLLM's
    ``LLM`` (``vllm_plain``) and the served path. ``python -m bench.vllm_served async-alone``"""
    import os

    from transformers import AutoTokenizer

    from bench.common import TARGET
    from configs import SamplingParams, VerifierConfig
    from verifier.vllm_engine import VllmVerifierEngine

    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default=BENCH_DTYPE)
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    async def run():
        eng = VllmVerifierEngine(VerifierConfig(model=TARGET, backend="vllm", dtype=args.dtype, vllm_kv_cache_gib=0.25,
                                                max_model_len=512, num_threads=1))
        prompt = load_prompts(1, AutoTokenizer.from_pretrained(TARGET))[0][1]
        for rep in range(args.repeats):
            sp = eng.sampling_params(SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True), 0, "s", 0,
                                     len(prompt), args.max_tokens, None)
            n, t0 = 0, time.perf_counter()
            async for ids, _, _ in eng.generate(prompt, sp, f"alone-{rep}"):
                n += len(ids)
            print(f"AsyncLLM alone, k = 0: {1000 * (time.perf_counter() - t0) / n:.2f} ms/token", flush=True)
        eng.shutdown()

    asyncio.run(run())


def main(argv=None):
    from transformers import AutoTokenizer

    from bench.common import DRAFTER, TARGET
    from bench.vllm_peer import VllmPeer, VllmServer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",") if x], default=[16, 64])
    ap.add_argument("--load-tokens", type=int, default=64)
    ap.add_argument("--dtype", default=BENCH_DTYPE)
    ap.add_argument("--speculate", default="measured", choices=["measured", "always"], help="verifier.vllm_speculate")
    ap.add_argument("--no-pin", action="store_true", help="leave the replicas (and vLLM's processes) to the OS")
    ap.add_argument("--no-peers", action="store_true", help="no in-process vLLM peers (ratios to them then absent)")
    ap.add_argument("--no-http-peers", action="store_true", help="no vLLM OpenAI servers beside the served app")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    py = vllm_python()
    if py is None:
        raise SystemExit("no interpreter here imports vllm")
    prompts = load_prompts(args.prompts, AutoTokenizer.from_pretrained(TARGET))
    rows: dict[str, list] = {}
    for name, k in () if args.no_peers else (("vllm_plain", 0), ("vllm_draft_model", args.k)):  # one at a time
        log(f"{name}: starting")
        peer = VllmPeer(py, k, 1, dtype=args.dtype, method="draft_model", drafter=DRAFTER)
        try:
            peer.wait_ready()
            peer.run(prompts[0][1], 16, 0.0, 0)  # warm-up
            rows[name] = []
            for rep in range(args.repeats):
                for i, (_, ids) in enumerate(prompts):
                    r = peer.run(ids, args.max_tokens, 0.0, 0)
                    rows[name].append({"prompt": i, "repeat": rep, "ms_per_token": 1000 * r["wall_s"] / r["tokens"],
                                       "spec": r.get("spec")})
        finally:
            peer.close()
    with contextlib.ExitStack() as stack:
        http_peers = {}
        if not args.no_http_peers:  # both start now, and are idle while the other systems run
            servers = {"vllm_http_plain": VllmServer(py, 0, 1, dtype=args.dtype),
                       "vllm_http_draft_model": VllmServer(py, args.k, 1, dtype=args.dtype, method="draft_model",
                                                           drafter=DRAFTER)}
            for name, srv in servers.items():
                stack.enter_context(srv)
            http_peers = {name: srv.wait_ready() for name, srv in servers.items()}
        urls = stack.enter_context(serving({"vllm": served_args(args.k, args.dtype, pin=not args.no_pin,
                                                                speculate=args.speculate)}, 1))
        served = asyncio.run(_served_runs(urls["vllm"], prompts, args, http_peers))
    rows.update(served["rows"])
    base, plain = rows.get("vllm_draft_model", rows["served_spec"]), rows.get("vllm_plain", rows["served_off"])
    result = {"scenario": "vllm_served", "config": vars(args), "systems": {}, "load": served["load"],
              "same_tokens_as_reference": served["same_tokens_as_reference"],
              "proposer": (served["verifier"].get("proposer") or [None])[0]}
    http_base, http_plain = rows.get("vllm_http_draft_model"), rows.get("vllm_http_plain")
    for name, rs in rows.items():
        result["systems"][name] = {
            "ms_per_token": rnd(median([r["ms_per_token"] for r in rs])),
            "vs_vllm_draft_model": paired_ratio(rs, base),
            "speedup_vs_vllm_plain": paired_ratio(plain, rs),
        }
        if http_base and "chunks" in rs[0]:  # the HTTP systems, paired per (repeat, prompt) in one interleaved run
            result["systems"][name] |= {
                "vs_vllm_http_draft_model": paired_ratio(rs, http_base),
                "speedup_vs_vllm_http_plain": paired_ratio(http_plain, rs),
                "chunks_per_request": rnd(median([r["chunks"] for r in rs]))}
        spec = [r["speculation"] for r in rs if r.get("speculation")]
        if spec:
            result["systems"][name]["mean_acceptance_length"] = rnd(median(
                [1 + s["num_accepted_tokens"] / max(1, s["num_drafts"]) for s in spec]))
    result["environment"] = environment(1)
    write_json(Path(args.out), "vllm_served", result)
    for name, s in result["systems"].items():
        print(name, s)
    print("load", result["load"])
    print("proposer", result["proposer"])


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 1 and sys.argv[1] == "async-alone":
        async_alone(sys.argv[2:])
    else:
        main()
