"""Replay k policies offline on recorded greedy acceptance traces (deterministic, seconds).

Greedy decoding's text does not depend on k, so one trace per prompt says everything a policy
meets: at each output position, how many of the drafter's ``--max-k`` greedy drafts from that
prefix match the target's tokens (the accepted length for any k is min(k, L)). Each step's cost is
drawn from a per-k step-time curve (ms; by default the served per-k step times measured on this
machine) with lognormal noise, plus a fixed cost per change of k (the pre-draft made for the old k
misses). Policies share one ``StepCosts`` across the prompts, as a replica's sequences do.

With ``--miss-ms`` a step costs what it costs served, by whether the pre-draft made during the
step before covered that step's outcome: ``--cost-ms`` on a hit, ``--miss-ms`` on a miss (drafting
on the critical path). A whole block accepted is covered when the drafter's next token was right
(the trace says); a correction with probability ``--p-correction`` (the drafter's second choice);
after a plain step, or a k more than one above the last, nothing is covered. Outliers (a stalled
host) add 3-12 ms to ``--outliers`` of the steps.

    python -m bench.policy_replay --record --prompts 8      # traces -> bench/traces/policy_traces.json
    python -m bench.policy_replay                            # fixed k and the adaptive policy
    python -m bench.policy_replay --traces bench/traces/policy_traces5.json \
        --cost-ms 6.3,7.1,7.9,8.5,9.5,11.5,14.5,16.5,19.5 --miss-ms 6.3,8.8,10,11.4,12.7,14,16.5,18.5,20.8
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from functools import partial
from pathlib import Path

from core.policy import AdaptiveK, FixedK, StepCosts

# recorded greedy traces (inputs, not results): 8 held-out prompts in float32 (policy_traces5.json: 5)
TRACES = Path(__file__).resolve().parent / "traces" / "policy_traces.json"
# served per-k step wall times, ms (bf16, 1 stream, k = 0..8; measured by the policy's own table)
SERVED_MS = [6.0, 9.1, 9.2, 10.5, 11.0, 12.0, 12.9, 13.9, 14.4]


def record(prompts: int, max_k: int, tokens: int, out: Path, workload: str | None = None):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench import workloads
    from bench.common import DRAFTER, TARGET, load_prompts

    tok = AutoTokenizer.from_pretrained(TARGET)
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    drafter = AutoModelForCausalLM.from_pretrained(DRAFTER, dtype=torch.float32).eval()
    chosen = workloads.load(workload, prompts, tok).prompts if workload else load_prompts(prompts, tok)
    traces = []
    with torch.no_grad():
        for _, ids in chosen:
            n = tokens + max_k
            out_ids = target.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False)[0, len(ids):].tolist()
            lengths = []
            for p in range(tokens):
                ctx = torch.tensor([ids + out_ids[:p]])
                d = drafter.generate(ctx, max_new_tokens=max_k, min_new_tokens=max_k,
                                     do_sample=False)[0, ctx.shape[1]:].tolist()
                m = 0
                while m < max_k and d[m] == out_ids[p + m]:
                    m += 1
                lengths.append(m)
            traces.append(lengths)
            print(f"prompt {len(traces)}: mean matching drafts {statistics.mean(lengths):.2f}", flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(traces))


def _fixed(k: int, costs: StepCosts) -> FixedK:
    return FixedK(k)


def replay(make, traces, cost_ms, seed: int, noise: float, switch_ms: float, miss_ms=None,
           p_correction: float = 0.5, outliers: float = 0.0) -> list[float]:
    """ms per token of each trace, in order, the policies sharing one StepCosts."""
    rng, costs, out = random.Random(seed), StepCosts(), []
    for lengths in traces:
        policy, pos, total, prev, covered = make(costs), 0, 0.0, None, False
        while pos < len(lengths):
            k = policy.next_k(1)
            accepted = min(k, lengths[pos])
            if miss_ms is None:
                ms = cost_ms[k] * rng.lognormvariate(0, noise) + (switch_ms if k != prev and k > 0 else 0.0)
            else:  # hit or miss of the pre-draft made during the step before (see the module's docstring)
                hit = k > 0 and covered and k <= (prev or 0) + 1
                ms = (cost_ms if hit else miss_ms)[k] * rng.lognormvariate(0, noise)
                covered = k > 0 and (lengths[pos] > k if accepted == k else rng.random() < p_correction)
            if outliers and rng.random() < outliers:
                ms += rng.uniform(3, 12)
            prev = k
            # engine-model inputs (before measurements): a 5 ms forward, 0.4 ms per drafted token
            policy.observe(k, accepted, 0.0004 * k, 0.005 * (1 + 0.05 * k), ms / 1000, 1)
            pos, total = pos + accepted + 1, total + ms
        out.append(total / pos)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", action="store_true", help="record the traces first")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--workload", default=None, help="record this workload's prompts (bench.workloads: humaneval, "
                    "held-out or a JSONL file; default: the bench prompts)")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--traces", type=Path, default=TRACES)
    ap.add_argument("--cost-ms", default=",".join(map(str, SERVED_MS)), help="step ms for k = 0..max-k")
    ap.add_argument("--noise", type=float, default=0.15, help="lognormal sigma of a step's cost")
    ap.add_argument("--switch-ms", type=float, default=3.0, help="added to a step whose k changed")
    ap.add_argument("--miss-ms", default=None, help="step ms for k = 0..max-k when the pre-draft missed; "
                    "then --cost-ms is a hit's, and --switch-ms is not used")
    ap.add_argument("--p-correction", type=float, default=0.5, help="a pre-draft guesses a correction token")
    ap.add_argument("--outliers", type=float, default=0.0, help="share of steps 3-12 ms longer")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", default=None, help="also write policy_replay.json to this folder")
    args = ap.parse_args(argv)
    if args.record:
        record(args.prompts, args.max_k, args.tokens, args.traces, args.workload)
    traces = json.loads(args.traces.read_text())
    cost_ms = [float(x) for x in args.cost_ms.split(",")]
    miss_ms = [float(x) for x in args.miss_ms.split(",")] if args.miss_ms else None
    systems = {f"fixed k={k}": partial(_fixed, k) for k in range(0, args.max_k + 1, 1 if miss_ms else 2)}
    systems["adaptive (replica-shared costs)"] = lambda c: AdaptiveK(args.max_k, costs=c)
    systems["adaptive (each request alone)"] = lambda c: AdaptiveK(args.max_k)
    rows = {}
    for name, make in systems.items():
        runs = [replay(make, traces, cost_ms, s, args.noise, args.switch_ms, miss_ms, args.p_correction, args.outliers)
                for s in range(args.seeds)]
        rows[name] = [statistics.mean(r[i] for r in runs) for i in range(len(traces))]
        print(f"{name:32s} mean {statistics.mean(rows[name]):5.2f}  median {statistics.median(rows[name]):5.2f}  "
              + " ".join(f"{x:5.2f}" for x in rows[name]))
    fixed = [v for n, v in rows.items() if n.startswith("fixed")]
    best = [min(v[i] for v in fixed) for i in range(len(traces))]
    print(f"{'best fixed k per prompt':32s} mean {statistics.mean(best):5.2f}")
    result = {"scenario": "policy_replay", "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "ms_per_token": rows, "best_fixed_k_per_prompt": best}
    if args.out:
        from bench.common import write_json

        write_json(Path(args.out), "policy_replay", result)
    return result


if __name__ == "__main__":
    main()
