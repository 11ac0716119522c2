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

import numpy as np
import torch

from core.protocol import DraftProbs, VerifyRequest, VerifyResult
from core.sampling import History, Stream, gumbel_argmax, gumbel_noise, processed_probs, sample_inverse_cdf, target_logits, uniform

PAD = -1  # marks positions after the last emitted token


def greedy_verify(draft: torch.Tensor, target_argmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy fast path: accept while the draft equals the target's argmax.

    draft [B, k] token ids; target_argmax [B, k+1] argmax of the target's logits.
    Returns (tokens [B, k+1] with PAD after the last emitted token, num_accepted [B]).
    """
    B, k = draft.shape
    mismatch = draft != target_argmax[:, :k]  # [B, k]
    num_accepted = _first_true_or(mismatch, k)  # [B]
    tokens = target_argmax.clone()  # accepted drafts equal the argmax; the next one is the recovered/bonus token
    return _pad_after(tokens, num_accepted), num_accepted


def rejection_sample(
    draft: torch.Tensor,
    q: torch.Tensor | None,
    p: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stochastic verification.

    draft    [B, k]      draft token ids, drawn from q
    q        [B, k, V]   drafter's processed distributions, or None for one-hot drafts
    p        [B, k+1, V] target's processed distributions (position k+1 for the bonus token)
    u_accept [B, k]      uniforms for the accept tests
    u_sample [B, k+1]    uniforms for drawing the recovered or bonus token
    Returns (tokens [B, k+1] with PAD after the last emitted token, num_accepted [B]).
    """
    B, k = draft.shape
    p_draft = p[:, :k].gather(-1, draft.unsqueeze(-1)).squeeze(-1)  # [B, k] p(x_i)
    if q is None:
        q = torch.nn.functional.one_hot(draft, p.shape[-1]).to(p.dtype)  # [B, k, V]
    q_draft = q.gather(-1, draft.unsqueeze(-1)).squeeze(-1)  # [B, k] q(x_i) > 0
    accepted = u_accept.to(p.dtype) * q_draft < p_draft  # [B, k] u < p/q without dividing
    num_accepted = _first_true_or(~accepted, k)  # [B]

    residual = (p[:, :k] - q).clamp_min(0.0)  # [B, k, V] unnormalised norm(max(0, p - q))
    final_dists = torch.cat([residual, p[:, k:]], dim=1)  # [B, k+1, V]
    rows = torch.arange(B)
    final_dist = final_dists[rows, num_accepted]  # [B, V] residual at the rejection, or p for the bonus
    # Rejection has probability 0 where the residual is empty (p <= q everywhere means p == q);
    # fall back to p there so float round-off can never yield an invalid token.
    empty = final_dist.sum(-1) <= 0
    if empty.any():
        final_dist[empty] = p[rows, num_accepted][empty]
    final_token = sample_inverse_cdf(final_dist, u_sample[rows, num_accepted])  # [B]

    tokens = torch.cat([draft, torch.full((B, 1), PAD, dtype=draft.dtype)], dim=1)  # [B, k+1]
    tokens[rows, num_accepted] = final_token
    return _pad_after(tokens, num_accepted), num_accepted


def gumbel_verify(draft: torch.Tensor, p: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Coupled verification: the greedy rule applied to the target's Gumbel-max tokens.

    draft [B, k] draft token ids; p [B, k+1, V] target's processed distributions;
    noise [B, k+1, V] Gumbel noise of those positions.
    Returns (tokens [B, k+1] with PAD after the last emitted token, num_accepted [B]).
    """
    B, k1, V = p.shape
    target = gumbel_argmax(p.reshape(B * k1, V), noise.reshape(B * k1, V)).reshape(B, k1)  # [B, k+1]
    return greedy_verify(draft, target)


def _first_true_or(mask: torch.Tensor, default: int) -> torch.Tensor:
    """Index of the first True per row of mask [B, k], or default where none is."""
    if mask.shape[-1] == 0:  # k = 0: nothing to accept
        return torch.full(mask.shape[:-1], default, dtype=torch.long)
    first = mask.int().argmax(-1)
    return torch.where(mask.any(-1), first, torch.full_like(first, default))


def _pad_after(tokens: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """Keep tokens [B, k+1] up to and including index num_accepted, PAD after it."""
    cols = torch.arange(tokens.shape[1])
    return tokens.masked_fill(cols.unsqueeze(0) > num_accepted.unsqueeze(1), PAD)


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
    if r.sampling.greedy and history is None:  # greedy_verify's rule on lists: no small tensors per sequence
        target = target_logits(logits, r.sampling, None).argmax(-1).tolist()  # [k+1] the target's tokens
        k = len(r.draft_tokens)
        n = next((i for i in range(k) if r.draft_tokens[i] != target[i]), k)  # drafts accepted
        return _result(r, logits, target[: n + 1], n)
    if r.sampling.greedy:  # argmax of the processed logits
        draft = torch.tensor([r.draft_tokens], dtype=torch.long)  # [1, k]
        tokens, n_acc = greedy_verify(draft, target_logits(logits, r.sampling, history).argmax(-1).unsqueeze(0))
        return _result(r, logits, [t for t in tokens[0].tolist() if t != PAD], int(n_acc[0]))
    first = (0 if r.full else r.start) + len(r.new_tokens)  # absolute position of draft 1
    p = processed_probs(logits, r.sampling, history)  # [k+1, V]
    if r.sampling.verification == "gumbel":
        return _result(r, logits, *_gumbel_by_position(r, p, first))
    return _result(r, logits, *_rejection_by_position(r, p, first))


# One sequence's sampled verification, position by position until the first rejection: the rules of
# gumbel_verify and rejection_sample (the batched definitions, which tests hold these to, exactly), with
# the random numbers, Gumbel noise and dense q rows computed only for the positions reached. On the whole
# block most of decide's time went to noise for positions after a rejection and to small tensors, and the
# noise grows with the vocabulary (docs/decisions/0013-decide-fast-paths.md).

def _gumbel_by_position(r: VerifyRequest, p: torch.Tensor, first: int) -> tuple[list[int], int]:
    """gumbel_verify for one sequence: p [k+1, V]; draft i sits at position first + i."""
    out = []
    for i in range(r.k + 1):
        noise = gumbel_noise(r.seed, [first + i], p.shape[-1])  # [1, V] the same row gumbel_noise draws in a block
        out.append(int(gumbel_argmax(p[i: i + 1], noise)[0]))
        if i == r.k or out[i] != r.draft_tokens[i]:
            return out, i
    raise AssertionError("unreachable")


def _rejection_by_position(r: VerifyRequest, p: torch.Tensor, first: int) -> tuple[list[int], int]:
    """rejection_sample for one sequence: p [k+1, V] float32; draft i sits at position first + i, q is
    ``r.draft_probs`` (sparse rows) or one-hot. The accept test is rejection_sample's, in float32."""
    V, q = p.shape[-1], r.draft_probs
    if q is not None and (len(q.ids) < r.k or any(t < 0 or t >= V for row in q.ids[: r.k] for t in row)):
        # (checked whole, so a bad q fails whichever position the drafts are rejected at)
        raise ValueError(f"draft_probs must give q for each of the {r.k} drafts over token ids below {V}")
    for i, x in enumerate(r.draft_tokens):
        q_x = 1.0 if q is None else next((pr for t, pr in zip(q.ids[i], q.probs[i]) if t == x), 0.0)
        u = uniform(r.seed, first + i, Stream.ACCEPT)
        if np.float32(u) * np.float32(q_x) < p[i, x].item():  # u < p(x) / q(x), in p's float32
            continue
        if q is None:
            q_row = torch.zeros(V)  # [V] one-hot, as rejection_sample's q
            q_row[x] = 1.0
        else:
            q_row = DraftProbs(q.ids[i: i + 1], q.probs[i: i + 1]).dense(V)[0]  # [V] row i of q.dense(V)
        final = (p[i] - q_row).clamp_min(0.0)  # [V] the residual norm(max(0, p - q)), unnormalised
        if final.sum() <= 0:  # empty residual (p == q): p itself, as rejection_sample falls back
            final = p[i]
        return r.draft_tokens[:i] + [_draw(final, r.seed, first + i)], i
    return list(r.draft_tokens) + [_draw(p[r.k], r.seed, first + r.k)], r.k  # all accepted: the bonus token


def _draw(dist: torch.Tensor, seed: int, position: int) -> int:
    """sample_inverse_cdf of one row dist [V] with the position's SAMPLE uniform."""
    u = torch.tensor([uniform(seed, position, Stream.SAMPLE)], dtype=torch.float64)  # [1]
    return int(sample_inverse_cdf(dist.unsqueeze(0), u)[0])


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
