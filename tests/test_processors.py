"""Logits processors under speculation: penalties, logit_bias, min_p, min_tokens, stop_token_ids.

p at draft position i must include every processor computed over the history up to that
position (prompt, output so far, the block's earlier drafts), or speculation stops being
lossless. Checked three ways:
- greedy: token-identical to transformers' own processors (repetition penalty, sequence bias),
  and to a naive one-token-at-a-time reference for the penalties transformers lacks;
- sampled: a chi-square test of the production path (``decide`` with keyed random numbers and
  the drafter's sparse top-K q) against the exact distribution, enumerated over every history;
- a verifier that forgets the block's drafts in the penalties is caught by the same test.
"""

import pytest
import torch

from configs import SamplingParams
from core.loop import generate
from core.protocol import DraftProbs, VerifyRequest
from core.rejection import decide
from core.sampling import History, Stream, apply_processors, processed_probs, sample_inverse_cdf, uniform
from tests.test_greedy_equivalence import compare, prompts
from tests.test_rejection import min_p_value_of

MAX_NEW = 32


def hf_greedy(model, prompt, n, **kw):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, pad_token_id=2, **kw)
    return out[0, len(prompt):].tolist()


def naive_greedy(model, prompt, n, params: SamplingParams, stop_ids=()):
    """One token at a time over the full context, the processors written out longhand."""
    toks = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([toks])).logits[0, -1].float()
            out = toks[len(prompt):]
            if len(out) < params.min_tokens:
                logits[list(stop_ids)] = float("-inf")
            for t, b in params.logit_bias.items():
                logits[t] += b
            for t in set(toks):  # repetition: prompt and output
                if params.repetition_penalty != 1.0:
                    penalty = params.repetition_penalty
                    logits[t] = logits[t] / penalty if logits[t] > 0 else logits[t] * penalty
            for t in set(out):
                logits[t] -= params.frequency_penalty * out.count(t) + params.presence_penalty
            toks.append(int(logits.argmax()))
    return toks[len(prompt):]


@pytest.mark.parametrize("k", [0, 1, 4])
def test_greedy_repetition_penalty_equals_transformers(tiny_engines, k):
    tok, target, ver, drafter = tiny_engines
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.3)
    ps = prompts(tok, 10)
    seqs = generate(ps, params, k, drafter, ver)
    near_ties = []
    for p, s in zip(ps, seqs):
        want = hf_greedy(target, p, MAX_NEW, repetition_penalty=1.3)
        assert compare(target, p, s.output_ids, want, near_ties), p
    plain = generate(ps, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), k, drafter, ver)
    assert any(a.output_ids != b.output_ids for a, b in zip(seqs, plain)), "the penalty changed nothing"
    if k:
        assert sum(s.stats.num_accepted_tokens for s in seqs) > 0


@pytest.mark.parametrize("k", [0, 4])
def test_greedy_logit_bias_equals_transformers_sequence_bias(tiny_engines, k):
    tok, target, ver, drafter = tiny_engines
    ps = prompts(tok, 10)
    plain = generate(ps, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), 0, None, ver)
    # push down a token the target likes, push up a few it does not
    bias = {plain[0].output_ids[0]: -100.0, 7: 6.0, 11: 4.5, 23: 9.0}
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logit_bias=bias)
    seqs = generate(ps, params, k, drafter, ver)
    near_ties = []
    for p, s in zip(ps, seqs):
        want = hf_greedy(target, p, MAX_NEW, sequence_bias={(t,): b for t, b in bias.items()})
        assert compare(target, p, s.output_ids, want, near_ties), p
    assert any(a.output_ids != b.output_ids for a, b in zip(seqs, plain))


@pytest.mark.parametrize("k", [0, 3])
def test_greedy_frequency_presence_min_tokens_equal_naive_reference(tiny_engines, k):
    tok, target, ver, drafter = tiny_engines
    ps = prompts(tok, 6)
    stop_id = 9
    params = SamplingParams(temperature=0, max_tokens=24, frequency_penalty=0.8, presence_penalty=0.4,
                            repetition_penalty=1.1, min_tokens=10, stop_token_ids=(stop_id,))
    seqs = generate(ps, params, k, drafter, ver)
    for p, s in zip(ps, seqs):
        want = naive_greedy(target, p, 24, params, stop_ids=[stop_id])
        if stop_id in want:  # a stop token id ends generation, and is returned
            want = want[: want.index(stop_id) + 1]
        assert s.output_ids == want, p
        assert stop_id not in s.output_ids[:10]


def test_stop_token_ids_end_generation_and_are_returned(tiny_engines):
    tok, target, ver, drafter = tiny_engines
    p = prompts(tok, 1)[0]
    free = generate([p], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), 0, None, ver)[0]
    stop = free.output_ids[5]
    first = free.output_ids.index(stop)
    for k in (0, 4):
        (s,) = generate([p], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                                            stop_token_ids=(stop,)), k, drafter, ver)
        assert s.output_ids == free.output_ids[: first + 1] and s.finish_reason == "stop"
        # min_tokens masks it until then: generation goes past it
        (m,) = generate([p], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                                            stop_token_ids=(stop,), min_tokens=first + 2), k, drafter, ver)
        assert stop not in m.output_ids[: first + 2]


def test_stop_string_inside_an_accepted_block_reports_only_kept_tokens(tiny_engines):
    """Defect: a stop string found inside a block trimmed seq.tokens but returned every new id."""
    tok, target, ver, drafter = tiny_engines
    p = prompts(tok, 1)[0]
    (free,) = generate([p], SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), 0, None, ver)
    text = tok.decode(free.output_ids[:12], skip_special_tokens=True)
    stop = text[-3:-1] if len(text) > 3 else text
    from core.sequence import Sequence

    seq = Sequence(p, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, stop=(stop,)), 8,
                   tok, set(), ver.max_len, logprobs=1)
    reported = []
    while not seq.done:
        new, _ = seq.apply(ver.verify([seq.verify_request(free.output_ids[len(seq.output_ids):][:8])])[0])
        reported += new
    assert reported == seq.output_ids and len(seq.logprobs) == len(reported)
    assert stop not in seq.text and seq.finish_reason == "stop"


# ---------------------------------------------------------------- distribution (production path)
V, K, N, TOP_K = 6, 3, 12_000, 4


def _model(seed=1):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(V, V, generator=g) * 1.5  # logits after token x: row x
    return target, target + torch.randn(V, V, generator=g) * 1.0


def exact_marginals(target, params, prompt=(0,), n=K + 1):
    """Per position, the exact distribution of the target's output under the processors,
    enumerated over every history (V^n paths)."""
    out = [torch.zeros(V, dtype=torch.float64) for _ in range(n)]
    frontier = {tuple(prompt): 1.0}
    for j in range(n):
        nxt = {}
        for hist, mass in frontier.items():
            p = processed_probs(target[hist[-1]].unsqueeze(0), params, History(list(hist), len(prompt)))[0].double()
            for t in range(V):
                if p[t] > 0:
                    nxt[hist + (t,)] = nxt.get(hist + (t,), 0.0) + mass * float(p[t])
                    out[j][t] += mass * p[t]
        frontier = nxt
    return out


def run_production(target, draft, params, n=N, k=K, stale_verifier=False):
    """n sequences of k+1 tokens after the prompt [0], each step drafted from q (the drafter's
    sparse top-K of its processed distribution, keyed draws) and verified by ``decide``."""
    rows, sparse_q = [], {}  # context -> the drafter's sparse q there (a function of the context: computed once)
    for s in range(n):
        seed = 1_000_003 * s + 17
        seq = [0]
        while len(seq) < k + 2:
            ctx, drafts, ids, probs = list(seq), [], [], []
            for _ in range(k):
                if (key := tuple(ctx)) not in sparse_q:
                    q = processed_probs(draft[ctx[-1]].unsqueeze(0), params, History(ctx, 1))[0]
                    vals, top = q.topk(TOP_K)
                    vals, top = vals[vals > 0], top[vals > 0]
                    sparse_q[key] = top, vals / vals.sum()
                top, vals = sparse_q[key]
                u = torch.tensor([uniform(seed, len(ctx), Stream.DRAFT)])
                t = int(top[sample_inverse_cdf(vals.unsqueeze(0), u)[0]])
                drafts.append(t), ids.append(top.tolist()), probs.append(vals.tolist()), ctx.append(t)
            logits = target[[seq[-1]] + drafts]  # [k+1, V]: row i predicts the token after draft i
            q = DraftProbs(ids, probs) if params.verification == "rejection" else None
            r = VerifyRequest("s", 0, None, list(seq), drafts, params, seed, q, num_prompt=1)
            if stale_verifier:  # wrong: every row penalised as if the block's drafts were not output yet
                logits = torch.cat([apply_processors(logits[i:i + 1], params, History(list(seq), 1))
                                    for i in range(k + 1)])
                r.sampling = params.model_copy(update={"frequency_penalty": 0.0, "presence_penalty": 0.0})
            res = decide(r, logits, seq + drafts)
            seq.extend(res.tokens)
        rows.append(seq[1:k + 2])
    return torch.tensor(rows)


DIST_PARAMS = {
    # the production path without processors (test_rejection.py tests the sampler's maths alone)
    "t1.0": SamplingParams(temperature=1.0, verification="rejection"),
    "t0.7-top_p0.9": SamplingParams(temperature=0.7, top_p=0.9, verification="rejection"),
    "t0.8-presence-frequency": SamplingParams(temperature=0.8, presence_penalty=0.6, frequency_penalty=0.9,
                                              verification="rejection"),
    "t0.8-min_p": SamplingParams(temperature=0.8, min_p=0.15, verification="rejection"),
    "t0.8-repetition-bias": SamplingParams(temperature=0.8, repetition_penalty=1.6, logit_bias={2: 1.5},
                                           verification="rejection"),
    "t0.8-presence-frequency-gumbel": SamplingParams(temperature=0.8, presence_penalty=0.6, frequency_penalty=0.9,
                                                     verification="gumbel"),
}


# Most of a minute each on one core (12,000 sequences through the production sampler in Python): three
# cases stay in `make test` (penalties with rejection and with gumbel, repetition with a bias), the others
# and the negative control run in `make test-long`, so `make test` stays short.
LONG_DIST = {"t1.0", "t0.7-top_p0.9", "t0.8-min_p"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.long) if n in LONG_DIST else n
                                  for n in DIST_PARAMS])
def test_distribution_with_processors_production_path(name):
    params = DIST_PARAMS[name]
    target, draft = _model()
    tokens = run_production(target, draft, params)
    assert min_p_value_of(tokens, exact_marginals(target, params)) > 1e-3
    if not params.processed and params.min_p == 0.0:
        return
    # the processors matter here: without them the marginals differ measurably
    plain = params.model_copy(update={"presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0,
                                      "repetition_penalty": 1.0, "logit_bias": {}})
    assert min_p_value_of(tokens, exact_marginals(target, plain)) < 1e-6


@pytest.mark.long
def test_a_verifier_that_forgets_the_drafts_in_its_penalties_is_caught():
    params = DIST_PARAMS["t0.8-presence-frequency"]
    target, draft = _model()
    tokens = run_production(target, draft, params, stale_verifier=True)
    assert min_p_value_of(tokens, exact_marginals(target, params)) < 1e-6


def test_processors_order_and_neutral_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    hist = History([3, 3, 1], num_prompt=1)  # prompt [3], output [3, 1]
    neutral = SamplingParams(temperature=1.0)
    assert not neutral.processed
    assert torch.equal(processed_probs(logits, neutral, hist), processed_probs(logits, neutral))
    p = SamplingParams(temperature=1.0, repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25,
                       logit_bias={0: 1.0})
    got = apply_processors(logits, p, hist)[0]
    # bias first (token 0: 3.0), then repetition on prompt+output tokens {3, 1}: 3.0/2, -1.0*2,
    # then frequency (once each for 3 and 1 in the output) and presence
    assert torch.allclose(got, torch.tensor([3.0, -2.0 - 0.75, 0.5, 1.5 - 0.75]))


def test_the_python_inverse_cdf_draws_what_the_tensor_one_draws():
    """The drafter draws from its sparse q in Python floats (``inverse_cdf``): the index ``sample_inverse_cdf``
    picks for the same row and uniform, zeros never chosen, the last positive entry at u near 1."""
    from core.sampling import inverse_cdf

    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 64):
        for _ in range(50):
            row = torch.rand(n, generator=gen, dtype=torch.float64)
            row[torch.rand(n, generator=gen) < 0.3] = 0.0
            if row.sum() == 0:
                row[0] = 1.0
            for u in (0.0, float(torch.rand(1, generator=gen)), 1 - 2.0**-53):
                want = int(sample_inverse_cdf(row.unsqueeze(0), torch.tensor([u], dtype=torch.float64))[0])
                assert inverse_cdf(row.tolist(), u) == want and row[want] > 0


def test_a_sparse_draw_sends_the_q_its_draft_was_drawn_from():
    """``sparse_draw``: q's top ``top_k`` entries renormalised in float32 (the values the verifier reads), its zeros
    dropped where q has fewer positive entries, the alternatives from the wider top-k when they ask for more,
    the draft drawn from exactly the q sent; a row that is not a distribution (NaN logits) raises, so its
    sequence keeps the drafts it has instead of sending q it cannot be verified against."""
    import numpy as np
    import pytest

    from core.sampling import inverse_cdf
    from drafter.base import sparse_draw

    q = torch.zeros(2, 100)
    q[0, [5, 9, 40]] = torch.tensor([0.5, 0.3, 0.2])
    q[1] = torch.softmax(torch.randn(100, generator=torch.Generator().manual_seed(1)), -1)
    rows = sparse_draw(q, 8, 12, [0.9, 0.3])
    (d0, alts0, ids0, p0), (d1, alts1, ids1, p1) = rows
    assert ids0 == [5, 9, 40] and d0 == 40 and len(alts0) == 12 and alts0[:3] == [5, 9, 40]
    assert len(ids1) == 8 and ids1 == q[1].topk(8).indices.tolist() and alts1[:8] == ids1
    assert all(np.float32(x) == x for x in p0 + p1)  # (float32 values: what the verifier reads)
    assert d1 == ids1[inverse_cdf(p1, 0.3)] and abs(sum(p1) - 1) < 1e-6
    with pytest.raises(ValueError):
        sparse_draw(torch.full((1, 100), float("nan")), 8, 0, [0.5])
