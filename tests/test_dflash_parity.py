"""DFlash and DSpark heads against vLLM 0.32: the same checkpoint and inputs give the draft logits, drafts and
confidences vLLM's forward gives (``tests/data/dflash/make_vectors.py`` records them from vLLM's source and
its own norm, rope and config-reading code)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from core.dflash import ParallelSpec, load_head

DATA = Path(__file__).resolve().parent / "data" / "dflash"
VARIANTS = ["qwen3_dflash", "sliding_causal", "qwen3_dspark", "dspark_anchor"]


@pytest.mark.parametrize("name", VARIANTS)
def test_draft_logits_equal_vllms(name):
    meta = json.loads((DATA / name / "vectors.json").read_text())
    tensors = load_file(str(DATA / name / "vectors.safetensors"))
    head = load_head(DATA / name)
    tokens, k = meta["tokens"], meta["k"]
    assert k == head.spec.max_k
    drafts, logits = head.draft(tokens, tensors["aux"], k, return_logits=True)
    torch.testing.assert_close(logits, tensors["logits"], rtol=1e-4, atol=1e-4)
    assert drafts == meta["drafts"]
    if "confidence" in meta:
        n = len(tokens) - 1
        ctx = [(a.unsqueeze(0), b.unsqueeze(0)) for a, b in head.context_kv(tensors["aux"], torch.arange(n))]
        hidden = head.block(head.block_ids(torch.tensor([tokens[-1]])), torch.tensor([n]), ctx,
                            torch.arange(n).unsqueeze(0))
        rows = head.draft_rows(hidden)[0, :k]
        prev = torch.tensor([tokens[-1]] + drafts[:-1])
        torch.testing.assert_close(head.confidence(rows, prev), torch.tensor(meta["confidence"]), rtol=1e-4, atol=1e-5)


def test_causality_follows_the_training_masks():
    cfg = json.loads((DATA / "sliding_causal" / "config.json").read_text())
    spec = ParallelSpec.from_config(cfg)
    assert [spec.causal(i) for i in range(spec.num_layers)] == [True, True] and spec.window(0) == 6
    spec = ParallelSpec.from_config({**cfg, "sliding_window_non_causal": True})
    assert not spec.causal(0)
    full = ParallelSpec.from_config(json.loads((DATA / "qwen3_dflash" / "config.json").read_text()))
    assert not any(full.causal(i) for i in range(full.num_layers)) and full.max_k == 7
