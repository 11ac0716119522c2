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

import torch

from verifier.sampling import gumbel_argmax, sample_inverse_cdf

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
