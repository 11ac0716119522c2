"""The loop that serves (``core.loop.speculate``), run in process on the real engines: greedy
output equal to the target's, pre-drafts used only on an exact match, the per-sequence breaker,
and the policy's choices on recorded step-time curves."""

import asyncio
import random

import pytest

from configs import SamplingParams
from core.loop import speculate, speculate_local
from core.policy import AdaptiveK, Breaker, FixedK
from core.sequence import Sequence
from tests.test_greedy_equivalence import compare, prompts, reference

MAX_NEW = 32


def new_seq(tok, ver, prompt, k, **params):
    return Sequence(prompt, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, **params), k, tok,
                    ver.eos_ids, ver.max_len)


async def run(seq, drafter, ver, policy, pipeline=True, fail_drafter=False):
    """speculate on the real engines, recording every verified block with the tokens before it."""
    verified, infos = [], []

    async def propose(requests):
        if fail_drafter:
            raise ConnectionError("drafter pool unreachable")
        return drafter.propose(requests)

    async def verify(requests):
        (r,) = requests
        verified.append((tuple(seq.tokens), tuple(r.draft_tokens)))
        return ver.verify(requests)

    async for _, _, info in speculate(seq, propose, verify, policy, Breaker(), pipeline):
        infos.append(info)
    ver.release(seq.seq_id)
    drafter.release(seq.seq_id)
    return verified, infos


@pytest.mark.parametrize("pipeline", [True, False])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equals_target_and_pre_drafts_are_used_on_exact_match_only(tiny_engines, k, pipeline):
    tok, target, ver, drafter = tiny_engines
    hits = misses = 0
    near_ties = []
    for p in prompts(tok, 8):
        seq = new_seq(tok, ver, p, k)
        verified, infos = asyncio.run(run(seq, drafter, ver, FixedK(k), pipeline))
        assert compare(target, p, seq.output_ids, reference(target, p, MAX_NEW), near_ties), p
        hits += sum(i.pre_draft == "hit" for i in infos)
        misses += sum(i.pre_draft == "miss" for i in infos)
        # every verified block is the drafter's proposal for exactly the tokens the sequence had:
        # a block's drafts are a continuation the drafter produced from that context
        for tokens, drafts in verified:
            if drafts:
                assert drafter_agrees(drafter, tokens, drafts), (tokens, drafts)
    assert len(near_ties) <= 2
    if pipeline:
        assert hits > 0 and misses > 0, (hits, misses)
    else:
        assert hits == misses == 0


def drafter_agrees(drafter, tokens, drafts) -> bool:
    """Greedy drafts are a function of the context: redraft from scratch and compare."""
    from core.protocol import DraftRequest

    r = DraftRequest("check", 0, None, list(tokens), len(drafts), SamplingParams(temperature=0), 0, full=True)
    (p,) = drafter.propose([r])
    drafter.release("check")
    return tuple(p.tokens) == tuple(drafts)


def test_a_failing_drafter_degrades_steps_not_the_request(tiny_engines):
    tok, target, ver, drafter = tiny_engines
    p = prompts(tok, 1)[0]
    seq = new_seq(tok, ver, p, 4)
    _, infos = asyncio.run(run(seq, drafter, ver, FixedK(4), fail_drafter=True))
    assert seq.output_ids == reference(target, p, MAX_NEW)
    assert infos[0].degraded and all(i.k == 0 for i in infos)


def test_breaker_backs_off_doubles_and_resets():
    b = Breaker(max_backoff_s=4.0)
    assert not b.open(0.0)
    assert b.failed(10.0) == 0.5 and b.open(10.4) and not b.open(10.6)
    assert b.failed(11.0) == 1.0 and b.failed(12.0) == 2.0 and b.failed(13.0) == 4.0 and b.failed(14.0) == 4.0
    b.succeeded()
    assert b.failed(20.0) == 0.5
    # one per sequence: another sequence's breaker is untouched
    assert not Breaker().open(20.1)


def test_speculate_local_matches_the_lockstep_reference(tiny_engines):
    tok, target, ver, drafter = tiny_engines
    from core.loop import generate

    ps = prompts(tok, 4)
    ref = generate(ps, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), 3, drafter, ver)
    for p, r in zip(ps, ref):
        seq = asyncio.run(speculate_local(new_seq(tok, ver, p, 3), drafter, ver, FixedK(3)))
        assert seq.output_ids == r.output_ids and seq.text == r.text


def simulate(policy, verify_s, acceptance, steps=200, draft_s=lambda k: 0.0005 * k, overhead_s=0.001, seed=0):
    """Drive the policy with a recorded cost curve: verify_s(k) forward seconds, draft_s(k) drafting
    on the critical path, overhead_s every step pays (plain ones too); each draft accepted with
    probability ``acceptance`` (seeded), up to the first rejected one."""
    rng, ks = random.Random(seed), []
    for _ in range(steps):
        k = policy.next_k(1)
        ks.append(k)
        accepted = next((j for j in range(k) if rng.random() >= acceptance), k)
        d = draft_s(k) if k else 0.0
        policy.observe(k, accepted, d, verify_s(k), verify_s(k) + d + overhead_s)
    return ks


def test_policy_on_cpu_like_and_gpu_like_curves():
    # CPU-like: verification cost grows with k (0.12 of a step per token); GPU-like: nearly flat
    # the same prior for both: the measured curves alone make the difference
    cpu = simulate(AdaptiveK(12), lambda k: 0.010 * (1 + 0.12 * k), 0.8)
    gpu = simulate(AdaptiveK(12), lambda k: 0.010 * (1 + 0.01 * k), 0.8)
    median = lambda ks: sorted(ks)[len(ks) // 2]  # noqa: E731
    assert 1 <= median(cpu) < median(gpu), (median(cpu), median(gpu))
    # drafting that sits on the critical path and costs more than the tokens it brings: plain steps, rechecked
    # until the replica has measured three cold steps (a sequence's first speculative step, or one after plain
    # steps), then not while the measurements say a try cannot pay
    slow = AdaptiveK(4, recheck_steps=10)
    ks = simulate(slow, lambda k: 0.010 * (1 + 0.12 * k), 0.3, steps=200, draft_s=lambda k: 0.02)
    assert 0 in ks and ks.index(0) <= slow.min_steps + 1, ks
    cold = [i for i in range(1, len(ks)) if ks[i] > 0 and ks[i - 1] == 0]
    assert len(cold) <= 2 and not any(ks[cold[-1] + 2 * slow.run:]) and slow.costs.recheck_in > 0, ks
    # and a cheap drafter with good acceptance keeps speculating
    assert 0 not in simulate(AdaptiveK(4), lambda k: 0.010 * (1 + 0.12 * k), 0.8, steps=60)


def test_engine_failures_are_retryable_request_faults_are_not(tiny_engines):
    """A verify result with an engine error raises RuntimeError (the router fails over); a
    request the engine refuses raises ValueError (the router answers 400)."""
    from core.protocol import VerifyResult

    tok, target, ver, drafter = tiny_engines
    p = prompts(tok, 1)[0]
    for retryable, exc in ((True, RuntimeError), (False, ValueError)):
        seq = new_seq(tok, ver, p, 0)

        async def verify(requests, retryable=retryable):
            return [VerifyResult(requests[0].seq_id, error="boom", retryable=retryable)]

        async def drive(seq=seq):
            async for _ in speculate(seq, None, verify, FixedK(0), Breaker(), pipeline=False):
                pass

        with pytest.raises(exc, match="boom"):
            asyncio.run(drive())


def test_waiting_for_a_pre_draft_counts_as_drafting_on_the_critical_path(tiny_engines):
    """A pre-draft slower than the verification it was meant to hide behind makes the next step
    wait for it; that wait is drafting on the critical path (``StepInfo.draft_s``), not exposed
    time, so the policy and the breakdown charge it to drafting. On a clock that only the drafter
    and the verifier move: every pre-draft answers once the loop has taken its step's tokens, and
    then takes DRAFT_S of the next step; a verify takes VERIFY_S, all of it its forward pass."""
    tok, target, ver, drafter = tiny_engines
    seq = new_seq(tok, ver, prompts(tok, 1)[0], 4)
    DRAFT_S, VERIFY_S = 0.03, 0.005
    now = [0.0]

    async def main():
        infos, state = [], {"yielded": asyncio.Event()}

        async def propose(requests):
            (r,) = requests
            if r.branches:  # a pre-draft: still running when the verify it hides behind has answered
                await state["yielded"].wait()
                now[0] += DRAFT_S
            return drafter.propose(requests)

        async def verify(requests):
            out = ver.verify(requests)
            now[0] += VERIFY_S
            for res in out:
                res.forward_s = VERIFY_S
            return out

        async for _, _, info in speculate(seq, propose, verify, FixedK(4), Breaker(), True, draft_timeout_s=5.0,
                                          clock=lambda: now[0]):
            infos.append(info)
            state["yielded"].set()  # releases the pre-draft made during this step
            state["yielded"] = asyncio.Event()
        return infos

    infos = asyncio.run(main())
    ver.release(seq.seq_id)
    drafter.release(seq.seq_id)
    hits = [i for i in infos if i.pre_draft == "hit"]
    assert hits, [i.pre_draft for i in infos]
    assert all(i.draft_s == pytest.approx(DRAFT_S) for i in hits), [i.draft_s for i in hits]
    # the wait is not counted as exposed: a step is its drafting and its verify, nothing else
    assert all(i.step_s - i.forward_s - i.draft_s == pytest.approx(0, abs=1e-9) for i in infos if i.k), \
        [(i.step_s, i.forward_s, i.draft_s) for i in infos]


class _PlainThen(FixedK):
    """k = 0 for the first ``plain`` steps, saying how many plain steps remain, then the bound."""

    def __init__(self, bound: int, plain: int):
        super().__init__(bound)
        self.left = plain + 1

    def next_k(self, batch_size: int = 1) -> int:
        self.left = max(0, self.left - 1)
        return 0 if self.left else self.bound

    def plain_ahead(self) -> int:
        return self.left


def test_a_head_captures_no_states_deep_in_a_long_plain_stretch_and_recomputes_them():
    """In a plain stretch the policy holds LONG_PLAIN steps or more, verify requests carry no capture
    (its cost is every plain step's); when speculation resumes the head's missing states are
    recomputed in one prefill, and the greedy output is the target's."""
    from core.loop import LONG_PLAIN
    from tests.test_eagle3_serving import CODE, shipped_engines
    from tests.test_processors import hf_greedy

    ver, dr = shipped_engines.__wrapped__()
    ids = ver.tokenizer(CODE[0])["input_ids"]
    n, plain = LONG_PLAIN + 40, LONG_PLAIN + 8
    seq = Sequence(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), 4, ver.tokenizer,
                   ver.eos_ids, ver.max_len)
    captured, verify = [], ver.verify

    def recording(requests):
        captured.extend(bool(r.capture) for r in requests)
        return verify(requests)

    ver.verify = recording
    try:
        asyncio.run(speculate_local(seq, dr, ver, _PlainThen(4, plain)))
    finally:
        del ver.verify
    assert seq.output_ids == hf_greedy(ver.model, ids, n)
    assert not any(captured[: plain + 1 - LONG_PLAIN]) and all(captured[plain + 1:]), captured
    assert seq.cache_misses["states"] >= 1 and seq.stats.num_drafts > 0
