"""Drafters side by side in the in-process loop (the engines, no RPC): a draft model, the EAGLE-3 head and
parallel heads (DFlash, DSpark), greedy, one stream.

    python -m bench.heads compare --head build/dflash/tiny-code-dflash [--head DIR ...] [--ks 2 3 4]
    python -m bench.heads confidence --head build/dflash/tiny-code-dspark [--stops 0.3 0.5 0.7]

compare: per drafter and k, the drafting time on the critical path per step (the drafter's engine time per
call: its passes and its sampling; a pool adds one round trip per call whatever k) and ms per output token,
each prompt running every (drafter, k) in a rotated order (paired; noisy machines drift between runs).
confidence: a DSpark head without ending blocks early at each k, and ending them at low confidence
(``confidence_stop``) at the largest k: accepted tokens per drafter pass, mean acceptance length and ms per
token, paired the same way.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench.common import DRAFTER, EAGLE3, MAX_MODEL_LEN, TARGET, load_prompts


class _Timed:
    """A drafter whose propose calls are timed (engine seconds per call)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []
        self.aux_layers = getattr(inner, "aux_layers", ())

    def propose(self, requests):
        t0 = time.perf_counter()
        out = self.inner.propose(requests)
        self.calls.append(time.perf_counter() - t0)
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def drafters(heads: list[str], threads: int, dtype: str, stops=(None,)) -> dict:
    from configs import DraftModelConfig, Eagle3Config, ParallelHeadConfig
    from drafter.dflash_drafter import ParallelDrafter
    from drafter.eagle3_drafter import Eagle3Drafter
    from drafter.model_drafter import ModelDrafter

    common = dict(num_threads=threads, dtype=dtype, max_model_len=MAX_MODEL_LEN)
    out = {}
    if heads and stops == (None,):
        out["draft model"] = ModelDrafter(DraftModelConfig(model=DRAFTER, cache_budget_mb=8, **common))
        out["EAGLE-3 head"] = Eagle3Drafter(Eagle3Config(model=EAGLE3, cache_budget_mb=8, verifier_model=TARGET, **common))
    for h in heads:
        method = json.loads((Path(h) / "config.json").read_text())["speculators_model_type"]
        for stop in stops:
            name = f"{method} head {Path(h).name}" + ("" if stop is None else f" stop {stop}")
            out[name] = ParallelDrafter(ParallelHeadConfig(method=method, model=h, cache_budget_mb=8, verifier_model=TARGET,
                                                           confidence_stop=stop, **common))
    return out


def run(verifier, drafter, ids: list[int], max_tokens: int, k: int) -> dict:
    from configs import SamplingParams
    from core.loop import generate

    timed = _Timed(drafter)
    t0 = time.perf_counter()
    (seq,) = generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), k, timed, verifier)
    wall = time.perf_counter() - t0
    st = seq.stats.as_dict()
    passes = getattr(drafter, "stats", {}).get("passes")
    return {"ms": 1000 * wall, "tokens": seq.num_output, "draft_s": sum(timed.calls), "calls": len(timed.calls),
            "accepted": st["num_accepted_tokens"], "drafted": st["num_draft_tokens"], "steps": st["num_drafts"],
            "passes": passes}


def measure(names_ks: list[tuple[str, int]], ds: dict, verifier, prompts, max_tokens: int) -> dict:
    rows = {nk: [] for nk in names_ks}
    for i, (_, ids) in enumerate(prompts):
        order = names_ks[i % len(names_ks):] + names_ks[: i % len(names_ks)]
        for name, k in order:
            d = ds[name]
            before = dict(getattr(d, "stats", {}))
            r = run(verifier, d, ids, max_tokens, k)
            if before:
                r["passes"] = d.stats["passes"] - before["passes"]
            rows[(name, k)].append(r)
    out = {}
    for (name, k), rs in rows.items():
        tok, steps = sum(r["tokens"] for r in rs), sum(r["steps"] for r in rs)
        calls = sum(r["calls"] for r in rs)
        passes = sum(r["passes"] or 0 for r in rs)
        out[f"{name} k={k}"] = {
            "drafter": name, "k": k, "ms_per_token": round(sum(r["ms"] for r in rs) / tok, 3),
            "draft_ms_per_step": round(1000 * sum(r["draft_s"] for r in rs) / max(calls, 1), 3),
            "mean_acceptance_length": round(1 + sum(r["accepted"] for r in rs) / max(steps, 1), 3),
            "accepted_per_pass": round(sum(r["accepted"] for r in rs) / passes, 3) if passes else None}
    return out


def main(argv=None) -> None:
    import torch

    from configs import VerifierConfig
    from verifier.engine import VerifierEngine

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["compare", "confidence"])
    ap.add_argument("--head", action="append", default=[], help="a parallel head directory (repeatable)")
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--stops", type=float, nargs="+", default=[0.3, 0.5, 0.7])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    verifier = VerifierEngine(VerifierConfig(model=TARGET, num_threads=args.threads, cache_budget_mb=64, dtype=args.dtype,
                                             max_model_len=MAX_MODEL_LEN))
    prompts = load_prompts(args.prompts, verifier.tokenizer)
    if args.what == "compare":
        ds = drafters(args.head, args.threads, args.dtype)
        names_ks = [(n, k) for n in ds for k in args.ks]
    else:
        ds = drafters(args.head, args.threads, args.dtype, stops=(None, *args.stops))
        plain = [n for n in ds if " stop " not in n]  # the head without stops at each k, the stops at the largest
        names_ks = [(n, k) for n in plain for k in args.ks] + [(n, max(args.ks)) for n in ds if n not in plain]
    out = measure(names_ks, ds, verifier, prompts, args.max_tokens)
    print("| drafter | k | ms/token | drafting ms per step | mean acceptance length | accepted per drafter pass |")
    print("|---|---|---|---|---|---|")
    for r in out.values():
        print(f"| {r['drafter']} | {r['k']} | {r['ms_per_token']} | {r['draft_ms_per_step']} | {r['mean_acceptance_length']} | "
              f"{r['accepted_per_pass'] if r['accepted_per_pass'] is not None else ''} |")
    if args.out:
        args.out.write_text(json.dumps({"what": args.what, "prompts": args.prompts, "max_tokens": args.max_tokens,
                                        "threads": args.threads, "dtype": args.dtype, "rows": out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
