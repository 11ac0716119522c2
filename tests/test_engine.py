"""Engine behaviour: determinism, batching, stopping, context limit, cache protocol."""

import pytest
import torch

from configs import DraftModelConfig, NgramConfig, SamplingParams, VerifierConfig
from core.loop import generate, step
from core.protocol import DraftRequest, VerifyRequest, prefix_hash
from core.sequence import Sequence
from drafter.model_drafter import ModelDrafter
from drafter.ngram import NgramDrafter, ngram_propose
from tests.helpers import tiny_llama
from tests.test_greedy_equivalence import prompts, reference
from verifier.engine import VerifierEngine


def make(tiny_pair, budget_mb=64, drafter_budget_mb=64, target=None, draft=None):
    tok, t, d = tiny_pair
    ver = VerifierEngine(VerifierConfig(model="tiny", cache_budget_mb=budget_mb), model=target or t, tokenizer=tok)
    dr = ModelDrafter(DraftModelConfig(model="tiny", cache_budget_mb=drafter_budget_mb), model=draft or d)
    return tok, ver, dr


SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_pair):
    tok, ver, dr = make(tiny_pair)
    ps = prompts(tok, 5)
    alone = generate([ps[0]], SAMPLED, 4, dr, ver)[0].output_ids
    again = generate([ps[0]], SAMPLED, 4, dr, ver)[0].output_ids
    batched = generate(ps, [SAMPLED] + [SAMPLED.model_copy(update={"seed": i}) for i in range(4)], 4, dr, ver)
    assert alone == again == batched[0].output_ids
    other_seed = generate([ps[0]], SAMPLED.model_copy(update={"seed": 99}), 4, dr, ver)[0].output_ids
    assert other_seed != alone
    # and with the n-gram drafter in the mix of a batch
    ng = NgramDrafter(NgramConfig())
    assert generate([ps[0]], SAMPLED, 4, ng, ver)[0].output_ids == generate(ps[:3], SAMPLED, 4, ng, ver)[0].output_ids


def test_unseeded_requests_differ(tiny_pair):
    tok, ver, dr = make(tiny_pair)
    p = prompts(tok, 1)
    params = SAMPLED.model_copy(update={"seed": None, "temperature": 1.5, "top_p": 1.0})
    outs = {tuple(generate(p, params, 3, dr, ver)[0].output_ids) for _ in range(3)}
    assert len(outs) > 1


@pytest.mark.parametrize("k", [0, 8])
def test_eos_inside_a_draft_ends_generation(tiny_pair, k):
    tok, t, d = tiny_pair
    p = prompts(tok, 1)[0]
    free = reference(t, p, 20)
    eos = free[6]  # make a token the target emits at step 6 its end-of-sequence token
    first = free.index(eos)
    t.generation_config.eos_token_id = eos
    try:
        _, ver, dr = make(tiny_pair)
        (s,) = generate([p], SamplingParams(temperature=0, max_tokens=20), k, dr, ver)
    finally:
        t.generation_config.eos_token_id = None
    assert s.output_ids == free[: first + 1] and s.finish_reason == "stop"
    assert eos not in tok(s.text)["input_ids"] or tok.decode([eos]) in s.text  # EOS id is in ids, not text


def test_max_tokens_inside_a_draft(tiny_pair):
    tok, ver, dr = make(tiny_pair)
    p = prompts(tok, 1)[0]
    want = reference(tiny_pair[1], p, 7)
    for k in (3, 8):
        seq = Sequence(p, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), k, tok, ver.eos_ids,
                       ver.max_len)
        while not seq.done:
            step([seq], dr, ver)
        assert seq.output_ids == want and seq.finish_reason == "length"


def test_stop_string(tiny_pair):
    tok, ver, dr = make(tiny_pair)
    p = prompts(tok, 3)[2]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    (free,) = generate([p], params, 4, dr, ver)
    text = free.text
    stop = text[9:13]
    assert stop and len(text) > 14
    (s,) = generate([p], params.model_copy(update={"stop": (stop, "NEVER-APPEARS")}), 4, dr, ver)
    assert s.text == text[: text.index(stop)] and s.finish_reason == "stop"
    assert len(s.output_ids) < len(free.output_ids)
    assert tok.decode(s.output_ids).find(stop) >= 0  # the ids run through the stop string, the text stops before it


def test_sequence_at_the_context_limit(tiny_pair):
    tok, _, _ = tiny_pair
    t = tiny_llama(len(tok), peak=30.0, eos_token_id=None, max_len=48)
    d = tiny_llama(len(tok), peak=30.0, eos_token_id=None, max_len=48, layers=1, seed=3)
    _, ver, dr = make(tiny_pair, target=t, draft=d)
    assert ver.max_len == 48
    p = prompts(tok, 2)[1]
    (s,) = generate([p], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True), 8, dr, ver)
    assert len(s.tokens) == 48 and s.finish_reason == "length"
    ids = torch.tensor([p])
    want = t.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_length=48, pad_token_id=2)
    assert s.output_ids == want[0, len(p):].tolist()
    with pytest.raises(ValueError, match="context"):
        Sequence(list(range(3, 51)), SamplingParams(), 4, tok, set(), 48)


def block_budget_mb(ver, blocks):
    return blocks * ver.cache.block_bytes / 2**20


def make_limited(tiny_pair, blocks, max_len):
    tok, t, d = tiny_pair
    probe = VerifierEngine(VerifierConfig(model="tiny", max_model_len=max_len), model=t, tokenizer=tok)
    mb = block_budget_mb(probe, blocks)
    ver = VerifierEngine(VerifierConfig(model="tiny", cache_budget_mb=mb, max_model_len=max_len), model=t,
                         tokenizer=tok)
    dr = ModelDrafter(DraftModelConfig(model="tiny", cache_budget_mb=mb * d.config.num_hidden_layers
                                       / t.config.num_hidden_layers, max_model_len=max_len), model=d)
    return tok, ver, dr


def test_eviction_and_recompute_give_the_same_output(tiny_pair):
    tok, big_ver, big_dr = make(tiny_pair)
    # one sequence at the context limit (4 blocks) plus two blocks: three sequences do not fit
    _, ver, dr = make_limited(tiny_pair, blocks=7, max_len=64)
    assert ver.cache.num_blocks == dr.cache.num_blocks == 7
    ps = [p[:20] for p in prompts(tok, 3)]
    want = [s.output_ids for s in generate(ps, SAMPLED, 3, big_dr, big_ver)]
    seqs = [Sequence(p, SAMPLED, 3, tok, ver.eos_ids, ver.max_len) for p in ps]
    while not all(s.done for s in seqs):
        for s in seqs:  # round robin: each step evicts another sequence's blocks
            if not s.done:
                step([s], dr, ver)
    assert [s.output_ids for s in seqs] == want
    assert ver.cache.stats["evictions"] > 0 and ver.cache.stats["misses"] > 0


def test_paged_cache_holds_sequences_by_tokens_used(tiny_pair):
    """More concurrent short sequences than budget / (max_model_len x bytes per token): memory is
    bounded by the tokens held, and nothing is evicted."""
    tok, big_ver, big_dr = make(tiny_pair)
    _, ver, dr = make_limited(tiny_pair, blocks=3 * 16 + 1, max_len=256)  # 3 sequences at the context limit
    per_sequence_at_limit = ver.cache.num_blocks * ver.cache.block_bytes // (256 * ver.cache.token_bytes)
    assert per_sequence_at_limit == 3
    ps = [p[:16] for p in prompts(tok, 8)]
    want = [s.output_ids for s in generate(ps, SAMPLED, 3, big_dr, big_ver)]
    seqs = [Sequence(p, SAMPLED, 3, tok, ver.eos_ids, ver.max_len) for p in ps]
    most = 0
    while not all(s.done for s in seqs):
        step([s for s in seqs if not s.done], dr, ver)  # one batch of all 8
        most = max(most, len(ver.cache))
    assert [s.output_ids for s in seqs] == want
    assert most == 8 > per_sequence_at_limit
    assert ver.cache.stats["evictions"] == 0 and dr.cache.stats["evictions"] == 0
    held = ver.cache.held_tokens()
    used = ver.cache.num_blocks - 1 - ver.cache.free_blocks
    assert used * ver.cache.block_size < held + 2 * 8 * ver.cache.block_size  # at most two partial blocks each
    # a batch that needs more than the whole pool fails those sequences alone, retryably
    greedy = SamplingParams(temperature=0)
    reqs = [VerifyRequest(f"big{i}", 0, None, [5 + j % 50 for j in range(240)], [], greedy, 0) for i in range(4)]
    res = ver.verify(reqs)
    assert [bool(r.error and r.retryable) for r in res] == [False, False, False, True], [r.error for r in res]


def test_any_replica_can_serve_any_step(tiny_pair):
    """Alternating two replicas: each step on the other replica misses, resends, and the output is unchanged."""
    tok, ver_a, dr_a = make(tiny_pair)
    _, ver_b, dr_b = make(tiny_pair)
    p = prompts(tok, 1)[0]
    want = generate([p], SAMPLED, 3, dr_a, ver_a)[0].output_ids
    s = Sequence(p, SAMPLED, 3, tok, ver_a.eos_ids, ver_a.max_len)
    i = 0
    while not s.done:
        step([s], [dr_a, dr_b][i % 2], [ver_a, ver_b][(i // 2) % 2])
        i += 1
    assert s.output_ids == want
    assert ver_b.cache.stats["misses"] > 0


def test_cache_protocol_miss_and_rollback(tiny_pair):
    tok, ver, _ = make(tiny_pair)
    toks = prompts(tok, 1)[0] + [7, 8, 9]
    g = SamplingParams(temperature=0)
    r = ver.verify([VerifyRequest.for_tokens("s", toks, 0, draft_tokens=[], sampling=g, seed=0)])[0]
    assert not r.cache_miss and r.cached == len(toks)
    # a wrong prefix hash is a miss, not a wrong answer
    bad = VerifyRequest("s", len(toks), prefix_hash(toks[:-1] + [0]), [r.tokens[0]], [], g, 0)
    assert ver.verify([bad])[0].cache_miss
    # rolling back to an earlier prefix only moves the length pointer
    ok = VerifyRequest.for_tokens("s", toks[:4] + [11], 4, draft_tokens=[], sampling=g, seed=0)
    r2 = ver.verify([ok])[0]
    assert not r2.cache_miss and r2.cached == 5
    assert ver.release("s") and not ver.release("s")


def test_ngram_propose():
    assert ngram_propose([1, 2, 3, 4, 1, 2], 3, 1, 3) == [3, 4, 1]
    assert ngram_propose([1, 2, 3, 9, 2, 3, 5, 2, 3], 2, 1, 2) == [5, 2]  # latest match wins
    assert ngram_propose([1, 2, 3], 3, 1, 3) == []


def test_gumbel_mode_output_is_independent_of_drafter_and_k(tiny_pair):
    """Deterministic mode: a seeded sampled request gives the same tokens with the model
    drafter at any k, the n-gram drafter, and plain decoding; and the coupled drafter is
    accepted often (it draws with the verifier's noise)."""
    tok, ver, dr = make(tiny_pair)
    ps = prompts(tok, 3)
    params = SAMPLED.model_copy(update={"verification": "gumbel", "max_tokens": 32})
    plain = [s.output_ids for s in generate(ps, params, 0, None, ver)]
    for k, drafter in [(1, dr), (4, dr), (8, dr), (4, NgramDrafter(NgramConfig()))]:
        seqs = generate(ps, params, k, drafter, ver)
        assert [s.output_ids for s in seqs] == plain, (k, type(drafter).__name__)
    seqs = generate(ps, params, 4, dr, ver)
    rate = sum(s.stats.num_accepted_tokens for s in seqs) / sum(s.stats.num_draft_tokens for s in seqs)
    assert rate > 0.3, rate
    # rejection mode draws differently: same distribution, different tokens for this seed
    assert [s.output_ids for s in generate(ps, SAMPLED.model_copy(update={"max_tokens": 32}), 0, None, ver)] != plain


def test_a_poisoned_sequence_fails_alone(tiny_pair):
    """One sequence whose forward pass or decision raises gets its own error; every other sequence of
    the batch gets the result it would have had alone (verifier and drafter)."""
    from core.protocol import DraftProbs, DraftRequest

    tok, ver, dr = make(tiny_pair)
    V = ver.vocab_size
    ps = [p[:12] for p in prompts(tok, 4)]
    greedy = SamplingParams(temperature=0)
    sampled = SamplingParams(temperature=0.8, seed=3)

    def reqs(poison):
        out = [VerifyRequest(f"s{i}", 0, None, p, [5, 6, 7], sampled, 11,
                             draft_probs=DraftProbs([[5], [6], [7]], [[1.0]] * 3)) for i, p in enumerate(ps)]
        if poison == "forward":  # a token outside the vocabulary: the batched pass raises
            out[1] = VerifyRequest("s1", 0, None, ps[1], [5, V + 7, 7], greedy, 11)
        else:  # q names a token outside the vocabulary: the forward pass is fine, the decision raises
            out[2].draft_probs = DraftProbs([[5], [V + 3], [7]], [[1.0]] * 3)
        return out

    for poison, bad in (("forward", 1), ("decide", 2)):
        for s in [f"s{i}" for i in range(4)]:
            ver.release(s)
        res = ver.verify(reqs(poison))
        assert res[bad].error and "failed" in res[bad].error and not res[bad].retryable
        assert f"s{bad}" not in ver.cache
        for i, r in enumerate(res):
            if i == bad:
                continue
            ver.release(f"s{i}")
            (alone,) = ver.verify([reqs(poison)[i]])
            assert r.error is None and (r.tokens, r.num_accepted) == (alone.tokens, alone.num_accepted), i

    drafts = [DraftRequest(f"d{i}", 0, None, p, 3, greedy, 1) for i, p in enumerate(ps)]
    drafts[2] = DraftRequest("d2", 0, None, ps[2][:-1] + [V + 9], 3, greedy, 1)
    props = dr.propose(drafts)
    assert props[2].tokens == [] and props[2].cached == 0
    for i in (0, 1, 3):
        dr.release(f"d{i}")
        assert props[i].tokens == dr.propose([drafts[i]])[0].tokens and len(props[i].tokens) == 3


def test_ngram_index_equals_the_scan_and_is_bounded_in_bytes():
    """The incremental index proposes what the full rescan does, at every length and after a cut;
    the drafter keeps its sequences within cache_budget_mb, least recently used out."""
    import random

    from drafter.ngram import NgramIndex

    rng = random.Random(0)
    for trial in range(20):
        tokens = [rng.randrange(6) for _ in range(rng.randint(2, 120))]
        idx = NgramIndex(1, 4)
        i = 0
        while i < len(tokens):
            n = rng.randint(1, 5)
            idx.set(i, tokens[i:i + n])
            i += n
            assert idx.propose(5) == ngram_propose(tokens[:i], 5, 1, 4), (trial, i)
        cut = rng.randrange(1, len(tokens))
        idx.set(cut, [3, 3, 1])
        assert idx.propose(4) == ngram_propose(tokens[:cut] + [3, 3, 1], 4, 1, 4)

    greedy = SamplingParams(temperature=0)
    one = NgramIndex(1, 4)
    one.set(0, list(range(100)) * 3)
    budget = 3.5 * one.nbytes() / 2**20  # room for three such sequences
    ng = NgramDrafter(NgramConfig(cache_budget_mb=budget))
    for s in range(6):
        ng.propose([DraftRequest(f"n{s}", 0, None, list(range(100)) * 3, 4, greedy, 1)])
        assert ng.bytes <= ng.budget
    assert list(ng.seqs) == ["n3", "n4", "n5"]
    assert ng.bytes == sum(x.nbytes() for x in ng.seqs.values())
    ng.release("n4")
    assert ng.bytes == sum(x.nbytes() for x in ng.seqs.values())


def test_memoised_prefix_hash_equals_the_definition():
    """The prefix hash with a memo (links of 256-token blocks kept per token list) equals the hash
    computed from scratch, as the list grows, is cut back and regrows with other tokens, and a
    guessed tail (``stable``) never enters the memo; common_prefix_len agrees with a plain scan."""
    import random

    from core.protocol import HASH_BLOCK, common_prefix_len, cut_chain

    rng = random.Random(0)
    tokens, chain = [], [b""]
    for n_step in range(300):
        tokens += [rng.randrange(4096) for _ in range(rng.randint(1, 40))]
        if n_step % 37 == 36:  # a rollback past a block boundary, then different tokens
            cut = rng.randrange(len(tokens))
            del tokens[cut:]
            cut_chain(chain, cut)
            tokens += [rng.randrange(4096) for _ in range(5)]
        n = rng.randint(0, len(tokens))
        assert prefix_hash(tokens, n, chain) == prefix_hash(tokens[:n]), n_step
        assert len(chain) <= len(tokens) // HASH_BLOCK + 1
    guess = tokens + [1] * 600
    before = list(chain)
    assert prefix_hash(guess, len(guess), chain, stable=len(tokens)) == prefix_hash(guess)
    assert len(chain) <= len(tokens) // HASH_BLOCK + 1 and chain[:len(before)] == before
    for _ in range(200):
        a = [rng.randrange(3) for _ in range(rng.randint(0, 300))]
        b = a[: rng.randint(0, len(a))] + [rng.randrange(3) for _ in range(rng.randint(0, 80))]
        want = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix_len(a, b) == want


def test_per_step_overhead_is_flat_up_to_8192_positions(tiny_pair):
    """A synthetic long-context model (8,192 positions, random weights): the engine and loop work per
    step outside the forward pass (cache protocol, hashing, bookkeeping) at an 8,000-token context
    is about what it is at 64 tokens, with a loose bound (linear work would be ~100x). The two
    sequences step in alternation, so the shared machine's drifts in speed fall on both alike."""
    import statistics
    import time

    tok, _, _ = tiny_pair
    model = tiny_llama(len(tok), max_len=8192, eos_token_id=None, seed=5)
    ver = VerifierEngine(VerifierConfig(model="tiny", cache_budget_mb=64), model=model, tokenizer=tok)
    assert ver.max_len == 8192

    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    seqs = [Sequence([5 + i % 300 for i in range(n)], params, 0, None, set(), ver.max_len) for n in (64, 8000)]
    per_step = [[], []]
    for n_step in range(params.max_tokens):
        for i in (0, 1) if n_step % 2 else (1, 0):
            t0 = time.perf_counter()
            (res,) = ver.verify([seqs[i].verify_request()])
            seqs[i].apply(res)
            per_step[i].append(time.perf_counter() - t0 - res.forward_s)
    assert all(seq.done for seq in seqs)
    for seq in seqs:
        ver.release(seq.seq_id)
    short, long = (statistics.median(times[5:]) for times in per_step)
    print(f"per-step overhead outside the forward: {short * 1e6:.0f} us at 64 tokens, {long * 1e6:.0f} us at 8,000")
    assert long < 3 * short + 100e-6
