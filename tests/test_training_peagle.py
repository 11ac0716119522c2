"""Training P-EAGLE heads (offline/training/peagle.py): the training pass computes exactly the rows the head drafts
from (``core.peagle``), and a short run from an EAGLE-3 head writes a peagle head that the server's check reads and
the drafter pool serves losslessly."""

import json

import pytest
import torch

from configs import SamplingParams, VerifierConfig
from configs.models import PEagleConfig
from core.eagle3 import aux_states
from core.loop import generate
from offline.training import eagle3 as base
from offline.training import peagle
from tests.helpers import tiny_llama


def _head(target, vocab: int, mask: int):
    """A random P-EAGLE head for ``target`` (a new EAGLE-3 head, its layer perturbed off the target's copy)."""
    from tests.peagle_heads import from_eagle3_head

    torch.manual_seed(3)
    head = base.build_head(target, torch.arange(vocab), 48, [1, 2])
    with torch.no_grad():
        for p in head.layers.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return from_eagle3_head(head.eval(), mask, seed=4)


def test_a_training_pass_computes_the_rows_the_head_drafts_from():
    """The block layout's rows for an anchor n (the real row n and its k - 1 placeholders, all anchors in one pass
    with the whole window's real rows) give the logits ``PEagleHead.draft`` gives after x_0..x_{n+1}: what the head
    learns is what it drafts with. The mask keeps anchors apart and the real rows causal."""
    V, k = 96, 4
    target = tiny_llama(V, layers=3, peak=5.0)
    head = _head(target, V, mask=2)
    x = torch.randint(3, V, (2, 24), generator=torch.Generator().manual_seed(1))
    aux, _ = aux_states(target, x, head.spec.aux_layer_ids)
    anchors = [4, 11, 17]
    positions, mask, block = peagle.block_layout(x.shape[1] - 1, anchors, k)
    T, R = x.shape[1] - 1, len(positions)
    ids = torch.cat([x[:, 1:], torch.full((2, R - T), 2)], 1)
    h = torch.cat([head.combine(aux[:, :T]), head.placeholder_state().unsqueeze(0).expand(2, R - T, -1)], 1)
    with torch.no_grad():
        logits, _ = head.layer(ids, h, positions.expand(2, R), [], mask)
    for b in range(2):
        for j, n in enumerate(anchors):
            _, ref = head.draft(x[b, : n + 2].tolist(), aux[b, : n + 1], k, return_logits=True)
            rows = [n] + [T + j * (k - 1) + i for i in range(k - 1)]
            torch.testing.assert_close(logits[b, rows], ref, rtol=1e-5, atol=1e-5)
    assert block.tolist() == [0] * T + [1, 2, 3] * len(anchors)
    assert not mask[T, T + k - 1] and mask[T + 1, T] and not mask[T, T + 1]  # anchors apart; placeholders causal


@pytest.mark.heavy  # a training run of a few steps, then the served loop
def test_a_short_run_from_an_eagle3_head_writes_a_head_the_pool_serves(tmp_path):
    """Six steps from a new EAGLE-3 head's weights on the standard library: the held-out KL over the block positions
    falls, the written head passes the server's build check, and through the loop greedy equals the target's own."""
    from core.peagle import check_head
    from drafter.peagle_drafter import PEagleDrafter
    from tests.helpers import tiny_tokenizer
    from verifier.engine import VerifierEngine

    tok = tiny_tokenizer()
    target = tiny_llama(len(tok), layers=4, peak=20.0, max_len=512)
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    out, work = tmp_path / "head", tmp_path / "work"
    peagle.main(["--target", str(tmp_path / "target"), "--out", str(out), "--work", str(work), "--steps", "6",
                 "--batch", "4", "--seq-len", "96", "--lr", "3e-3", "--warmup", "1", "--eval-every", "3",
                 "--ckpt-every", "3", "--eval-windows", "4", "--draft-vocab", "128", "--anchors", "8",
                 "--corpus-files", "4", "--acceptance-prompts", "2", "--acceptance-max-tokens", "8", "--no-bf16-target",
                 "--threads", "1", "--no-progress"])
    acc = json.loads((out / "acceptance.json").read_text())
    kl = [h["held_out_kl"] for h in acc["history"]]
    assert len(kl) == 3 and kl[-1] < kl[0], kl
    assert len(acc["peagle"]["per_position_acceptance_rate"]) == 4
    spec = check_head(out, tmp_path / "target")
    assert spec.layout == "speculators" and spec.speculative_tokens == 4 and spec.mask_token_id == tok.pad_token_id
    drafter = PEagleDrafter(PEagleConfig(model=str(out), dtype="float32", cache_budget_mb=8,
                                         verifier_model=str(tmp_path / "target")))
    verifier = VerifierEngine(VerifierConfig(model="t", dtype="float32", cache_budget_mb=16), model=target,
                              tokenizer=tok)
    ids = tok("def add(a, b):")["input_ids"]
    (seq,) = generate([ids], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), 4, drafter, verifier)
    want = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                           attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=2)[0, len(ids):]
    assert seq.output_ids == want.tolist() and seq.stats.num_drafts > 0
