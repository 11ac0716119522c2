"""Coupled (Gumbel-max) verification: exactly the target's distribution, and an output that
does not depend on the drafts.

Same Markov-chain target as tests/test_rejection.py. Sequence i uses seed i; the token at
position t is argmax(log p + g(i, t)). The marginals of positions 1..k+1 and the joint
distribution of positions (1, 2) are tested (the joint catches noise reused across
positions, which leaves every marginal right).
"""

import pytest
import torch
from scipy.stats import chisquare

from configs import SamplingParams
from core.rejection import PAD, gumbel_verify
from core.sampling import gumbel_argmax, gumbel_noise
from tests.test_rejection import PARAMS, V, _chain, min_p_value

K, N = 3, 20_000


def run_coupled(P, Q, k: int, n: int = N, noise_fn=gumbel_noise, coupled_drafts: bool = True, seed: int = 5):
    """Speculative generation of k+1 tokens after token 0, n sequences (seed = row index).
    Drafts come from Q, drawn with the verifier's noise (coupled) or independently."""
    g = torch.Generator().manual_seed(seed)
    seqs = [[0] for _ in range(n)]
    accepted = drafted = 0
    while True:
        live = [i for i in range(n) if len(seqs[i]) < k + 2]
        if not live:
            break
        noise = torch.stack([noise_fn(i, range(len(seqs[i]), len(seqs[i]) + k + 1), V) for i in live])  # [B, k+1, V]
        prev = torch.tensor([seqs[i][-1] for i in live])
        drafts, ps = [], []
        for j in range(k):
            if coupled_drafts:
                x = gumbel_argmax(Q[prev], noise[:, j])
            else:
                x = torch.multinomial(Q[prev], 1, generator=g)[:, 0]
            drafts.append(x), ps.append(P[prev])
            prev = x
        ps.append(P[prev])
        draft = torch.stack(drafts, 1) if k else torch.zeros(len(live), 0, dtype=torch.long)  # [B, k]
        tokens, n_acc = gumbel_verify(draft, torch.stack(ps, 1), noise)
        accepted += int(n_acc.sum())
        drafted += k * len(live)
        for row, i in enumerate(live):
            seqs[i].extend(t for t in tokens[row].tolist() if t != PAD)
    out = torch.tensor([s[1:k + 2] for s in seqs])  # positions 1..k+1
    return out, accepted / max(1, drafted)


def joint_p_value(tokens, P) -> float:
    """Chi-square of the joint distribution of positions 1 and 2 (both after token 0)."""
    expected = (P[0].double()[:, None] * P.double()).flatten()  # [V*V]
    observed = torch.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V).double()
    support = expected > 0
    assert observed[~support].sum() == 0
    exp = expected[support] / expected[support].sum() * len(tokens)
    return chisquare(observed[support].numpy(), exp.numpy()).pvalue


@pytest.mark.parametrize("params", PARAMS, ids=["t1.0", "t0.7-top_p0.9"])
def test_gumbel_verification_preserves_target_distribution(params):
    P, Q = _chain(params, seed=1)
    tokens, acc = run_coupled(P, Q, K)
    assert 0.2 < acc < 0.95, acc  # drafts were both accepted and rejected, often
    assert min_p_value(tokens, P, K) > 1e-3
    assert joint_p_value(tokens, P) > 1e-3


def test_gumbel_output_independent_of_drafts_and_k():
    """The same seeds give the same tokens with coupled drafts, random drafts, any k, and k=0
    (plain decoding): the deterministic guarantee."""
    P, Q = _chain(SamplingParams(temperature=1.0), seed=1)
    plain, _ = run_coupled(P, Q, 0, n=2000)
    for k, coupled in [(1, True), (3, True), (3, False), (6, True)]:
        out, _ = run_coupled(P, Q, k, n=2000, coupled_drafts=coupled)
        assert torch.equal(out[:, :1], plain[:, :1])
    # positions beyond the first: compare longer runs generated step by step
    five_plain = _extend(P, Q, 0, 5)
    assert torch.equal(_extend(P, Q, 2, 5), five_plain)
    assert torch.equal(_extend(P, Q, 4, 5, coupled=False), five_plain)


def _extend(P, Q, k, length, coupled=True, n=500):
    """Generate `length` tokens after token 0 in steps of k drafts."""
    g = torch.Generator().manual_seed(9)
    seqs = [[0] for _ in range(n)]
    while any(len(s) < length + 1 for s in seqs):
        for i, s in enumerate(seqs):
            if len(s) >= length + 1:
                continue
            noise = gumbel_noise(i, range(len(s), len(s) + k + 1), V).unsqueeze(0)
            prev, drafts, ps = torch.tensor([s[-1]]), [], []
            for j in range(k):
                x = gumbel_argmax(Q[prev], noise[:, j]) if coupled else torch.multinomial(Q[prev], 1, generator=g)[:, 0]
                drafts.append(x), ps.append(P[prev])
                prev = x
            ps.append(P[prev])
            draft = torch.stack(drafts, 1) if k else torch.zeros(1, 0, dtype=torch.long)
            tokens, _ = gumbel_verify(draft, torch.stack(ps, 1), noise)
            s.extend(t for t in tokens[0].tolist() if t != PAD)
    return torch.tensor([s[1:length + 1] for s in seqs])


def test_reused_noise_is_caught():
    """Noise keyed by the seed alone (the same at every position) keeps each marginal right
    but correlates positions: the joint test must reject it."""
    P, Q = _chain(SamplingParams(temperature=1.0), seed=1)

    def same_noise_everywhere(seed, positions, vocab):
        return gumbel_noise(seed, [0], vocab).expand(len(positions), vocab)

    tokens, _ = run_coupled(P, Q, K, noise_fn=same_noise_everywhere)
    assert joint_p_value(tokens, P) < 1e-6


def test_gumbel_noise_keyed_by_seed_and_position():
    a = gumbel_noise(3, [7, 8], 50)
    assert torch.equal(a, gumbel_noise(3, [7, 8], 50))
    assert torch.equal(a[1], gumbel_noise(3, [8], 50)[0])
    assert not torch.equal(a[0], a[1]) and not torch.equal(a, gumbel_noise(4, [7, 8], 50))
    # standard Gumbel: mean = Euler-Mascheroni constant, variance pi^2/6
    big = gumbel_noise(11, range(200), 1000)
    assert abs(big.mean() - 0.5772) < 0.02 and abs(big.var() - 1.6449) < 0.05


def test_noise_cache_returns_gumbel_noise_rows_within_its_byte_budget(monkeypatch):
    """A drafter's ``NoiseCache`` gives the rows ``gumbel_noise`` draws, draws each (seed, position)
    once while it is kept, and drops the least recently used past its budget."""
    import core.sampling as sampling
    from core.sampling import NoiseCache

    cache = NoiseCache(budget_bytes=3 * 50 * 8)  # three float64 rows of V = 50
    for seed, pos in ((1, 10), (1, 11), (2, 10)):
        assert torch.equal(cache.row(seed, pos, 50), gumbel_noise(seed, [pos], 50))
    calls = []
    real = sampling.gumbel_noise
    monkeypatch.setattr(sampling, "gumbel_noise", lambda *a: calls.append(a) or real(*a))
    cache.row(1, 10, 50)  # kept: no draw (and now the most recently used)
    assert calls == [] and len(cache) == 3
    cache.row(3, 0, 50)  # a fourth row: (1, 11), the least recently used, goes
    assert len(cache) == 3 and len(calls) == 1
    cache.row(1, 10, 50)
    assert len(calls) == 1
    cache.row(1, 11, 50)
    assert len(calls) == 2 and torch.equal(cache.row(1, 11, 50), real(1, [11], 50))


def _draft_tree(tiny_engines, prompt: str, params, seq_id: str, m: int):
    """A chain of 4 drafts (k = 3 and the bonus guess), then the pre-draft tree ``tree_branches`` makes
    of it with m alternatives: (chain drafts, their alternatives, [(branch drafts, alternatives)])."""
    from core.loop import tree_branches
    from core.sequence import Sequence

    tok, _, ver, dr = tiny_engines
    seq = Sequence(tok.encode(prompt), params, 3, tok, ver.eos_ids, ver.max_len, seq_id=seq_id)
    (p,) = dr.propose([seq.draft_request(4, alternatives=m + 1)])
    seq.note_proposal(p)
    branches = tree_branches(p.tokens[:3], p, m)
    (t,) = dr.propose([seq.draft_request(4, context=seq.tokens + p.tokens[:3], alternatives=m + 1,
                                         branches=[(len(seq.tokens) + j, c) for j, c in branches])])
    dr.release(seq_id)
    q = [(b.probs.ids, b.probs.probs) if b.probs else None for b in [p, *t.branches]]
    return p.tokens, p.alts, [(b.tokens, b.alts) for b in t.branches], q


def test_a_drafter_draws_a_trees_positions_once(tiny_engines, monkeypatch):
    """A pre-draft tree's branches overlap at every depth: the drafter draws each position's noise
    once (k = 3, m = 1: 5 branches of 4 drafts over 7 positions, 3 of them the chain's), and drafts
    what it drafts without the cache."""
    import core.sampling as sampling
    from core.sampling import NoiseCache

    dr = tiny_engines[3]
    params = SamplingParams(temperature=0.9, seed=5, verification="gumbel", max_tokens=64, ignore_eos=True)
    calls = []
    real = sampling.gumbel_noise
    monkeypatch.setattr(sampling, "gumbel_noise", lambda *a: calls.append(a[1][0]) or real(*a))
    dr.noise = NoiseCache()
    cached = _draft_tree(tiny_engines, "def add(a, b):", params, "a", 1)
    # the chain: positions L..L+3 (L the prompt's length); the tree's branch j draws L+j+1..L+j+4, j = 0..3
    assert len(cached[2]) == 5 and len(calls) == len(set(calls)) == 8, calls
    dr.noise = NoiseCache(budget_bytes=0)  # keeps one row at most: nearly every draw anew
    assert _draft_tree(tiny_engines, "def add(a, b):", params, "b", 1) == cached and len(calls) > 20


@pytest.mark.parametrize("verification", ["gumbel", "rejection"])
@pytest.mark.parametrize("params", [dict(temperature=0.0), dict(temperature=0.7), dict(temperature=1.3, top_k=20),
                                    dict(temperature=1.0, top_p=0.9)])
def test_a_trees_rows_drawn_together_are_drawn_as_alone(tiny_engines, monkeypatch, params, verification):
    """A pass's greedy and sampled rows are drawn in one batched op (``_batched_draws``): every branch's
    drafts, alternatives and, for rejection sampling, sparse q are those each row draws alone (``_draw``)."""
    from drafter.model_drafter import ModelDrafter

    sp = SamplingParams(**params, seed=9, verification=verification, max_tokens=64, ignore_eos=True)
    prompt = "class Stack:\n    def push(self, x):"
    batched, draws = [], ModelDrafter._batched_draws
    monkeypatch.setattr(ModelDrafter, "_batched_draws", lambda self, passed: batched.append(draws(self, passed))
                        or batched[-1])
    together = _draft_tree(tiny_engines, prompt, sp, "together", 2)
    assert len(together[2]) == 9 and all(len(toks) == 4 for toks, _ in together[2])
    assert sum(len(d) for d in batched) >= 9 * 3  # (most rows drawn together)
    assert (together[3][0] is None) == (sp.greedy or verification == "gumbel")
    monkeypatch.setattr(ModelDrafter, "_batched_draws", lambda self, passed: {})
    assert _draft_tree(tiny_engines, prompt, sp, "alone", 2) == together


@pytest.mark.parametrize("params", [dict(temperature=0.8), dict(temperature=1.0, top_p=0.9)])
def test_a_coupled_drafts_alternatives_are_its_runners_up_under_the_noise(tiny_engines, params):
    """A Gumbel-coupled verifier emits argmax(log p + g) where it rejects a draft, with the noise g the drafter
    drew with: the drafter's guess of that token, which a pre-draft tree branches on, is the runner-up of
    log q + g, not of q. A position's alternatives are log q + g's top tokens, the draft first."""
    from core.protocol import DraftRequest, Proposal
    from core.sampling import perturbed, processed_probs

    dr = tiny_engines[3]
    sp = SamplingParams(**params, seed=4, verification="gumbel", max_tokens=64, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    differs = 0
    for seed in range(20):
        logits = 3 * torch.randn(1, V, generator=gen)
        r = DraftRequest("alts", 0, None, [1, 2, 3], 1, sp, seed, alternatives=3)
        prop = Proposal("alts", [], alts=[])
        x = dr._draw(r, logits, [1, 2, 3], prop)
        q = processed_probs(logits, sp)
        scores = perturbed(q, gumbel_noise(seed, [3], V))[0]
        assert prop.alts == [scores.topk(3).indices.tolist()] and prop.alts[0][0] == x
        differs += prop.alts[0][1] != q[0].topk(3).indices.tolist()[1]
    assert differs > 0  # (the two rankings differ on these rows: the test tells them apart)
