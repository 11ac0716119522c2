"""Soak: many concurrent streams for minutes while drafter and verifier replicas are killed.

    python -m tests.soak_scenario --minutes 5          (or: make soak)

Starts its own Ray cluster and the splitspec app (2 drafter and 2 verifier replicas) on the
shipped model pair, then runs ``--clients`` streaming clients in a loop. Every
``--kill-every`` seconds one replica (drafter and verifier in turn) is killed; Serve replaces
it. Half the prompts share a prefix (a system prompt), and requests come with and without a
``cache_salt``: the verifiers' prefix caches hit across requests (``cached_tokens`` in the report).
Every request is greedy or seeded Gumbel-coupled sampling, whose exact tokens are known
in advance (computed in this process by plain decoding with the same engine code, no Ray),
so each completed stream is checked token for token (in float32: in bf16 the target has exact
top-2 ties, where a different batch composition may round the other way). Prints a JSON report and exits non-zero
if any request failed or any output differed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

from bench.common import free_port  # (below the ephemeral range: see there)

ROOT = Path(__file__).resolve().parent.parent


def references(target: str, prompts: list[str], modes: list[dict], max_tokens: int) -> dict:
    """Expected token ids per (prompt, mode), by plain decoding in this process."""
    import torch

    from configs import SamplingParams, VerifierConfig
    from core.loop import generate
    from verifier.engine import VerifierEngine

    torch.set_num_threads(1)
    engine = VerifierEngine(VerifierConfig(model=target, dtype="float32", cache_budget_mb=256))
    out = {}
    for mi, mode in enumerate(modes):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **mode)
        ids = [engine.tokenizer(p)["input_ids"] for p in prompts]
        for pi, seq in enumerate(generate(ids, params, 0, None, engine)):
            out[(pi, mi)] = seq.output_ids
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--kill-every", type=float, default=20.0, help="seconds between replica kills")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--target", default=str(ROOT / "models" / "tiny-code-target"))
    ap.add_argument("--drafter", default=str(ROOT / "models" / "tiny-code-drafter"))
    ap.add_argument("--out", default=None, help="also write the report to this JSON file")
    args = ap.parse_args(argv)

    from offline.training.corpus import held_out_prompts

    # and conversations' next turns: the others after the first as a shared system prompt, sent by tenants with and
    # without a cache_salt (prefix-cache hits across requests, isolated by salt)
    prompts = held_out_prompts(8, prompt_chars=300)
    prompts += [prompts[0] + "\n" + p for p in prompts[1:]]
    modes = [{"temperature": 0.0}, {"temperature": 0.8, "seed": 17, "verification": "gumbel"}]
    t0 = time.monotonic()
    expected = references(args.target, prompts, modes, args.max_tokens)
    print(f"references computed in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)

    import ray
    from ray import serve

    from deployments.app import build_app_with

    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    serve.run(build_app_with({
        "model_name": "soak",
        "verifier": {"model": args.target, "dtype": "float32", "cache_budget_mb": 1024, "num_threads": 1},
        "drafter": {"method": "draft_model", "model": args.drafter, "dtype": "float32", "num_speculative_tokens": 4,
                    "cache_budget_mb": 32, "num_threads": 1},
        "max_active_requests": 4 * args.clients,
    }, overrides={"Verifier": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}},
                  "Drafter": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.25}}}),
              name="soak", route_prefix="/")

    report = {"sent": 0, "completed": 0, "failed": 0, "mismatches": 0, "kills": {"Drafter": 0, "Verifier": 0},
              "errors": [], "latency_s": [], "tokens": 0, "degraded_steps": 0, "verifier_recomputes": 0,
              "cached_tokens": 0}
    stop_at = time.monotonic() + 60 * args.minutes

    async def one(client: httpx.AsyncClient, rng: random.Random):
        pi, mi = rng.randrange(len(prompts)), rng.randrange(len(modes))
        body = {"model": "soak", "prompt": prompts[pi], "max_tokens": args.max_tokens, "ignore_eos": True,
                "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}, **modes[mi]}
        if salt := rng.choice((None, "tenant-a", "tenant-b")):
            body["cache_salt"] = salt
        report["sent"] += 1
        ids, error, spec, t = [], None, {}, time.monotonic()
        try:
            async with client.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as r:
                if r.status_code != 200:
                    error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            error = chunk["error"]["message"]
                            break
                        if chunk.get("usage"):
                            report["cached_tokens"] += chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
                        if chunk["choices"]:
                            ids += chunk["choices"][0].get("token_ids", [])
                            spec = chunk["choices"][0].get("speculation") or spec
        except Exception as e:  # noqa: BLE001 - any transport failure is a failed request
            error = repr(e)
        if error:
            report["failed"] += 1
            report["errors"].append(error)
            return
        report["completed"] += 1
        report["latency_s"].append(time.monotonic() - t)
        report["tokens"] += len(ids)
        report["degraded_steps"] += spec.get("degraded_steps", 0)
        report["verifier_recomputes"] += spec.get("verifier_recomputes", 0)
        if ids != expected[(pi, mi)]:
            report["mismatches"] += 1

    async def client_loop(i: int):
        rng = random.Random(i)
        async with httpx.AsyncClient() as client:
            while time.monotonic() < stop_at:
                await one(client, rng)

    async def killer():
        which = 0
        while time.monotonic() + args.kill_every < stop_at:
            await asyncio.sleep(args.kill_every)
            name = ("Drafter", "Verifier")[which % 2]
            which += 1
            actors = [a for a in ray.util.list_named_actors(all_namespaces=True)
                      if f"#{name}#" in a["name"] and a["name"].startswith("SERVE_REPLICA")]
            if actors:
                a = random.Random(which).choice(actors)
                ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]), no_restart=True)
                report["kills"][name] += 1
                print(f"[{time.strftime('%X')}] killed a {name} replica", file=sys.stderr, flush=True)

    async def run():
        await asyncio.gather(killer(), *(client_loop(i) for i in range(args.clients)))

    t_run = time.monotonic()
    asyncio.run(run())
    elapsed = time.monotonic() - t_run
    lat = sorted(report.pop("latency_s"))
    report.update({
        "minutes": round(elapsed / 60, 2), "clients": args.clients,
        "tokens_per_s": round(report["tokens"] / elapsed, 1),
        "latency_p50_s": round(statistics.median(lat), 3) if lat else None,
        "latency_p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None,
        "errors": report["errors"][:10],
    })
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # build/ does not exist on a fresh clone
        Path(args.out).write_text(json.dumps(report, indent=1))
    serve.shutdown()
    ray.shutdown()
    return 0 if report["failed"] == 0 and report["mismatches"] == 0 and report["completed"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
