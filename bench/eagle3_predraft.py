"""What pre-drafting costs an EAGLE-3 head in acceptance.

Block n + 1 can be pre-drafted while block n is verified only from the head's own states for
block n (the target's do not exist yet). This measures, on the target's own greedy
continuations of held-out prompts, the drafts made in that case against the drafts made a
step later from the target's states, at the same positions:

- at every position m, the head drafts k + 1 tokens from the target's states (a block and the
  guess of its bonus token);
- where all k + 1 equal the target's continuation (the case a pre-draft is used in), the
  pre-draft continues from the head's own rows (``DraftRequest.provisional``) for the next k
  tokens, and the ordinary drafting does the same from the target's states;
- both are scored by their greedy acceptance length against the continuation.

    python -m bench.eagle3_predraft --out bench/results
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.common import BENCH_DTYPE, DEFAULT_OUT, EAGLE3, TARGET, load_prompts, log, median, rnd, write_json


def accepted(drafts: list[int], truth: list[int]) -> int:
    n = 0
    for d, t in zip(drafts, truth):
        if d != t:
            break
        n += 1
    return n


def main(argv=None):
    from configs import Eagle3Config, SamplingParams, VerifierConfig
    from core.protocol import DraftRequest
    from drafter.eagle3_drafter import Eagle3Drafter
    from offline.training.eagle3 import greedy_continuations
    from verifier.engine import VerifierEngine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--dtype", default=BENCH_DTYPE)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    ver = VerifierEngine(VerifierConfig(model=TARGET, dtype=args.dtype, cache_budget_mb=64, num_threads=1))
    dr = Eagle3Drafter(Eagle3Config(model=EAGLE3, dtype=args.dtype, cache_budget_mb=32, verifier_model=TARGET,
                                    num_threads=1))
    prompts = [ids for _, ids in load_prompts(args.prompts, ver.tokenizer)]
    truths = greedy_continuations(ver.model, prompts, args.max_tokens)
    sp, k = SamplingParams(temperature=0), args.k
    real, prov, used, positions = [], [], 0, 0
    for i, (p, seq) in enumerate(zip(prompts, truths)):  # each: the prompt, then its continuation
        aux = ver.aux_states(seq, dr.aux_layers)  # [len, A]: the target's states at every token
        for m in range(len(p), len(seq) - 2 * k - 2):
            positions += 1
            sid = f"p{i}-{m}"
            (a,) = dr.propose([DraftRequest(sid, 0, None, seq[:m], k=k + 1, sampling=sp, seed=0, full=True,
                                            aux=aux[: m - 1], aux_start=0)])
            if a.tokens != seq[m: m + k + 1]:
                dr.release(sid)
                continue
            used += 1
            ctx = seq[: m + k + 1]
            (b,) = dr.propose([DraftRequest.for_tokens(sid, ctx, m, k=k, sampling=sp, seed=0, provisional=True)])
            assert not b.cache_miss, "the continuation should exist"
            (c,) = dr.propose([DraftRequest(sid + "r", 0, None, ctx, k=k, sampling=sp, seed=0, full=True,
                                            aux=aux[: len(ctx) - 1], aux_start=0)])
            truth = seq[len(ctx): len(ctx) + k]
            prov.append(1 + accepted(b.tokens, truth))
            real.append(1 + accepted(c.tokens, truth))
            dr.release(sid), dr.release(sid + "r")
        log(f"prompt {i + 1}/{len(prompts)}: {used} pre-draft positions so far")
    out = {"k": k, "dtype": args.dtype, "prompts": len(prompts), "max_tokens": args.max_tokens,
           "positions": positions, "pre_draft_positions": used, "pre_draft_share": rnd(used / max(1, positions)),
           "mean_acceptance_length_target_states": rnd(sum(real) / max(1, len(real))),
           "mean_acceptance_length_own_states": rnd(sum(prov) / max(1, len(prov))),
           "median_target": median(real) if real else None, "median_own": median(prov) if prov else None,
           "seconds": rnd(time.perf_counter() - t0, 1),
           "command": "python -m bench.eagle3_predraft " + " ".join(argv or [])}
    path = write_json(args.out, "eagle3_predraft", out)
    log(f"wrote {path}: {out}")
    return out


if __name__ == "__main__":
    main()
