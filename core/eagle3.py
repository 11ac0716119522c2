"""EAGLE-3 draft heads: the Speculators format (what vLLM loads), the head's one forward, the reference drafting.

Glossary (Li et al., EAGLE-3; names as in the ``speculators`` library and vLLM):
- aux states g_t: the target's residual stream entering decoder layers ``aux_layer_ids`` at
  position t (vLLM's layer id L, ``_maybe_add_hidden_state``: 0 is the embeddings, ``num_hidden_layers``
  the last layer's output before the final norm), concatenated in increasing id order (vLLM sorts
  the ids and drops repeats): [n_aux * target_hidden];
- ``fc``: projects g_t to the head's width H, after ``input_norm`` over the whole concatenation
  (``norm_before_fc``) or one RMSNorm per aux state (``fc_norm``) when the head has them;
- the head: ``num_hidden_layers`` decoder layers (Llama's, or Qwen3's with q_norm/k_norm); the
  first one's attention reads cat(input_layernorm(embed(x_{t+1})), hidden_norm(h_t)) [2H], where h_t
  is fc(g_t) on the first draft step and the head's own output on later steps; later layers are
  ordinary decoder layers over the residual stream; the head's output is that stream before the
  final norm, or after it with ``norm_output``;
- draft vocabulary: the ``draft_vocab_size`` most frequent target tokens; ``d2t[i]`` is the offset
  from draft id i to its target id (target = i + d2t[i]); ``t2d`` marks target ids in it.

Position t of the head pairs token x_{t+1} with state h_t and predicts x_{t+2}: after the verifier
has states for x_0..x_n and chose x_{n+1}, the first draft step runs positions up to n, later draft
steps positions n+1, n+2, ... .

One implementation of the head's layers (``EagleLayer.forward``) serves every caller: the
reference drafting (``EagleHead.draft``), training (``EagleHead.layer`` with test-time-training
masks) and the drafter pool's runner over the paged cache (``drafter.eagle3_drafter.HeadRunner``);
the callers differ only in how attention reads earlier keys (``attend``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import torch
import torch.nn.functional as F
from torch import nn

from core.layers import RMSNorm, attention, mlp, rotate, signed_sin

SPECULATORS_VERSION = "0.3.0"
LAYER_TYPES = ("llama", "qwen3")  # vLLM's Eagle3LlamaForCausalLM and Eagle3Qwen3ForCausalLM
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedHead(ValueError):
    """A head config this project cannot run: the message names the field and its value."""


def default_aux_layers(num_layers: int) -> list[int]:
    """vLLM's default aux layers for an N-layer target (``get_eagle3_default_aux_hidden_state_layers``:
    (2, N // 2, N - 3)), in the order vLLM captures them: sorted, repeats dropped."""
    return sorted({2, num_layers // 2, num_layers - 3})


def _rope_parameters(t: dict) -> dict:
    """The layer config's rotary embedding in the new form (``rope_parameters``), from the new key or
    the old ones (``rope_theta``, ``rope_scaling``), as transformers and vLLM normalise them."""
    rope = dict(t.get("rope_parameters") or {})
    if not rope:
        rope = dict(t.get("rope_scaling") or {})
        if "rope_theta" in t:
            rope["rope_theta"] = t["rope_theta"]
    if "type" in rope and "rope_type" not in rope:  # the legacy spelling
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    rope.setdefault("rope_theta", 10000.0)
    return rope


def default_proposal(cfg: dict) -> dict:
    """A Speculators config's default proposal method (``speculators_config.proposal_methods``): the one its
    ``default_proposal_method`` names, else the first, else {} (its ``speculative_tokens`` is the head's k)."""
    spec = cfg.get("speculators_config") or {}
    methods = [m for m in spec.get("proposal_methods") or [] if isinstance(m, dict)]
    default = spec.get("default_proposal_method")
    return next((m for m in methods if m.get("proposal_type") == default), methods[0] if methods else {})


def speculators_config(algorithm: str, k: int, verifier_path: str, verifier_arch: list[str]) -> dict:
    """A head config's ``speculators_config`` as Speculators writes it: one greedy proposal method of k
    tokens (``default_proposal`` reads it back) and the verifier the head drafts for."""
    return {"algorithm": algorithm, "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1,
                                  "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier_path, "architectures": verifier_arch}}


def unsupported(name: str, value, why: str) -> NoReturn:
    """Refuse a head config: ``UnsupportedHead``, one line naming the field and its value."""
    raise UnsupportedHead(f"{name} {value!r}: {why}")


def layer_config(cfg: dict, kind: str) -> dict:
    """A Speculators config's ``transformer_layer_config`` (the draft layers'), which a ``kind`` head needs."""
    t = cfg.get("transformer_layer_config")
    if not isinstance(t, dict):
        unsupported("transformer_layer_config", t, f"the {kind} config needs the draft layers' config")
    return t


def check_draft_layers(t: dict, rope: dict) -> None:
    """What every draft head's layers run here, as vLLM's: silu, no biases, a rotary embedding of a static type
    over the whole head (``rope``: ``_rope_parameters``), no logit scale."""
    act = t.get("hidden_act", "silu")
    if act != "silu":
        unsupported("transformer_layer_config.hidden_act", act, "vLLM's draft layers run silu only")
    for flag in ("attention_bias", "mlp_bias"):
        if t.get(flag):
            unsupported(f"transformer_layer_config.{flag}", t[flag], "not supported (published heads have no biases)")
    if rope["rope_type"] not in ROPE_TYPES:
        unsupported("rope_type", rope["rope_type"], f"supported: {', '.join(ROPE_TYPES)}")
    partial = rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        unsupported("partial_rotary_factor", partial, "the head's rotary embedding covers the whole head")
    if float(t.get("logit_scale", 1.0) or 1.0) != 1.0:
        unsupported("transformer_layer_config.logit_scale", t["logit_scale"], "not supported")


def draft_layer_types(t: dict, n_layers: int) -> tuple[list[str] | None, int | None]:
    """(each of the n draft layers' attention type, the sliding window) from ``layer_types`` and
    ``sliding_window``; no types without ``layer_types`` (every layer full attention)."""
    layer_types, window = t.get("layer_types"), t.get("sliding_window")
    if layer_types is None:
        return None, int(window) if window else None
    if len(layer_types) < n_layers or not set(layer_types) <= {"full_attention", "sliding_attention"}:
        unsupported("transformer_layer_config.layer_types", layer_types,
                    f"needs full_attention or sliding_attention for each of the {n_layers} layers")
    if "sliding_attention" in layer_types[:n_layers] and (window is None or int(window) < 1):
        unsupported("transformer_layer_config.sliding_window", window,
                    "sliding_attention layers need a window of at least 1")
    return list(layer_types[:n_layers]), int(window) if window else None


def _aux_layer_ids(cfg: dict, eagle: dict, target_num_layers: int | None) -> list[int]:
    """The verifier layers whose states the head reads, as vLLM captures them: the config's, sorted with
    repeats dropped, or vLLM's default for the verifier where the config gives none."""
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return sorted(set(int(i) for i in ids))
    if target_num_layers is None:  # absent, null or empty: vLLM's default for the verifier
        unsupported("eagle_aux_hidden_state_layer_ids", cfg.get("eagle_aux_hidden_state_layer_ids"),
                    "the default (2, N // 2, N - 3) needs the verifier's num_hidden_layers N")
    ids = default_aux_layers(target_num_layers)
    if len(ids) != 3:
        unsupported("eagle_aux_hidden_state_layer_ids", None,
                    f"vLLM's default (2, N // 2, N - 3) repeats a layer for a {target_num_layers}-layer verifier")
    return ids


@dataclass
class HeadShape:
    """What every draft head's spec holds (EAGLE-3's, the parallel heads'): its layers' shape, the two
    vocabularies and the target layers whose states it reads. A spec adds ``layer_types`` and
    ``sliding_window``, which ``window`` reads."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]

    @staticmethod
    def read(cfg: dict, t: dict, max_position_embeddings: int) -> dict:
        """The shape fields but ``aux_layer_ids`` of a Speculators config (``t``: its draft layers' config), absent
        ones at vLLM's defaults (``max_position_embeddings``: the head type's)."""
        heads = t["num_attention_heads"]
        return dict(hidden_size=t["hidden_size"], num_attention_heads=heads,
                    num_key_value_heads=t.get("num_key_value_heads") or heads,
                    head_dim=t.get("head_dim") or t["hidden_size"] // heads, intermediate_size=t["intermediate_size"],
                    rms_norm_eps=t.get("rms_norm_eps", 1e-6),
                    max_position_embeddings=t.get("max_position_embeddings", max_position_embeddings),
                    vocab_size=t["vocab_size"], draft_vocab_size=cfg.get("draft_vocab_size") or t["vocab_size"],
                    target_hidden_size=cfg.get("target_hidden_size") or t["hidden_size"])

    def window(self, layer: int) -> int | None:
        """The layer's attention window in keys (the query's own included), None: no window."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None


@dataclass
class Eagle3Spec(HeadShape):
    """The head's shape and flags, as read from (and written to) a Speculators config.json."""

    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    norm_before_residual: bool = True
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    num_layers: int = 1
    layer_type: str = "llama"  # "qwen3": q_norm and k_norm on each head before the rotary embedding
    layer_types: list[str] | None = None  # per draft layer: "full_attention" | "sliding_attention"
    sliding_window: int | None = None

    @property
    def rope_theta(self) -> float:
        return self.rope_parameters["rope_theta"]

    @classmethod
    def from_config(cls, cfg: dict, target_num_layers: int | None = None) -> Eagle3Spec:
        """The spec of a Speculators eagle3 config.json, read as vLLM reads it (absent flags take
        vLLM's defaults). ``target_num_layers``: the verifier's ``num_hidden_layers``, needed when the
        config leaves the aux layer ids to vLLM's default. Raises ``UnsupportedHead`` (one line naming
        the field and value) for a config this project cannot run."""
        if cfg.get("speculators_model_type") != "eagle3":
            unsupported("speculators_model_type", cfg.get("speculators_model_type"), "not a Speculators eagle3 config")
        t = layer_config(cfg, "eagle3")
        model_type = t.get("model_type", "llama")
        if model_type not in LAYER_TYPES:
            unsupported("transformer_layer_config.model_type", model_type,
                        f"vLLM's eagle3 heads have {' or '.join(LAYER_TYPES)} layers")
        rope = _rope_parameters(t)
        check_draft_layers(t, rope)
        eagle = cfg.get("eagle_config") or {}
        if eagle.get("use_aux_hidden_state") is False:
            unsupported("eagle_config.use_aux_hidden_state", False, "an EAGLE-3 head reads the target's aux states")
        n_layers = int(t.get("num_hidden_layers") or 1)
        layer_types, window = draft_layer_types(t, n_layers)
        if layer_types and len(set(layer_types)) > 1:  # vLLM asserts one KV cache group for a head's layers
            unsupported("transformer_layer_config.layer_types", layer_types,
                        "vLLM runs a head's layers in one KV cache group: all sliding or all full attention")
        ids = _aux_layer_ids(cfg, eagle, target_num_layers)
        return cls(**HeadShape.read(cfg, t, max_position_embeddings=8192), aux_layer_ids=ids, rope_parameters=rope,
                   # vLLM's speculators reader: true when absent (published heads are validated in vLLM)
                   norm_before_residual=bool(cfg.get("norm_before_residual", True)),
                   norm_before_fc=bool(eagle.get("norm_before_fc", cfg.get("norm_before_fc", False))),
                   fc_norm=bool(cfg.get("fc_norm", False)), norm_output=bool(cfg.get("norm_output", False)),
                   num_layers=n_layers, layer_type=model_type, layer_types=layer_types, sliding_window=window)

    def to_config(self, verifier_path: str, verifier_arch: list[str], k: int = 4) -> dict:
        layer = {"architectures": ["Qwen3ForCausalLM" if self.layer_type == "qwen3" else "LlamaForCausalLM"],
                 "model_type": self.layer_type, "hidden_size": self.hidden_size,
                 "intermediate_size": self.intermediate_size, "num_attention_heads": self.num_attention_heads,
                 "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
                 "num_hidden_layers": self.num_layers, "rms_norm_eps": self.rms_norm_eps, "vocab_size": self.vocab_size,
                 "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
                 "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
                 "rope_parameters": dict(self.rope_parameters)}
        if self.layer_types:
            layer["layer_types"] = list(self.layer_types)
            layer["sliding_window"] = self.sliding_window
        return {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "speculators_config": speculators_config("eagle3", k, verifier_path, verifier_arch),
            "transformer_layer_config": layer, "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size, "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
            # written always: vLLM defaults norm_before_residual to true when absent, speculators to false
            "norm_before_residual": self.norm_before_residual, "norm_before_fc": self.norm_before_fc,
            "fc_norm": self.fc_norm, "norm_output": self.norm_output, "embed_requires_grad": False,
        }


def rope_frequencies(spec: Eagle3Spec) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2], the cos/sin scale) of the head's rotary embedding, by transformers'
    rope functions (vLLM's ``get_rope`` computes the same for these types)."""
    D, rope = spec.head_dim, spec.rope_parameters
    if rope["rope_type"] == "default":
        return 1.0 / (rope["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float32, device="cpu") / D)), 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    c = LlamaConfig(hidden_size=spec.num_attention_heads * D, num_attention_heads=spec.num_attention_heads,
                    head_dim=D, max_position_embeddings=spec.max_position_embeddings, rope_parameters=dict(rope))
    with torch.device("cpu"):  # (also inside a meta-device context: a spec check builds a head there)
        inv, scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](c, "cpu")
    return inv.float(), float(scale)


class MatMul:
    """y = x W^T over row blocks ``parts`` of W (outputs concatenated) on the engines' own matmul dispatch
    (``core/csrc/decoder.cpp`` ``linear``, as the target's forward runs it): AMX tiles or the bf16 GEMV
    in bf16 where the CPU has them, the float32 FMA kernel in float32, reading exact bf16 copies of
    weights that are all bf16 values (half the bytes), else oneDNN pre-packed (bf16) or ``F.linear``.
    So a draft step's matmuls run in the dtype ``dtype: auto`` chose for this CPU, on the kernels the
    target's step uses there. Without the native build: ``core.llama.Linear``."""

    def __init__(self, parts: list[torch.Tensor]):
        from core.llama import Linear, _bf16_exact
        from core.native import load

        w = torch.cat(parts) if len(parts) > 1 else parts[0]
        self.linear = Linear(w)
        self.ops = load() if w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16) else None
        none = torch.empty(0, dtype=w.dtype)
        self.none, self.parts, self.parts16, self.tiles = none, [], [], none
        if self.ops is None:
            return
        if self.linear.packed:  # bf16 on a CPU oneDNN packs for
            if self.ops.gemv_supported():
                self.parts = [p.contiguous() for p in parts]
            if self.ops.amx_supported() and w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0:
                self.tiles = self.ops.amx_pack(w.contiguous())
        elif w.dtype == torch.float32 and self.ops.fma_supported():
            self.parts = [p.contiguous() for p in parts]
            if all(_bf16_exact(p) for p in self.parts):
                self.parts16 = [p.to(torch.bfloat16) for p in self.parts]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is None:
            return self.linear(x)
        y = self.ops.linear(x.reshape(-1, x.shape[-1]).contiguous(), self.linear.weight, self.none, self.linear.packed,
                            self.parts, self.tiles, self.parts16)
        return y.view(*x.shape[:-1], y.shape[-1])


class _Fused:
    """A layer's projections fused (q|k|v, gate|up) on the engines' matmul kernels (``MatMul``): a draft
    step at batch 1 is a handful of small matmuls, where the fusion and the kernels decide the time."""

    def __init__(self, layer: EagleLayer):
        a, m = layer.self_attn, layer.mlp
        self.qkv = MatMul([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
        self.o = MatMul([a.o_proj.weight])
        self.gate_up = MatMul([m.gate_proj.weight, m.up_proj.weight])
        self.down = MatMul([m.down_proj.weight])


class EagleLayer(nn.Module):
    """One decoder layer of the head, under the Speculators weight names (``layers.i.*``)."""

    def __init__(self, spec: Eagle3Spec, index: int):
        super().__init__()
        s, H, D = spec, spec.hidden_size, spec.head_dim
        self.index, self.spec = index, spec
        self.window = spec.window(index)
        width = 2 * H if index == 0 else H  # the first layer reads cat(embedding, state)
        self.input_layernorm = RMSNorm(H, s.rms_norm_eps)
        if index == 0:
            self.hidden_norm = RMSNorm(H, s.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, s.rms_norm_eps)
        self.self_attn = attention(width, s.num_attention_heads, s.num_key_value_heads, D, H,
                                   s.rms_norm_eps if s.layer_type == "qwen3" else None)
        self.mlp = mlp(H, s.intermediate_size)
        self.fused: _Fused | None = None  # set by ``EagleHead.fuse`` for serving (no gradients through it)
        self.splits = (s.num_attention_heads * D, s.num_key_value_heads * D, s.num_key_value_heads * D)

    def forward(self, h, residual, embeds, cos, sin, attend):
        """h [B, n, H]: layer 0: the state fed (fc(g) or the head's output), later layers: the previous
        layer's output; residual: None for layer 0, else the stream before it; embeds [B, n, H];
        cos, sin [B, n, 1, D]; ``attend(layer, q, k, v)`` with q [B, n, nh, D] and k, v [B, n, nkv, D]
        (rotated) returns the attention output [B, n, nh, D]. Returns (h, residual) as vLLM's layers do:
        the stream after the layer is h + residual."""
        s, a, m = self.spec, self.self_attn, self.mlp
        B, n, _ = h.shape
        D, nh, nkv = s.head_dim, s.num_attention_heads, s.num_key_value_heads
        if self.index == 0:
            e = self.input_layernorm(embeds)
            if s.norm_before_residual:
                h = self.hidden_norm(h)
                residual = h
            else:
                residual, h = h, self.hidden_norm(h)
            x = torch.cat([e, h], dim=-1)
        else:
            residual = h + residual
            x = self.input_layernorm(residual)
        f = self.fused
        if f is not None and s.layer_type != "qwen3":
            # q and k rotated as one [B, n, nh + nkv, D] view of the fused projection: half the small ops
            qk, v = f.qkv(x).split((self.splits[0] + self.splits[1], self.splits[2]), dim=-1)
            qk = qk.view(B, n, nh + nkv, D)
            q, k = rotate(qk, cos, sin).split((nh, nkv), dim=2)
            v = v.view(B, n, nkv, D)
        else:
            if f is not None:
                q, k, v = f.qkv(x).split(self.splits, dim=-1)
            else:
                q, k, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)
            q, k, v = q.view(B, n, nh, D), k.view(B, n, nkv, D), v.view(B, n, nkv, D)
            if s.layer_type == "qwen3":
                q, k = a.q_norm(q), a.k_norm(k)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        o = attend(self.index, q, k, v).reshape(B, n, nh * D).to(x.dtype)
        h = f.o(o) if f is not None else a.o_proj(o)
        residual = h + residual
        x = self.post_attention_layernorm(residual)
        if f is not None:
            gate, up = f.gate_up(x).chunk(2, dim=-1)
            return f.down(F.silu(gate) * up), residual
        return m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x)), residual


def sdpa(q, K, V, mask, nh: int, nkv: int) -> torch.Tensor:
    """Attention of q [B, n, nh, D] over K, V [B, S, nkv, D] with mask [.., n, S] (True: attend)
    -> [B, n, nh, D], in K's dtype."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2).to(K.dtype), K.transpose(1, 2), V.transpose(1, 2),
                                       attn_mask=mask, enable_gqa=nkv != nh)
    return o.transpose(1, 2)


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor | None:
    """Keys within ``window`` positions of each query (itself included): [.., n, S] bool, None without one."""
    if window is None:
        return None
    return k_pos.unsqueeze(-2) > q_pos.unsqueeze(-1) - window


class DraftVocabulary:
    """A head's draft vocabulary over the target's (``d2t``: draft id i is target id i + d2t[i]), for every
    head (EAGLE-3, DFlash, DSpark): mixed into an ``nn.Module`` with a ``spec`` and a ``d2t`` buffer."""

    _targets: tuple | None = None  # ((device, d2t's identity and version), the target id of each draft id)

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., Vd] -> target-vocabulary logits [..., V], -inf outside the draft
        vocabulary (q is exact over the target's vocabulary: zero there). The map is d2t's as it is now: kept
        while d2t and the logits' device stay the same, made again when weights are loaded into d2t or the
        head moves (``_version`` counts d2t's in-place writes)."""
        s = self.spec
        if s.draft_vocab_size == s.vocab_size:
            return draft_logits
        d2t = self.d2t  # (an inference tensor, made in inference mode, counts no versions)
        key = (draft_logits.device, d2t.data_ptr(), None if d2t.is_inference() else d2t._version)
        if self._targets is None or self._targets[0] != key:
            ids = torch.arange(s.draft_vocab_size, device=d2t.device)
            self._targets = (key, self.to_target(ids).to(draft_logits.device))
        out = draft_logits.new_full((*draft_logits.shape[:-1], s.vocab_size), float("-inf"))
        out[..., self._targets[1]] = draft_logits
        return out


class EagleHead(DraftVocabulary, nn.Module):
    """The head's modules under the Speculators weight names (``layers.i.*``, ``fc``, ``norm``, ...)."""

    def __init__(self, spec: Eagle3Spec):
        super().__init__()
        self.spec = s = spec
        H = s.hidden_size
        n_in = len(s.aux_layer_ids) * s.target_hidden_size
        self.embed_tokens = nn.Embedding(s.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        if s.norm_before_fc:
            self.input_norm = RMSNorm(n_in, s.rms_norm_eps)
        if s.fc_norm:
            self.fc_norm = nn.ModuleList([RMSNorm(s.target_hidden_size, s.rms_norm_eps) for _ in s.aux_layer_ids])
        self.fc = nn.Linear(n_in, H, bias=False)
        self.layers = nn.ModuleList([EagleLayer(s, i) for i in range(s.num_layers)])
        self.norm = RMSNorm(H, s.rms_norm_eps)
        self.lm_head = nn.Linear(H, s.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(s.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(s.vocab_size, dtype=torch.bool))
        # float32 whatever the head's dtype (not a buffer, which ``to(dtype)`` would round), as vLLM's cache
        self.inv_freq, self.rope_scale = rope_frequencies(s)
        self._fc = self._lm_head = None
        self._cos = self._sin = None  # serving tables (``fuse``)
        self.native: dict | None = None  # the native one-token step's arguments (``fuse``)

    # ------------------------------------------------------------------ pieces
    def fuse(self, max_len: int) -> EagleHead:
        """Serving: fused projections on the engines' matmul kernels (``MatMul``) for every layer, fc and lm_head."""
        for L in self.layers:
            L.fused = _Fused(L)
        self._fc, self._lm_head = MatMul([self.fc.weight]), MatMul([self.lm_head.weight])
        # a draft step is a handful of small ops: each one precomputed here is one fewer per step
        w = self.fc.weight
        cos, sin = self.rope(torch.arange(max_len, device=w.device).unsqueeze(0), tables=False)
        self._cos, self._sin = cos[0].to(w.dtype), sin[0].to(w.dtype)  # [max_len, D]
        # by cache row (``drafter.eagle3_drafter``: row t is rotary position t - 1, row 0 position 0)
        self._row_rope = (torch.cat([self._cos[:1], self._cos[:-1]]).unsqueeze(1),
                          torch.cat([self._sin[:1], self._sin[:-1]]).unsqueeze(1))  # [max_len, 1, D]
        self.native = self._native_step(max_len)
        return self

    def _native_step(self, max_len: int) -> dict | None:
        """The arguments of the native one-token step (``core/csrc/decoder.cpp`` ``eagle3_step``: the layers'
        arithmetic as one call, on the same matmul kernels), None where it cannot run (no native build)."""
        fused = [m for L in self.layers for m in (L.fused.qkv, L.fused.o, L.fused.gate_up, L.fused.down)]
        fused.append(self._lm_head)
        ops = fused[0].ops
        if ops is None or not hasattr(ops, "eagle3_step"):
            return None
        none = fused[0].none
        weights = []
        for L in self.layers:
            a, f = L.self_attn, L.fused
            weights += [L.input_layernorm.weight, L.hidden_norm.weight if L.index == 0 else none, f.qkv.linear.weight,
                        a.q_norm.weight if hasattr(a, "q_norm") else none,
                        a.k_norm.weight if hasattr(a, "k_norm") else none, f.o.linear.weight,
                        L.post_attention_layernorm.weight, f.gate_up.linear.weight, f.down.linear.weight]
        # each matmul's GEMV parts and their bf16 copies go as one list in the layers' order, or none at all
        parts = [p for m in fused for p in m.parts] if all(m.parts for m in fused) else []
        parts16 = [p for m in fused for p in m.parts16] if parts and all(m.parts16 for m in fused) else []
        tiles = [m.tiles for m in fused] if any(m.tiles.numel() for m in fused) else []
        # cos and the plain sin by cache row (the native rotary is rotate_half's)
        cos, sin = self._row_rope[0][:, 0], signed_sin(self._row_rope[1][:, 0])
        s = self.spec
        return {"ops": ops, "weights": [t.detach() for t in weights], "parts": parts, "parts16": parts16,
                "tiles": tiles, "packed": fused[0].linear.packed, "lm_head": self._lm_head.linear.weight,
                "cos": cos, "sin": sin,
                "args": (s.norm_before_residual, s.norm_output, s.rms_norm_eps, s.num_attention_heads,
                         s.num_key_value_heads, s.head_dim)}

    def rope(self, positions: torch.Tensor, tables: bool = True):
        """cos and signed sin (``rotate``) [B, T, D] for positions [B, T] (from the serving tables where
        ``fuse`` made them)."""
        if tables and self._cos is not None:
            return self._cos[positions], self._sin[positions]
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        f = positions.float().unsqueeze(-1) * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((f, f), dim=-1)
        return emb.cos() * self.rope_scale, signed_sin(emb.sin() * self.rope_scale)

    def row_rope(self, rows: torch.Tensor):
        """cos, signed sin [B, n, 1, D] for paged-cache rows [B, n] (row t: position t - 1; needs ``fuse``)."""
        return self._row_rope[0][rows], self._row_rope[1][rows]

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """fc over the aux states [.., n_aux * target_hidden] -> [.., H] (vLLM's ``combine_hidden_states``)."""
        s = self.spec
        if s.norm_before_fc:
            aux = self.input_norm(aux)
        if s.fc_norm:
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, aux.chunk(len(s.aux_layer_ids), dim=-1))], dim=-1)
        return self._fc(aux) if self._fc is not None else self.fc(aux)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self._lm_head(normed) if self._lm_head is not None else self.lm_head(normed)

    def forward_layers(self, ids, h, positions, attend, rope=None):
        """The head's layers over tokens ids [B, n] at rotary positions [B, n] with states h [B, n, H]
        (fc(g) or its own earlier output); ``rope``: their (cos, signed sin) [B, n, 1, D] where the caller
        has them. Returns (the final-normed stream [B, n, H], the state fed to the next draft step
        [B, n, H]: the stream before the final norm, or after it with ``norm_output``)."""
        embeds = self.embed_tokens(ids)
        h = h.to(embeds.dtype)
        cos, sin = rope or (c.unsqueeze(2).to(embeds.dtype) for c in self.rope(positions))  # [B, n, 1, D]
        residual = None
        for L in self.layers:
            h, residual = L(h, residual, embeds, cos, sin, attend)
        out = h + residual
        normed = self.norm(out)
        return normed, normed if self.spec.norm_output else out

    def layer(self, ids: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, past: list, mask: torch.Tensor):
        """One pass of the head (the reference and training form). ids, positions [B, T]; h [B, T, H];
        past: per layer, (K, V) of earlier passes, [B, S', kv, D] each, extended in place; mask
        [T, S' + T] bool (True: attend), intersected with each sliding layer's window. Returns
        (logits over the draft vocabulary [B, T, draft_vocab], the state for the next pass [B, T, H])."""
        s = self.spec
        if not past:
            past.extend([] for _ in self.layers)
        k_pos = torch.cat([p for p in ([e[2] for e in past[0]] + [positions])], dim=1)  # [B, S' + T]

        def attend(i, q, k, v):
            past[i].append((k, v, positions))
            K = torch.cat([e[0] for e in past[i]], dim=1)
            V = torch.cat([e[1] for e in past[i]], dim=1)
            w = window_mask(positions, k_pos, self.layers[i].window)
            m = mask if w is None else mask & w.unsqueeze(1)  # [B, 1, T, S]
            return sdpa(q, K, V, m, s.num_attention_heads, s.num_key_value_heads)

        normed, state = self.forward_layers(ids, h, positions, attend)
        return self.logits(normed), state

    # ------------------------------------------------------------------ reference drafting
    @torch.no_grad()
    def draft(self, tokens: list[int], aux: torch.Tensor, k: int, return_logits: bool = False):
        """Greedy drafts after ``tokens`` (x_0..x_n+1, the last one chosen by the verifier and
        without a state yet) from the target's aux states ``aux`` [n+1, n_aux * target_hidden] (one
        per token before it). Recomputes the whole prefix: the slow, obvious reference.
        With ``return_logits``, also each draft step's draft-vocabulary logits [k, draft_vocab]."""
        n1 = len(tokens) - 1  # positions 0..n: pairs (x_{t+1}, g_t)
        assert aux.shape[0] == n1, (aux.shape, n1)
        dev = aux.device
        ids = torch.tensor([tokens[1:]], device=dev)
        pos = torch.arange(n1, device=dev).unsqueeze(0)
        h = self.combine(aux.unsqueeze(0).to(self.fc.weight.dtype))
        past: list = []
        mask = torch.ones(n1, n1, dtype=torch.bool, device=dev).tril()
        logits, out = self.layer(ids, h, pos, past, mask)
        drafts, rows = [], []
        for i in range(k):
            rows.append(logits[0, -1])
            tok = int(self.to_target(logits[0, -1].argmax()))
            drafts.append(tok)
            if i + 1 == k:
                break
            S = sum(kv[0].shape[1] for kv in past[0])
            logits, out = self.layer(torch.tensor([[tok]], device=dev), out[:, -1:],
                                     torch.tensor([[n1 + i]], device=dev), past,
                                     torch.ones(1, S + 1, dtype=torch.bool, device=dev))
        return (drafts, torch.stack(rows)) if return_logits else drafts


def aux_states(target, input_ids: torch.Tensor, layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's aux states [B, T, len(ids) * hidden] and logits [B, T, V] in one forward pass
    (transformers' ``hidden_states[i]`` is the stream entering layer i for i < num_hidden_layers)."""
    n = target.config.get_text_config().num_hidden_layers
    if any(i >= n for i in layer_ids):
        raise ValueError(f"aux layer ids {layer_ids}: transformers returns layer {n}'s state after the final norm")
    out = target(input_ids=input_ids, output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in layer_ids], dim=-1), out.logits


def _safetensors_files(path: Path) -> list[Path]:
    """A checkpoint's safetensors files: ``model.safetensors`` or the shards its index names."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"]
    return sorted(path.glob("*.safetensors"))


def read_state(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (one file or shards with an index)."""
    from safetensors.torch import load_file

    files = _safetensors_files(Path(path))
    if not files:
        raise ValueError(f"{path}: no safetensors weights (model.safetensors or an index of shards)")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def verifier_tensor(verifier: str | Path, what: str, shape_only: bool = False):
    """The verifier checkpoint's input embedding (``what`` = "embed_tokens") or output projection
    ("lm_head", the tied embedding when the verifier ties them), read from its safetensors."""
    from safetensors import safe_open

    path = Path(verifier)
    names = {}
    for f in _safetensors_files(path):
        with safe_open(str(f), "pt") as h:
            names.update({k: f for k in h.keys()})
    cfg = json.loads((path / "config.json").read_text())
    tied = cfg.get("tie_word_embeddings", (cfg.get("text_config") or {}).get("tie_word_embeddings", False))
    suffix = "lm_head.weight" if what == "lm_head" and "lm_head.weight" in names else "embed_tokens.weight"
    if what == "lm_head" and suffix != "lm_head.weight" and not tied:
        raise ValueError(f"verifier {str(path)!r} has no lm_head.weight")
    found = sorted((k for k in names if k.endswith(suffix) and "vision" not in k and "audio" not in k), key=len)
    if not found:
        raise ValueError(f"verifier {str(path)!r} has no {suffix}")
    with safe_open(str(names[found[0]]), "pt") as h:
        return h.get_slice(found[0]).get_shape() if shape_only else h.get_tensor(found[0])


def verifier_layers(verifier: str | Path) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(verifier)).get_text_config().num_hidden_layers


def verifier_hidden_size(verifier: str | Path) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(verifier)).get_text_config().hidden_size


def check_reads(path: Path, spec, verifier, shapes: dict[str, tuple]) -> None:
    """What the head reads, before any weight's shape is compared: the verifier's hidden states at its width
    (a head trained for another verifier is named as one, with both sizes), and the aux states vLLM captures:
    each listed layer once (``_set_aux_hidden_state_layers``: ``sorted(set(layers))``), repeats included."""
    fc = shapes.get("fc.weight")
    raw = json.loads((path / "config.json").read_text())
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or raw.get("aux_hidden_state_layer_ids") or []
    n = len(spec.aux_layer_ids)
    if fc is not None and len(ids) > n and fc[-1] == len(ids) * spec.target_hidden_size:
        field_ = ("eagle_aux_hidden_state_layer_ids" if "eagle_aux_hidden_state_layer_ids" in raw
                  else "aux_hidden_state_layer_ids")
        raise UnsupportedHead(f"{field_} {ids} repeat a layer: vLLM captures each layer once ({n} states, "
                              f"{sorted(set(ids))}), while fc.weight {fc} reads {len(ids)}")
    if verifier is None:
        return
    width = verifier_hidden_size(verifier)
    sizes = {"target_hidden_size": spec.target_hidden_size}
    if fc is not None and fc[-1] % width and not fc[-1] % n:  # the weights' own width, where the config hides it
        sizes["fc.weight"] = fc[-1] // n
    for what, size in sizes.items():
        if size != width:
            raise UnsupportedHead(f"the head reads hidden states of size {size} ({what}), the verifier's hidden size "
                                  f"is {width}: the head belongs to another verifier, one {size} wide")


def _borrowed(path: Path, spec, names: set[str], verifier, read) -> dict:
    """{weight name: ``read(verifier, what)``} for the weights the head leaves to the verifier (vLLM's rules:
    the target's embedding without ``embed_tokens``, its lm_head without ``lm_head``), each as wide as the head;
    ``read``: ``verifier_tensor`` (the weight) or ``_verifier_shape`` (its shape)."""
    out = {}
    for name, what in (("embed_tokens.weight", "embed_tokens"), ("lm_head.weight", "lm_head")):
        if name in names:
            continue
        if verifier is None:
            raise ValueError(f"{path}: the head has no {name}: vLLM uses the verifier's, so loading needs the verifier")
        if what == "lm_head" and spec.draft_vocab_size != spec.vocab_size:
            raise UnsupportedHead(f"lm_head absent with draft_vocab_size {spec.draft_vocab_size}: only a head over "
                                  "the verifier's whole vocabulary can use the verifier's lm_head")
        out[name] = read(verifier, what)
        width = (out[name].shape if isinstance(out[name], torch.Tensor) else out[name])[-1]
        if width != spec.hidden_size:
            raise UnsupportedHead(f"{what} absent with hidden_size {spec.hidden_size}: the verifier's is {width} wide, "
                                  "so the head cannot use it")
    return out


def _complete(path: Path, spec, shapes: dict[str, tuple], head_cls: type[nn.Module] | None = None) -> None:
    """Every weight the config makes the head (``head_cls(spec)``, default ``EagleHead``) have is there, with
    its shape; nothing else is."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in (head_cls or EagleHead)(spec).state_dict().items()}
    wrong = [f"{k} is {shapes[k]}, the config makes it {expected[k]}" for k in shapes
             if k in expected and shapes[k] != expected[k]]
    if wrong:
        raise ValueError(f"{path}: " + "; ".join(wrong))
    missing = set(expected) - set(shapes) - {"d2t", "t2d"}
    unexpected = set(shapes) - set(expected)
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match the config (missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)})")


def _names(key: str) -> str:
    return key.replace("midlayer.", "layers.0.")  # the original EAGLE checkpoints' name for layer 0


def check_head(path: str | Path, verifier: str | Path) -> Eagle3Spec:
    """The build-time check of a head for a verifier, reading headers only: the config (one
    ``UnsupportedHead`` line naming a field the project cannot run), every weight's name and shape,
    and what the head borrows from the verifier (its width must match). Returns the spec."""
    path = checkpoint_dir(path)
    spec = Eagle3Spec.from_config(json.loads((path / "config.json").read_text()), verifier_layers(verifier))
    check_weights(path, spec, verifier, EagleHead)
    return spec


def checkpoint_dir(path: str | Path) -> Path:
    """A head checkpoint's directory, refused unless it has config.json and safetensors weights."""
    path = Path(path)
    if not (path / "config.json").exists() or not _safetensors_files(path):
        raise ValueError(f"{str(path)!r} needs config.json and safetensors weights (model.safetensors or shards "
                         "with model.safetensors.index.json)")
    return path


def check_weights(path: Path, spec, verifier, head_cls: type[nn.Module]) -> None:
    """From the safetensors headers: every weight ``head_cls(spec)`` has is in the checkpoint at ``path`` or
    borrowed from the verifier (as wide as the head), with its shape, and nothing else is."""
    from safetensors import safe_open

    shapes = {}
    for f in _safetensors_files(path):
        with safe_open(str(f), "pt") as h:
            shapes.update({_names(k): tuple(h.get_slice(k).get_shape()) for k in h.keys()})
    check_reads(path, spec, verifier, shapes)
    shapes.update({k: tuple(v) for k, v in _borrowed(path, spec, set(shapes), verifier, _verifier_shape).items()})
    shapes.pop("inv_freq", None)
    _complete(path, spec, shapes, head_cls)


def _verifier_shape(verifier, what: str):
    files = _safetensors_files(Path(verifier))
    if not files or not all(f.exists() for f in files):
        # the weights are elsewhere (a Hub model whose metadata alone the app builder fetched): the
        # shape its config gives, [vocab_size, hidden_size] for the embedding and the lm_head alike
        from transformers import AutoConfig

        text = AutoConfig.from_pretrained(str(verifier)).get_text_config()
        return (text.vocab_size, text.hidden_size)
    return verifier_tensor(verifier, what, shape_only=True)


def load_head(path: str | Path, dtype=torch.float32, device="cpu", verifier: str | Path | None = None) -> EagleHead:
    """A Speculators eagle3 head. ``verifier``: the target's directory, for what the head leaves to
    it (vLLM's rules): its layer count when the aux layer ids are absent, its embedding when the head
    has no ``embed_tokens``, its lm_head when the head has none (equal vocabularies only)."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    spec = Eagle3Spec.from_config(cfg, verifier_layers(verifier) if verifier is not None else None)
    head = EagleHead(spec)
    load_weights(head, path, verifier)
    return head.to(device=device, dtype=dtype).eval()


def load_weights(head: nn.Module, path: Path, verifier) -> None:
    """A head checkpoint's weights into ``head`` (built from its spec, ``head.spec``), with what it borrows from
    the verifier (``_borrowed``), every weight checked against the config (``_complete``)."""
    spec = head.spec
    state = {_names(k): v for k, v in read_state(path).items()}
    state.pop("inv_freq", None)
    check_reads(path, spec, verifier, {k: tuple(v.shape) for k, v in state.items()})
    state.update(_borrowed(path, spec, set(state), verifier, verifier_tensor))
    if "t2d" not in state and spec.draft_vocab_size != spec.vocab_size:
        # d2t absent: vLLM keeps its zeros, draft id i is target id i
        d2t = state.get("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
        t2d[torch.arange(spec.draft_vocab_size) + d2t] = True
        state["t2d"] = t2d
    _complete(path, spec, {k: tuple(v.shape) for k, v in state.items()}, type(head))
    head.load_state_dict(state, strict=False)


def save_head(head: nn.Module, path: str | Path, config: dict, dtype=torch.bfloat16) -> None:
    """config.json plus model.safetensors in the Speculators layout (d2t/t2d only with a smaller
    draft vocabulary: vLLM refuses d2t when the vocabularies are equal), for any head with a ``spec``."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in head.state_dict().items()}
    if head.spec.draft_vocab_size == head.spec.vocab_size:
        state.pop("d2t"), state.pop("t2d")
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def draft_vocabulary(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [size] int64, t2d [V] bool) from token counts [V]: the ``size`` most frequent tokens
    (ties to the lower id), in id order; d2t[i] = target id - i."""
    order = sorted(range(len(counts)), key=lambda t: (-int(counts[t]), t))[:size]
    chosen = torch.tensor(sorted(order), dtype=torch.long)
    t2d = torch.zeros(len(counts), dtype=torch.bool)
    t2d[chosen] = True
    return chosen - torch.arange(size), t2d


def ttt_mask(T: int, step: int, device=None) -> torch.Tensor:
    """Test-time-training attention at draft step ``step`` (0-based): a query at t sees the first
    pass's keys 0..t (causal) and its own position in each later pass (1..step): [T, (step+1) T]."""
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    eye = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)


def kl_to_target(target_logits: torch.Tensor, draft_logits: torch.Tensor, t2d: torch.Tensor,
                 valid: torch.Tensor) -> torch.Tensor:
    """Mean over valid positions of KL(p || q), p the target's distribution restricted to the draft
    vocabulary and renormalised (as speculators trains it), q the head's. [B, T, V] / [B, T, Vd]."""
    log_p = F.log_softmax(target_logits[..., t2d].float(), -1)
    log_q = F.log_softmax(draft_logits.float(), -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)  # [B, T]
    return (kl * valid).sum() / valid.sum().clamp(min=1)


def mean_acceptance_length(accepted: list[int]) -> float:
    return 1 + sum(accepted) / len(accepted) if accepted else math.nan
