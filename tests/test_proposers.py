"""The loop's drafting parts (``core.proposers``), each on its own, on the tiny drafter engine:
the drafter call (timeout, miss resend, breaker), the pre-draft tree and the head's chain, and
``Proposer``'s order of preference (prediction, pre-draft, drafter)."""

import asyncio

from configs import SamplingParams
from core.policy import Breaker
from core.prediction import PredictedOutput
from core.proposers import ChainAhead, DrafterCall, Proposer, TreeAhead, tree_branches
from core.protocol import DraftRequest, StepInfo
from core.sequence import Sequence
from tests.test_greedy_equivalence import prompts


def _seq(tok, ver, prompt, k=3):
    return Sequence(prompt, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), k, tok, ver.eos_ids,
                    ver.max_len)


def _alone(drafter, context, k):
    """What the drafter drafts after ``context`` from scratch (greedy)."""
    (p,) = drafter.propose([DraftRequest("alone", 0, None, list(context), k, SamplingParams(temperature=0), 0,
                                         full=True)])
    drafter.release("alone")
    return p.tokens


def test_a_drafter_call_resends_a_miss_whole_and_a_failure_opens_the_breaker(tiny_engines):
    tok, _, ver, drafter = tiny_engines
    seq = _seq(tok, ver, prompts(tok, 1)[0])
    sent = []

    async def propose(requests):
        sent.append(requests[0])
        return drafter.propose(requests)

    async def main():
        breaker = Breaker()
        call = DrafterCall(seq, propose, breaker)
        seq.drafter_held = list(seq.tokens) + [1, 2]  # a belief the drafter does not share: a miss
        p = await call(3, seq.tokens)
        assert [r.full for r in sent] == [False, True] and seq.cache_misses["drafter"] == 1
        assert p.tokens == _alone(drafter, seq.tokens, 3) and not breaker.open(0.0)

        async def slow(requests):
            await asyncio.sleep(1.0)

        late = DrafterCall(seq, slow, breaker, timeout_s=0.05)
        assert await late(3, seq.tokens) is None
        assert breaker.open(__import__("time").monotonic()) and seq.drafter_held == []

    asyncio.run(main())
    drafter.release(seq.seq_id)


def test_a_tree_pre_draft_covers_the_blocks_outcomes_and_is_narrowed_to_the_one_taken(tiny_engines):
    tok, _, ver, drafter = tiny_engines
    seq = _seq(tok, ver, prompts(tok, 1)[0])
    told = []

    async def propose(requests):
        return drafter.propose(requests)

    async def main():
        call = DrafterCall(seq, propose, Breaker())
        ahead = TreeAhead(call, 1, narrow=lambda *a: told.append(a))
        p = await call(4, seq.tokens, alternatives=ahead.alternatives())
        drafts = p.tokens[:3]
        ahead.start(seq, drafts, p, 3, chained=False)
        assert ahead.pre.branches == tree_branches(drafts, p, 1) and len(ahead.pre.branches) == 1 * (3 + 1) + 1
        answer = await ahead.pre.task
        j, c = ahead.pre.branches[2]  # an outcome: j drafts accepted, then c
        seq.tokens += drafts[:j] + [c]
        b = ahead.pre.branch_for(seq.tokens)
        assert b == 2 and answer.branches[b].tokens == _alone(drafter, seq.tokens, 4)
        ahead.settle(seq)
        assert told == [(seq.seq_id, ahead.pre.context_len, (ahead.pre.base + j, c))]
        seq.tokens.append(c)  # a context no branch is: no branch, and nothing kept after a drop
        assert ahead.pre.branch_for(seq.tokens) is None
        ahead.drop(seq, tell=True)
        assert ahead.pre is None and told[-1][2] is None

    asyncio.run(main())
    drafter.release(seq.seq_id)


def test_a_heads_chain_is_provisional_one_branch_and_never_chained_twice(tiny_engines):
    tok, _, ver, drafter = tiny_engines
    seq = _seq(tok, ver, prompts(tok, 1)[0])
    sent = []

    async def propose(requests):
        sent.append(requests[0])
        return drafter.propose(requests)

    async def main():
        call = DrafterCall(seq, propose, Breaker())
        ahead = ChainAhead(call)
        p = await call(4, seq.tokens, alternatives=ahead.alternatives())
        ahead.start(seq, p.tokens[:3], p, 3, chained=True)  # drafts that were themselves pre-drafted
        assert ahead.pre is None
        ahead.start(seq, p.tokens[:3], p, 3, chained=False)
        await ahead.pre.task
        assert ahead.pre.branches == [(3, p.tokens[3])] and sent[-1].provisional and not sent[-1].branches
        r = sent[-1]  # the chain's context: the sequence, the block, then the guessed bonus
        assert r.start + len(r.new_tokens) == len(seq.tokens) + 4 and r.new_tokens[-1] == p.tokens[3]
        ahead.settle(seq)  # (a chain is never narrowed: nothing to tell)
        ahead.drop(seq)

    asyncio.run(main())
    drafter.release(seq.seq_id)


def test_the_proposer_prefers_the_prediction_then_the_pre_draft_then_the_drafter(tiny_engines):
    tok, _, ver, drafter = tiny_engines
    prompt = prompts(tok, 1)[0]
    calls = []

    async def propose(requests):
        calls.append(requests[0])
        return drafter.propose(requests)

    async def main():
        seq = _seq(tok, ver, prompt)
        call = DrafterCall(seq, propose, Breaker())
        ahead = TreeAhead(call, 1)
        source = Proposer(seq, call, ahead)
        source.plan()
        info = StepInfo(0, 0)
        k, p = await source.propose(3, info)  # nothing ahead: the drafter, one token more for the tree after it
        assert k == 3 and len(p.tokens) == 4 and p.alts and info.pre_draft is None and not info.degraded
        source.pre_draft(k, p.tokens[:3], p, info)
        pre = ahead.pre
        seq.tokens += p.tokens[:3] + [p.tokens[3]]  # the whole block accepted and the bonus as guessed
        source.next(3)
        assert source.early is None  # the pre-draft covers the next step: no draft started for it
        await pre.task
        n = len(calls)
        info = StepInfo(0, 0)
        k, q = await source.propose(3, info)
        assert info.pre_draft == "hit" and len(calls) == n and q is (await pre.task).branches[0]
        # the client's prediction, where it continues the output, comes first: no drafter call
        seq2 = _seq(tok, ver, prompt)
        call2 = DrafterCall(seq2, propose, Breaker())
        predicted = Proposer(seq2, call2, TreeAhead(call2, 1), PredictedOutput([7, 8, 9, 10]))
        predicted.plan()
        info = StepInfo(0, 0)
        n = len(calls)
        k, r = await predicted.propose(3, info)
        assert (k, r.tokens, info.predicted, len(calls)) == (3, [7, 8, 9], 3, n)
        source.close()

    asyncio.run(main())
    drafter.release("s")
    for r in calls:
        drafter.release(r.seq_id)
