"""Does a vLLM verify step cost work proportional to its new tokens, not to the sequence?

For each sequence length (default 100..1,500 tokens) a sequence is prefilled once, then
verified step after step (k random drafts, so nearly every step emits one token and the
next call sends one new token plus k drafts, as decoding does); the median (and minimum)
wall time of a verify step is reported per length, with the number of prompt tokens vLLM
actually computed per step (not read from its prefix cache): the work measure, immune to
a noisy machine. With vLLM's prefix caching the earlier tokens' K/V are
read from the cache, so the time should stay flat as the sequence grows; the baseline
engine (``--baseline``: prefix caching off) recomputes the whole sequence every step.

    python -m bench.vllm_prefix --out build/vllm_prefix.json

``measure`` takes any async verify callable, so the tests run it through a served replica.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

from configs import SamplingParams
from core.protocol import VerifyRequest

DEFAULT_LENGTHS = [100, 250, 500, 750, 1000, 1500]


async def measure(verify, lengths, repeats: int, k: int, seed: int, vocab: int, sampled: bool = False,
                  tag: str = "bench", engine_stats=None) -> list[dict]:
    """verify: async list[VerifyRequest] -> list[VerifyResult]. Per length: step times (median,
    min) and, with ``engine_stats`` (a callable returning the engine's counters), the tokens vLLM
    computed per step. Lengths take turns step by step, so a noisy neighbour hits them alike."""
    rng = random.Random(seed)
    params = SamplingParams(temperature=1.0 if sampled else 0.0)
    drafts = lambda: [rng.randrange(3, vocab) for _ in range(k)]  # noqa: E731
    seqs = {}
    for length in lengths:  # prefill
        seq_id = f"{tag}-{length}-{seed}"
        tokens = [rng.randrange(3, vocab) for _ in range(length)]
        t0 = time.perf_counter()
        (res,) = await verify([VerifyRequest(seq_id, 0, None, list(tokens), drafts(), params, seed, full=True)])
        assert res.error is None, res.error
        seqs[length] = {"id": seq_id, "tokens": tokens + res.tokens, "cached": res.cached, "times": [],
                        "computed": [], "misses": 0, "prefill_ms": (time.perf_counter() - t0) * 1e3}
    for _ in range(repeats):
        for length in lengths:
            s = seqs[length]
            d = drafts()
            req = VerifyRequest.for_tokens(s["id"], s["tokens"], s["cached"], draft_tokens=d, sampling=params, seed=seed)
            before = engine_stats()["computed_tokens"] if engine_stats else 0
            t0 = time.perf_counter()
            (res,) = await verify([req])
            s["times"].append(time.perf_counter() - t0)
            if engine_stats:
                s["computed"].append(engine_stats()["computed_tokens"] - before)
            if res.cache_miss:
                s["misses"] += 1
                (res,) = await verify([VerifyRequest(s["id"], 0, None, list(s["tokens"]), d, params, seed, full=True)])
            assert res.error is None, res.error
            s["tokens"] += res.tokens
            s["cached"] = res.cached
    rows = []
    for length in lengths:
        s = seqs[length]
        rows.append({"length": length, "median_ms": round(statistics.median(s["times"]) * 1e3, 2),
                     "min_ms": round(min(s["times"]) * 1e3, 2), "max_ms": round(max(s["times"]) * 1e3, 2),
                     "computed_tokens_per_step": statistics.median(s["computed"]) if s["computed"] else None,
                     "prefill_ms": round(s["prefill_ms"], 2), "repeats": repeats, "k": k, "cache_misses": s["misses"]})
    return rows


def build_model(path: Path, max_len: int = 2048):
    """A random Llama shaped like the shipped target (8 x 512, head_dim 64, 4,096-token
    vocabulary) but with room for 2,048 positions (the shipped one has 1,024)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.helpers import tiny_tokenizer

    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=max_len,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)  # any tokenizer: the benchmark sends token ids
    return path


async def run_engine(model: str, args, prefix_caching: bool) -> dict:
    from configs import VerifierConfig
    from verifier.vllm_engine import VllmVerifierEngine

    cfg = VerifierConfig(model=model, backend="vllm", vllm_kv_cache_gib=args.kv_cache_gib,
                         vllm_block_size=args.block_size, max_model_len=max(args.lengths) + args.repeats * 2 + 64)
    eng = VllmVerifierEngine(cfg, enable_prefix_caching=prefix_caching)
    try:
        await measure(eng.verify, [min(args.lengths)], 2, args.k, 99, eng.vocab_size, tag="warmup")
        out = {}
        for mode in args.modes:
            out[mode] = await measure(eng.verify, args.lengths, args.repeats, args.k, args.seed, eng.vocab_size,
                                      sampled=mode == "sampled", tag=mode, engine_stats=lambda: eng.stats)
            for r in out[mode]:
                print(f"prefix_caching={prefix_caching} {mode:7s} length {r['length']:5d}: "
                      f"median {r['median_ms']:8.2f} ms (min {r['min_ms']}, max {r['max_ms']}), "
                      f"computed {r['computed_tokens_per_step']} tokens/step", flush=True)
        return out
    finally:
        eng.shutdown()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="local model directory (default: a random Llama shaped like the shipped target)")
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=DEFAULT_LENGTHS)
    ap.add_argument("--repeats", type=int, default=15, help="verify steps timed per length (median reported)")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step")
    ap.add_argument("--modes", type=lambda s: s.split(","), default=["greedy", "sampled"])
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--kv-cache-gib", type=float, default=0.5)
    ap.add_argument("--baseline", action="store_true", help="also run an engine with prefix caching off")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="build/vllm_prefix.json")
    args = ap.parse_args()
    model = args.model or str(build_model(Path("build/bench_vllm_model")))
    result = {"model": model, "k": args.k, "block_size": args.block_size, "repeats": args.repeats,
              "prefix_caching": asyncio.run(run_engine(model, args, True))}
    if args.baseline:
        result["no_prefix_caching"] = asyncio.run(run_engine(model, args, False))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
