"""``python -m offline.generate``: generate text with speculative decoding, in process.

Composes a drafter (a draft model, n-gram lookup, or a Speculators head: EAGLE-3, DFlash, DSpark,
told apart by its config.json) and the target's verifier engine around the loop that serves
(``core.loop.speculate``: policy, pre-drafting, the drafter on a thread of its own); no Ray, no HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from configs import DraftModelConfig, SamplingParams, VerifierConfig
from core.hub import local_dir
from core.loop import speculate_local
from core.policy import AdaptiveK, FixedK
from core.registry import load
from core.sequence import Sequence
from drafter.build import build_drafter
from drafter.registry import METHODS, heads
from verifier.engine import VerifierEngine


def drafter_config(ref: str, target: str, k: int, **engine):
    """The drafter config ``ref`` names: a method without a model by its name (``ngram``); a head (its config's
    ``speculators_model_type``: eagle3, dflash or dspark) for the verifier ``target``, as the app builder
    configures it; else a draft model. ``engine``: engine fields (dtype, num_threads, cache_budget_mb,
    max_model_len) of a model drafter."""
    if ref in METHODS and not METHODS[ref].model:
        return load(METHODS[ref].config)(method=ref, num_speculative_tokens=k)
    path = Path(local_dir(ref, field="--drafter"))
    cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    name = cfg.get("speculators_model_type")
    if name in heads():  # (``drafter.registry``: a head's config class, by the method its config.json names)
        config = load(METHODS[name].config)
        return config(method=name, model=str(path), num_speculative_tokens=k, verifier_model=target, **engine)
    if name is not None:
        raise SystemExit(f"--drafter {ref}: speculators_model_type {name!r}; this runs {', '.join(heads())} heads")
    return DraftModelConfig(model=str(path), num_speculative_tokens=k, **engine)


def main(argv=None):
    ap = argparse.ArgumentParser(description="Generate text with speculative decoding, in process.")
    ap.add_argument("--prompt", default="def fibonacci(n):\n")
    ap.add_argument("--target", default="models/tiny-code-target")
    ap.add_argument("--drafter", default="models/tiny-code-drafter", help=(
        "a draft model, a Speculators EAGLE-3, DFlash or DSpark head for --target (a directory or a Hub id), "
        "or 'ngram'"))
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--policy", choices=["fixed", "adaptive"], default="fixed",
                    help="k per step: fixed, or adaptive (k the bound)")
    ap.add_argument("--no-pipeline", action="store_true", help="do not pre-draft the next block during verification")
    args = ap.parse_args(argv)

    args.target = local_dir(args.target, field="--target")
    verifier = VerifierEngine(VerifierConfig(model=args.target))
    k = args.num_speculative_tokens
    drafter = build_drafter(drafter_config(args.drafter, args.target, k))
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens)
    ids = verifier.tokenizer(args.prompt)["input_ids"]
    t0 = time.perf_counter()
    seq = Sequence(ids, params, k, verifier.tokenizer, verifier.eos_ids, min(verifier.max_len, drafter.max_len)
                   if hasattr(drafter, "max_len") else verifier.max_len)
    policy = AdaptiveK(k) if args.policy == "adaptive" else FixedK(k)
    asyncio.run(speculate_local(seq, drafter if k else None, verifier, policy, not args.no_pipeline))
    dt = time.perf_counter() - t0
    print(args.prompt + seq.text)
    n = len(seq.output_ids)
    print(f"\n--- {n} tokens in {dt:.2f}s ({1000 * dt / max(n, 1):.1f} ms/token), finish_reason={seq.finish_reason}")
    print(f"--- k={k}: {seq.stats.as_dict()}")


if __name__ == "__main__":
    main()
