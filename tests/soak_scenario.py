"""Soak: many concurrent streams for minutes while drafter and verifier replicas are killed.

    python -m tests.soak_scenario --minutes 5          (or: make soak)

Starts its own Ray cluster and the splitspec app (2 drafter and 2 verifier replicas) on the
shipped model pair, then runs ``--clients`` streaming clients in a loop. Every
``--kill-every`` seconds one replica (drafter and verifier in turn) is killed; Serve replaces
it. Half the prompts share a prefix (a system prompt), and requests come with and without a
``cache_salt``: the verifiers' prefix caches hit across requests (``cached_tokens`` in the report).
A quarter of the clients hold conversations instead: five turns, each sent with its whole history
(a shared system prompt, the earlier asks and answers), so each turn hits the blocks its last one
left. The verifiers' KV budget is small enough that cached blocks are evicted; every 10 seconds
each replica's cache is audited (every block free, a sequence's own, cached, or set aside for
states, never two of these or none) and its bytes checked against the configured budget.
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


def conversation_references(target: str, system: list[int], asks: list[list[int]], modes: list[dict],
                            max_tokens: int, turns: int) -> dict:
    """Expected answers per (conversation, mode): each turn's prompt is the history (the system prompt, every
    ask and answer before) and its ask; conversation c asks ``asks[c:c + turns]``."""
    import torch

    from configs import SamplingParams, VerifierConfig
    from core.loop import generate
    from verifier.engine import VerifierEngine

    torch.set_num_threads(1)
    engine = VerifierEngine(VerifierConfig(model=target, dtype="float32", cache_budget_mb=256))
    out = {}
    for mi, mode in enumerate(modes):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **mode)
        histories = [list(system) for _ in range(len(asks) - turns + 1)]
        answers = [[] for _ in histories]
        for t in range(turns):
            prompts = [h + asks[c + t] for c, h in enumerate(histories)]
            for c, seq in enumerate(generate(prompts, params, 0, None, engine)):
                answers[c].append(seq.output_ids)
                histories[c] = prompts[c] + seq.output_ids
        out.update({(c, mi): a for c, a in enumerate(answers)})
    return out


async def audit(handles: dict, samples: dict, tries: int = 6):
    """Each replica's cache accounting and resident memory (``stats``; a replica answers one of ``tries`` calls
    through the handle, as Serve routes them): appended to ``samples[(role, replica)]``."""
    for role, handle in handles.items():
        for _ in range(tries):
            try:
                st = await handle.stats.remote()
            except Exception:  # noqa: BLE001 - a replica killed under the call: the next sample asks another
                continue
            if "cache_memory" in st:
                samples.setdefault((role, st.get("replica_id")), []).append(
                    {"t": time.monotonic(), "rss": st.get("rss_bytes"), **st["cache_memory"],
                     "evictions": st["cache"]["evictions"], "prefix_evictions": st["cache"]["prefix_evictions"]})


def memory_report(samples: dict) -> dict:
    """Per role: replicas sampled, the largest bytes in use against the budget, resident memory, and every
    sample whose accounting failed (a block in no place or two, K/V past the budget, states past their
    blocks)."""
    out = {}
    for (role, _), xs in samples.items():
        r = out.setdefault(role, {"replicas": 0, "samples": 0, "budget_bytes": xs[0]["budget_bytes"],
                                  "max_kv_bytes": 0, "max_state_bytes": 0, "max_rss_bytes": 0,
                                  "max_idle_blocks": 0, "evictions": 0, "prefix_evictions": 0, "bad": []})
        r["replicas"] += 1
        r["samples"] += len(xs)
        for key in ("evictions", "prefix_evictions"):  # (each replica's counts since it started)
            r[key] += max(x[key] for x in xs)
        for x in xs:
            r["max_kv_bytes"] = max(r["max_kv_bytes"], x["kv_bytes"])
            r["max_state_bytes"] = max(r["max_state_bytes"], x["state_bytes"])
            r["max_rss_bytes"] = max(r["max_rss_bytes"], x["rss"] or 0)
            r["max_idle_blocks"] = max(r["max_idle_blocks"], x["idle"])
            if (x["leaked"] or x["double"] or x["kv_bytes"] > x["budget_bytes"]
                    or x["state_bytes"] > x["ballast_bytes"]):
                r["bad"].append(x)
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
    ap.add_argument("--turns", type=int, default=5, help="turns of each conversation")
    ap.add_argument("--verifier-cache-mb", type=int, default=192,
                    help="each verifier's KV budget: small enough that cached blocks are evicted")
    args = ap.parse_args(argv)

    from offline.training.corpus import held_out_prompts

    # and conversations' next turns: the others after the first as a shared system prompt, sent by tenants with and
    # without a cache_salt (prefix-cache hits across requests, isolated by salt)
    prompts = held_out_prompts(8, prompt_chars=300)
    prompts += [prompts[0] + "\n" + p for p in prompts[1:]]
    modes = [{"temperature": 0.0}, {"temperature": 0.8, "seed": 17, "verification": "gumbel"}]
    t0 = time.monotonic()
    expected = references(args.target, prompts, modes, args.max_tokens)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.target)
    texts = held_out_prompts(16, prompt_chars=400)
    system = tok("".join(texts[:3]))["input_ids"][:320]  # (the system prompt, five turns and answers: 1,024 at most)
    asks = [tok(t)["input_ids"][:24] for t in texts[3:]]
    chats = conversation_references(args.target, system, asks, modes, args.max_tokens, args.turns)
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
        "verifier": {"model": args.target, "dtype": "float32", "cache_budget_mb": args.verifier_cache_mb,
                     "num_threads": 1},
        "drafter": {"method": "draft_model", "model": args.drafter, "dtype": "float32", "num_speculative_tokens": 4,
                    "cache_budget_mb": 32, "num_threads": 1},
        "max_active_requests": 4 * args.clients,
    }, overrides={"Verifier": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}},
                  "Drafter": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.25}}}),
              name="soak", route_prefix="/")

    report = {"sent": 0, "completed": 0, "failed": 0, "mismatches": 0, "kills": {"Drafter": 0, "Verifier": 0},
              "errors": [], "latency_s": [], "tokens": 0, "degraded_steps": 0, "verifier_recomputes": 0,
              "cached_tokens": 0, "turns": 0, "turns_cached_tokens": 0}
    stop_at = time.monotonic() + 60 * args.minutes

    async def one(client: httpx.AsyncClient, rng: random.Random):
        pi, mi = rng.randrange(len(prompts)), rng.randrange(len(modes))
        await request(client, prompts[pi], mi, rng.choice((None, "tenant-a", "tenant-b")), expected[(pi, mi)])

    async def conversation(client: httpx.AsyncClient, rng: random.Random):
        """One conversation's turns, each with its history; a failed or wrong turn ends it."""
        c, mi = rng.randrange(len(asks) - args.turns + 1), rng.randrange(len(modes))
        salt, history = rng.choice((None, "tenant-a", "tenant-b")), list(system)
        for t, answer in enumerate(chats[(c, mi)]):
            history += asks[c + t]
            cached = await request(client, list(history), mi, salt, answer)
            if cached is None:
                return
            report["turns"] += 1
            report["turns_cached_tokens"] += cached
            history += answer

    async def request(client: httpx.AsyncClient, prompt, mi: int, salt: str | None, want: list[int]) -> int | None:
        """One streamed request, checked token for token: its cached tokens (None: failed or wrong)."""
        body = {"model": "soak", "prompt": prompt, "max_tokens": args.max_tokens, "ignore_eos": True,
                "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}, **modes[mi]}
        if salt:
            body["cache_salt"] = salt
        report["sent"] += 1
        ids, error, spec, t, cached = [], None, {}, time.monotonic(), 0
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
                            cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
                            report["cached_tokens"] += cached
                        if chunk["choices"]:
                            ids += chunk["choices"][0].get("token_ids", [])
                            spec = chunk["choices"][0].get("speculation") or spec
        except Exception as e:  # noqa: BLE001 - any transport failure is a failed request
            error = repr(e)
        if error:
            report["failed"] += 1
            report["errors"].append(error)
            return None
        report["completed"] += 1
        report["latency_s"].append(time.monotonic() - t)
        report["tokens"] += len(ids)
        report["degraded_steps"] += spec.get("degraded_steps", 0)
        report["verifier_recomputes"] += spec.get("verifier_recomputes", 0)
        if ids != want:
            report["mismatches"] += 1
            return None
        return cached

    async def client_loop(i: int):
        rng = random.Random(i)
        async with httpx.AsyncClient() as client:
            while time.monotonic() < stop_at:
                await (conversation if i % 4 == 3 else one)(client, rng)

    samples: dict = {}
    handles = {role: serve.get_deployment_handle(role, app_name="soak") for role in ("Verifier", "Drafter")}

    async def auditor():
        while time.monotonic() < stop_at:
            await audit(handles, samples)
            await asyncio.sleep(10)

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
        await asyncio.gather(killer(), auditor(), *(client_loop(i) for i in range(args.clients)))
        await audit(handles, samples)  # (after the load: idle blocks at their most)

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
        "memory": memory_report(samples),
    })
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # build/ does not exist on a fresh clone
        Path(args.out).write_text(json.dumps(report, indent=1))
    serve.shutdown()
    ray.shutdown()
    memory = report["memory"]
    audited = memory.get("Verifier", {}).get("samples") and not any(r["bad"] for r in memory.values())
    ok = report["failed"] == 0 and report["mismatches"] == 0 and report["completed"] > 0 and report["turns"] > 0
    return 0 if ok and audited else 1


if __name__ == "__main__":
    sys.exit(main())
