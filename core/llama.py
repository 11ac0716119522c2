"""The decoder forward pass the engines run: a compact Llama-family forward over Hugging Face weights.

Hugging Face's modules spend most of a small-batch decode step outside the matmuls
(docs/decisions/0001-native-forward.md): mask building, cache objects, three q/k/v and two
gate/up matmuls where one each would do. This forward keeps only what a step needs: the fused
projections, RMSNorm and rotary embedding as Hugging Face computes them (so outputs match the
model's own ``generate``), attention over
the paged cache (``core.kv_cache.KVAccess``), the LM head on the kept positions only. It can
also return the residual stream entering chosen layers (EAGLE-3's auxiliary hidden states) from
the same pass.

Architectures with anything else (another norm, sliding windows in use, a rotary embedding
that depends on the length, mixture-of-experts layers, attention sinks, per-layer head sizes:
Mistral with its window, Qwen3 MoE, Gemma 4, gpt-oss) run through ``HFRunner``: the model's own
modules over the same paged cache, with each layer type's mask (``layer_windows``).
``make_runner`` chooses by the config and says which.

The state of layer i (what EAGLE-3 heads read) is the same in both runners and in vLLM (its
``_maybe_add_hidden_state``: hidden + residual before layer i): the residual stream entering
decoder layer i, so 0 is the embeddings (scaled where the model scales them) and
``num_hidden_layers`` is the last layer's output before the final norm.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

from core.layers import rms_norm, rotate, signed_sin

log = logging.getLogger(__name__)

COMPACT_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
STATIC_ROPE = {"default", "linear", "llama3", "yarn"}  # cos/sin depend on the position only


def layer_windows(text_config) -> list[int | None]:
    """Each decoder layer's sliding window (keys at positions p - window < t <= p), None for full attention.

    From ``layer_types`` where the config has them (Gemma 4, gpt-oss, Qwen3: sliding and full layers
    interleaved), else one window for every layer (Mistral, Qwen3 MoE with ``use_sliding_window``)."""
    c = text_config
    if getattr(c, "use_bidirectional_attention", None) == "all":
        raise ValueError("use_bidirectional_attention 'all': a verifier must be causal")
    window = getattr(c, "sliding_window", None)
    types = getattr(c, "layer_types", None)
    if types is not None:
        other = sorted(set(types) - {"full_attention", "sliding_attention"})
        if other:
            raise ValueError(f"layer_types {other}: the verifier runs full and sliding attention layers only")
        return [window if t == "sliding_attention" else None for t in types[:c.num_hidden_layers]]
    use = getattr(c, "use_sliding_window", True)
    return [window if window and use else None] * c.num_hidden_layers


def packed_linear_available(weight: torch.Tensor) -> bool:
    """Whether oneDNN can run this weight pre-packed: bf16 on a CPU build with mkldnn, on a CPU its bf16 path
    runs on (it refuses CPUs without AVX-512 or AVX-NE-CONVERT, an AMD Zen 3 for one)."""
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and _onednn_packs_bf16()


@functools.lru_cache(maxsize=1)
def _onednn_packs_bf16() -> bool:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:  # the CPU check is oneDNN's own: ask it
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 32, dtype=torch.bfloat16), 1)
        return True
    except RuntimeError as e:
        log.info("oneDNN does not pre-pack bf16 weights here (%s): bf16 matmuls run through F.linear", e)
        return False


class Linear:
    """y = x W^T + b. On CPUs in bf16 the weight is pre-packed once into oneDNN's blocked layout (as
    inductor's freezing and vLLM's CPU backend do): faster than ``F.linear`` at decode shapes
    (docs/decisions/0001-native-forward.md) and bit-identical to it. Elsewhere it is ``F.linear``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.bias = bias
        self.packed = packed_linear_available(weight)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def compact_unsupported(model, max_len: int) -> str | None:
    """Why the compact forward cannot run this model (None when it can)."""
    c = model.config.get_text_config()
    if c.model_type not in COMPACT_TYPES:
        return f"model_type {c.model_type!r}"
    rope = (getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE:
        return f"rope_type {rope!r}"
    if getattr(c, "hidden_act", "silu") != "silu":
        return f"hidden_act {c.hidden_act!r}"
    if getattr(c, "mlp_bias", False):
        return "mlp_bias"
    rope_params = getattr(c, "rope_parameters", None) or {}
    if rope_params.get("partial_rotary_factor", 1.0) != 1.0:
        return f"partial_rotary_factor {rope_params['partial_rotary_factor']}"
    window = min((w for w in layer_windows(c) if w), default=None)
    if window and window < max_len:
        return f"sliding_window {window} < max_model_len {max_len}"
    return None


class CompactLlama:
    """One decoder forward over a Llama-family model's weights (the module itself is not called)."""

    kind = "compact"

    def __init__(self, model, max_len: int):
        c = model.config.get_text_config()
        inner = model.model
        self.eps = c.rms_norm_eps
        self.heads = c.num_attention_heads
        self.kv_heads = c.num_key_value_heads or self.heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // self.heads
        self.num_layers = c.num_hidden_layers
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.lm_head = Linear(model.lm_head.weight)
        self.layers = []
        for L in inner.layers:
            a, p = L.self_attn, L.mlp
            bias = a.q_proj.bias
            self.layers.append(dict(
                ln1=L.input_layernorm.weight, ln2=L.post_attention_layernorm.weight,
                qkv=Linear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]),
                           None if bias is None else torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])),
                o=Linear(a.o_proj.weight, a.o_proj.bias),
                q_norm=getattr(getattr(a, "q_norm", None), "weight", None),
                k_norm=getattr(getattr(a, "k_norm", None), "weight", None),
                gate_up=Linear(torch.cat([p.gate_proj.weight, p.up_proj.weight])), down=Linear(p.down_proj.weight)))
        # cos/sin for every position once, from the model's own rotary module (rope scaling included)
        pos = torch.arange(max_len, device=self.embed.device).unsqueeze(0)
        cos, sin = inner.rotary_emb(self.embed[:1].unsqueeze(0), pos)  # [1, max_len, head_dim]
        self.cos, self.sin = cos[0], signed_sin(sin[0])  # sin signed, as ``rotate`` takes it

    @torch.inference_mode()
    def __call__(self, input_ids, positions, kv, mask, keep: int, capture: tuple[int, ...] = ()):
        """input_ids, positions [B, n]; mask [B, 1, n, S] bool or None (attend to all) ->
        (logits [B, keep, V], {layer: residual stream entering it [B, n, hidden]})."""
        B, n = input_ids.shape
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        x = F.embedding(input_ids, self.embed)  # [B, n, hidden]
        cos, sin = self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)  # [B, n, 1, D]
        hidden = {}
        for i, w in enumerate(self.layers):
            if i in capture:
                hidden[i] = x
            h = rms_norm(x, w["ln1"], self.eps)
            qkv = w["qkv"](h)  # [B, n, (H + 2 KV) D]
            qk, v = qkv.view(B, n, H + 2 * KV, D).split([H + KV, KV], dim=2)  # [B, n, heads, D]
            if w["q_norm"] is not None:
                q, k = qk.split([H, KV], dim=2)
                qk = torch.cat([rms_norm(q, w["q_norm"], self.eps), rms_norm(k, w["k_norm"], self.eps)], dim=2)
            qk = rotate(qk, cos, sin)  # q and k rotated together: one set of kernels
            q, k = qk.split([H, KV], dim=2)
            K, V = kv.update(i, k, v)  # [B, S, KV, D], in the cache's dtype
            # attention in the cache's dtype: float32 on CPU, where bf16 attention kernels are slower (0007-dtype-auto)
            a = F.scaled_dot_product_attention(q.transpose(1, 2).to(K.dtype), K.transpose(1, 2), V.transpose(1, 2),
                                               attn_mask=mask, enable_gqa=KV != H)  # [B, H, n, D]
            x = x + w["o"](a.transpose(1, 2).reshape(B, n, H * D).to(x.dtype))
            gate, up = w["gate_up"](rms_norm(x, w["ln2"], self.eps)).chunk(2, dim=-1)
            x = x + w["down"](F.silu(gate) * up)
        if self.num_layers in capture:
            hidden[self.num_layers] = x
        logits = self.lm_head(rms_norm(x[:, n - keep:], self.norm, self.eps))  # [B, keep, V]
        return logits, hidden


class NativeLlama(CompactLlama):
    """The compact forward as one native call (``core/csrc/decoder.cpp``): the same matmuls and
    attention, the elementwise work in C++ loops, so a step pays one Python call instead of some 30
    small ops per layer."""

    kind = "native"

    def __init__(self, model, max_len: int, ops):
        super().__init__(model, max_len)
        self.ops = ops
        none = torch.empty(0, dtype=self.embed.dtype)
        linears = [self.lm_head] + [w[name] for w in self.layers for name in ("qkv", "o", "gate_up", "down")]
        self.packed = linears[0].packed
        assert all(f.packed == self.packed for f in linears)
        self.weights = []  # core/csrc/decoder.cpp's per-layer order
        for w in self.layers:
            self.weights += [w["ln1"], w["qkv"].weight, _or(w["qkv"].bias, none), w["o"].weight, _or(w["o"].bias, none),
                             _or(w["q_norm"], none), _or(w["k_norm"], none), w["ln2"], w["gate_up"].weight,
                             w["down"].weight]
        # the model's own weights, row-major, for the engine's own few-row kernels (no copy: the module holds them):
        # the bf16 GEMV where the CPU has AVX-512 BF16, the float32 FMA kernel in float32 (up to 64 rows)
        own_rows = ops.gemv_supported() if self.packed else (self.embed.dtype == torch.float32 and ops.fma_supported())
        self.gemv = os.environ.get("SPLITSPEC_GEMV", "1") != "0" and bool(own_rows)
        self.parts = []
        if self.gemv:
            for L in model.model.layers:
                a, p = L.self_attn, L.mlp
                self.parts += [m.weight.contiguous() for m in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, p.gate_proj,
                                                               p.up_proj, p.down_proj)]
            self.parts.append(model.lm_head.weight.contiguous())
        # float32 weights that are all bf16 values (a bf16 checkpoint loaded in float32): bf16 copies for the FMA
        # kernel's matmuls of a few rows, widened exactly in registers, so the sums are bit for bit the same, from
        # half the bytes (a one-row step reads every weight once). One more copy of the weights, at half their size.
        self.bf16_weights = (self.gemv and not self.packed and os.environ.get("SPLITSPEC_BF16_WEIGHTS", "1") != "0"
                             and all(_bf16_exact(w) for w in self.parts))
        self.parts16 = [w.to(torch.bfloat16) for w in self.parts] if self.bf16_weights else []
        # AMX tiles of each fused weight (matmuls of up to 16 rows: verification, batches): one more copy of the
        # weights, packed once; a weight whose shape does not tile (N % 16, K % 32) keeps the other paths
        self.amx = self.packed and os.environ.get("SPLITSPEC_AMX", "1") != "0" and bool(ops.amx_supported())
        self.tiles = []
        if self.amx:
            def tiles(w):
                return ops.amx_pack(w.contiguous()) if w.shape[0] % 16 == 0 and w.shape[1] % 32 == 0 else none

            for L in model.model.layers:
                a, p = L.self_attn, L.mlp
                self.tiles += [tiles(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
                               tiles(a.o_proj.weight), tiles(torch.cat([p.gate_proj.weight, p.up_proj.weight])),
                               tiles(p.down_proj.weight)]
            self.tiles.append(tiles(model.lm_head.weight))
        # attention over the cache in place (core/csrc/decoder.cpp); SPLITSPEC_ATTENTION=aten: ATen's, for A/B runs
        self.aten_attention = os.environ.get("SPLITSPEC_ATTENTION", "own") == "aten"
        # the native rotary takes the plain sin (rotate_half's)
        self.cos, self.sin = self.cos.contiguous(), signed_sin(self.sin).contiguous()
        self._none_rows = torch.empty(0, dtype=torch.long)

    def matmuls(self) -> list[tuple[Linear, list[torch.Tensor], torch.Tensor, list[torch.Tensor]]]:
        """Each fused matmul in forward order (per layer q|k|v, o, gate|up, down; then the LM head): its
        ``Linear``, its GEMV parts, its AMX tiles and its parts' bf16 copies (empty where off), as ``decoder``
        receives them."""
        fused = [w[name] for w in self.layers for name in ("qkv", "o", "gate_up", "down")] + [self.lm_head]
        none = torch.empty(0, dtype=self.embed.dtype)
        groups = [(7 * i + a, c) for i in range(len(self.layers)) for a, c in ((0, 3), (3, 1), (4, 2), (6, 1))]

        def split(ps):
            return [ps[a:a + c] for a, c in groups] + [ps[-1:]] if ps else [[] for _ in fused]

        return list(zip(fused, split(self.parts), self.tiles or [none] * len(fused), split(self.parts16)))

    @torch.inference_mode()
    def __call__(self, input_ids, positions, kv, mask, keep: int, capture: tuple[int, ...] = ()):
        rows, layers = kv.read_rows is not None, sorted(capture)
        out = self.ops.decoder(
            input_ids, positions, self.embed, self.cos, self.sin, self.weights, self.norm, self.lm_head.weight,
            self.packed, self.parts, self.parts16, self.tiles, kv.cache.k, kv.cache.v,
            kv.write_rows if rows else self._none_rows, kv.read_rows if rows else self._none_rows,
            kv.write_start, kv.read_start, kv.S, mask, keep,
            layers, self.eps, self.heads, self.kv_heads, self.head_dim, self.aten_attention)
        return out[0], dict(zip(layers, out[1:]))


def _or(t, default):
    return default if t is None else t


def _bf16_exact(w: torch.Tensor) -> bool:
    """Whether every element of a float32 tensor is a bf16 value (converting it loses nothing)."""
    return w.dtype == torch.float32 and torch.equal(w.to(torch.bfloat16).float(), w)


class _HFCacheView:
    """``past_key_values`` for a Hugging Face module: writes and reads the paged cache."""

    def __init__(self, kv, S: int):
        self.kv, self.S = kv, S

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # [B, kv_heads, n, head_dim] in and out, in the module's dtype
        K, V = self.kv.update(layer_idx, key_states.transpose(1, 2), value_states.transpose(1, 2))
        return K.transpose(1, 2).to(key_states.dtype), V.transpose(1, 2).to(value_states.dtype)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.S

    def is_compileable(self):
        return False


def decoder_layers(model):
    """The decoder layers of a causal LM (``model.model.layers`` for most; the text decoder's for a
    multimodal checkpoint)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (model.get_decoder().layers)")
    return layers


class capture_states:  # noqa: N801 (a context manager, named like contextlib's)
    """Record the state of the listed layers (see the module docstring) while the model's own forward runs:
    a pre-hook on layer i takes its input, a hook on the last layer its output (before the final norm).
    Only the listed layers are kept; nothing else is materialised (``output_hidden_states`` would keep
    every layer's, and transformers' last one is after the final norm)."""

    def __init__(self, model, layers: tuple[int, ...]):
        self.modules, self.layers, self.states, self._handles = decoder_layers(model), tuple(layers), {}, []

    def __enter__(self) -> dict[int, torch.Tensor]:
        n = len(self.modules)
        for L in self.layers:
            if not 0 <= L <= n:
                raise ValueError(f"layer {L}: the model has layers 0..{n}")

            def pre(module, args, kwargs, L=L):
                self.states[L] = args[0] if args else kwargs["hidden_states"]

            def post(module, args, kwargs, out, L=L):
                self.states[L] = out[0] if isinstance(out, tuple) else out

            if L < n:
                self._handles.append(self.modules[L].register_forward_pre_hook(pre, with_kwargs=True))
            else:
                self._handles.append(self.modules[n - 1].register_forward_hook(post, with_kwargs=True))
        return self.states

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()


class HFRunner:
    """Any causal LM through its own modules over the paged cache (slower: see the module docstring).

    Each layer type gets its own mask (``layer_windows``), built for the paged, batched layout: the
    module uses a ready mask as it is, so a sliding window not in the mask would never be applied.
    Models whose layers differ in window take them as a dict keyed by layer type (transformers'
    ``causal_mask_mapping``); a model with one window for every layer takes one mask. Sinks,
    per-layer inputs and shared K/V stay the modules' own. The masks are additive float masks, which
    both attention implementations that take a mask over a given cache (sdpa, eager) accept."""

    kind = "transformers"
    IMPLEMENTATIONS = ("sdpa", "eager")

    def __init__(self, model):
        self.model = model
        c = model.config.get_text_config()
        impl = getattr(c, "_attn_implementation", None) or model.config._attn_implementation or "eager"
        if impl not in self.IMPLEMENTATIONS:
            raise ValueError(f"attention implementation {impl!r}: the transformers forward passes masks over the "
                             f"paged cache, which {' and '.join(self.IMPLEMENTATIONS)} take")
        self.windows = layer_windows(c)
        self.by_type = None  # one mask for every layer
        if len(set(self.windows)) > 1:
            self.by_type = dict(zip(c.layer_types, self.windows))
        self.layers = decoder_layers(model)

    @torch.inference_mode()
    def __call__(self, input_ids, positions, kv, mask, keep: int, capture: tuple[int, ...] = ()):
        B, n = input_ids.shape
        S = kv.S if kv.read_rows is None else kv.read_rows.shape[1]
        if mask is None:
            mask = torch.ones(B, 1, n, S, dtype=torch.bool, device=input_ids.device)
        dtype = self.model.dtype
        keys = torch.arange(S, device=mask.device).view(1, 1, 1, S)
        float_masks = {}
        for w in set(self.windows):  # key t (at position t) is in the window of a query at p when t > p - w
            m = mask if w is None else mask & (keys > positions.view(B, 1, n, 1) - w)
            float_masks[w] = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, torch.finfo(dtype).min)
        attention_mask = ({t: float_masks[w] for t, w in self.by_type.items()} if self.by_type
                          else float_masks[self.windows[0]])
        with capture_states(self.model, capture) as hidden:
            out = self.model(input_ids=input_ids, position_ids=positions, attention_mask=attention_mask,
                             past_key_values=_HFCacheView(kv, S), use_cache=True, logits_to_keep=keep)
        return out.logits, dict(hidden)


def make_runner(model, max_len: int, forward: str = "auto"):
    """The forward for this model: ``compact`` when supported (``auto``), else the model's own modules."""
    why = compact_unsupported(model, max_len)
    if forward in ("compact", "native") and why:
        raise ValueError(f"forward: {forward} does not support this model ({why}); use auto or transformers")
    if forward == "transformers" or why:
        log.info("decoder forward: transformers modules%s", f" ({why})" if why else "")
        return HFRunner(model)
    c = model.config.get_text_config()
    ops = None
    # the native loops compute float32 and bf16 on CPUs; elsewhere (a GPU, float16) the eager compact forward
    not_native = (f"native runs on CPUs only (the model is on {model.device.type})" if model.device.type != "cpu" else
                  f"native computes float32 and bfloat16, not {model.dtype}"
                  if model.dtype not in (torch.float32, torch.bfloat16) else None)
    if forward == "native" and not_native:
        raise ValueError(f"forward: {not_native}; use auto or compact")
    if forward in ("auto", "native") and not not_native:
        from core.native import load, why_unavailable

        ops = load()
        if ops is None and forward == "native":
            raise ValueError(f"forward: native is unavailable here ({why_unavailable()}); use auto or compact")
    runner = NativeLlama(model, max_len, ops) if ops else CompactLlama(model, max_len)
    bf16_rows = " (bf16 copies of the weights up to 8 rows: exact)" if getattr(runner, "bf16_weights", False) else ""
    rows_kernel = "bf16 GEMV" if getattr(runner, "packed", False) else "float32 FMA rows" + bf16_rows
    kernels = [name for name, on in (("AMX tiles", getattr(runner, "amx", False)),
                                     (rows_kernel, getattr(runner, "gemv", False))) if on]
    log.info("decoder forward: %s (%s, %d layers)%s", runner.kind, c.model_type, c.num_hidden_layers,
             f", own matmul kernels: {', '.join(kernels)}" if kernels else "")
    return runner


class EngineModel:
    """What an engine runs: the model in its resolved dtype, its forward, and its paged KV cache.

    ``config`` is a drafter or verifier model config (dtype, kv_cache_dtype, forward, device,
    cache_budget_mb, max_model_len). A module passed in (tests, embedding in another program)
    keeps its own dtype under ``dtype: auto``.
    """

    def __init__(self, config, model=None):
        from core.kv_cache import PagedKVCache
        from core.models import DTYPES, load_causal_lm, resolve_dtype, resolve_kv_dtype

        self.device = torch.device(config.device)
        if model is not None and config.dtype == "auto":
            name = next(k for k, v in DTYPES.items() if v == model.dtype)
        else:
            name = resolve_dtype(config.dtype, self.device)
        self.dtype = DTYPES[name]
        self.model = (model or load_causal_lm(config.model, self.dtype, self.device)).to(
            device=self.device, dtype=self.dtype).eval()
        text = self.model.config.get_text_config()
        self.max_len = config.max_model_len or text.max_position_embeddings
        self.runner = make_runner(self.model, self.max_len, config.forward)
        kv = DTYPES[resolve_kv_dtype(config.kv_cache_dtype, name, self.device)]
        self.cache = PagedKVCache(self.model.config, self.max_len, int(config.cache_budget_mb * 2**20), kv, self.device,
                                  prefix_caching=getattr(config, "prefix_caching", False))
        log.info("engine for %s: %s compute, %s KV cache (%d blocks of %d tokens), %s forward", config.model, name,
                 kv, self.cache.num_blocks, self.cache.block_size, self.runner.kind)
