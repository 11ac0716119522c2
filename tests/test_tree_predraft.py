"""Pre-draft trees (``DraftRequest.branches``): every branch's drafts (and q) are the drafts the
drafter makes from that branch's context on its own, the sequence's own slot is left as it was,
and the scratch rows go back to the pool; the drafter's alternatives are its most likely tokens."""

import pytest
import torch

from configs import SamplingParams
from core.protocol import DraftRequest
from tests.test_greedy_equivalence import prompts

K = 4


def alone(drafter, context, k, params, seed=0):
    """What the drafter drafts after ``context`` from scratch."""
    (p,) = drafter.propose([DraftRequest("alone", 0, None, list(context), k, params, seed, full=True)])
    drafter.release("alone")
    return p


def chain(drafter, seq_id, context, k, params, seed=0, alternatives=0):
    (p,) = drafter.propose([DraftRequest(seq_id, 0, None, list(context), k, params, seed, full=True,
                                         alternatives=alternatives)])
    return p


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_branches_draft_what_their_contexts_draft_alone(tiny_engines, temperature):
    tok, _, _, drafter = tiny_engines
    params = SamplingParams(temperature=temperature, top_k=0)
    free = drafter.cache.free_blocks
    for i, prompt in enumerate(prompts(tok, 6)):
        seq_id = f"tree{i}"
        block = chain(drafter, seq_id, prompt, K + 1, params, seed=i, alternatives=2)
        assert len(block.alts) == K + 1 and all(len(a) == 2 for a in block.alts)
        if temperature == 0:  # greedy drafts are the drafter's best tokens
            assert [a[0] for a in block.alts] == block.tokens
        context = prompt + block.tokens[:K]
        held = drafter.cache.cached_tokens(seq_id)
        # every outcome j: the context's first len(prompt) + j tokens, then each alternative at j
        branches = [(len(prompt) + j, c) for j in range(K + 1) for c in block.alts[j]]
        req = DraftRequest.for_tokens(seq_id, context, len(held), None, None, k=K + 1, sampling=params, seed=i,
                                      alternatives=2, branches=branches)
        (tree,) = drafter.propose([req])
        assert tree.tokens == [] and len(tree.branches) == len(branches)
        assert drafter.cache.cached_tokens(seq_id) == context  # the slot holds the context, no branch rows
        for (n, c), b in zip(branches, tree.branches):
            want = alone(drafter, context[:n] + [c], K + 1, params, seed=i)
            assert b.tokens == want.tokens, (n, c)
            assert b.cached == n and len(b.alts) == K + 1
            if temperature > 0:
                assert b.probs.ids == want.probs.ids
                for got_q, want_q in zip(b.probs.probs, want.probs.probs, strict=True):
                    assert got_q == pytest.approx(want_q, abs=1e-5)
        drafter.release(seq_id)
    assert drafter.cache.free_blocks == free  # scratch rows and slots all returned


def test_a_tree_whose_context_is_not_held_feeds_it_first(tiny_engines):
    tok, _, _, drafter = tiny_engines
    params = SamplingParams(temperature=0)
    prompt = prompts(tok, 1)[0]
    block = chain(drafter, "fed", prompt, 2, params)
    context = prompt + block.tokens + [7, 8]  # two tokens the slot has not seen
    req = DraftRequest.for_tokens("fed", context, len(prompt) + 1, None, None, k=3, sampling=params, seed=0,
                                  branches=[(len(context), 5), (len(prompt), 6)])
    (tree,) = drafter.propose([req])
    assert drafter.cache.cached_tokens("fed") == context
    assert [b.tokens for b in tree.branches] == [alone(drafter, context + [5], 3, params).tokens,
                                                 alone(drafter, prompt + [6], 3, params).tokens]
    drafter.release("fed")
    # a tree for a sequence the replica does not hold is a cache miss, like any call
    (miss,) = drafter.propose([DraftRequest.for_tokens("gone", context, 5, None, None, k=3, sampling=params, seed=0,
                                                       branches=[(5, 1)])])
    assert miss.cache_miss


def test_a_narrowed_tree_drafts_only_the_branch_still_wanted(tiny_engines):
    """``narrow``: once the block's outcome is known, only the branch the sequence took is drafted on
    (its drafts unchanged); a miss stops every branch. A narrowing for another tree of the sequence
    (another context length) changes nothing, and the engine forgets a narrowing once its tree ran."""
    tok, _, _, drafter = tiny_engines
    params = SamplingParams(temperature=0)
    prompt = prompts(tok, 1)[0]

    def tree(seq_id, narrowed=None):
        block = chain(drafter, seq_id, prompt, K + 1, params, alternatives=2)
        context = prompt + block.tokens[:K]
        branches = [(len(prompt) + j, c) for j in range(K + 1) for c in block.alts[j][:1]]
        if narrowed is not None:
            drafter.narrow(seq_id, *narrowed(context, branches))
        req = DraftRequest.for_tokens(seq_id, context, len(context) - K, None, None, k=K + 1, sampling=params,
                                      seed=0, alternatives=2, branches=branches)
        (t,) = drafter.propose([req])
        drafter.release(seq_id)
        return branches, [b.tokens for b in t.branches]

    branches, full = tree("whole")
    assert all(len(b) == K + 1 for b in full)
    _, hit = tree("hit", lambda ctx, br: (len(ctx), br[2]))
    assert hit[2] == full[2] and all(b == [] for i, b in enumerate(hit) if i != 2)
    _, miss = tree("miss", lambda ctx, br: (len(ctx), None))
    assert all(b == [] for b in miss)
    _, other = tree("other", lambda ctx, br: (len(ctx) - 1, None))  # an older tree's outcome
    assert other == full
    assert not drafter.narrowed


def test_a_tree_narrowed_while_it_runs_stops_between_passes(tiny_engines, monkeypatch):
    """The verifier tells the drafter the outcome from another thread while the tree's passes run."""
    import drafter.model_drafter as md

    tok, _, _, drafter = tiny_engines
    params = SamplingParams(temperature=0)
    prompt = prompts(tok, 1)[0]
    block = chain(drafter, "mid", prompt, K + 1, params, alternatives=2)
    context = prompt + block.tokens[:K]
    branches = [(len(prompt) + j, c) for j in range(K + 1) for c in block.alts[j][:1]]
    passes = []
    real = md.batched_forward

    def counted(runner, cache, slots, *args, **kw):
        passes.append(len(slots))
        if len(passes) == 2:  # after the tree's first pass: the block took branch 0
            drafter.narrow("mid", len(context), branches[0])
        return real(runner, cache, slots, *args, **kw)

    monkeypatch.setattr(md, "batched_forward", counted)
    req = DraftRequest.for_tokens("mid", context, len(context) - K, None, None, k=K + 1, sampling=params, seed=0,
                                  alternatives=2, branches=branches)
    (t,) = drafter.propose([req])
    drafter.release("mid")
    assert passes[:2] == [1, len(branches)] and passes[2:] == [1] * K  # (the context's feed, then the tree)
    assert len(t.branches[0].tokens) == K + 1 and all(len(b.tokens) == 1 for b in t.branches[1:])


def test_a_branch_without_room_keeps_its_place(tiny_engines):
    """The loop reads a tree's answer by branch index: a branch the drafter cannot draft (past its
    context) answers empty in its place, and the branches after it stay where they were asked."""
    tok, _, _, drafter = tiny_engines
    params = SamplingParams(temperature=0)
    prompt = prompts(tok, 1)[0]
    block = chain(drafter, "room", prompt, 2, params)
    context = prompt + block.tokens
    req = DraftRequest.for_tokens("room", context, len(context), None, None, k=3, sampling=params, seed=0,
                                  branches=[(len(context) + 5, 4), (len(prompt), 6)])  # the first is past the context
    (t,) = drafter.propose([req])
    assert [b.tokens for b in t.branches] == [[], alone(drafter, prompt + [6], 3, params).tokens]
    drafter.release("room")


def test_the_ngram_drafter_drafts_the_chain_branch_only():
    from configs import NgramConfig
    from drafter.ngram import NgramDrafter

    dr = NgramDrafter(NgramConfig(method="ngram", num_speculative_tokens=3))
    params = SamplingParams(temperature=0)
    context = [1, 2, 3, 4, 9, 1, 2, 3]
    dr.propose([DraftRequest("s", 0, None, context, 3, params, 0, full=True)])
    (tree,) = dr.propose([DraftRequest.for_tokens("s", context, len(context), None, None, k=3, sampling=params, seed=0,
                                                  branches=[(len(context), 4), (len(context) - 1, 7)])])
    assert [b.tokens for b in tree.branches] == [[9, 1, 2], []]
    assert tree.cached == len(context) and tree.branches[0].cached == len(context) + 1


# ------------------------------------------------------------ the loop with trees
async def _speculate(seq, drafter, ver, k, m, pipeline=True):
    from core.loop import speculate
    from core.policy import Breaker, FixedK

    async def propose(requests):
        return drafter.propose(requests)

    async def verify(requests):
        return ver.verify(requests)

    infos = [info async for _, _, info in speculate(seq, propose, verify, FixedK(k), Breaker(), pipeline,
                                                    alternatives=m)]
    ver.release(seq.seq_id)
    drafter.release(seq.seq_id)
    return infos


def test_tree_guesses_m_corrections_per_rejected_position_and_m_plus_one_bonus_tokens():
    """At j < k the draft was rejected: c among the drafter's other m likeliest tokens; at j = k nothing is
    ruled out: its own next token and m more; m = 0 is the whole-block chain alone; likelier outcomes first."""
    from core.loop import tree_branches
    from core.protocol import Proposal

    drafts = [10, 11, 12]
    # the drafter's tokens (k + 1, the last the bonus guess) and its likeliest at each position (own first)
    p = Proposal("s", [10, 11, 12, 13], alts=[[10, 20, 30], [21, 11, 31], [12, 22, 32], [13, 23, 33]])
    assert tree_branches(drafts, p, 0) == [(3, 13)]
    assert tree_branches(drafts, p, 1) == [(3, 13), (3, 23), (2, 22), (1, 21), (0, 20)]
    assert tree_branches(drafts, p, 2) == [(3, 13), (3, 23), (3, 33), (2, 22), (2, 32), (1, 21), (1, 31),
                                           (0, 20), (0, 30)]
    # a sampled draft need not be the drafter's likeliest token: it is left out wherever it stands
    q = Proposal("s", [10, 11, 12, 40], alts=[[20, 10, 30], [21, 31, 41], [22, 32, 42], [13, 23, 33]])
    assert tree_branches(drafts, q, 2) == [(3, 40), (3, 13), (3, 23), (2, 22), (2, 32), (1, 21), (1, 31),
                                           (0, 20), (0, 30)]
    assert len(set(tree_branches(drafts, q, 2))) == 9


def test_greedy_with_trees_equals_the_target_and_uses_every_kind_of_branch(tiny_engines):
    import asyncio

    from tests.test_greedy_equivalence import compare, reference
    from tests.test_loop import MAX_NEW, new_seq

    tok, target, ver, drafter = tiny_engines
    by_outcome, near_ties, branches = {}, [], set()
    for p in prompts(tok, 8):
        seq = new_seq(tok, ver, p, K)
        infos = asyncio.run(_speculate(seq, drafter, ver, K, 2))
        assert compare(target, p, seq.output_ids, reference(target, p, MAX_NEW), near_ties), p
        for i in infos:
            if i.pre_draft:
                row = by_outcome.setdefault(i.pre_outcome, [0, 0])
                row[0] += i.pre_draft == "hit"
                row[1] += 1
                branches.add(i.pre_branches)
    assert len(near_ties) <= 2
    # drafts ready for rejected blocks (a guessed correction) as well as for whole ones (a guessed bonus)
    assert sum(h for j, (h, _) in by_outcome.items() if j < K) > 0, by_outcome
    assert sum(h for j, (h, _) in by_outcome.items() if j == K) > 0, by_outcome
    assert max(branches) == 2 * K + 3, branches  # m = 2 at each j < k, m + 1 at j = k


# ------------------------------------------------------------ distribution (tiny target, exact)
V, N = 8, 2000


# Most of a minute each on one core: the gumbel case runs in `make test-long`, so `make test` stays short
@pytest.mark.parametrize("verification", [pytest.param("rejection", marks=pytest.mark.heavy),
                                          pytest.param("gumbel", marks=pytest.mark.long)])
def test_sampled_outputs_with_trees_are_token_for_token_those_without(verification):
    """A branch's drafts and q are those its context gets when drafted on its own (randomness is keyed
    by seed and position), so pre-draft trees change no sampled token: every seed's output equals the
    output without pre-drafting, and follows the target's exact distribution. A tree that sent a wrong
    q, or drafts not drawn from it, breaks the equality at once."""
    import asyncio

    from configs import DraftModelConfig, VerifierConfig
    from core.sequence import Sequence
    from drafter.model_drafter import ModelDrafter
    from tests.helpers import noisy_copy, tiny_llama, tiny_tokenizer
    from tests.test_eagle3_serving import _exact
    from tests.test_rejection import min_p_value_of
    from verifier.engine import VerifierEngine

    target = tiny_llama(V, layers=2, hidden=24, seed=3, peak=3.0, eos_token_id=None)
    ver = VerifierEngine(VerifierConfig(model="tiny", dtype="float32", cache_budget_mb=64), model=target,
                         tokenizer=tiny_tokenizer())
    drafter = ModelDrafter(DraftModelConfig(model="tiny", dtype="float32", cache_budget_mb=64),
                           model=noisy_copy(target, 0.6))
    prompt, n = [0, 3], 5
    params = [SamplingParams(temperature=0.9, max_tokens=n, ignore_eos=True, seed=s, verification=verification)
              for s in range(N)]

    async def run_all(pre_draft: bool):
        out, hits = [], 0
        for sp in params:
            seq = Sequence(prompt, sp, 1, None, set(), 64)
            infos = await _speculate(seq, drafter, ver, 1, 2, pre_draft)  # k = 1: most steps are checked against a tree
            hits += sum(i.pre_draft == "hit" and i.pre_outcome == 0 for i in infos)
            out.append(seq.output_ids)
        return out, hits

    with_trees, hits = asyncio.run(run_all(True))
    without, _ = asyncio.run(run_all(False))
    assert hits > N // 20, hits  # steps verified drafts from the branches of a rejected block
    assert with_trees == without
    assert min_p_value_of(torch.tensor(with_trees), _exact(target, params[0], prompt, n)) > 1e-3


def test_the_ngram_drafters_byte_count_includes_the_chain_token():
    from configs import NgramConfig
    from drafter.ngram import NgramDrafter

    dr = NgramDrafter(NgramConfig(method="ngram", num_speculative_tokens=3))
    params = SamplingParams(temperature=0)
    context = [1, 2, 3, 4, 9, 1, 2, 3]
    dr.propose([DraftRequest("s", 0, None, context, 3, params, 0, full=True)])
    dr.propose([DraftRequest.for_tokens("s", context, len(context), None, None, k=3, sampling=params, seed=0,
                                        branches=[(len(context), 4)])])
    assert dr.bytes == dr.seqs["s"].nbytes()  # the budget counts what the index holds
