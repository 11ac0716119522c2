"""Lossless verification of draft tokens (Leviathan et al. 2023; Chen et al. 2023).

Glossary, for one sequence and one step with k draft tokens x_1..x_k:
- accepted tokens: the longest prefix of the drafts that passes verification;
- recovered token: at the first rejected position, a token drawn from the residual
  norm(max(0, p - q)), which corrects the draft's bias;
- bonus token: when all k drafts are accepted, one extra token drawn from p at
  position k+1, which the verification forward pass computed anyway.
Each step therefore emits between 1 and k+1 tokens.

Acceptance rule: accept x with probability min(1, p(x) / q(x)). A draft without
probabilities (n-gram lookup) has q = one-hot(x): accept with probability p(x), and
the residual is p without x, renormalised. Both keep the emitted tokens distributed
exactly as p.

Coupled (Gumbel-max) verification, the deterministic mode: the target's token at each
position is fixed in advance as argmax(log p + g), with Gumbel noise g keyed by (seed,
position); a draft is accepted while it equals that token, and the first mismatch emits
it (the recovered token), or the bonus position's does. Every emitted token is a draw from
p, and the output does not depend on the drafts at all: only acceptance does. The drafter
draws its proposal with the same noise (argmax(log q + g)) to be accepted often.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from core.protocol import DraftProbs, VerifyRequest, VerifyResult
from core.sampling import (
    History,
    Stream,
    gumbel_argmax,
    gumbel_noise,
    processed_probs,
    sample_inverse_cdf,
    target_logits,
    uniform,
)

PAD = -1  # marks positions after the last emitted token

# The rules, one sequence at a time, position by position until the first rejection: each draws its random
# numbers (Gumbel noise, uniforms) and builds dense q rows only for the positions it reaches. On a whole
# block most of the verification time went to noise for positions after a rejection and to small tensors,
# and the noise grows with the vocabulary (docs/decisions/0013-decide-fast-paths.md). ``decide`` runs
# them with draws keyed by (seed, position); the batched forms below run them row by row with given draws.
# Each returns (the emitted tokens: the accepted drafts, then the recovered or bonus token; drafts accepted).


def accept_greedy(draft: list[int], target: list[int]) -> tuple[list[int], int]:
    """Greedy verification: accept while the draft equals the target's token (target: k+1 argmaxes)."""
    k = len(draft)
    n = next((i for i in range(k) if draft[i] != target[i]), k)
    return target[: n + 1], n  # accepted drafts equal the target's; the next one is the recovered/bonus token


def accept_gumbel(draft: list[int], p: torch.Tensor, noise: Callable[[int], torch.Tensor]) -> tuple[list[int], int]:
    """Coupled verification: the greedy rule applied to the target's Gumbel-max tokens argmax(log p + g).
    p [k+1, V] the target's processed distributions; noise(i): the Gumbel noise [1, V] of draft i's position."""
    out = []
    for i in range(len(draft) + 1):
        out.append(int(gumbel_argmax(p[i: i + 1], noise(i))[0]))
        if i == len(draft) or out[i] != draft[i]:
            return out, i
    raise AssertionError("unreachable")


def accept_rejection(draft: list[int], p: torch.Tensor, q: DraftProbs | torch.Tensor | None,
                     u_accept: Callable[[int], float], u_sample: Callable[[int], float]) -> tuple[list[int], int]:
    """Stochastic verification: accept draft x with probability min(1, p(x) / q(x)), the test u q(x) < p(x)
    in float32; at the first rejection draw from the residual norm(max(0, p - q)) (p itself where it is
    empty, p == q), after k acceptances the bonus token from p[k]. p [k+1, V] float32; q: the drafter's
    distributions (sparse ``DraftProbs`` or dense [k, V]), None for one-hot drafts (n-gram lookup);
    u_accept(i), u_sample(i): the uniforms of draft i's position."""
    for i, x in enumerate(draft):
        if np.float32(u_accept(i)) * np.float32(_q_prob(q, i, x)) < p[i, x].item():  # u < p(x) / q(x)
            continue
        final = _residual(p[i], q, i, x).clamp_min(0.0)  # [V] the residual, unnormalised
        if final.sum() <= 0:  # empty residual (p == q): rejection has probability 0 there; p keeps the draw valid
            final = p[i]
        return draft[:i] + [_draw(final, u_sample(i))], i
    return list(draft) + [_draw(p[len(draft)], u_sample(len(draft)))], len(draft)  # all accepted: the bonus token


def _q_prob(q: DraftProbs | torch.Tensor | None, i: int, x: int) -> float:
    """q_i(x)."""
    if q is None:
        return 1.0
    if isinstance(q, torch.Tensor):
        return q[i, x].item()
    ids = q.ids[i]
    return q.probs[i][ids.index(x)] if x in ids else 0.0  # (a sparse row's ids are distinct)


def _residual(p_i: torch.Tensor, q: DraftProbs | torch.Tensor | None, i: int, x: int) -> torch.Tensor:
    """p_i - q_i [V], unclamped (q_i one-hot at the draft x without probabilities). A sparse q_i is
    subtracted at its own entries only: the same values as p_i - q.dense(V)[i], without the dense row."""
    if isinstance(q, torch.Tensor):
        return p_i - q[i]
    out = p_i.clone()
    if q is None:
        out[x] -= 1.0
    else:
        out[q.ids[i]] -= torch.tensor(q.probs[i], dtype=out.dtype)
    return out


def _draw(dist: torch.Tensor, u: float) -> int:
    """sample_inverse_cdf of one row dist [V] with the uniform u."""
    return int(sample_inverse_cdf(dist.unsqueeze(0), torch.tensor([u], dtype=torch.float64))[0])


# The batched forms: the same rules over B sequences with the draws given as tensors, as the distribution
# tests drive them (tests/test_rejection.py, tests/test_gumbel.py). Each returns (tokens [B, k+1] with PAD
# after the last emitted token, num_accepted [B]).

def greedy_verify(draft: torch.Tensor, target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``accept_greedy`` per row: draft [B, k] token ids; target_argmax [B, k+1] argmax of the target's logits."""
    return _batched(draft, [accept_greedy(d, t) for d, t in zip(draft.tolist(), target_argmax.tolist())])


def rejection_sample(draft: torch.Tensor, q: torch.Tensor | None, p: torch.Tensor, u_accept: torch.Tensor,
                     u_sample: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``accept_rejection`` per row: draft [B, k] drawn from q [B, k, V] (None: one-hot drafts); p [B, k+1, V]
    the target's processed distributions; uniforms u_accept [B, k] for the accept tests, u_sample [B, k+1]
    for the recovered or bonus token."""
    ua, us = u_accept.tolist(), u_sample.tolist()
    return _batched(draft, [accept_rejection(d, p[b], None if q is None else q[b], ua[b].__getitem__, us[b].__getitem__)
                            for b, d in enumerate(draft.tolist())])


def gumbel_verify(draft: torch.Tensor, p: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``accept_gumbel`` per row: draft [B, k]; p [B, k+1, V] the target's processed distributions; noise
    [B, k+1, V] the Gumbel noise of those positions."""
    return _batched(draft, [accept_gumbel(d, p[b], lambda i, b=b: noise[b, i: i + 1])
                            for b, d in enumerate(draft.tolist())])


def _batched(draft: torch.Tensor, rows: list[tuple[list[int], int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's (emitted tokens, accepted) as tokens [B, k+1], PAD after the last emitted, and num_accepted [B]."""
    width = draft.shape[1] + 1
    tokens = torch.tensor([out + [PAD] * (width - len(out)) for out, _ in rows], dtype=torch.long).view(-1, width)
    return tokens, torch.tensor([n for _, n in rows], dtype=torch.long)


def decide(r: VerifyRequest, logits: torch.Tensor, tokens: list[int] | None = None,
           eos_ids: frozenset[int] | set[int] = frozenset()) -> VerifyResult:
    """Accept/reject one sequence's drafts given the target logits [k+1, V] at their positions.
    Backend-independent: any engine that produces these logits verifies the same way.

    ``tokens``: the sequence through its last draft, which the history-dependent processors
    (penalties, min_tokens) read; needed only when the request uses them."""
    history = None
    if r.sampling.processed:
        stop = set(r.sampling.stop_token_ids) | (set() if r.sampling.ignore_eos else set(eos_ids))
        history = History(tokens, r.num_prompt, frozenset(stop))
    if r.sampling.greedy:  # the argmax of the processed logits, compared as lists: no small tensors per sequence
        argmax = target_logits(logits, r.sampling, history).argmax(-1).tolist()
        return _result(r, logits, *accept_greedy(r.draft_tokens, argmax))
    first = (0 if r.full else r.start) + len(r.new_tokens)  # absolute position of draft 1
    p = processed_probs(logits, r.sampling, history)  # [k+1, V]
    V, seed = p.shape[-1], r.seed
    if r.sampling.verification == "gumbel":
        return _result(r, logits, *accept_gumbel(r.draft_tokens, p, lambda i: gumbel_noise(seed, [first + i], V)))
    q = r.draft_probs
    if q is not None and (len(q.ids) < r.k or any(t < 0 or t >= V for row in q.ids[: r.k] for t in row)):
        # (checked whole, so a bad q fails whichever position the drafts are rejected at)
        raise ValueError(f"draft_probs must give q for each of the {r.k} drafts over token ids below {V}")
    return _result(r, logits, *accept_rejection(r.draft_tokens, p, q, lambda i: uniform(seed, first + i, Stream.ACCEPT),
                                                lambda i: uniform(seed, first + i, Stream.SAMPLE)))


def _result(r: VerifyRequest, logits: torch.Tensor, out: list[int], num_accepted: int) -> VerifyResult:
    """The step's result: the emitted tokens ``out`` (the accepted drafts, then the recovered or bonus
    token), with their logprobs (of the raw logits [k+1, V]) when the request asks for them."""
    res = VerifyResult(r.seq_id, tokens=out, num_accepted=num_accepted, num_drafts=r.k)
    if r.logprobs is not None:
        lp = logits[: len(out)].float().log_softmax(-1)  # [emitted, V]
        top = lp.topk(r.logprobs, -1) if r.logprobs > 0 else None
        res.logprobs = [(float(lp[i, t]), list(zip(top.indices[i].tolist(), top.values[i].tolist())) if top else [])
                        for i, t in enumerate(out)]
    return res
