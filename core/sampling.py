"""Processed distributions and request-keyed random numbers.

p and q are *processed* distributions: temperature, then top-k, then top-p applied
to the logits, exactly as plain decoding would apply them. Speculation is lossless
only if verifier and drafter process logits by the same rule.

Random numbers are keyed by (seed, position, stream) through a hash, not drawn from a
shared generator: a request's draws never depend on what else is in the batch, on
which replica serves it, or on how many draws an earlier step consumed. Every draw
that decides an emitted token is used once, so the draws stay independent.
"""

from __future__ import annotations

import hashlib
import struct
from enum import IntEnum
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pydantic stays out of engine-level imports
    from configs import SamplingParams


class Stream(IntEnum):
    """Independent random streams per position."""

    ACCEPT = 1  # the accept/reject test of a draft token
    SAMPLE = 2  # drawing a recovered, bonus or plain-decoding token from the target
    DRAFT = 3  # the drafter drawing its proposal from q
    GUMBEL = 4  # the Gumbel noise vector of a position (coupled verification)


def uniform(seed: int, position: int, stream: Stream) -> float:
    """A uniform draw in [0, 1) determined by (seed, position, stream) alone."""
    digest = hashlib.blake2b(struct.pack("<QqB", seed, position, stream), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) * 2.0**-53


def uniforms(seed: int, positions: range | list[int], stream: Stream) -> torch.Tensor:
    return torch.tensor([uniform(seed, p, stream) for p in positions], dtype=torch.float64)


def gumbel_noise(seed: int, positions: range | list[int], vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise [n, V] for each position, determined by (seed, position) alone.

    Drawn on the CPU from a generator seeded per position, so every replica and device
    produces the same vector (the drafter and the verifier must see the same noise).
    """
    out = torch.empty(len(positions), vocab_size, dtype=torch.float64)
    gen = torch.Generator()
    for row, pos in enumerate(positions):
        digest = hashlib.blake2b(struct.pack("<QqB", seed, pos, Stream.GUMBEL), digest_size=8).digest()
        gen.manual_seed(int.from_bytes(digest, "little") >> 1)
        u = torch.rand(vocab_size, generator=gen, dtype=torch.float64).clamp_(min=2.0**-53)
        out[row] = -torch.log(-torch.log(u))
    return out


def gumbel_argmax(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The Gumbel-max trick: argmax(log probs + noise) over rows of probs [n, V] is one draw
    from each row's distribution; tokens of probability 0 are never chosen."""
    return (probs.double().log() + noise).argmax(-1)


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [n, V] -> processed probabilities [n, V] (float32).

    Greedy (temperature 0) gives a one-hot at the argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(-1, descending=True)
        # drop a token when the mass strictly before it already reaches top_p
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one token per row of probs [n, V] (unnormalised is fine) using uniforms u [n].

    Returns token ids [n]. The chosen token always has positive probability.
    """
    cdf = probs.double().cumsum(-1)  # [n, V]
    target = (u.double() * cdf[:, -1]).unsqueeze(-1)  # [n, 1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # first index with cdf > target
    return idx.clamp_max(probs.shape[-1] - 1)
