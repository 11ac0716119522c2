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
import threading
from collections import OrderedDict
from dataclasses import dataclass
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
        # -log(-log u), in place: the same operations, the same values, without four temporaries of [V]
        torch.rand(vocab_size, generator=gen, dtype=torch.float64, out=out[row]).clamp_(min=2.0**-53)
        out[row].log_().neg_().log_().neg_()
    return out


class NoiseCache:
    """``gumbel_noise`` rows by (seed, position), the least recently used dropped past ``budget_bytes``.

    Why: a drafter draws the same positions again and again. A pre-draft tree's branches overlap
    (k = 4, m = 1: 30 draws over 9 positions), and the next step drafts positions the tree drew.
    Drawing that noise is most of what a sampled tree costs over a greedy one, and it grows with the
    vocabulary (docs/decisions/0013-decide-fast-paths.md). The rows are the ones ``gumbel_noise`` draws
    (read-only: callers must not write to them)."""

    def __init__(self, budget_bytes: int = 32 * 2**20):
        self.budget_bytes = budget_bytes
        self._rows: OrderedDict[tuple[int, int, int], torch.Tensor] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # (an engine's thread uses it; the lock only guards misuse)

    def row(self, seed: int, position: int, vocab_size: int) -> torch.Tensor:
        """Gumbel noise [1, V] of (seed, position): ``gumbel_noise(seed, [position], vocab_size)``."""
        key = (seed, position, vocab_size)
        with self._lock:
            x = self._rows.get(key)
            if x is not None:
                self._rows.move_to_end(key)
                return x
        x = gumbel_noise(seed, [position], vocab_size)
        with self._lock:
            if key not in self._rows:
                self._rows[key] = x
                self._bytes += x.numel() * x.element_size()
            while self._bytes > self.budget_bytes and len(self._rows) > 1:
                _, old = self._rows.popitem(last=False)
                self._bytes -= old.numel() * old.element_size()
        return x

    def __len__(self) -> int:
        return len(self._rows)


def perturbed(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """log probs + noise [n, V] (float64): the Gumbel-perturbed scores whose argmax is the draw.

    Their order past the argmax is the drafter's best guess of a coupled verifier's token where the
    target rejects the draft: the target's token is argmax(log p + g) with the same g, so where q is
    close to p it is likeliest the runner-up of log q + g, not of q (what a pre-draft tree branches on)."""
    return probs.double().log() + noise


def gumbel_argmax(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The Gumbel-max trick: argmax(log probs + noise) over rows of probs [n, V] is one draw
    from each row's distribution; tokens of probability 0 are never chosen."""
    return perturbed(probs, noise).argmax(-1)


@dataclass
class History:
    """What the logits processors of a step see: the sequence's tokens through the last fed
    draft (``tokens``), how many of them are the prompt, and the ids min_tokens masks."""

    tokens: list[int]
    num_prompt: int
    stop_ids: frozenset[int] = frozenset()


def apply_processors(logits: torch.Tensor, params: SamplingParams, history: History) -> torch.Tensor:
    """The history-dependent logits processors, in vLLM's order: min_tokens (EOS and stop ids
    masked while the output is short), logit_bias, then the repetition, frequency and presence
    penalties. logits [n, V] predict the n positions after ``history.tokens[:end - n + 1 + i]``:
    row i sees the drafts of rows before it as output, exactly as plain decoding would have."""
    logits = logits.float().clone()  # [n, V]
    n, vocab = logits.shape
    if params.logit_bias:
        ids = torch.tensor([t for t in params.logit_bias if 0 <= t < vocab], dtype=torch.long)
        bias = torch.tensor([b for t, b in params.logit_bias.items() if 0 <= t < vocab])
        logits[:, ids] += bias
    if not params.history_dependent:
        return logits
    tokens = torch.tensor(history.tokens, dtype=torch.long)
    first_out = len(tokens) - (n - 1) - history.num_prompt  # output tokens before row 0
    if params.min_tokens > 0 and history.stop_ids:
        short = first_out + torch.arange(n) < params.min_tokens  # [n]
        stop = torch.tensor(sorted(t for t in history.stop_ids if 0 <= t < vocab), dtype=torch.long)
        logits[short.nonzero().squeeze(-1).unsqueeze(-1), stop] = float("-inf")
    if params.repetition_penalty == 1.0 and params.frequency_penalty == 0.0 and params.presence_penalty == 0.0:
        return logits
    # output counts for each row: row i also counts the drafts fed before it
    out = tokens[history.num_prompt:]  # [m]
    counts = torch.zeros(n, vocab)  # [n, V]
    if first_out > 0:
        counts[0] = torch.bincount(out[:first_out], minlength=vocab)[:vocab].float()
    for i in range(1, n):
        counts[i] = counts[i - 1]
        counts[i, out[first_out + i - 1]] += 1
    if params.repetition_penalty != 1.0:
        seen = counts > 0  # [n, V]
        seen[:, tokens[: history.num_prompt]] = True
        rp = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    return logits


def target_logits(logits: torch.Tensor, params: SamplingParams, history: History | None) -> torch.Tensor:
    """logits [n, V] after the history-dependent processors (unchanged when none applies)."""
    if not params.processed:
        return logits.float()
    if history is None:
        raise ValueError("these sampling parameters need the sequence's history")
    return apply_processors(logits, params, history)


def processed_probs(logits: torch.Tensor, params: SamplingParams, history: History | None = None) -> torch.Tensor:
    """logits [n, V] -> processed probabilities [n, V] (float32): the processors, then
    temperature, min_p, top-k and top-p, the order plain decoding (and vLLM) applies them.

    Greedy (temperature 0) gives a one-hot at the argmax of the processed logits.
    """
    logits = target_logits(logits, params, history)
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if params.min_p > 0.0:
        p = logits.softmax(-1)
        logits = logits.masked_fill(p < params.min_p * p.max(-1, keepdim=True).values, float("-inf"))
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


def inverse_cdf(probs: list[float], u: float) -> int:
    """``sample_inverse_cdf`` of one short row in Python floats: cumulative sums in float64, in order; the first
    index whose sum exceeds u times the total (never an entry of probability 0)."""
    cdf, acc = [], 0.0
    for x in probs:
        acc += x
        cdf.append(acc)
    target = u * acc
    for i, c in enumerate(cdf):
        if c > target:
            return i
    return max((i for i, x in enumerate(probs) if x > 0), default=0)  # (u * total rounded up to the total)


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one token per row of probs [n, V] (unnormalised is fine) using uniforms u [n].

    Returns token ids [n]. The chosen token always has positive probability.
    """
    cdf = probs.double().cumsum(-1)  # [n, V]
    target = (u.double() * cdf[:, -1]).unsqueeze(-1)  # [n, 1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # first index with cdf > target
    if bool((idx >= probs.shape[-1]).any()):  # u * total rounded up to the total: the last entry of probability > 0
        idx = torch.where(idx >= probs.shape[-1], (cdf < cdf[:, -1:]).sum(-1), idx)
    return idx
