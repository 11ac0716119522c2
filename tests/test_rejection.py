"""The rejection sampler preserves the target distribution; wrong samplers are caught.

The target is a Markov chain over a small vocabulary: p(x_t | x_{t-1}) is a row of
processed target logits, q(x_t | x_{t-1}) a row of (different) processed draft logits.
Many sequences are generated with speculative steps of k drafts until each has k+1
tokens; the token at every position 0..k must then follow the chain's exact marginal.
Those positions are reached by accepted drafts, recovered tokens and bonus tokens alike.
A chi-square goodness-of-fit test with fixed seeds decides (never flaky).
"""

import pytest
import torch
from scipy.stats import chisquare

from configs import SamplingParams
from core.rejection import PAD, greedy_verify, rejection_sample
from core.sampling import Stream, processed_probs, sample_inverse_cdf, uniform

V, K, N = 6, 3, 40_000


def _chain(params: SamplingParams, seed: int):
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(V, V, generator=g) * 1.5
    draft_logits = target_logits + torch.randn(V, V, generator=g) * 1.2  # a drafter that is often wrong
    return processed_probs(target_logits, params), processed_probs(draft_logits, params)  # [V, V] rows


def always_accept(draft, q, p, u_accept, u_sample):
    """A wrong sampler: keeps every draft, then a bonus token from p."""
    B, k = draft.shape
    bonus = sample_inverse_cdf(p[:, k], u_sample[:, k])
    return torch.cat([draft, bonus[:, None]], 1), torch.full((B,), k)


def recover_from_p(draft, q, p, u_accept, u_sample):
    """A wrong sampler: the usual accept test, but the recovered token is drawn from p, not the residual."""
    B, k = draft.shape
    p_d = p[:, :k].gather(-1, draft[..., None])[..., 0]
    q_d = q.gather(-1, draft[..., None])[..., 0]
    rej = ~(u_accept * q_d < p_d)
    n_acc = torch.where(rej.any(1), rej.int().argmax(1), torch.full((B,), k))
    rows = torch.arange(B)
    tok = sample_inverse_cdf(p[rows, n_acc], u_sample[rows, n_acc])
    out = torch.cat([draft, torch.full((B, 1), PAD)], 1)
    out[rows, n_acc] = tok
    cols = torch.arange(k + 1)[None]
    return out.masked_fill(cols > n_acc[:, None], PAD), n_acc


def run_chain(sampler, P, Q, seed: int, n: int = N, k: int = K, one_hot_drafts: bool = False):
    """Speculative generation of k+1 tokens after token 0 for n sequences.
    Returns (tokens [n, k+1], counts of (accepted-all, rejected) steps)."""
    g = torch.Generator().manual_seed(seed)
    seqs = [[0] for _ in range(n)]
    stats = {"bonus": 0, "recovered": 0}
    while True:
        live = [i for i in range(n) if len(seqs[i]) < k + 2]
        if not live:
            break
        last = torch.tensor([seqs[i][-1] for i in live])
        drafts, qs, ps = [], [], []
        prev = last
        for _ in range(k):
            qrow = Q[prev]  # [B, V]
            x = torch.multinomial(qrow, 1, generator=g)[:, 0]
            drafts.append(x), qs.append(qrow), ps.append(P[prev])
            prev = x
        ps.append(P[prev])
        draft = torch.stack(drafts, 1)  # [B, k]
        q = None if one_hot_drafts else torch.stack(qs, 1)  # [B, k, V]
        p = torch.stack(ps, 1)  # [B, k+1, V]
        B = len(live)
        tokens, n_acc = sampler(draft, q, p, torch.rand(B, k, generator=g, dtype=torch.float64),
                                torch.rand(B, k + 1, generator=g, dtype=torch.float64))
        stats["bonus"] += int((n_acc == k).sum())
        stats["recovered"] += int((n_acc < k).sum())
        for row, i in enumerate(live):
            seqs[i].extend(t for t in tokens[row].tolist() if t != PAD)
    return torch.tensor([s[1:k + 2] for s in seqs]), stats


def marginals(P, k: int = K):
    """Exact distribution of the token at positions 1..k+1 of the chain started at token 0."""
    m = torch.nn.functional.one_hot(torch.tensor(0), V).double()
    out = []
    for _ in range(k + 1):
        m = m @ P.double()
        out.append(m)
    return out


def min_p_value(tokens, P, k: int = K) -> float:
    return min_p_value_of(tokens, marginals(P, k))


def min_p_value_of(tokens, expected_marginals) -> float:
    """Smallest chi-square p-value over positions: tokens [n, positions] against each position's
    exact distribution; a token of probability 0 emitted anywhere fails at once."""
    pvals = []
    for j, expected in enumerate(expected_marginals):
        observed = torch.bincount(tokens[:, j], minlength=len(expected)).double()
        support = expected > 0
        assert observed[~support].sum() == 0, f"position {j}: a token the target can never emit was emitted"
        exp = expected[support] / expected[support].sum() * len(tokens)
        pvals.append(chisquare(observed[support].numpy(), exp.numpy()).pvalue)
    return min(pvals)


PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)]


@pytest.mark.heavy  # 40,000 sequences through the per-sequence rule: several seconds each
@pytest.mark.parametrize("params", PARAMS, ids=["t1.0", "t0.7-top_p0.9"])
@pytest.mark.parametrize("one_hot", [False, True], ids=["model-q", "ngram-one-hot"])
def test_rejection_sampler_preserves_target_distribution(params, one_hot):
    P, Q = _chain(params, seed=1)
    tokens, stats = run_chain(rejection_sample, P, Q, seed=2, one_hot_drafts=one_hot)
    # all three ways of emitting a token were exercised
    assert stats["bonus"] > 1000 and stats["recovered"] > 1000, stats
    assert min_p_value(tokens, P) > 1e-3


@pytest.mark.parametrize("wrong", [always_accept, recover_from_p])
def test_wrong_samplers_are_caught(wrong):
    P, Q = _chain(SamplingParams(temperature=1.0), seed=1)
    tokens, _ = run_chain(wrong, P, Q, seed=2)
    assert min_p_value(tokens, P) < 1e-6


def test_greedy_path_accepts_prefix_then_argmax():
    draft = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 2, 3]])
    argmax = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [4, 2, 3, 8]])
    tokens, n_acc = greedy_verify(draft, argmax)
    assert n_acc.tolist() == [3, 1, 0]
    assert tokens.tolist() == [[5, 6, 7, 8], [5, 6, PAD, PAD], [4, PAD, PAD, PAD]]


def test_decide_greedy_fast_path_is_greedy_verify():
    """``decide`` compares a greedy request's drafts with the target's argmax as lists; it must emit
    what ``greedy_verify`` does: every k from 0, drafts right, wrong at each position, tied logits
    (the first maximal index), bf16 logits, and with logprobs."""
    from core.protocol import VerifyRequest
    from core.rejection import decide

    g = torch.Generator().manual_seed(0)
    for k in range(0, 6):
        for case in range(12):
            logits = torch.randn(k + 1, 20, generator=g)
            if case % 3 == 0:
                logits[:, 7] = logits[:, 3] = logits.max() + 1  # exact ties: 3 is the argmax
            if case % 4 == 1:
                logits = logits.bfloat16()
            target = logits.float().argmax(-1)
            draft = target[:k].clone()
            if case % 2 and k:
                draft[case % k] = (draft[case % k] + 1) % 20  # wrong from there on
            r = VerifyRequest("s", 5, "h", [1], draft.tolist(), SamplingParams(temperature=0), 0,
                              logprobs=2 if case == 5 else None)
            res = decide(r, logits)
            tokens, n_acc = greedy_verify(draft.unsqueeze(0), target.unsqueeze(0))
            assert res.tokens == [t for t in tokens[0].tolist() if t != PAD] and res.num_accepted == int(n_acc[0])
            assert res.num_drafts == k and (res.logprobs is None) == (case != 5)


@pytest.mark.parametrize("verification", ["rejection", "gumbel"])
def test_decide_sampled_position_by_position_is_the_batched_rule(verification):
    """``decide`` verifies a sampled request with draws keyed by (seed, position), made only for the
    positions it reaches; it must emit exactly what the batched forms (``rejection_sample``,
    ``gumbel_verify``, which the distribution tests check) emit with every position's draws given: every k
    from 0, drafts the target likes and dislikes, sparse q, one-hot q (no probabilities), q equal to p
    (an empty residual), top-k and top-p zeros in p, and a resent whole sequence (``full``)."""
    from core.protocol import DraftProbs, VerifyRequest
    from core.rejection import decide, gumbel_verify
    from core.sampling import gumbel_noise, uniforms

    g = torch.Generator().manual_seed(3)
    vocab, checked, accepted = 12, 0, 0
    for k in range(0, 6):
        for case in range(40):
            params = SamplingParams(temperature=[0.7, 1.0, 1.3][case % 3], top_k=6 if case % 5 == 1 else 0,
                                    top_p=0.8 if case % 5 == 2 else 1.0, verification=verification)
            logits = torch.randn(k + 1, vocab, generator=g) * 2
            p = processed_probs(logits, params)  # [k+1, V]
            # drafts: the target's likeliest token at some positions (so some are accepted), any token at others
            draft = [int(p[i].argmax()) if torch.rand(1, generator=g) < 0.6
                     else int(torch.randint(0, vocab, (1,), generator=g)) for i in range(k)]
            if case % 4 == 0:
                q = None  # one-hot drafts
            elif case % 4 == 1:  # q == p at every position: a rejection leaves an empty residual
                q = DraftProbs([list(range(vocab))] * k, [p[i].tolist() for i in range(k)])
            else:  # sparse q over a few ids, the draft among them
                ids = [sorted({draft[i], *torch.randperm(vocab, generator=g)[:3].tolist()}) for i in range(k)]
                w = [torch.rand(len(row), generator=g) + 0.05 for row in ids]
                q = DraftProbs(ids, [(x / x.sum()).tolist() for x in w])
            seed, full = 1000 + case, case % 7 == 3
            r = VerifyRequest("s", 0 if full else 30, None if full else "h", list(range(33 if full else 3)), draft,
                              params, seed, draft_probs=q, full=full)
            first = 33
            res = decide(r, logits)
            d = torch.tensor([draft], dtype=torch.long).view(1, k)
            if verification == "gumbel":
                noise = gumbel_noise(seed, range(first, first + k + 1), vocab).unsqueeze(0)
                tokens, n_acc = gumbel_verify(d, p.unsqueeze(0), noise)
            else:
                q_dense = q.dense(vocab).unsqueeze(0) if q is not None else None
                accept = uniforms(seed, range(first, first + k), Stream.ACCEPT).unsqueeze(0)
                sample = uniforms(seed, range(first, first + k + 1), Stream.SAMPLE).unsqueeze(0)
                tokens, n_acc = rejection_sample(d, q_dense, p.unsqueeze(0), accept, sample)
            assert res.tokens == [t for t in tokens[0].tolist() if t != PAD], (k, case)
            assert res.num_accepted == int(n_acc[0]) and res.num_drafts == k, (k, case)
            checked += 1
            accepted += res.num_accepted
    assert checked == 240 and accepted > 60  # many drafts accepted (of 600), many rejected


def test_greedy_equals_stochastic_path_at_temperature_zero():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 3 + 1, 50, generator=g)
    p = processed_probs(logits.view(-1, 50), SamplingParams(temperature=0)).view(4, 4, 50)
    draft = torch.stack([logits[:, 0].argmax(-1), torch.randint(0, 50, (4,), generator=g),
                         logits[:, 2].argmax(-1)], 1)
    a = greedy_verify(draft, logits.argmax(-1))
    b = rejection_sample(draft, None, p, torch.rand(4, 3, dtype=torch.float64, generator=g),
                         torch.rand(4, 4, dtype=torch.float64, generator=g))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_processed_probs_top_k_top_p():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and torch.allclose(p.sum(), torch.tensor(1.0))
    full = logits.softmax(-1)[0]
    p = processed_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    kept = int((p[0] > 0).sum())
    assert full[: kept - 1].sum() < 0.7 <= full[:kept].sum()  # smallest prefix reaching top_p
    assert torch.equal(processed_probs(logits, SamplingParams(temperature=0))[0], torch.tensor([1.0, 0, 0, 0, 0]))


def test_uniforms_depend_only_on_seed_position_stream():
    assert uniform(7, 3, Stream.ACCEPT) == uniform(7, 3, Stream.ACCEPT)
    draws = {uniform(7, 3, Stream.ACCEPT), uniform(7, 4, Stream.ACCEPT), uniform(8, 3, Stream.ACCEPT),
             uniform(7, 3, Stream.SAMPLE), uniform(7, 3, Stream.DRAFT)}
    assert len(draws) == 5 and all(0 <= u < 1 for u in draws)
    # and they look uniform
    us = torch.tensor([uniform(1, i, Stream.SAMPLE) for i in range(20000)])
    assert chisquare(torch.histc(us, 10, 0, 1).numpy()).pvalue > 1e-3
