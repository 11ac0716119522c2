"""The adaptive speculation policy picks k from acceptance, drafter cost and load."""

import itertools

import pytest

from core.policy import AdaptiveK


def test_high_acceptance_speculates_more():
    good, bad = AdaptiveK(8), AdaptiveK(8)
    for _ in range(20):
        good.observe(4, 4, draft_s=0.002, verify_s=0.03)
        bad.observe(4, 0, draft_s=0.002, verify_s=0.03)
    assert good.acceptance > 0.9 and bad.acceptance < 0.2
    assert good.next_k() >= 4 and bad.next_k() == 0


def test_expensive_drafter_turns_speculation_off():
    p = AdaptiveK(8)
    for _ in range(20):
        p.observe(2, 1, draft_s=0.1, verify_s=0.05)  # drafting a token costs two verify steps
    assert p.next_k() == 0


def test_saturated_verifier_speculates_less():
    p, q = AdaptiveK(8), AdaptiveK(8)
    for i in range(20):
        for x in (p, q):
            x.observe(4, (3, 1)[i % 2], draft_s=0.001, verify_s=0.02)
    assert p.next_k(batch_size=1) > q.next_k(batch_size=64)


def test_acceptance_in_runs_values_long_blocks():
    """On predictable text whole blocks are accepted or the first draft is not: a draft after
    accepted ones is likelier accepted than the first. The per-position estimate values the drafts
    past 4 by that, more than the i.i.d. a^j model from the pooled rate of the same data does."""
    p = AdaptiveK(8)
    for i in range(40):
        p.observe(4, (4, 0)[i % 3 == 2], draft_s=0.001, verify_s=0.02)  # 2 of 3 blocks all accepted
    a = p.acceptance
    tokens = p.expected_tokens(8)
    iid = [(1 - a ** (k + 1)) / (1 - a) for k in range(9)]
    assert tokens[1] < iid[1] and tokens[8] - tokens[4] > iid[8] - iid[4] + 0.5  # runs: later drafts count more
    assert p.next_k() >= 6


def test_bound_is_respected():
    p = AdaptiveK(2)
    for _ in range(20):
        p.observe(2, 2, draft_s=0.0001, verify_s=0.02)
    assert p.next_k() == 2 and AdaptiveK(0).next_k() == 0


def test_measured_slower_speculation_stops():
    """Engine times alone favour speculating, but end to end (round trips, queueing) each
    emitted token costs more than a plain step would: after min_steps the policy stops."""
    slow, fast = AdaptiveK(4), AdaptiveK(4)
    for i in range(12):
        # verify forward 30 ms for k=4 (plain step ~ 30 / 1.48 = 20 ms); 2 accepted -> 3 tokens
        slow.observe(4, 2, draft_s=0.002, verify_s=0.03, step_s=0.09)  # 30 ms per token
        fast.observe(4, 2, draft_s=0.002, verify_s=0.03, step_s=0.045)  # 15 ms per token
        if i < slow.min_steps - 1:
            assert slow.next_k() > 0  # not judged on a few steps
    assert slow.slower_than_plain and slow.next_k() == 0
    assert not fast.slower_than_plain and fast.next_k() > 0


def test_batch_speculation_turns_speculation_off_where_it_measures_slower():
    """vLLM's loop asks once per engine step. A cost model: at batch 1 a speculative step emits 3
    tokens in 4 ms against 1 token in 3 ms without; at batch 32 it emits 80 tokens in 60 ms against
    32 in 12 ms (the drafter cannot keep up). The choice must speculate at batch 1 and not at 32,
    each measured on its own, with the step's tokens and time credited to the arm that made it."""
    from core.gate import BatchSpeculation

    cost = {(1, True): (3, 0.004), (1, False): (1, 0.003), (32, True): (80, 0.060), (32, False): (32, 0.012)}
    choice, now, tokens, used = BatchSpeculation(), 0.0, 0, {1: [], 32: []}
    for step in range(1200):
        batch = 1 if (step // 300) % 2 == 0 else 32  # the load changes, and comes back
        arm = choice.use(batch, tokens, now)
        used[batch].append(arm)
        tokens, dt = cost[(batch, arm)]
        now += dt
    c = choice.choices[1]
    explore = c.run / c.explore_every  # the share of steps spent trying the other arm
    assert sum(used[1][-200:]) >= 200 * (1 - explore) - 10, sum(used[1][-200:])  # speculates at batch 1
    assert sum(used[32][-200:]) <= 200 * explore + 10, sum(used[32][-200:])  # not at batch 32
    rep = choice.report()
    assert rep["1"]["spec_ms"] < rep["1"]["off_ms"] and rep["32"]["spec_ms"] > rep["32"]["off_ms"]
    assert BatchSpeculation(always=True).use(32, 0, 0.0) is True


def test_a_larger_load_starts_plain_where_a_smaller_one_chose_plain():
    """The replica's gate (plain decoding the safe arm): once speculation lost at 4 streams, 16 streams start
    plain and try speculation only when a try is due, instead of measuring both arms afresh; where it pays at
    16 after all, the tries find it. Without an inherited choice (a load below any measured one, or one above
    a load that chose speculation) both arms are measured first, as before."""
    from core.gate import BatchSpeculation

    def run(cost, loads, steps=400):
        gate, now, tokens, used = BatchSpeculation(explore_every=128, run=16, settle=4, window=12, margin=1.1,
                                                   prefer=False, back_margin=1.05, max_explore_every=1024), 0.0, 0, {}
        for load in loads:
            for _ in range(steps):
                arm = gate.use(load, tokens, now)
                used.setdefault(load, []).append(arm)
                tokens, dt = cost[(load, arm)]
                now += dt
        return gate, used

    loses = {(4, True): (8, 0.020), (4, False): (4, 0.008), (16, True): (32, 0.040), (16, False): (16, 0.014)}
    gate, used = run(loses, [4, 16])
    assert min(gate.choices.items())[1].best is False
    # no speculation before the first try is due
    assert sum(used[16][:120]) == 0, [i for i, a in enumerate(used[16]) if a]
    assert sum(used[16]) <= 2 * 16 + 4  # the tries, nothing more
    fresh, fresh_used = run(loses, [16])
    assert sum(fresh_used[16][:64]) >= 12  # measured afresh: speculation tried at once
    pays = {**loses, (16, True): (40, 0.020)}  # speculation pays at 16 streams after all
    gate, used = run(pays, [4, 16], steps=600)
    assert sum(used[16][-200:]) >= 150, sum(used[16][-200:])
    wins_below = {**loses, (4, True): (12, 0.009)}  # speculation chosen at 4: 16 measures both arms itself
    gate, used = run(wins_below, [4, 16])
    assert sum(used[16][:64]) >= 12

def test_the_gates_tries_wait_as_long_as_their_loss_asks():
    """With a budget, a try of speculation that measured it losing waits until the try costs that share of
    the wait: 16 steps at 1.43x a token, 2% of the wait, about 340 steps from the first choice on, where
    doubling from 128 tried at 128 and 256; where speculation pays, the budget changes nothing."""
    import itertools

    from core.gate import BatchSpeculation

    def run(cost, budget, steps=1500):
        gate, now, tokens, arms = BatchSpeculation(explore_every=128, run=16, settle=4, window=12, margin=1.1,
                                                   prefer=False, back_margin=1.05, max_explore_every=1024,
                                                   budget=budget), 0.0, 0, []
        for _ in range(steps):
            arm = gate.use(16, tokens, now)
            arms.append(arm)
            tokens, dt = cost[arm]
            now += dt
        starts = [i for i in range(1, len(arms)) if arms[i] and not arms[i - 1]]
        return arms, [b - a for a, b in itertools.pairwise(starts)]

    loses = {True: (32, 0.040), False: (16, 0.014)}
    arms, gaps = run(loses, 0.02)
    assert gaps and min(gaps) >= 320, gaps
    old_arms, old_gaps = run(loses, 0.0)
    assert old_gaps[0] < 200 and sum(arms) <= sum(old_arms) - 16, (old_gaps, sum(arms), sum(old_arms))
    pays = {True: (40, 0.020), False: (16, 0.014)}
    assert sum(run(pays, 0.02)[0][200:]) == sum(run(pays, 0.0)[0][200:]) >= 1250


def test_a_new_request_starts_from_what_the_replica_measured():
    """Step costs belong to the replica: a request arriving after others speculates by the costs
    and per-position acceptance they measured from its first step, where one on its own starts
    from the engine model and the neutral prior."""
    from core.policy import StepCosts

    costs = StepCosts()
    first = AdaptiveK(8, costs=costs)
    for _ in range(60):  # predictable text, a step costs 10 ms + 0.2 ms per draft, plain 8 ms
        k = first.next_k()
        first.observe(k, k, draft_s=0.0005 * k, verify_s=0.006, step_s=(0.010 + 0.0002 * k) if k else 0.008)
    assert costs.measured(1) >= first.min_steps
    assert costs.step_s(1, 8, first.model_s) == pytest.approx(0.0116, rel=0.05)
    late, alone = AdaptiveK(8, costs=costs), AdaptiveK(8)
    assert late.next_k() == 8  # the replica's positions say long blocks are accepted
    assert alone.next_k() < 8  # (the prior alone does not)


def test_step_costs_are_kept_per_batch_size():
    """A step at batch 64 is not a step at batch 1: a replica whose big batches are slow per draft
    speculates less there, and as much as ever for a lone request."""
    from core.policy import StepCosts

    costs = StepCosts()
    for batch, per_draft in ((1, 0.0002), (64, 0.004)):
        p = AdaptiveK(8, costs=costs)
        for _ in range(40):
            for k in (2, 2, 6, 6):
                p.observe(k, k - 1, draft_s=0.0005 * k, verify_s=0.006, step_s=0.010 + per_draft * k, batch_size=batch)
    assert costs.step_s(64, 6, lambda k: 1.0) > 2 * costs.step_s(1, 6, lambda k: 1.0)
    probes = [AdaptiveK(8, costs=costs) for _ in range(2)]  # (a request's first k is a run of steps: one call each)
    for probe in probes:
        for _ in range(20):
            probe.observe(4, 3, draft_s=0.002, verify_s=0.006)
    assert probes[0].next_k(batch_size=1) > probes[1].next_k(batch_size=64)


def test_rechecks_from_plain_decoding_back_off_while_they_fail():
    """Plain decoding measures speculation again now and then. On text the drafter never guesses, each
    failed recheck doubles the request's wait before the next, and the replica's other sequences are
    not held back (acceptance is the request's). Where a step costs more than the k + 1 plain steps
    it could save (here each draft costs 6 ms, a plain step 5), speculation loses at any acceptance:
    the replica's sequences then wait until a recheck's cost (a step's measured time beyond plain
    steps' for its expected tokens, for a run of steps) is ``recheck_budget`` of the wait: at k = 1,
    3 x (11 - 5 x 1.05) / (0.02 x 5), about 170 steps. A later request on the replica, which the replica's
    evidence keeps plain from its start, tries only once that evidence has aged for hundreds of plain steps."""
    from core.policy import StepCosts

    def drive(extra_s, steps=2000, costs=None):
        costs = costs or StepCosts()
        p, ks = AdaptiveK(4, recheck_steps=8, costs=costs), []
        for _ in range(steps):
            k = p.next_k()
            ks.append(k)
            p.observe(k, 0, draft_s=0.001 * k, verify_s=0.005, step_s=0.005 + extra_s(k))
        starts = [i for i in range(1, len(ks)) if ks[i] > 0 and ks[i - 1] == 0]
        return p, ks, starts, [b - a for a, b in itertools.pairwise(starts)]

    p, ks, starts, gaps = drive(lambda k: 0.004 * (k > 0), 1000)  # 9 ms a step at any k: acceptance decides
    assert len(gaps) >= 4 and all(a < b for a, b in itertools.pairwise(gaps)), gaps
    assert p.costs.recheck_in == 0 and max(gaps) <= p.max_recheck_steps + p.run, gaps
    late, ks, starts, _ = drive(lambda k: 0.004 * (k > 0), 1000, p.costs)
    assert ks[0] == 0 and starts and starts[0] > 250, starts  # (plain from its start: no try on the evidence)
    p, ks, starts, gaps = drive(lambda k: 0.006 * k)  # no acceptance pays
    assert len(gaps) >= 4 and min(gaps[2:]) >= 150, gaps  # (once the steps at k are measured)
    spent = sum(0.006 * k for k in ks[starts[0]:] if k > 0)  # beyond plain decoding, the first try aside
    assert spent < 2 * p.recheck_budget * 0.005 * (len(ks) - starts[0]), spent


def test_a_request_starts_from_the_replicas_recheck_wait():
    """A slow drafter is the replica's: a new request's first plain stretch waits as long as the
    replica's last failed recheck set, instead of rechecking after ``recheck_steps``."""
    from core.policy import StepCosts

    costs = StepCosts()

    def drive(p, steps):
        ks = []
        for _ in range(steps):
            k = p.next_k()
            ks.append(k)
            p.observe(k, 0, draft_s=0.02 * k, verify_s=0.005, step_s=0.005 + 0.02 * k)
        return ks

    drive(AdaptiveK(4, costs=costs), 400)
    assert costs.recheck_in > 100, costs.recheck_in
    late = drive(AdaptiveK(4, costs=costs), 100)
    assert sum(k > 0 for k in late) == 0, late  # plain from its first step: the replica measured plain faster


def _gate_server(tiny_engines):
    from deployments.verifier import VerifierServer

    _, _, ver, _ = tiny_engines
    server = VerifierServer({}, engine=ver)
    now = [0.0]
    server.clock = lambda: now[0]
    return server, now


def test_a_replica_gates_speculation_by_what_its_engine_steps_emit_per_second(tiny_engines):
    """The replica's choice at GATE_MIN_STREAMS streams or more, driven by its engine steps (fake clock): with 8
    streams, where 8 speculating sequences emit 3 tokens each in 60 ms and plain ones 1 each in 12 ms, steps
    go plain (but for the runs that re-measure speculation); where speculation emits faster, they speculate;
    a few streams are never gated."""
    from core.protocol import VerifyResult
    from deployments.replica_gate import GATE_HOLD_S, GATE_MIN_STREAMS

    def run(spec_cost, plain_cost, steps=400, prefill_every=0):
        server, now = _gate_server(tiny_engines)
        arms = []
        for j in range(steps):
            spec = server.speculating
            arms.append(spec)
            prefill = prefill_every and j % prefill_every == prefill_every - 1
            out = [VerifyResult(f"s{i}", num_accepted=2 if spec and not prefill else 0,
                                num_drafts=4 if spec and not prefill else 0) for i in range(8)]
            now[0] += 0.5 if prefill else spec_cost if spec else plain_cost
            server._gate_step(out, streams=8, prefill=bool(prefill))
        return server, arms[-200:]

    choice = lambda s: s.gate.choices[next(iter(s.gate.choices))]  # noqa: E731
    server, arms = run(0.060, 0.012)
    c = choice(server)
    assert sum(arms) <= 200 * c.run / c.explore_every + c.run, sum(arms)  # plain, but for re-measuring runs
    rep = server.gate.report()["8"]
    assert rep["spec_ms"] > rep["off_ms"] > 0
    server.speculating = False
    server._gate_step([], streams=GATE_MIN_STREAMS - 1)
    assert not server.speculating and server.gate_load() == 8  # the burst's stragglers: its choice holds
    end = server.clock()
    server.clock = lambda: end + GATE_HOLD_S
    server._gate_step([], streams=GATE_MIN_STREAMS - 1)
    # a few streams, the burst over: the requests' policies decide
    assert server.speculating and server.gate_load() == 0
    server, arms = run(0.030, 0.012)  # 24 tokens in 30 ms against 8 in 12: speculation pays
    c = choice(server)
    assert sum(arms) >= 200 * (1 - c.run / c.explore_every) - c.run, sum(arms)
    # prompts' prefills (0.5 s for a token a sequence) every 13 steps: credited to neither arm, so plain
    # decoding is still measured the faster (credited, one in an arm's window of 6 makes it the slower)
    server, arms = run(0.060, 0.012, prefill_every=13)
    assert sum(arms) <= 200 * c.run / c.explore_every + c.run, sum(arms)
    rep = server.gate.report()["8"]
    assert rep["spec_ms"] > rep["off_ms"] > 0, rep


def _noisy_gate(gate, now: list, spec_over_plain: float, steps: int, seed: int = 0):
    """Drive a replica's gate with 16 streams on fake time (``now``, its clock's): a plain engine step emits 16
    tokens in 25.6 ms (+-10%); a speculating one 16-80 tokens, at ``spec_over_plain`` times plain's seconds per
    token on average (+-50%), as served steps vary with the text's luck. -> (the arm of each step, seconds per
    token over all-plain)."""
    import random

    from core.protocol import VerifyResult

    rng, plain_s = random.Random(seed), 0.0016
    arms, total, tokens = [], 0.0, 0
    for _ in range(steps):
        spec = gate.speculating
        arms.append(spec)
        accepted = [rng.randint(0, 4) if spec else 0 for _ in range(16)]
        n = sum(a + 1 for a in accepted)
        dt = n * plain_s * (spec_over_plain * rng.uniform(0.5, 1.5) if spec else rng.uniform(0.9, 1.1))
        now[0] += dt
        total, tokens = total + dt, tokens + n
        gate._gate_step([VerifyResult(f"s{i}", num_accepted=a, num_drafts=4 if spec else 0)
                         for i, a in enumerate(accepted)], streams=16)
    return arms, total / tokens / plain_s


def test_the_replica_gate_holds_plain_decoding_through_lucky_tries(tiny_engines):
    """Where speculating batches are 1.34x slower per token, but each try of a few steps lands on luckier or
    unluckier text, the replica stays within 3.5% of plain decoding over 3,000 engine steps (the tries' cost),
    and its tries back off: the gaps between them double up to 1,024 steps. The replica's earlier gate (a
    symmetric margin of 1.2 over windows of 6 steps, a try every 128) cost 6% here: the negative control.
    Where speculation is 1.25x faster, the gate speculates on nine steps in ten."""
    from core.gate import BatchSpeculation

    costs = []
    for seed in range(4):
        server, now = _gate_server(tiny_engines)
        arms, cost = _noisy_gate(server, now, 1.34, 3000, seed)
        costs.append(cost)
        starts = [i for i in range(1, len(arms)) if arms[i] and not arms[i - 1]]
        gaps = [b - a for a, b in itertools.pairwise(starts)]
        assert max(gaps) >= 1024 and gaps[-1] >= 512, gaps
    assert max(costs) < 1.035, costs
    old, now = _gate_server(tiny_engines)
    old.gate = BatchSpeculation(explore_every=128, run=8, settle=4)
    assert _noisy_gate(old, now, 1.34, 3000, 0)[1] > 1.045  # (the earlier gate, on the same steps)
    server, now = _gate_server(tiny_engines)
    arms, cost = _noisy_gate(server, now, 0.8, 3000)
    assert sum(arms[500:]) > 0.9 * 2500 and cost < 0.85, (sum(arms[500:]), cost)


def test_the_replica_gate_credits_no_step_at_a_waves_edges(tiny_engines):
    """Waves of 16 streams: each ends with 30 steps where streams leave (15 down to 12, the choice still
    keyed by 16: fewer tokens a step at the same fixed cost, and a wait for each sequence that ended, so
    plain decoding is 1.5x dearer a token at 12-13 streams) and starts again with a prefill. Speculating
    steps cost 1.2x plain's. Credited, the edges read plain decoding slow and tries after them move the
    replica to speculation; uncredited (more than an eighth off the load), it stays plain."""
    import random

    from core.protocol import VerifyResult

    server, now = _gate_server(tiny_engines)
    rng, arms = random.Random(0), []
    for step in range(3000):
        phase = step % 100
        streams = 16 if phase < 70 else 15 - (phase - 70) // 8
        spec, prefill = server.speculating, phase == 0
        arms.append(spec and not prefill)
        accepted = [rng.randint(0, 4) if spec and not prefill else 0 for _ in range(streams)]
        n = sum(a + 1 for a in accepted)
        dearer = {16: 1.0, 15: 1.03, 14: 1.06}.get(streams, 1.5)
        per_token = 0.0016 * (1.2 * rng.uniform(0.8, 1.2) if spec else dearer * rng.uniform(0.95, 1.05))
        now[0] += 0.5 if prefill else n * per_token
        server._gate_step([VerifyResult(f"s{i}", num_accepted=a, num_drafts=4 if spec and not prefill else 0)
                           for i, a in enumerate(accepted)], streams=streams, prefill=prefill)
    assert sum(arms[500:]) < 0.05 * 2500, sum(arms[500:])


def test_the_replica_gate_returns_to_speculation_when_it_pays_again(tiny_engines):
    """Backed off to its longest wait on a load where speculation lost, the gate finds it faster again (the
    text turned predictable) within one wait and a try, and speculates from then on."""
    server, now = _gate_server(tiny_engines)
    _noisy_gate(server, now, 1.34, 4000)
    arms, _ = _noisy_gate(server, now, 0.7, 1500, seed=1)
    c = next(iter(server.gate.choices.values()))
    first = arms.index(True)
    assert first <= c.max_explore_every, first
    switched = next(i for i in range(first, len(arms)) if all(arms[i:i + 100]))  # (a try is 16 steps)
    assert switched <= c.max_explore_every + 2 * c.run, switched
    assert sum(arms[switched:]) >= 0.85 * len(arms[switched:])  # (and only tries of plain decoding after)


def test_gated_adaptive_requests_decode_plain_in_large_batches_and_the_same_tokens(tiny_engines, monkeypatch):
    """The wiring: with the replica's choice set to plain (measuring off), 5 concurrent adaptive requests on a
    real verifier and drafter engine plan no drafts while GATE_MIN_STREAMS or more of them run (their steps'
    plans recorded as made); with it set to speculate they do; the same greedy tokens either way."""
    import asyncio

    from configs import SamplingParams
    from deployments.drafter import DrafterServer
    from deployments.replica_gate import GATE_MIN_STREAMS, ReplicaGatedK

    plans = []  # (streams running on the replica, k) of every step's plan
    next_k = ReplicaGatedK.next_k

    def recorded(self, batch_size=1):
        k = next_k(self, batch_size)
        plans.append((self.server.streams, k))
        return k

    monkeypatch.setattr(ReplicaGatedK, "next_k", recorded)

    tok, _, ver, drafter = tiny_engines
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [tok.encode(t) for t in ("def add(a, b):", "import os\n", "class Foo:", "for i in range(", "x = [")]

    def run(speculating: bool, tag: str):
        server, _ = _gate_server(tiny_engines)
        server.local = DrafterServer({}, engine=drafter)
        server.gate, server.speculating = None, speculating

        async def one(i, p):
            steps = []
            async for group in server.speculate(p, params, f"{tag}{i}", k=4, k_policy="adaptive"):
                steps += group
            return steps

        async def main():
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return asyncio.run(main())

    outs = {}
    for speculating in (False, True):
        plans.clear()
        streams = run(speculating, f"gate{speculating}-")
        after_large = [k for n, k in plans if n >= GATE_MIN_STREAMS]
        assert len(prompts) >= GATE_MIN_STREAMS and after_large
        if speculating:
            assert any(after_large), after_large
        else:
            assert not any(after_large), after_large
        outs[speculating] = [[t for ids, _, _ in steps for t in ids] for steps in streams]
    assert outs[False] == outs[True] and all(len(o) == 24 for o in outs[True])


def test_a_burst_s_choice_holds_for_its_next_requests_which_never_call_the_drafter(tiny_engines):
    """Right after the replica ran GATE_MIN_STREAMS streams or more with plain decoding chosen, requests that
    start alone (a wave's first) decode plain from their first step, as the burst's did, and never reach the
    drafter (no draft, no release); once the burst is GATE_HOLD_S behind, their own policies speculate again.
    The same greedy tokens either way."""
    import asyncio

    from configs import SamplingParams
    from deployments.drafter import DrafterServer
    from deployments.replica_gate import GATE_HOLD_S, GATE_MIN_STREAMS

    tok, _, ver, drafter = tiny_engines
    server, now = _gate_server(tiny_engines)
    server.local = DrafterServer({}, engine=drafter)
    calls = []
    for name in ("propose", "release"):
        real = getattr(server.local, name)

        async def counted(*a, name=name, real=real):
            calls.append(name)
            return await real(*a)
        setattr(server.local, name, counted)
    server._gate_peak, server.speculating = (GATE_MIN_STREAMS * 2, 0.0), False  # a burst just decoded plain
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    async def one(tag):
        out = []
        async for group in server.speculate(tok.encode("def add(a, b):"), params, tag, k=4, k_policy="adaptive"):
            out += [t for ids, _, info in group for t in ids]
        return out

    async def main():
        held = await one("held")
        assert calls == [] and len(held) == 24
        now[0] += GATE_HOLD_S  # the burst is over: a lone request's own policy speculates
        assert await one("free") == held and "propose" in calls and "release" in calls

    asyncio.run(main())


def test_every_ks_cost_read_in_one_pass_is_each_ones_own():
    """The policy reads every k's step cost at once each step (one pass over the tables, on the
    verifier's critical path): each must be what that k alone reads, measured or off the line."""
    from core.policy import StepCosts

    costs = StepCosts()
    p = AdaptiveK(8, costs=costs)
    for i in range(60):  # k = 2, 3, 5 and plain measured (runs of 3), skewed steps; 1, 4, 6-8 off the line
        for k in (2, 3, 5, 0):
            for _ in range(3):
                p.observe(k, k - 1 if k else 0, draft_s=0.0004 * k, verify_s=0.006,
                          step_s=0.008 + 0.0011 * k + (0.004 if i % 7 == 0 else 0.0))
    ks = list(range(9))
    together = costs.step_all(1, ks, p.model_s)
    assert together == [costs.step_all(1, [k], p.model_s)[0] for k in ks]
    assert together[0] is not None and len(set(together)) == 9  # measured plain, and a line with a slope
    assert p.costs_all(ks) == [p.costs_all([k])[0] for k in ks]


def test_a_drafter_slowed_until_drafting_cannot_pay_is_left_for_plain_decoding(tiny_engines, monkeypatch):
    """A drafter replica slowed by fault injection (30 ms more per batch, against a few ms for a plain
    step of the tiny target; well inside the drafter timeout, so no step degrades): the default policy
    goes plain within a few steps, the replica's first request rechecks speculation at most once, and
    a later request on the same replica plays plain from its first step (the replica measured it), with
    the target's own greedy tokens."""
    import asyncio

    from configs import SamplingParams
    from deployments.drafter import DrafterServer
    from deployments.server import FAULT_INJECTION_ENV
    from tests.test_greedy_equivalence import reference

    tok, target, ver, drafter = tiny_engines
    monkeypatch.setenv(FAULT_INJECTION_ENV, "1")
    server, _ = _gate_server(tiny_engines)
    server.clock = __import__("time").perf_counter
    server.local = DrafterServer({}, engine=drafter)
    prompt, n = tok.encode("def add(a, b):"), 96
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    async def one(seq_id):
        return [info for group in [g async for g in server.speculate(prompt, params, seq_id, k=4, k_policy="adaptive")]
                for info in group]

    async def main():
        await server.local.inject_fault("slow", 0.03)
        return [await one(f"slow{i}") for i in range(2)]

    first, later = asyncio.run(main())
    for steps in (first, later):
        assert [t for ids, _, _ in steps for t in ids] == reference(target, prompt, n)
        assert not any(i.degraded for _, _, i in steps)
    spec = [j for j, (_, _, i) in enumerate(first) if i.k > 0]
    # its first step (the prompt's) and at most a try of `run` steps before plain, then at most one recheck
    assert spec and spec[0] == 0 and len(spec) <= 1 + 2 * AdaptiveK(4).run, spec
    assert sum(i.k > 0 for _, _, i in later) == 0, [i.k for _, _, i in later]
    costs = server.step_costs[0.0]  # (greedy requests')
    assert costs.recheck_in > n, costs.recheck_in


def test_a_step_with_more_drafts_is_never_read_as_cheaper():
    """Per-k step costs measured where each k happened to run are noisy and biased (served, lower ks read
    dearer than higher ones: docs/decisions/0032-policy-cold-start.md): the policy pools adjacent violators,
    weighted by their steps, so its costs never fall as k grows."""
    from core.policy import StepCosts

    costs = StepCosts()
    p = AdaptiveK(6, costs=costs)
    for k, ms, n in ((0, 3.2, 20), (1, 5.4, 12), (2, 4.1, 12), (3, 7.2, 3), (5, 6.2, 3)):
        for _ in range(n + 1):  # (a sequence's first step at a k is not measured)
            p.observe(k, 0, draft_s=0.0004 * k, verify_s=0.003, step_s=ms / 1000)
    raw = costs.step_all(1, range(7), p.model_s)
    assert raw[1] > raw[2] and raw[3] > raw[5]  # what the tables say, before pooling
    c = p.costs_all(range(7))
    assert c[0] == pytest.approx(0.0032)
    assert all(a <= b for a, b in zip(c[1:], c[2:])), c
    assert c[1] == c[2] and raw[2] < c[1] < raw[1]  # pooled: between the two, nearer the better measured
    assert p.costs_all([0, 3]) == [c[0], c[3]]  # any subset reads the same pooled costs


def test_a_cold_replica_measures_a_spread_of_k_once():
    """A replica's first request, on text where only the first draft is accepted, settles at a low k; its
    explorations try each k of a coarse grid the replica has not measured a try of (1, 2, 4, 8) before the best
    k's neighbours, so the replica's cost line has a spread of ks behind it. Later requests, with the
    grid measured, explore neighbours only."""
    from core.policy import StepCosts

    costs = StepCosts()

    def serve(steps: int):
        p, tried = AdaptiveK(8, costs=costs), []
        for _ in range(steps):
            k = p.next_k()
            tried.append(k)
            p.observe(k, min(k, 1), draft_s=0.0002 * k, verify_s=0.003, step_s=0.004 + 0.0006 * k if k else 0.003)
        return tried

    first = serve(200)
    row = costs.row(1)
    assert all(len(row.get(k, ())) >= 2 for k in (1, 2, 4, 8)), {k: len(v) for k, v in row.items()}
    assert max(set(first), key=first.count) <= 2  # it still settles where its text pays
    second = serve(200)
    assert 8 not in second[3:] and 4 not in second[3:], second  # its first k is a run of three steps



def test_a_sequences_first_decoding_step_is_not_read_as_a_steady_step():
    """The prompt's prefill reports no times, and the step after it is cold (the drafter catches up on
    the prompt): neither is a steady cost of k, for the replica or the request. The cold step, with the
    drafting the prefill waited for, and the first speculative step after plain ones are the replica's cold
    steps (what a try from plain decoding pays)."""
    p = AdaptiveK(4)
    p.observe(2, 1, start_s=0.006)  # the prefill: acceptance, and the drafting it waited for (the drafter's prompt)
    p.observe(2, 1, 0.003, 0.004, 0.012, 1)  # the first decoding step
    assert not p.costs.row(1) and not p.own.row(1)
    assert list(p.costs.cold[1]) == [(2, pytest.approx(0.018))]  # cold: with the prefill's drafting
    p.observe(2, 2, 0.0, 0.004, 0.005, 1)
    assert list(p.costs.row(1)[2]) == [0.005] and list(p.own.row(1)[2]) == [0.005]
    p.observe(0, 0, 0.0, 0.004, 0.004, 1)
    p.observe(2, 0, 0.002, 0.004, 0.011, 1)  # the first after plain steps: cold too
    assert [s for _, s in p.costs.cold[1]] == [pytest.approx(0.018), 0.011] and len(p.costs.row(1)[2]) == 1


def _serve_sampled(costs, cold_extra_s: float, requests: int, seed: int = 0, accept: float = 0.45,
                   horizon: int | None = None) -> list[list[int]]:
    """Requests of 128 steps on one replica's tables: each draft accepted with chance ``accept`` (sampled text), a
    plain step 4 ms, a steady one at k 4.5 + 0.8 k ms, a cold one (a sequence's first speculative step, or the
    first after plain steps) ``cold_extra_s`` more. Each request's ks, its prompt's prefill first."""
    import random

    rng, out = random.Random(seed), []
    for _ in range(requests):
        p = AdaptiveK(4, costs=costs, horizon=horizon)
        ks = [p.next_k()]
        p.observe(ks[0], next((j for j in range(ks[0]) if rng.random() >= accept), ks[0]))  # the prefill
        for _ in range(127):
            k = p.next_k()
            cold = k > 0 and ks[-1] == 0 or len(ks) == 1
            wall = 0.004 if k == 0 else 0.0045 + 0.0008 * k + (cold_extra_s if cold else 0.0)
            p.observe(k, next((j for j in range(k) if rng.random() >= accept), k), 0.0005 * k, 0.004, wall)
            ks.append(k)
        out.append(ks)
    return out


def test_a_new_request_starts_from_the_acceptance_the_replica_measured():
    """A new request's prior is the acceptance the replica's sequences measured at its temperature (shrunk
    towards ``prior`` while they have tested little), not the neutral prior: served at T = 0.8 the replica
    measured 0.35-0.45 while every new request assumed 0.6."""
    from core.policy import StepCosts

    costs = StepCosts()
    _serve_sampled(costs, 0.0, 2)
    measured = sum(costs.acceptance.accepted) / sum(costs.acceptance.tested)
    late, alone = AdaptiveK(4, costs=costs), AdaptiveK(4)
    assert measured < 0.5 and late.acceptance < alone.acceptance - 0.1, (measured, late.acceptance)
    assert measured <= late.acceptance and alone.acceptance == pytest.approx(alone.prior)
    assert late.expected_tokens(4)[4] < alone.expected_tokens(4)[4] - 0.3


def test_a_try_from_plain_decoding_pays_for_its_cold_step():
    """The step tables hold steady steps only; a try from plain decoding (a request's first, a recheck) also
    pays a cold step (the drafter catches up on the prompt or the tokens decoded plain; the pre-draft is gone),
    which the replica measures apart (``StepCosts.cold``) and charges to the try, over the tokens the request
    may still speculate on. On sampled text where a steady k pays a little (0.7 a draft), with cold steps 11 ms
    dearer, the replica's later requests of a few tokens decode plain from their first step and make no try in
    128 steps, while long ones try; where cold steps cost what steady ones do, every request tries. Where
    no steady k pays on what the replica measured (0.3 a draft), not even a long request tries."""
    from core.policy import StepCosts

    dear, cheap, hard = StepCosts(), StepCosts(), StepCosts()
    _serve_sampled(dear, 0.011, 3, accept=0.7)
    _serve_sampled(cheap, 0.0, 3, accept=0.7)
    _serve_sampled(hard, 0.0, 3, accept=0.3)
    assert dear.cold_extra_s(1, [0.0045 + 0.0008 * k for k in range(5)]) == pytest.approx(0.011, abs=0.002)
    later = _serve_sampled(dear, 0.011, 4, seed=1, accept=0.7, horizon=4)
    assert all(sum(k > 0 for k in ks) == 0 for ks in later), [sum(k > 0 for k in ks) for ks in later]
    assert all(ks[0] > 0 for ks in _serve_sampled(dear, 0.011, 4, seed=1, accept=0.7, horizon=2000))
    assert all(ks[0] > 0 for ks in _serve_sampled(cheap, 0.0, 4, seed=1, accept=0.7, horizon=4))
    assert all(ks[0] == 0 for ks in _serve_sampled(hard, 0.0, 4, seed=1, accept=0.3, horizon=2000))


def test_greedy_and_sampled_requests_measure_apart(tiny_engines):
    """A replica keeps its step costs and acceptance per draft position per temperature: a sampled request
    neither starts from what greedy ones measured nor moves it."""
    import asyncio

    from configs import SamplingParams
    from deployments.drafter import DrafterServer

    tok, _, _, drafter = tiny_engines
    server, _ = _gate_server(tiny_engines)
    server.clock = __import__("time").perf_counter
    server.local = DrafterServer({}, engine=drafter)
    prompt = tok.encode("def add(a, b):")
    greedy, sampled = (SamplingParams(temperature=t, max_tokens=48, ignore_eos=True, seed=1) for t in (0.0, 0.8))

    async def one(seq_id, params):
        return [g async for g in server.speculate(prompt, params, seq_id, k=4, k_policy="adaptive")]

    asyncio.run(one("g", greedy))
    g = server.costs_for(greedy)
    tested, measured = list(g.acceptance.tested), g.measured(1)
    assert measured > 0 and tested
    assert server.costs_for(sampled) is not g and not server.costs_for(sampled).acceptance.tested
    asyncio.run(one("s", sampled))
    s = server.costs_for(sampled)
    assert s.measured(1) > 0 and s.acceptance.tested
    assert g.acceptance.tested == tested and g.measured(1) == measured
    assert server.costs_for(SamplingParams(temperature=0.81, max_tokens=1)) is s
    # a structured output's steps (forced punctuation, accepted far more often) measure apart too
    from core.grammar import json_schema_constraint

    drafter.grammar_tokenizer = tok
    schema = {"type": "array", "items": {"enum": ["alpha", "beta"]}, "minItems": 6, "maxItems": 6}

    async def constrained():
        return [g async for g in server.speculate(prompt, greedy, "c", k=4, k_policy="adaptive",
                                                   constraint=json_schema_constraint(schema))]

    asyncio.run(constrained())
    assert server.costs_for(greedy, True) is not g and server.costs_for(greedy, True).acceptance.tested
    assert g.acceptance.tested == tested and g.measured(1) == measured


def test_rechecks_stop_while_the_replicas_rechecks_fail():
    """Where a text defeats the drafter at a temperature it stays so (sampled: noise, not a change of text), and
    each recheck costs a cold step and a run: a request that left speculation skips its rechecks while fewer
    than a quarter of the replica's recent ones resumed speculation, and rechecks as before where they win.
    A skip ages the evidence, so a recheck still comes now and then."""
    from core.policy import StepCosts

    def rechecks(costs):
        p, ks = AdaptiveK(4, costs=costs), []
        for i in range(600):  # predictable for 30 steps, then text the drafter never guesses
            k = p.next_k()
            ks.append(k)
            p.observe(k, k if i < 30 else 0, draft_s=0.001 * k, verify_s=0.005, step_s=0.009 if k else 0.005)
        return sum(1 for i in range(1, len(ks)) if ks[i] > 0 and ks[i - 1] == 0)

    assert rechecks(StepCosts(rechecks=(6.0, 8.0))) >= 4 and rechecks(StepCosts()) >= 4
    assert rechecks(StepCosts(rechecks=(0.0, 8.0))) == 0
    asked = [StepCosts(rechecks=(0.0, 8.0))] * 12
    won = [costs.rechecks_win() for costs in asked]  # (one replica's, asked at 12 recheck points)
    assert not won[0] and any(won), won  # skipped rechecks age the evidence until one goes ahead
