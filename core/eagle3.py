"""EAGLE-3 draft heads: the reference forward and the Speculators format (vLLM loads the same files).

Glossary (Li et al., EAGLE-3; names as in the ``speculators`` library and vLLM):
- aux states g_t: the target's residual stream entering decoder layers ``aux_layer_ids`` at
  position t (vLLM's layer id L; transformers' ``hidden_states[L]``, index 0 the embeddings),
  concatenated: [3 * target_hidden];
- ``fc``: projects g_t to the head's width H;
- the head: one decoder layer whose attention reads cat(input_layernorm(embed(x_{t+1})),
  hidden_norm(h_t)) [2H], where h_t is fc(g_t) on the first draft step and the head's own output
  (its residual stream before the final norm) on later steps;
- draft vocabulary: the ``draft_vocab_size`` most frequent target tokens; ``d2t[i]`` is the offset
  from draft id i to its target id (target = i + d2t[i]); ``t2d`` marks target ids in it.

Position t of the head pairs token x_{t+1} with state h_t and predicts x_{t+2}: after the verifier
has states for x_0..x_n and chose x_{n+1}, the first draft step runs positions up to n, later draft
steps positions n+1, n+2, ... . ``EagleHead.draft`` does this from scratch for one sequence (the
reference the pipeline's evaluation uses); the training loop calls ``layer`` with TTT masks.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

SPECULATORS_VERSION = "0.3.0"


def default_aux_layers(num_layers: int) -> list[int]:
    """vLLM's and speculators' default for an N-layer target: (2, N // 2, N - 3)."""
    return sorted({2, num_layers // 2, num_layers - 3})


@dataclass
class Eagle3Spec:
    """The head's shape and flags, as read from (and written to) a Speculators config.json."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: list[int]
    norm_before_residual: bool = True

    @classmethod
    def from_config(cls, cfg: dict) -> "Eagle3Spec":
        if cfg.get("speculators_model_type") != "eagle3":
            raise ValueError(f"not a Speculators eagle3 config (speculators_model_type {cfg.get('speculators_model_type')!r})")
        for flag in ("norm_before_fc", "fc_norm", "norm_output"):
            if cfg.get(flag):
                raise ValueError(f"{flag}: true is not supported by this reference implementation")
        t = cfg["transformer_layer_config"]
        rope = t.get("rope_parameters") or {"rope_theta": t.get("rope_theta", 10000.0), "rope_type": "default"}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"rope_type {rope.get('rope_type')!r} is not supported by this reference implementation")
        heads = t["num_attention_heads"]
        return cls(hidden_size=t["hidden_size"], num_attention_heads=heads,
                   num_key_value_heads=t.get("num_key_value_heads") or heads,
                   head_dim=t.get("head_dim") or t["hidden_size"] // heads, intermediate_size=t["intermediate_size"],
                   rms_norm_eps=t.get("rms_norm_eps", 1e-6), rope_theta=rope["rope_theta"],
                   max_position_embeddings=t["max_position_embeddings"], vocab_size=t["vocab_size"],
                   draft_vocab_size=cfg.get("draft_vocab_size") or t["vocab_size"],
                   target_hidden_size=cfg.get("target_hidden_size") or t["hidden_size"],
                   aux_layer_ids=list(cfg["eagle_aux_hidden_state_layer_ids"]),
                   norm_before_residual=cfg.get("norm_before_residual", True))

    def to_config(self, verifier_path: str, verifier_arch: list[str], k: int = 4) -> dict:
        layer = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": self.hidden_size,
                 "intermediate_size": self.intermediate_size, "num_attention_heads": self.num_attention_heads,
                 "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim, "num_hidden_layers": 1,
                 "rms_norm_eps": self.rms_norm_eps, "vocab_size": self.vocab_size,
                 "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
                 "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
                 "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"}}
        return {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": k, "verifier_accept_k": 1,
                                      "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": verifier_path, "architectures": verifier_arch}},
            "transformer_layer_config": layer, "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size, "eagle_aux_hidden_state_layer_ids": self.aux_layer_ids,
            # written always: vLLM defaults norm_before_residual to true when absent, speculators to false
            "norm_before_residual": self.norm_before_residual, "norm_before_fc": False, "fc_norm": False,
            "norm_output": False, "embed_requires_grad": False,
        }


class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class EagleHead(nn.Module):
    """The head's modules under the Speculators weight names (``layers.0.*``, ``fc``, ``norm``, ...)."""

    def __init__(self, spec: Eagle3Spec):
        super().__init__()
        self.spec = s = spec
        H, D = s.hidden_size, s.head_dim
        self.embed_tokens = nn.Embedding(s.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.fc = nn.Linear(len(s.aux_layer_ids) * s.target_hidden_size, H, bias=False)
        layer = nn.Module()
        layer.input_layernorm = RMSNorm(H, s.rms_norm_eps)
        layer.hidden_norm = RMSNorm(H, s.rms_norm_eps)
        layer.post_attention_layernorm = RMSNorm(H, s.rms_norm_eps)
        attn = layer.self_attn = nn.Module()
        attn.q_proj = nn.Linear(2 * H, s.num_attention_heads * D, bias=False)
        attn.k_proj = nn.Linear(2 * H, s.num_key_value_heads * D, bias=False)
        attn.v_proj = nn.Linear(2 * H, s.num_key_value_heads * D, bias=False)
        attn.o_proj = nn.Linear(s.num_attention_heads * D, H, bias=False)
        mlp = layer.mlp = nn.Module()
        mlp.gate_proj = nn.Linear(H, s.intermediate_size, bias=False)
        mlp.up_proj = nn.Linear(H, s.intermediate_size, bias=False)
        mlp.down_proj = nn.Linear(s.intermediate_size, H, bias=False)
        self.layers = nn.ModuleList([layer])
        self.norm = RMSNorm(H, s.rms_norm_eps)
        self.lm_head = nn.Linear(H, s.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(s.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(s.vocab_size, dtype=torch.bool))
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        self.register_buffer("inv_freq", inv, persistent=False)

    # ------------------------------------------------------------------ pieces
    def rope(self, positions: torch.Tensor):
        """cos, sin [B, T, D] for positions [B, T] (the default rotary embedding, as Llama's)."""
        f = positions.float().unsqueeze(-1) * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((f, f), dim=-1)
        return emb.cos(), emb.sin()

    def layer_input(self, ids: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layer's input cat(input_layernorm(embed(ids)), hidden_norm(h)) [B, T, 2H] and its
        residual stream [B, T, H] (normalised h or raw h, per ``norm_before_residual``)."""
        s, L = self.spec, self.layers[0]
        emb = L.input_layernorm(self.embed_tokens(ids))
        if s.norm_before_residual:
            h = L.hidden_norm(h)
            residual = h
        else:
            residual, h = h, L.hidden_norm(h)
        return torch.cat([emb, h], dim=-1), residual

    def layer(self, ids: torch.Tensor, h: torch.Tensor, positions: torch.Tensor, past: list, mask: torch.Tensor):
        """One pass of the head's decoder layer. ids, positions [B, T]; h [B, T, H] (fc output or the
        head's own previous output); past: (K, V) of earlier passes, [B, kv, S', D] each, extended in
        place; mask [T, S' + T] bool (True: attend). Returns (logits over the draft vocabulary
        [B, T, draft_vocab], the residual stream before the final norm [B, T, H])."""
        s, L = self.spec, self.layers[0]
        B, T = ids.shape
        D, nh, nkv = s.head_dim, s.num_attention_heads, s.num_key_value_heads
        x, residual = self.layer_input(ids, h)  # [B, T, 2H], [B, T, H]
        a = L.self_attn
        q = a.q_proj(x).view(B, T, nh, D).transpose(1, 2)  # [B, nh, T, D]
        k = a.k_proj(x).view(B, T, nkv, D).transpose(1, 2)
        v = a.v_proj(x).view(B, T, nkv, D).transpose(1, 2)
        cos, sin = (c.unsqueeze(1).to(q.dtype) for c in self.rope(positions))  # [B, 1, T, D]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        past.append((k, v))
        K = torch.cat([kv[0] for kv in past], dim=2)
        V = torch.cat([kv[1] for kv in past], dim=2)
        o = F.scaled_dot_product_attention(q, K, V, attn_mask=mask, enable_gqa=nkv != nh)  # [B, nh, T, D]
        h = residual + a.o_proj(o.transpose(1, 2).reshape(B, T, nh * D))
        m = L.mlp
        h = h + m.down_proj(F.silu(m.gate_proj(L.post_attention_layernorm(h))) * m.up_proj(L.post_attention_layernorm(h)))
        return self.lm_head(self.norm(h)), h

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., Vd] -> target-vocabulary logits [..., V], -inf outside the
        draft vocabulary (so q is exact over the target's vocabulary: zero there)."""
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.spec.vocab_size), float("-inf"))
        out[..., self.to_target(torch.arange(self.spec.draft_vocab_size, device=draft_logits.device))] = draft_logits
        return out

    # ------------------------------------------------------------------ reference drafting
    @torch.no_grad()
    def draft(self, tokens: list[int], aux: torch.Tensor, k: int, return_logits: bool = False):
        """Greedy drafts after ``tokens`` (x_0..x_n+1, the last one chosen by the verifier and
        without a state yet) from the target's aux states ``aux`` [n+1, 3 * target_hidden] (one
        per token before it). Recomputes the whole prefix: the slow, obvious reference.
        With ``return_logits``, also each draft step's draft-vocabulary logits [k, draft_vocab]."""
        n1 = len(tokens) - 1  # positions 0..n: pairs (x_{t+1}, g_t)
        assert aux.shape[0] == n1, (aux.shape, n1)
        dev = aux.device
        ids = torch.tensor([tokens[1:]], device=dev)
        pos = torch.arange(n1, device=dev).unsqueeze(0)
        h = self.fc(aux.unsqueeze(0).to(self.fc.weight.dtype))
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
            S = sum(kv[0].shape[2] for kv in past)
            logits, out = self.layer(torch.tensor([[tok]], device=dev), out[:, -1:], torch.tensor([[n1 + i]], device=dev),
                                     past, torch.ones(1, S + 1, dtype=torch.bool, device=dev))
        return (drafts, torch.stack(rows)) if return_logits else drafts


def aux_states(target, input_ids: torch.Tensor, layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's aux states [B, T, len(ids) * hidden] and logits [B, T, V] in one forward pass."""
    out = target(input_ids=input_ids, output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in layer_ids], dim=-1), out.logits


def load_head(path: str | Path, dtype=torch.float32, device="cpu") -> EagleHead:
    from safetensors.torch import load_file

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    head = EagleHead(Eagle3Spec.from_config(cfg))
    state = load_file(str(path / "model.safetensors"))
    missing, unexpected = head.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"d2t", "t2d"}:
        raise ValueError(f"{path}: weights do not match the head (missing {missing}, unexpected {unexpected})")
    return head.to(device=device, dtype=dtype).eval()


def save_head(head: EagleHead, path: str | Path, config: dict, dtype=torch.bfloat16) -> None:
    """config.json plus model.safetensors in the Speculators layout (d2t/t2d only with a smaller
    draft vocabulary: vLLM refuses d2t when the vocabularies are equal)."""
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
