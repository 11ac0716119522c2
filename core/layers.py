"""The pieces every decoder here shares: RMSNorm and the rotary embedding.

The target's compact forward (``core.llama``), the EAGLE-3 head (``core.eagle3``) and the parallel
drafter's heads compute them through these functions, so a fix or a faster form lands in all of them.
Both compute what Hugging Face's Llama modules and vLLM compute, to the bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Llama RMSNorm: x normalised in float32 and rounded to x's dtype, then scaled by the weight.

    ``F.rms_norm`` computes a bf16 or float16 input in float32 and rounds once, so it equals
    ``rms_norm(x.float()).to(x.dtype)`` bit for bit without the float32 copy of x."""
    return F.rms_norm(x, (x.shape[-1],), eps=eps) * weight


class RMSNorm(nn.Module):
    """``rms_norm`` as a module with its weight (the checkpoints' ``*.weight`` names)."""

    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """The sine table as ``rotate`` takes it, from the plain one (Hugging Face's, the native kernels'):
    the first half of the last dimension negated. Its own inverse: a signed table back to a plain one."""
    h = sin.shape[-1] // 2
    return torch.cat([-sin[..., :h], sin[..., h:]], dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding in Llama's half-split form, x * cos + rotate_half(x) * plain_sin, with ``sin``
    signed (``signed_sin``): rotate_half(x) * plain_sin is roll(x, D/2) * signed_sin exactly (a negation
    moved from x to the table), one roll where rotate_half takes a slice, a negation and a concatenation."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def attention(width: int, heads: int, kv_heads: int, head_dim: int, hidden: int,
              qk_norm_eps: float | None = None) -> nn.Module:
    """A decoder layer's attention projections under the checkpoints' names (``q_proj``, ``k_proj``, ``v_proj``,
    ``o_proj``, no biases) from an input ``width`` wide, with Qwen3's per-head ``q_norm`` and ``k_norm`` where
    ``qk_norm_eps`` is given. The weights are made in that order (a seeded initialisation depends on it)."""
    a = nn.Module()
    a.q_proj = nn.Linear(width, heads * head_dim, bias=False)
    a.k_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
    a.v_proj = nn.Linear(width, kv_heads * head_dim, bias=False)
    a.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
    if qk_norm_eps is not None:
        a.q_norm = RMSNorm(head_dim, qk_norm_eps)
        a.k_norm = RMSNorm(head_dim, qk_norm_eps)
    return a


def mlp(hidden: int, intermediate: int) -> nn.Module:
    """A decoder layer's SwiGLU MLP under the checkpoints' names (``gate_proj``, ``up_proj``, ``down_proj``,
    no biases)."""
    m = nn.Module()
    m.gate_proj = nn.Linear(hidden, intermediate, bias=False)
    m.up_proj = nn.Linear(hidden, intermediate, bias=False)
    m.down_proj = nn.Linear(intermediate, hidden, bias=False)
    return m
