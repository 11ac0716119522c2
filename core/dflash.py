"""Parallel draft heads: Speculators' DFlash and DSpark formats (what vLLM 0.32 loads), one block per pass.

Glossary (Chen et al., DFlash: block diffusion for speculative decoding; names as in ``speculators``
and vLLM's ``qwen3_dflash`` / ``qwen3_dspark``):
- context: the target's aux states g_t (the residual stream entering verifier layers
  ``aux_hidden_state_layer_ids``, concatenated; the EAGLE-3 transport, ``core.eagle3``) of every
  position t whose state exists. ``fc`` projects g_t to the head's width H, ``hidden_norm`` normalises
  it, and each draft layer turns it into keys and values of its own (its k_proj with k_norm and the
  rotary embedding at t, its v_proj): the context enters the head only as keys and values, never as a
  query;
- the block: after the verifier has states for x_0..x_{n-1} and chose x_n (the anchor, or bonus
  token), the head's queries are x_n at position n and ``mask_token_id`` at n+1, n+2, ...; they attend
  to every context key and to each other: both ways (bidirectional: a block is denoised at once) or,
  for a causal layer, to the block's earlier queries only; a sliding layer of window W sees the W
  context positions before the anchor (n - W .. n - 1) from every query of the block, and the block's
  own queries, as Speculators' training mask has it (``create_anchor_block_mask_mod``: the window is
  counted from the anchor; vLLM 0.32's kernel counts it from each query, so a query deep in the block
  sees fewer context keys there than the head was trained with: this follows training, as for causality);
- the draft at block position i (1..k) is read from the head's output at query i: it predicts x_{n+i}
  (the mask sits at the predicted position). With ``sample_from_anchor`` (DSpark's dense layout) query
  i predicts the next token instead, x_{n+i+1}, and the anchor's query predicts x_{n+1};
- DSpark adds a Markov head: block position i's logits get a bias from the token drafted at i - 1
  (the anchor for the first), ``markov_w2(markov_w1[x])``, so q_i depends on the draft before it and
  a block is sampled left to right after its one parallel pass; and a confidence head, the head's
  estimate that the draft at i is accepted: sigmoid(proj([h_i; markov_w1[x_{i-1}]])).

Layer ids: Speculators writes ``aux_hidden_state_layer_ids`` in vLLM's EAGLE-3 sense (the stream
entering layer L; 0 is the embeddings), which is what the verifier here captures. vLLM stores
``target_layer_ids = L - 1`` (the output of layer L - 1, the DFlash authors' count) and adds the one
back when it captures: the same states.

Causality within the block (``sliding_window_non_causal``): Speculators trains full-attention layers
bidirectionally and sliding layers causally unless the flag is true; this reads the head that way.
vLLM 0.32 reads a present ``false`` as causal for every layer, full ones included: the two agree for
heads whose layers are all sliding or all full with the flag true or absent (docs/parallel-drafters.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from core.eagle3 import (
    DraftVocabulary,
    HeadShape,
    UnsupportedHead,
    _rope_parameters,
    check_draft_layers,
    check_weights,
    checkpoint_dir,
    default_proposal,
    draft_layer_types,
    layer_config,
    load_weights,
    rope_frequencies,
    speculators_config,
    unsupported,
)
from core.eagle3 import save_head as save_head  # re-exported: a parallel head is saved in the same layout
from core.layers import RMSNorm, attention, mlp, rotate

SPECULATORS_VERSION = "0.3.0"


class Format(NamedTuple):
    """A Speculators parallel-head format read here: its architecture name, and whether it has DSpark's Markov head
    (which conditions each position's q on the draft before it)."""

    architecture: str
    markov: bool


FORMATS = {"dflash": Format("DFlashSpeculator", markov=False), "dspark": Format("DSparkSpeculator", markov=True)}
METHODS = tuple(FORMATS)  # the speculators_model_type values read here
LAYER_TYPES = ("qwen3",)  # vLLM's DFlashQwen3 / Qwen3DSpark layers (gemma4_dspark's Gemma 4 MTP layers are not here)


@dataclass
class ParallelSpec(HeadShape):
    """A DFlash or DSpark head's shape and flags, as read from (and written to) a Speculators config.json."""

    method: str  # "dflash" | "dspark"
    block_size: int
    mask_token_id: int
    num_layers: int = 1
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1000000.0})
    layer_types: list[str] | None = None  # per layer: "full_attention" | "sliding_attention"
    sliding_window: int | None = None
    sliding_window_non_causal: bool | None = None  # None: absent (bidirectional everywhere, vLLM's reading)
    sample_from_anchor: bool = False
    markov_rank: int = 0  # DSpark: the Markov head's rank
    confidence_head: bool = False  # DSpark: a confidence head ships with the head
    confidence_with_markov: bool = False
    # the default proposal's k, when the config names one
    speculative_tokens: int | None = field(default=None, compare=False)

    def causal(self, layer: int) -> bool:
        """Whether the layer's block queries see only the block's earlier queries (Speculators' training
        masks: sliding layers causal unless ``sliding_window_non_causal``, full layers bidirectional)."""
        return self.window(layer) is not None and not self.sliding_window_non_causal

    @property
    def max_k(self) -> int:
        """Drafts one block yields: the mask positions (block_size - 1), or every query with
        ``sample_from_anchor``."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    @property
    def markov(self) -> bool:
        return FORMATS[self.method].markov

    @classmethod
    def from_config(cls, cfg: dict) -> ParallelSpec:
        """The spec of a Speculators dflash or dspark config.json, read as vLLM reads it. Raises
        ``UnsupportedHead`` (one line naming the field and value) for a config this project cannot run."""
        method = cfg.get("speculators_model_type")
        if method not in METHODS:
            unsupported("speculators_model_type", method, f"not a Speculators {' or '.join(METHODS)} config")
        t = layer_config(cfg, method)
        model_type = t.get("model_type", "qwen3")
        if model_type not in LAYER_TYPES:
            unsupported("transformer_layer_config.model_type", model_type,
                        "only Qwen3-type draft layers run here (vLLM's qwen3_dflash / qwen3_dspark); "
                        "Gemma 4 DSpark's layers (k = v, v_norm, logit soft-capping) are not implemented")
        if t.get("is_neox_style", True) is not True:
            unsupported("transformer_layer_config.is_neox_style", t["is_neox_style"],
                        "the rotary embedding here is the half-split (neox) form")
        rope = _rope_parameters(t)
        if not any("rope_theta" in (d or {}) for d in (t, t.get("rope_parameters"), t.get("rope_scaling"))):
            rope["rope_theta"] = 1000000.0  # vLLM's default for these layers (set_default_rope_theta)
        check_draft_layers(t, rope)
        extra = t.get("dflash_config") or {}
        for name in ("attention_sink_bias", "attention_value_scale", "use_swa"):
            if extra.get(name):
                unsupported(f"transformer_layer_config.dflash_config.{name}", extra[name], "not supported")
        if cfg.get("projector_type", "dflash") != "dflash":
            unsupported("projector_type", cfg["projector_type"],
                        "only the dflash projector (Domino's correction head is not in vLLM)")
        if cfg.get("shift_label"):
            unsupported("shift_label", cfg["shift_label"],
                        "vLLM reads the mask positions' own tokens, not shifted ones")
        if cfg.get("use_aux_hidden_state") is False:
            unsupported("use_aux_hidden_state", False, "the head reads the target's aux states")
        ids = cfg.get("aux_hidden_state_layer_ids")
        if not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
            unsupported("aux_hidden_state_layer_ids", ids,
                        "needs the verifier layers whose input states the head reads")
        mask = cfg.get("mask_token_id")
        if not isinstance(mask, int) or not 0 <= mask < t["vocab_size"]:
            unsupported("mask_token_id", mask,
                        f"needs a token id below the vocab_size {t['vocab_size']} (the masked slots' embedding)")
        block = cfg.get("block_size", 8)
        if not isinstance(block, int) or block < 2:
            unsupported("block_size", block, "a block is the anchor and at least one mask position")
        anchor = bool(cfg.get("sample_from_anchor", False))
        markov = FORMATS[method].markov
        if anchor and not markov:
            unsupported("sample_from_anchor", True, "vLLM's DFlash drafts from the mask positions only")
        n_layers = int(t.get("num_hidden_layers") or 1)
        layer_types, window = draft_layer_types(t, n_layers)
        rank, conf, conf_markov = _markov_fields(cfg) if markov else (0, False, False)
        k = default_proposal(cfg).get("speculative_tokens")
        non_causal = cfg.get("sliding_window_non_causal")
        return cls(**HeadShape.read(cfg, t, max_position_embeddings=40960), method=method,
                   aux_layer_ids=[int(i) for i in ids], block_size=block, mask_token_id=mask, num_layers=n_layers,
                   rope_parameters=rope, layer_types=layer_types, sliding_window=window,
                   sliding_window_non_causal=None if non_causal is None else bool(non_causal),
                   sample_from_anchor=anchor, markov_rank=rank, confidence_head=conf,
                   confidence_with_markov=conf_markov, speculative_tokens=k if isinstance(k, int) and k >= 1 else None)

    def to_config(self, verifier_path: str, verifier_arch: list[str], k: int | None = None) -> dict:
        layer = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": self.hidden_size,
                 "intermediate_size": self.intermediate_size, "num_attention_heads": self.num_attention_heads,
                 "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
                 "num_hidden_layers": self.num_layers, "rms_norm_eps": self.rms_norm_eps, "vocab_size": self.vocab_size,
                 "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
                 "attention_bias": False, "tie_word_embeddings": False, "rope_parameters": dict(self.rope_parameters)}
        if self.layer_types:
            layer["layer_types"] = list(self.layer_types)
            layer["sliding_window"] = self.sliding_window
        k = k or self.max_k
        cfg = {"architectures": [FORMATS[self.method].architecture],
               "speculators_model_type": self.method, "speculators_version": SPECULATORS_VERSION,
               "speculators_config": speculators_config(self.method, k, verifier_path, verifier_arch),
               "transformer_layer_config": layer, "draft_vocab_size": self.draft_vocab_size,
               "target_hidden_size": self.target_hidden_size, "aux_hidden_state_layer_ids": list(self.aux_layer_ids),
               "block_size": self.block_size, "mask_token_id": self.mask_token_id,
               "sample_from_anchor": self.sample_from_anchor}
        if self.sliding_window_non_causal is not None:
            cfg["sliding_window_non_causal"] = self.sliding_window_non_causal
        if self.markov:
            cfg.update(markov_rank=self.markov_rank, markov_head_type="vanilla",
                       enable_confidence_head=self.confidence_head,
                       confidence_head_with_markov=self.confidence_with_markov)
        return cfg


def _markov_fields(cfg: dict) -> tuple[int, bool, bool]:
    """A DSpark config's Markov head: (its rank, a confidence head, the confidence head reading the Markov head)."""
    rank = cfg.get("markov_rank", 0)
    if not isinstance(rank, int) or rank < 1:
        unsupported("markov_rank", rank, "vLLM's DSpark always applies its Markov head (rank at least 1)")
    if cfg.get("markov_head_type", "vanilla") != "vanilla":
        unsupported("markov_head_type", cfg["markov_head_type"], "vLLM runs the vanilla Markov head only")
    return rank, bool(cfg.get("enable_confidence_head", False)), bool(cfg.get("confidence_head_with_markov", False))


class ParallelLayer(nn.Module):
    """One Qwen3 decoder layer of the head (``layers.i.*``): its attention reads the context's keys and
    values, made from the context states by this layer's own projections (``context_kv``)."""

    def __init__(self, spec: ParallelSpec, index: int):
        super().__init__()
        s, H, D = spec, spec.hidden_size, spec.head_dim
        self.index, self.spec = index, spec
        self.window, self.causal = spec.window(index), spec.causal(index)
        self.input_layernorm = RMSNorm(H, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, s.rms_norm_eps)
        self.self_attn = attention(H, s.num_attention_heads, s.num_key_value_heads, D, H, s.rms_norm_eps)
        self.mlp = mlp(H, s.intermediate_size)

    def context_kv(self, normed: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_norm, rotated) and values [.., n, nkv, D] of context states already through ``hidden_norm``."""
        s, a = self.spec, self.self_attn
        shape = (*normed.shape[:-1], s.num_key_value_heads, s.head_dim)
        k = rotate(a.k_norm(a.k_proj(normed).view(shape)), cos, sin)
        return k, a.v_proj(normed).view(shape)

    def forward(self, h, residual, cos, sin, ctx_k, ctx_v, mask):
        """h [B, n, H] (the block's embeddings for layer 0), residual (None for layer 0); cos, sin
        [B, n, 1, D]; ctx_k, ctx_v [B, S, nkv, D]; mask [B, 1, n, S + n] bool (True: attend).
        Returns (h, residual) as vLLM's layers do: the stream after the layer is h + residual."""
        s, a, m = self.spec, self.self_attn, self.mlp
        B, n, _ = h.shape
        D, nh, nkv = s.head_dim, s.num_attention_heads, s.num_key_value_heads
        if residual is None:
            residual = h
        else:
            residual = h + residual
        x = self.input_layernorm(residual)
        q = a.q_norm(a.q_proj(x).view(B, n, nh, D))
        k = a.k_norm(a.k_proj(x).view(B, n, nkv, D))
        v = a.v_proj(x).view(B, n, nkv, D)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        K = torch.cat([ctx_k.to(k.dtype), k], dim=1)
        V = torch.cat([ctx_v.to(v.dtype), v], dim=1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), K.transpose(1, 2), V.transpose(1, 2), attn_mask=mask,
                                           enable_gqa=nkv != nh).transpose(1, 2)
        h = a.o_proj(o.reshape(B, n, nh * D))
        residual = h + residual
        x = self.post_attention_layernorm(residual)
        return m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x)), residual


class ParallelHead(DraftVocabulary, nn.Module):
    """A DFlash or DSpark head under the Speculators weight names (``layers.i.*``, ``fc``, ``hidden_norm``,
    ``norm``, ``lm_head``; DSpark: ``markov_head.markov_w1`` [V, r], ``markov_head.markov_w2`` [Vd, r],
    ``confidence_head.proj``)."""

    def __init__(self, spec: ParallelSpec):
        super().__init__()
        self.spec = s = spec
        H = s.hidden_size
        self.embed_tokens = nn.Embedding(s.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.fc = nn.Linear(len(s.aux_layer_ids) * s.target_hidden_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, s.rms_norm_eps)
        self.layers = nn.ModuleList([ParallelLayer(s, i) for i in range(s.num_layers)])
        self.norm = RMSNorm(H, s.rms_norm_eps)
        self.lm_head = nn.Linear(H, s.draft_vocab_size, bias=False)
        if s.markov:
            mh = self.markov_head = nn.Module()
            mh.markov_w1 = nn.Embedding(s.vocab_size, s.markov_rank)  # indexed by target ids, as vLLM's
            mh.markov_w2 = nn.Linear(s.markov_rank, s.draft_vocab_size, bias=False)
            if s.confidence_head:
                ch = self.confidence_head = nn.Module()
                ch.proj = nn.Linear(H + (s.markov_rank if s.confidence_with_markov else 0), 1, bias=True)
        self.register_buffer("d2t", torch.zeros(s.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(s.vocab_size, dtype=torch.bool))
        self.inv_freq, self.rope_scale = rope_frequencies(s)  # float32 whatever the head's dtype

    # ------------------------------------------------------------------ pieces
    def rope(self, positions: torch.Tensor):
        """cos and signed sin (``core.layers.rotate``) [.., n, 1, D] for positions [.., n], in float32."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        f = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat((f, f), dim=-1)
        sign = torch.ones(emb.shape[-1], device=emb.device)
        sign[: emb.shape[-1] // 2] = -1
        return (emb.cos() * self.rope_scale).unsqueeze(-2), (emb.sin() * (self.rope_scale * sign)).unsqueeze(-2)

    def context_kv(self, aux: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the context keys and values [.., n, nkv, D] of aux states [.., n, n_aux * target_hidden]
        at positions [.., n] (vLLM's ``precompute_and_store_context_kv``). A position's keys depend on its
        own state alone, so a sequence's rows are computed once and kept."""
        normed = self.hidden_norm(self.fc(aux.to(self.fc.weight.dtype)))
        cos, sin = (c.to(normed.dtype) for c in self.rope(positions))
        return [L.context_kv(normed, cos, sin) for L in self.layers]

    def block_ids(self, anchor: torch.Tensor) -> torch.Tensor:
        """The block's query ids [B, block_size]: the anchor, then mask tokens. Always the whole block, whatever
        k: the queries of a bidirectional block see each other, so fewer masks would change every draft, and
        the head was trained on whole blocks (vLLM runs ``num_speculative_tokens`` masks, the block for these
        heads' published configs); the pass costs about the same."""
        ids = anchor.new_full((anchor.shape[0], self.spec.block_size), self.spec.mask_token_id)
        ids[:, 0] = anchor
        return ids

    def block(self, ids: torch.Tensor, start: torch.Tensor, ctx: list[tuple[torch.Tensor, torch.Tensor]],
              ctx_pos: torch.Tensor, ctx_valid: torch.Tensor | None = None) -> torch.Tensor:
        """The head's output (final-normed) [B, n, H] for block query ids [B, n] at positions start + 0..n-1
        (start [B]), attending to the context keys ``ctx`` (per layer, [B, S, nkv, D]) at positions ctx_pos
        [B, S]; ctx_valid [B, S] bool marks real keys (padding: False)."""
        B, n = ids.shape
        pos = start.view(B, 1) + torch.arange(n, device=ids.device).view(1, n)  # [B, n]
        h = self.embed_tokens(ids)
        cos, sin = (c.to(h.dtype) for c in self.rope(pos))
        S = ctx_pos.shape[1]
        base = torch.ones(B, n, S + n, dtype=torch.bool, device=ids.device)
        if ctx_valid is not None:
            base[:, :, :S] = ctx_valid.view(B, 1, S)
        causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
        masks = {}
        residual = None
        for L, (ck, cv) in zip(self.layers, ctx):
            key = (L.window, L.causal)
            if key not in masks:
                m = base.clone()
                if L.causal:
                    m[:, :, S:] &= causal
                if L.window is not None:  # the W context positions before the anchor, for every query of the block
                    m[:, :, :S] &= (ctx_pos >= start.view(B, 1) - L.window).unsqueeze(1)
                masks[key] = m.unsqueeze(1)
            h, residual = L(h, residual, cos, sin, ck, cv, masks[key])
        return self.norm(h + residual)

    def draft_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """The block's rows that predict drafts [.., k, H]: the mask queries, or every query with
        ``sample_from_anchor``."""
        return hidden if self.spec.sample_from_anchor else hidden[..., 1:, :]

    def logits(self, rows: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits (before DSpark's Markov bias) [.., Vd]."""
        return self.lm_head(rows)

    def markov_embed(self, prev: torch.Tensor) -> torch.Tensor:
        return self.markov_head.markov_w1(prev)

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """DSpark: the bias [.., Vd] that the token drafted before a position (target ids [..]) adds to its logits."""
        return self.markov_head.markov_w2(self.markov_embed(prev))

    def confidence(self, row: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """DSpark: the head's estimate [..] that the draft from ``row`` [.., H] after token ``prev`` is accepted."""
        x = torch.cat([row, self.markov_embed(prev)], dim=-1) if self.spec.confidence_with_markov else row
        return torch.sigmoid(self.confidence_head.proj(x.float()).squeeze(-1))

    # ------------------------------------------------------------------ reference drafting
    @torch.no_grad()
    def draft(self, tokens: list[int], aux: torch.Tensor, k: int, return_logits: bool = False):
        """Greedy drafts after ``tokens`` (x_0..x_n, the last chosen by the verifier and without a state)
        from the target's aux states ``aux`` [n, n_aux * target_hidden] (one per token before it): one
        pass, then (DSpark) the Markov bias left to right. With ``return_logits``, also the
        draft-vocabulary logits [k, Vd] each draft was the argmax of."""
        n = len(tokens) - 1
        assert aux.shape[0] == n, (aux.shape, n)
        dev = aux.device
        ctx = [(kk.unsqueeze(0), vv.unsqueeze(0)) for kk, vv in self.context_kv(aux, torch.arange(n, device=dev))]
        ids = self.block_ids(torch.tensor([tokens[-1]], device=dev))
        hidden = self.block(ids, torch.tensor([n], device=dev), ctx, torch.arange(n, device=dev).unsqueeze(0))
        base = self.logits(self.draft_rows(hidden)[0, :k])  # [k, Vd]
        drafts, rows, prev = [], [], tokens[-1]
        for i in range(k):
            row = base[i] + self.markov_bias(torch.tensor(prev, device=dev)) if self.spec.markov else base[i]
            rows.append(row)
            prev = int(self.to_target(row.argmax()))
            drafts.append(prev)
        return (drafts, torch.stack(rows)) if return_logits else drafts


# ---------------------------------------------------------------------- checkpoints
def block_drafts(cfg: dict) -> int:
    """The most drafts a head's block yields, from its config.json (``ParallelSpec.max_k``; ``UnsupportedHead``,
    a ValueError, for a config this project cannot run)."""
    return ParallelSpec.from_config(cfg).max_k


def read_spec(path: str | Path) -> ParallelSpec:
    path = Path(path)
    if (path / "mask_embedding.pt").exists():
        raise UnsupportedHead("mask_embedding.pt: a separate mask embedding is not supported (the head embeds "
                              "mask_token_id with embed_tokens)")
    return ParallelSpec.from_config(json.loads((path / "config.json").read_text()))


def check_head(path: str | Path, verifier: str | Path) -> ParallelSpec:
    """The build-time check of a head for a verifier, reading headers only (``core.eagle3.check_head``'s
    counterpart). Returns the spec."""
    path = checkpoint_dir(path)
    spec = read_spec(path)
    check_weights(path, spec, verifier, ParallelHead)
    return spec


def load_head(path: str | Path, dtype=torch.float32, device="cpu", verifier: str | Path | None = None) -> ParallelHead:
    """A Speculators dflash or dspark head; ``verifier``: the target's directory, for what the head leaves to it
    (its embedding without ``embed_tokens``, its lm_head without ``lm_head``: equal vocabularies only)."""
    path = Path(path)
    spec = read_spec(path)
    head = ParallelHead(spec)
    load_weights(head, path, verifier)
    head = head.to(device=device, dtype=dtype).eval()
    if spec.markov and spec.confidence_head:
        head.confidence_head.float()  # vLLM keeps the confidence projection in float32
    return head


