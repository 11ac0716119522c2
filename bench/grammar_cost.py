"""What structured outputs cost a speculative step: the grammar's masks against the step itself.

Runs the shipped pair in process (``core.loop.generate``, greedy, float32) on code prompts under a
JSON schema, and times the verifier's masking stage (``VerifierEngine.masked``: syncing the
matcher, k + 1 bitmasks, applying them) and the drafter's (``ModelDrafter._masked``, once per
draft) against the step's verify and propose calls (medians per call); and the same prompts
without the schema.

    .venv/bin/python -m bench.grammar_cost [--k 4] [--prompts 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z_]{1,12}$"},
    "args": {"type": "array", "items": {"type": "string", "pattern": "^[a-z_]{1,8}$"}, "maxItems": 4},
    "returns": {"enum": ["int", "str", "list", "None"]},
    "lines": {"type": "integer", "minimum": 1, "maximum": 200}},
    "required": ["name", "args", "returns", "lines"], "additionalProperties": False}
PROMPTS = ["def parse_header(line):\n    ", "class Stack:\n    def __init__(self):\n        ",
           "import os\n\ndef walk(root):\n    for ", "def fib(n):\n    ", "for i in range(10):\n    if i % 2",
           "def merge(a, b):\n    out = []\n    "]


def timed(obj, name: str, acc: list):
    """Wrap obj.name so each call's time is appended to acc."""
    inner = getattr(obj, name)

    def wrapper(*a, **kw):
        t0 = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            acc.append(time.perf_counter() - t0)

    setattr(obj, name, wrapper)


def run(k: int, n_prompts: int) -> dict:
    from configs import DraftModelConfig, SamplingParams, VerifierConfig
    from core.grammar import json_schema_constraint
    from core.loop import generate
    from drafter.model_drafter import ModelDrafter
    from verifier.engine import VerifierEngine

    ver = VerifierEngine(VerifierConfig(model="models/tiny-code-target", dtype="float32", num_threads=1))
    dr = ModelDrafter(DraftModelConfig(model="models/tiny-code-drafter", dtype="float32", num_threads=1))
    c = json_schema_constraint(SCHEMA)
    verify_s, mask_s, draft_mask_s, propose_s = [], [], [], []
    timed(ver, "verify", verify_s)
    timed(ver, "masked", mask_s)
    timed(dr, "_masked", draft_mask_s)
    timed(dr, "propose", propose_s)
    prompts = [ver.tokenizer(p)["input_ids"] for p in PROMPTS[:n_prompts]]
    params = SamplingParams(temperature=0, max_tokens=96)
    generate(prompts[:1], params, k, dr, ver, constraint=c)  # compile and warm up
    out = {}
    for label, constraint in (("free", None), ("schema", c)):
        for acc in (verify_s, mask_s, draft_mask_s, propose_s):
            acc.clear()
        t0 = time.perf_counter()
        seqs = [generate([p], params, k, dr, ver, constraint=constraint)[0] for p in prompts]
        wall = time.perf_counter() - t0
        tokens, steps = sum(s.num_output for s in seqs), sum(s.stats.steps for s in seqs)
        # medians per call: on a shared machine a neighbour's burst lands on a few calls, not on the typical one
        verify, propose = _median_ms(verify_s), _median_ms(propose_s)
        masks = _median_ms(mask_s) + len(draft_mask_s) / max(len(propose_s), 1) * _median_ms(draft_mask_s)
        forced = _forced_positions(ver, c, seqs) if constraint is not None else 0
        out[label] = {"forced_share": round(forced / tokens, 3), "tokens": tokens, "steps": steps, "tokens_per_step": round(tokens / steps, 3),
                      "ms_per_token": round(1e3 * wall / tokens, 3), "verify_call_ms": round(verify, 3),
                      "propose_call_ms": round(propose, 3), "verifier_mask_call_ms": round(_median_ms(mask_s), 3),
                      "drafter_mask_call_ms": round(_median_ms(draft_mask_s), 3), "mask_ms_per_step": round(masks, 3),
                      "mask_share_of_step": round(masks / (verify + propose), 4)}
    return out


def _forced_positions(ver, c, seqs) -> int:
    """Output positions where the grammar allowed a single token (what forced tokens as free drafts would skip)."""
    from core.grammar import SequenceMasks, unpack

    masks, n = SequenceMasks(ver.masks.grammars), 0
    for i, s in enumerate(seqs):
        out = s.output_ids
        bm = masks.masks(f"forced-{i}", c, out, len(out) + 1)[:-1]  # [len(out), W]: the mask before each token
        n += int((unpack(bm, ver.vocab_size).sum(-1) == 1).sum())
    return n


def _median_ms(xs: list[float]) -> float:
    return 1e3 * statistics.median(xs) if xs else 0.0


def forced_blocks(k: int, n_prompts: int) -> dict:
    """The served loop (``speculate_local``: pre-drafting, the default policy's fixed-k form) under the schema,
    with and without the grammar's forced tokens drafted for free: tokens per step, ms per token, drafter calls."""
    import asyncio

    from configs import DraftModelConfig, SamplingParams, VerifierConfig
    from core.grammar import json_schema_constraint
    from core.loop import speculate_local
    from core.policy import FixedK
    from core.sequence import Sequence
    from drafter.model_drafter import ModelDrafter
    from verifier.engine import VerifierEngine

    ver = VerifierEngine(VerifierConfig(model="models/tiny-code-target", dtype="float32", num_threads=1))
    dr = ModelDrafter(DraftModelConfig(model="models/tiny-code-drafter", dtype="float32", num_threads=1))
    calls: list[float] = []
    timed(dr, "propose", calls)
    c = json_schema_constraint(SCHEMA)
    prompts = [ver.tokenizer(p)["input_ids"] for p in PROMPTS[:n_prompts]]

    def one(p, forced):
        seq = Sequence(p, SamplingParams(temperature=0, max_tokens=96), k, ver.tokenizer, ver.eos_ids, ver.max_len,
                       constraint=c)
        return asyncio.run(speculate_local(seq, dr, ver, FixedK(k), forced=forced))

    one(prompts[0], True)  # compile and warm up
    out = {}
    for forced in (False, True, False, True):  # interleaved: a neighbour's burst hits both alike
        calls.clear()
        t0 = time.perf_counter()
        seqs = [one(p, forced) for p in prompts]
        wall = time.perf_counter() - t0
        tokens, steps = sum(s.num_output for s in seqs), sum(s.stats.steps for s in seqs)
        row = {"tokens": tokens, "tokens_per_step": round(tokens / steps, 3), "ms_per_token": 1e3 * wall / tokens,
               "drafter_calls_per_token": round(len(calls) / tokens, 3)}
        key = "forced" if forced else "drafter_only"
        if key in out:
            row["ms_per_token"] = min(row["ms_per_token"], out[key]["ms_per_token"])
            assert [s.output_ids for s in seqs] == out[key]["outputs"]
        row["outputs"] = [s.output_ids for s in seqs]
        out[key] = row
    assert out["forced"]["outputs"] == out["drafter_only"]["outputs"]  # greedy: the same text either way
    for row in out.values():
        del row["outputs"]
        row["ms_per_token"] = round(row["ms_per_token"], 3)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=6)
    args = ap.parse_args(argv)
    print(json.dumps({"masks": run(args.k, args.prompts), "forced_blocks": forced_blocks(args.k, args.prompts)}, indent=1))


if __name__ == "__main__":
    main()
