"""Pre-drafting: what drafting block n + 1 while block n is verified covers, and what it costs.

``python -m bench.predraft SUBCOMMAND ...``:

- ``tree``: pre-draft trees (``core.loop.tree_branches``), the draft model's. Their offline coverage
  curve (in process, no timing): on held-out prompts, each step drafts k + 1 tokens with the
  drafter's 9 most likely tokens recorded at every position, is verified, and its outcome (j drafts
  accepted, then the target's token c) is checked against the tree pre-drafted with m
  alternatives, for m = 0 (the whole-block branch only) to 8; the fraction covered is the ceiling
  of a pre-draft's hit rate. Then served (unless ``--no-serve``; one stream, non-streaming
  requests, fixed k, every app deployed at once and interleaved per (repeat, prompt); verifier and
  drafter replicas on cores of their own unless ``--no-pin``): speculation with pre-drafting off,
  and the default (trees of m = 1 pre-drafted at every step); per (prompt, repeat) the ratio to
  pre-drafting off, then the median; the served hit rate per outcome beside the offline ceiling.
  Writes ``tree_predraft.json``.
- ``eagle3``: what pre-drafting costs an EAGLE-3 head in acceptance. Block n + 1 can be
  pre-drafted while block n is verified only from the head's own states for block n (the
  target's do not exist yet). On the target's own greedy continuations of held-out prompts, at
  every position m the head drafts k + 1 tokens from the target's states (a block and the guess
  of its bonus token); where all k + 1 equal the continuation (the case a pre-draft is used in),
  the pre-draft continues from the head's own rows (``DraftRequest.provisional``) for the next k
  tokens, and the ordinary drafting does the same from the target's states; both are scored by
  their greedy acceptance length against the continuation. Writes ``eagle3_predraft.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench.common import (
    BENCH_DTYPE,
    DEFAULT_OUT,
    EAGLE3,
    TARGET,
    TIMING_HEADERS,
    app_args,
    completion_body,
    environment,
    load_prompts,
    log,
    median,
    rnd,
    serving,
    set_threads,
    speculation,
    write_json,
)

# ------------------------------------------------------------------ tree
MS = list(range(9))


def coverage(args, temperature: float, k: int) -> dict:
    """Offline: the fraction of steps whose outcome a tree of m alternatives covers, per m and per outcome j."""
    from bench.inproc import Reference
    from configs import SamplingParams
    from core.loop import tree_branches
    from core.sequence import Sequence

    ref = Reference(args.threads, args.dtype)
    ver, dr = ref.verifier, ref.drafter
    covered = {m: 0 for m in MS}
    by_j = {}  # j -> [steps, covered at m = 1, covered at m = 2]
    steps = 0
    for i, (_, ids) in enumerate(load_prompts(args.prompts, ver.tokenizer)):
        seq = Sequence(list(ids), SamplingParams(temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True,
                                                 seed=100 + i), k, ver.tokenizer, ver.eos_ids, ver.max_len)
        while not seq.done:
            (p,) = dr.propose([seq.draft_request(k + 1, alternatives=max(MS) + 1)])
            if p.cache_miss:
                (p,) = dr.propose([seq.draft_request(k + 1, full=True, alternatives=max(MS) + 1)])
            seq.note_proposal(p)
            drafts = p.tokens[:k]
            (res,) = ver.verify([seq.verify_request(drafts, p.probs.head(len(drafts)) if p.probs else None)])
            base = len(seq.tokens)
            seq.apply(res)
            j = res.num_accepted
            if len(p.tokens) <= k or seq.done:
                continue  # no tree would be drafted here, or no step uses it
            outcome = (j, seq.tokens[base + j])
            steps += 1
            row = by_j.setdefault(j, [0, 0, 0])
            row[0] += 1
            for m in MS:
                hit = outcome in tree_branches(drafts, p, m)
                covered[m] += hit
                if m in (1, 2):
                    row[m] += hit
        ver.release(seq.seq_id)
        dr.release(seq.seq_id)
    return {"steps": steps, "coverage": {m: rnd(covered[m] / max(1, steps)) for m in MS},
            "branches": {m: len(tree_branches([0] * k, _Fake(k, m), m)) for m in MS},
            "by_outcome": {j: {"steps": n, "m1": rnd(a / n), "m2": rnd(b / n)} for j, (n, a, b) in sorted(by_j.items())}}


class _Fake:
    """A proposal with distinct alternatives everywhere: how many branches a tree of m has."""

    def __init__(self, k, m):
        self.tokens = [0] * (k + 1)
        self.alts = [[0] + list(range(1, m + 1)) for _ in range(k + 1)]


SERVED = {  # name: app overrides (m = 0 and 2 and the measured choice were removed: docs/decisions/0027-one-policy.md)
    "off": {"pipeline_drafts": False},
    "always_m1": {},  # the default: a tree of m = 1 pre-drafted at every step
}  # (apps' order: each (repeat, prompt) starts one further along it)


def served(args) -> dict:
    import httpx
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TARGET)
    prompts = load_prompts(args.prompts, tok)
    names = [n for n in args.served.split(",") if n]
    rows = {name: [] for name in names}
    # every app deployed at once and interleaved per (repeat, prompt), in an order that rotates: a shared
    # host's speed drifts within minutes, so apps run one after another would compare different machines,
    # and an idle replica costs its cores next to nothing
    apps = {name: {**app_args(args.threads, "fixed", args.k, dtype=args.dtype, pin=not args.no_pin), **SERVED[name]}
            for name in names}
    with serving(apps, args.threads) as urls, httpx.Client(timeout=600) as client:
        for name in names:
            client.post(f"{urls[name]}/v1/completions", json=completion_body(prompts[0][1], 16, 0.0, 1, args.k))  # warm-up
        for rep in range(args.repeats):
            for i, (_, ids) in enumerate(prompts):
                r0 = (rep * len(prompts) + i) % len(names)
                for name in names[r0:] + names[:r0]:
                    t0 = time.perf_counter()
                    r = client.post(f"{urls[name]}/v1/completions",
                                    json=completion_body(ids, args.max_tokens, args.temperature, 500 + i, args.k),
                                    headers=TIMING_HEADERS)
                    r.raise_for_status()
                    data = r.json()
                    rows[name].append({"prompt": i, "repeat": rep, "ms_per_token": 1000 * (time.perf_counter() - t0)
                                       / data["usage"]["completion_tokens"], "speculation": speculation(data)})
    out = {}
    for name, rs in rows.items():
        spec = [r["speculation"] or {} for r in rs]
        hits, misses = sum(s.get("pre_draft_hits", 0) for s in spec), sum(s.get("pre_draft_misses", 0) for s in spec)
        by_j = {}
        for s in spec:
            for j, (h, n) in (s.get("pre_draft_by_outcome") or {}).items():
                row = by_j.setdefault(int(j), [0, 0])
                row[0] += h
                row[1] += n
        ratio = [r["ms_per_token"] / o["ms_per_token"] for r, o in zip(rs, rows["off"])] if "off" in rows else [0.0]
        out[name] = {"overrides": SERVED[name], "ms_per_token": rnd(median([r["ms_per_token"] for r in rs])),
                     "vs_off": rnd(median(ratio)), "pre_drafts": hits + misses,
                     "steps": sum(s.get("steps", 0) for s in spec),
                     "hit_rate": rnd(hits / (hits + misses)) if hits + misses else None,
                     "hit_rate_by_outcome": {j: rnd(h / n) for j, (h, n) in sorted(by_j.items())},
                     "mean_forward_ms": rnd(median([s.get("mean_forward_ms", 0) for s in spec])),
                     "mean_draft_ms": rnd(median([s.get("mean_draft_ms", 0) for s in spec])),
                     "mean_step_ms": rnd(median([s.get("mean_step_ms", 0) for s in spec]))}
    return out


def tree_main(argv=None):
    """``tree``: pre-draft trees' offline coverage, then served (see the module's docstring)."""
    ap = argparse.ArgumentParser(prog="python -m bench.predraft tree", description="Pre-draft trees: offline coverage "
                                 "and served speed-up.")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--coverage-ks", default="2,4,6")
    ap.add_argument("--temperature", type=float, default=0.0, help="of the served runs")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default=BENCH_DTYPE, choices=["bfloat16", "float32"])
    ap.add_argument("--no-serve", action="store_true")
    ap.add_argument("--no-pin", action="store_true", help="leave the replicas' cores to the OS (no cpu_affinity)")
    ap.add_argument("--served", default=",".join(SERVED), help=f"the served apps, in order, any of {list(SERVED)}")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    if any(n not in SERVED for n in args.served.split(",") if n):
        raise SystemExit(f"--served: any of {list(SERVED)}")
    set_threads(args.threads)
    t0 = time.perf_counter()
    result = {"scenario": "tree_predraft", "config": vars(args), "coverage": {}}
    for temperature in (0.0, 0.8):
        for k in [int(x) for x in args.coverage_ks.split(",")]:
            log(f"coverage: T={temperature} k={k}")
            result["coverage"][f"T{temperature}_k{k}"] = coverage(args, temperature, k)
    if not args.no_serve:
        log("served")
        result["served"] = served(args)
        cov = result["coverage"].get(f"T{args.temperature}_k{args.k}")
        if cov:  # the served hit rate against its offline ceiling, same k and temperature
            for name, m in (("always_m0", 0), ("always_m1", 1), ("always_m2", 2)):
                if name not in result["served"]:
                    continue
                hr = result["served"][name]["hit_rate"]
                result["served"][name]["of_ceiling"] = rnd(hr / cov["coverage"][m]) if hr and cov["coverage"][m] else None
    result["environment"] = environment(args.threads)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    path = write_json(Path(args.out), "tree_predraft", result)
    log(f"wrote {path}")
    print_summary(result)
    return result


def print_summary(result):
    for key, c in result["coverage"].items():
        print(key, "steps", c["steps"], "coverage by m", c["coverage"], "branches", c["branches"])
    for name, s in (result.get("served") or {}).items():
        print(name, {k: v for k, v in s.items() if k != "overrides"})


# ------------------------------------------------------------------ eagle3
def accepted(drafts: list[int], truth: list[int]) -> int:
    n = 0
    for d, t in zip(drafts, truth):
        if d != t:
            break
        n += 1
    return n


def eagle3_main(argv=None):
    """``eagle3``: an EAGLE-3 head's acceptance from its own states against the target's (see the module's docstring)."""
    from configs import Eagle3Config, SamplingParams, VerifierConfig
    from core.protocol import DraftRequest
    from drafter.eagle3_drafter import Eagle3Drafter
    from offline.training.eagle3 import greedy_continuations
    from verifier.engine import VerifierEngine

    ap = argparse.ArgumentParser(prog="python -m bench.predraft eagle3",
                                 description="What pre-drafting costs an EAGLE-3 head in acceptance.")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--dtype", default=BENCH_DTYPE)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    set_threads(1)
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
    out = {"scenario": "eagle3_predraft", "k": k, "dtype": args.dtype, "prompts": len(prompts), "max_tokens": args.max_tokens,
           "positions": positions, "pre_draft_positions": used, "pre_draft_share": rnd(used / max(1, positions)),
           "mean_acceptance_length_target_states": rnd(sum(real) / max(1, len(real))),
           "mean_acceptance_length_own_states": rnd(sum(prov) / max(1, len(prov))),
           "median_target": median(real) if real else None, "median_own": median(prov) if prov else None,
           "seconds": rnd(time.perf_counter() - t0, 1), "environment": environment(1)}
    path = write_json(args.out, "eagle3_predraft", out)
    log(f"wrote {path}: {out}")
    return out


# ------------------------------------------------------------------ entry point
SUBCOMMANDS = {"tree": tree_main, "eagle3": eagle3_main}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        raise SystemExit(f"usage: python -m bench.predraft {{{','.join(SUBCOMMANDS)}}} ... (--help after one for its options)")
    return SUBCOMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    main()
