"""Load: N concurrent streaming clients (closed loop, prompts cycled), speculation on (the default policy) against
off, per N: output tokens/s, time to first token, inter-token latency (the gap between streamed chunks, as vLLM's
benchmark measures it) and time per output token, p50 and p99. ``--rounds R`` alternates each level's pair R times:
a mode's figures pool its rounds, the on/off ratio is the median of the rounds'.

``--multi-turn``: the conversations workload (``bench.workloads.conversations``: a shared system prompt, chats whose
every turn carries its whole history) with the prefix cache on (one ``cache_salt`` for the run) and off (a fresh
salt per request), per N; at N = 1 each turn that hit the cache is followed by its uncached suffix sent alone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import time
import uuid

from bench import workloads
from bench.client import Scenario, add_arguments, completion_body, serving, stream_completion
from bench.common import TARGET, environment, ints, log, median, percentile, rnd, write_json

MODES = {"spec_on": None, "spec_off": 0}  # request's num_speculative_tokens (None: the server's default)


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.load",
                                 description="Throughput and latency under concurrent streaming load.")
    add_arguments(ap, prompts=16, max_tokens=128)  # (the prompts cycled through by the clients)
    ap.add_argument("--concurrency", type=ints, default=[1, 4, 16, 64])
    ap.add_argument("--min-requests", type=int, default=8,
                    help="requests per (concurrency, mode) at least; each client sends ceil(this / N)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=1, help="on/off pairs per concurrency level (ratio: their median)")
    ap.add_argument("--multi-turn", action="store_true", help="the conversations workload, prefix cache on and off")
    ap.add_argument("--system-tokens", type=int, default=850, help="--multi-turn: the shared system prompt's tokens")
    ap.add_argument("--turn-tokens", type=int, default=24, help="--multi-turn: each user turn's tokens")
    ap.add_argument("--vllm", action="store_true", help="--multi-turn: vLLM's own server too, its prefix cache on")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: at least 1")
    if args.multi_turn and args.system_tokens + 5 * (args.turn_tokens + args.max_tokens) + 8 > 1024:
        ap.error("--multi-turn: the system prompt, five turns and their answers (and 8 drafts) exceed the pair's "
                 "context of 1,024 tokens")
    return args


async def _level(client, url, prompts, n: int, per_client: int, k, args) -> tuple[list[dict], float]:
    """One round of a level in one mode: (every request's result, the round's wall seconds)."""
    results = []

    async def one_client(c: int):
        for j in range(per_client):
            p = prompts[(c * per_client + j) % len(prompts)][1]
            t_send = time.perf_counter()
            r = await stream_completion(client, url, completion_body(p, args.max_tokens, args.temperature,
                                                                     10_000 + c * 100 + j, k, True))
            r["t_send"], r["t_done"] = t_send, time.perf_counter()
            results.append(r)

    t0 = time.perf_counter()
    await asyncio.gather(*(one_client(c) for c in range(n)))
    return results, time.perf_counter() - t0


def _summary(n: int, results: list[dict], wall: float) -> dict:
    """A mode's figures over its rounds' requests; throughput: their tokens over the rounds' summed wall time."""
    tokens = sum(r["tokens"] for r in results)
    ttft = [r["chunks"][0][0] for r in results if r["chunks"]]
    itl = [b[0] - a[0] for r in results for a, b in zip(r["chunks"], r["chunks"][1:])]
    tpot = [(r["latency_s"] - r["chunks"][0][0]) / (r["tokens"] - 1) for r in results
            if r["chunks"] and r["tokens"] > 1]
    spec = [r["speculation"] for r in results if r.get("speculation")]
    drafted = sum(s.get("num_draft_tokens", 0) for s in spec)
    accepted = sum(s.get("num_accepted_tokens", 0) for s in spec)
    steps = sum(s.get("num_drafts", 0) for s in spec)
    return {"clients": n, "requests": len(results), "output_tokens": tokens, "wall_s": rnd(wall, 3),
            "throughput_tok_s": rnd(tokens / wall, 2),
            "ttft_ms_p50": rnd(1000 * percentile(ttft, 50), 2), "ttft_ms_p99": rnd(1000 * percentile(ttft, 99), 2),
            "itl_ms_p50": rnd(1000 * percentile(itl, 50), 2) if itl else None,
            "itl_ms_p99": rnd(1000 * percentile(itl, 99), 2) if itl else None,
            "tpot_ms_p50": rnd(1000 * percentile(tpot, 50), 2) if tpot else None,
            "tpot_ms_p99": rnd(1000 * percentile(tpot, 99), 2) if tpot else None,
            "tokens_per_chunk": rnd(tokens / max(1, sum(len(r["chunks"]) for r in results)), 3),
            "acceptance_rate": rnd(accepted / drafted, 4) if drafted else None,
            "mean_k": rnd(drafted / steps, 3) if steps else 0.0,
            "mean_exposed_ms": rnd(median([s.get("mean_exposed_ms") for s in spec if s.get("num_drafts")]), 3)}


async def _measure(url, prompts, args) -> list[dict]:
    import httpx

    n_max = max(args.concurrency) + 8
    limits = httpx.Limits(max_connections=n_max, max_keepalive_connections=n_max)
    out = []
    async with httpx.AsyncClient(timeout=1800, limits=limits) as client:
        for k in MODES.values():  # warm-up
            await stream_completion(client, url, completion_body(prompts[0][1], 16, args.temperature, 1, k, True))
        for i, n in enumerate(args.concurrency):
            per_client = max(1, math.ceil(args.min_requests / n))
            modes = list(MODES.items())
            if i % 2:
                modes.reverse()  # alternate which mode goes first
            runs = {mode: [] for mode in MODES}  # per round: (results, wall)
            ratios = []
            for r in range(args.rounds):
                this = {}  # the round's figures per mode
                for mode, k in (modes if r % 2 == 0 else modes[::-1]):
                    runs[mode].append(await _level(client, url, prompts, n, per_client, k, args))
                    s = this[mode] = _summary(n, *runs[mode][-1])
                    log(f"N={n} round {r + 1} {mode}: {s['throughput_tok_s']} tok/s, TTFT p50 {s['ttft_ms_p50']} ms, "
                        f"ITL p50 {s['itl_ms_p50']} ms, mean k {s['mean_k']}")
                ratios.append(this["spec_on"]["throughput_tok_s"] / this["spec_off"]["throughput_tok_s"])
            row = {"concurrency": n, **{mode: _summary(n, [x for res, _ in rs for x in res], sum(w for _, w in rs))
                                        for mode, rs in runs.items()}}
            row["throughput_ratio_on_vs_off"] = rnd(median(ratios), 4)
            row["round_ratios_on_vs_off"] = [rnd(x, 4) for x in ratios]
            out.append(row)
    return out


async def _chats(client, url, system: list[int], convs: list, n: int, salt: str | None, args) -> tuple[list, float]:
    """n clients run the conversations, each turn with its history (``salt`` None: a fresh one per request)."""
    results = []

    async def one_client(c: int):
        for conv in convs[c::n]:
            history = list(system)
            for j, ask in enumerate(conv):
                history += ask
                body = completion_body(history, args.max_tokens, args.temperature, 1000 + j, None, True)
                r = await stream_completion(client, url, body | {"cache_salt": salt or uuid.uuid4().hex})
                if r["cached_tokens"] and n == 1:  # the uncached suffix alone: its prefill without the history
                    alone = completion_body(history[r["cached_tokens"]:], args.max_tokens, args.temperature, 1, None,
                                            True) | {"cache_salt": uuid.uuid4().hex}
                    r["suffix_ttft_s"] = (await stream_completion(client, url, alone))["chunks"][0][0]
                results.append(r)
                history += r["token_ids"]

    t0 = time.perf_counter()
    await asyncio.gather(*(one_client(c) for c in range(n)))
    return results, time.perf_counter() - t0


def _chat_summary(n: int, results: list[dict], wall: float) -> dict:
    s = _summary(n, results, wall)
    ttft = [r["chunks"][0][0] for r in results if r["chunks"]]
    s["ttft_ms_p90"] = rnd(1000 * percentile(ttft, 90), 2)
    s["cached_tokens_mean"] = rnd(sum(r["cached_tokens"] or 0 for r in results) / len(results), 1)
    ratio = [r["chunks"][0][0] / r["suffix_ttft_s"] for r in results if r.get("suffix_ttft_s")]
    if ratio:  # a hit's time to first token over its uncached suffix's alone
        s["hit_vs_suffix_ttft_p50"], s["hit_vs_suffix_ttft_p90"] = (rnd(percentile(ratio, q), 3) for q in (50, 90))
    return s


async def _measure_chats(url, args) -> list[dict]:
    import httpx
    from transformers import AutoTokenizer

    system, convs = workloads.conversations(AutoTokenizer.from_pretrained(TARGET), system_tokens=args.system_tokens,
                                            turn_tokens=args.turn_tokens)
    out = []
    async with httpx.AsyncClient(timeout=1800) as client:
        await _chats(client, url, system, convs[:1], 1, None, args)  # warm-up
        for n in args.concurrency:
            row = {"concurrency": n}
            for mode, salt in (("cache_off", None), ("cache_on", uuid.uuid4().hex)):
                s = row[mode] = _chat_summary(n, *await _chats(client, url, system, convs, n, salt, args))
                log(f"N={n} {mode}: TTFT p50 {s['ttft_ms_p50']} p90 {s['ttft_ms_p90']} ms, "
                    f"{s['throughput_tok_s']} tok/s, cached {s['cached_tokens_mean']}, "
                    f"hit/suffix {s.get('hit_vs_suffix_ttft_p50')}")
            out.append(row)
    return out


def _run_chats(args, sc: Scenario, url: str | None, t0: float) -> dict:
    # (a context of 1,024 tokens, the shipped pair's, and KV for a conversation per stream)
    app = sc.app("adaptive", streams=2 * max(args.concurrency) + 2)
    app["verifier"]["max_model_len"] = app["drafter"]["max_model_len"] = 1024
    with contextlib.ExitStack() as stack:
        url = url or stack.enter_context(serving({"load": app}, args.threads))["load"]
        levels = asyncio.run(_measure_chats(url, args))
    peer = {}
    if args.vllm:  # vLLM's own server, its draft_model speculation at the peers' k, its prefix caching on
        from bench.common import PEER_K, vllm_python
        from bench.vllm import VllmServer

        with VllmServer(vllm_python(), PEER_K, args.threads, 1024, args.dtype, prefix_caching=True) as server:
            peer["vllm_levels"] = asyncio.run(_measure_chats(server.wait_ready(), args))
    return {"scenario": "load-multi-turn", "config": {"concurrency": args.concurrency, "max_tokens": args.max_tokens,
                                                      "temperature": args.temperature, "threads": args.threads,
                                                      "system_tokens": args.system_tokens,
                                                      "turn_tokens": args.turn_tokens},
            "environment": environment(args.threads), "levels": levels, **peer,
            "duration_s": round(time.perf_counter() - t0, 1)}


def run(args, url: str | None = None) -> dict:
    sc, t0 = Scenario.from_args(args), time.perf_counter()
    if args.multi_turn:
        return _run_chats(args, sc, url, t0)
    wls = sc.load()
    per_workload = {}
    with contextlib.ExitStack() as stack:
        if url is None:
            app = sc.app("adaptive", streams=max(args.concurrency))
            url = stack.enter_context(serving({"load": app}, args.threads))["load"]
        for wl in wls:
            log(f"workload {wl.name}: {len(wl.prompts)} prompts")
            per_workload[wl.name] = {"workload": wl.describe(), "levels": asyncio.run(_measure(url, wl.prompts, args))}
    config = {"concurrency": args.concurrency, "min_requests": args.min_requests, "rounds": args.rounds,
              "temperature": args.temperature, "verifier_replicas": 1, "drafter_replicas": 1}
    # ``levels``: the first workload's (the report's plot); ``workloads``: each one's
    return sc.record("load", wls, t0, config=config, levels=per_workload[wls[0].name]["levels"], workloads=per_workload)


def main(argv=None):
    args = parse(argv)
    data = run(args)
    path = write_json(args.out, "load-multi-turn" if args.multi_turn else "load", data)
    log(f"wrote {path} ({data['duration_s']} s)")
    return data


if __name__ == "__main__":
    main()
