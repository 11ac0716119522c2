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
    if head.spec.layer_types and "sliding_attention" in head.spec.layer_types:
        # vLLM counts a sliding window from each query, Speculators' training from the anchor: the head follows
        # training (test_sliding_layers_follow_speculators_training_forward), so vLLM's logits differ here
        assert not torch.allclose(logits, tensors["logits"], atol=1e-3)
        return
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


# ------------------------------------------------------------ Speculators' training forward
def _rms(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def _rotate_half(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def speculators_block(head, tokens: list[int], aux: torch.Tensor, anchor: int, window_from: str = "anchor"):
    """The block's final-normed hidden states [block_size, H] for one anchor as Speculators' DFlash training
    forward computes them, written from its source (``models/dflash/core.py::_backbone_forward``,
    ``model_definitions.py``'s Qwen3DFlashAttention and decoder layer, ``attention.py::create_anchor_block_mask_mod``)
    with dense masks and eager attention: the context is every position's ``hidden_norm(fc(aux))`` (later ones
    masked), the queries the anchor and mask tokens at anchor + 0..; a query sees the context positions before the
    anchor (a sliding layer: the ``sliding_window`` before it) and its own block, causally in a sliding layer
    unless ``sliding_window_non_causal``. ``window_from="query"``: vLLM's kernel rule instead, the negative control."""
    s, sd = head.spec, {k: v.float() for k, v in head.state_dict().items()}
    T, bs, D = aux.shape[0], s.block_size, s.head_dim
    nh, nkv, eps = s.num_attention_heads, s.num_key_value_heads, s.rms_norm_eps
    ids = torch.tensor([tokens[anchor]] + [s.mask_token_id] * (bs - 1))
    noise = sd["embed_tokens.weight"][ids]
    target = _rms(aux.float() @ sd["fc.weight"].T, sd["hidden_norm.weight"], eps)
    positions = torch.cat([torch.arange(T), anchor + torch.arange(bs)]).float()
    inv_freq = 1.0 / s.rope_parameters["rope_theta"] ** (torch.arange(0, D, 2).float() / D)
    emb = torch.cat([positions[:, None] * inv_freq] * 2, dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # [T + bs, 1, D]
    kv = torch.arange(T + bs)
    for i in range(s.num_layers):
        p = f"layers.{i}."
        window = s.window(i)
        non_causal = window is None or bool(s.sliding_window_non_causal)
        q_idx = torch.arange(bs)[:, None]
        base = (kv[None] < anchor) & (kv[None] < T)
        if window is not None and window_from == "anchor":
            base &= kv[None] >= anchor - window
        block = kv[None] >= T
        if not non_causal:
            block = block & (kv[None] - T <= q_idx)
        mask = base | block
        if window is not None and window_from == "query":
            mask = mask & (positions[None] > (anchor + q_idx) - window)
        residual = noise
        x = _rms(noise, sd[p + "input_layernorm.weight"], eps)
        q = _rms((x @ sd[p + "self_attn.q_proj.weight"].T).view(bs, nh, D), sd[p + "self_attn.q_norm.weight"], eps)
        k = torch.cat([target, x]) @ sd[p + "self_attn.k_proj.weight"].T
        k = _rms(k.view(T + bs, nkv, D), sd[p + "self_attn.k_norm.weight"], eps)
        v = (torch.cat([target, x]) @ sd[p + "self_attn.v_proj.weight"].T).view(T + bs, nkv, D)
        q = q * cos[-bs:] + _rotate_half(q) * sin[-bs:]
        k = k * cos + _rotate_half(k) * sin
        kh, vh = (t.repeat_interleave(nh // nkv, dim=1).transpose(0, 1) for t in (k, v))
        scores = (q.transpose(0, 1) @ kh.transpose(1, 2)) * D ** -0.5  # [nh, bs, T + bs]
        o = (torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ vh).transpose(0, 1).reshape(bs, nh * D)
        noise = residual + o @ sd[p + "self_attn.o_proj.weight"].T
        x = _rms(noise, sd[p + "post_attention_layernorm.weight"], eps)
        gate, up = x @ sd[p + "mlp.gate_proj.weight"].T, x @ sd[p + "mlp.up_proj.weight"].T
        noise = noise + (torch.nn.functional.silu(gate) * up) @ sd[p + "mlp.down_proj.weight"].T
    return _rms(noise, sd["norm.weight"], eps)


@pytest.mark.parametrize("method, non_causal", [("dflash", None), ("dflash", True), ("dspark", False)])
def test_sliding_layers_follow_speculators_training_forward(method, non_causal):
    """A head with a sliding layer (window 4) and a full one, anchors before and past the window: the block equals
    Speculators' training forward, whose window counts from the anchor; vLLM's rule (from each query) differs."""
    import dataclasses

    from tests.test_dflash import random_head, tiny_spec

    head = random_head(dataclasses.replace(tiny_spec(method), sliding_window_non_causal=non_causal))
    assert head.spec.window(0) == 4 and head.spec.window(1) is None
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, head.spec.vocab_size - 1, (24,), generator=g).tolist()
    aux = torch.randn(24, head.fc.in_features, generator=g)
    for anchor in (2, 4, 9, 17):
        with torch.no_grad():
            ctx = [(a.unsqueeze(0), b.unsqueeze(0)) for a, b in head.context_kv(aux[:anchor], torch.arange(anchor))]
            ours = head.block(head.block_ids(torch.tensor([tokens[anchor]])), torch.tensor([anchor]), ctx,
                              torch.arange(anchor).unsqueeze(0))[0]
            ref = speculators_block(head, tokens, aux, anchor)
            torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
            if anchor > 4:  # past the window the two rules give the block different keys
                assert not torch.allclose(ours, speculators_block(head, tokens, aux, anchor, "query"), atol=1e-3)
