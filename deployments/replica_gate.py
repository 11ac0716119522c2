"""A verifier replica's choice whether its adaptive requests speculate at its present load, measured on its
engine steps (docs/decisions/0016-replica-gate.md), and the step costs its requests' policies share."""

from __future__ import annotations

import logging
import time

from configs import SamplingParams
from core.gate import BatchSpeculation
from core.policy import AdaptiveK, FixedK, StepCosts
from core.protocol import VerifyResult

log = logging.getLogger(__name__)
# from this many streams on the replica, its measured choice (``BatchSpeculation``) may turn the adaptive
# requests' speculation off; below it their own policies decide alone
GATE_MIN_STREAMS = 4
# ... and for this long after the replica last ran that many: the first and last requests of a burst (a wave's
# first arrivals, its stragglers) follow the choice made for the burst, not their own policies
GATE_HOLD_S = 1.0


class ReplicaGatedK:
    """An adaptive request's policy under its replica's choice: where the replica measured that engine steps
    at its present load (streams running) emit tokens faster without speculation, the step is plain.

    Why: each request's policy charges itself a step's whole wall time, but in a batch most of that
    time is the other sequences' rows. A request that stops speculating alone saves almost nothing, so
    every policy keeps speculating where the batch as a whole would be faster without. The replica sees
    the whole step: tokens emitted per second of engine steps, with and without.
    See docs/decisions/0016-replica-gate.md."""

    def __init__(self, policy: AdaptiveK, server: ReplicaGate):
        self.policy, self.server = policy, server

    def next_k(self, batch_size: int = 1) -> int:
        if not self.server.speculating and self.server.gate_load() >= GATE_MIN_STREAMS:
            return 0
        return self.policy.next_k(batch_size)

    def plain_ahead(self) -> int:
        return self.policy.plain_ahead()

    def observe(self, *args, **kwargs):
        self.policy.observe(*args, **kwargs)


class ReplicaGate:
    """The replica's side of ``ReplicaGatedK`` (a mixin of ``deployments.verifier.VerifierServer``): the
    arm its engine steps measure faster per load bucket, the step costs per temperature, each request's
    k policy."""

    def _init_gate(self) -> None:
        # what a step costs here and how often drafts are accepted, measured by every sequence (the adaptive
        # policy), per temperature (``costs_for``)
        self.step_costs: dict[float | tuple, StepCosts] = {}
        # whether adaptive requests speculate while GATE_MIN_STREAMS or more run here, measured per load bucket;
        # None: no measuring, ``speculating`` stays as set
        # plain decoding is the safe arm: speculation is chosen where it measures 1.1x faster, and left where it
        # measures 1.05x slower; the arm not in use is re-measured for 16 engine steps (12 measured: a stretch of
        # text long enough that its luck does not decide) after 128, backing off to one try in 1,024 steps while
        # tries confirm the choice, and at once as far as a try costs 2% of the wait by what speculation lost
        # (docs/decisions/0016-replica-gate.md, 0066-gate-try-budget.md)
        self.gate: BatchSpeculation | None = BatchSpeculation(
            explore_every=128, run=16, settle=4, window=12, margin=1.1, prefer=False, back_margin=1.05,
            max_explore_every=1024, budget=0.02)
        self.speculating = True
        self.clock = time.perf_counter
        self.streams = 0  # requests whose loop runs here now (the gate's load measure)
        self._gate_load = 0  # the stream count the gate's choice is keyed by (see _gate_step)
        self._gate_prev = (0, False)  # (streams, prefill) of the engine step before
        self._gate_peak = (0, float("-inf"))  # (streams, when) of the last engine step at GATE_MIN_STREAMS or more

    def _gate_step(self, out: list[VerifyResult], streams: int | None = None, prefill: bool = False) -> None:
        """An engine step ended (on the engine's thread): credit its emitted tokens and the time since the step
        before to the arm in use, and choose the arm of the steps that follow, per bucket of ``streams`` (the
        requests running here). Keyed by streams, not by the step's batch: speculating sequences wait on drafts
        and fill smaller batches than plain ones, so batch-size buckets each see one arm only: they hand the
        choice back and forth and speculation runs on where plain decoding is faster
        (docs/decisions/0016-replica-gate.md). A few streams are the requests' own policies' business.
        A step that carries a prompt's prefill (or a resend of a whole sequence) is credited to neither arm:
        it costs many times a decoding step for one token a sequence, and a burst of new requests landing
        in one arm's few measured steps made that arm look slower for as long as its window held them. Nor is
        the step after one (its sequences send their first tokens out), one right after a stream started or
        ended, or one whose streams are more than an eighth off the load its choice is keyed by: the last
        steps of a wave, a few sequences left at the same fixed cost a step, read plain decoding slower
        than it was, and the next wave then speculated (docs/decisions/0016-replica-gate.md)."""
        if self.gate is None:
            return
        streams = self.streams if streams is None else streams
        steady = not (prefill or self._gate_prev[1]) and streams == self._gate_prev[0]
        self._gate_prev = (streams, prefill)
        if streams < GATE_MIN_STREAMS:
            self.gate.reset()  # (the next large load starts a fresh measurement)
            if self.gate_load() < GATE_MIN_STREAMS:
                self.speculating = True
            return  # (a burst's stragglers: its choice holds, but they are not credited to it)
        self._gate_peak = (streams, self.clock())
        # the load the choice is keyed by moves only past a quarter of itself: streams ending and starting
        # around a bucket's edge (63, 64, 63) would hand the choice back and forth between two buckets
        if not 0.75 * self._gate_load <= streams <= 1.25 * self._gate_load:
            self._gate_load = streams
        tokens = sum(r.num_accepted + 1 for r in out if not (r.cache_miss or r.error))
        # (a step allowed to speculate where no sequence drafted says nothing of speculation's cost)
        unsure = self.speculating and not any(r.num_drafts for r in out)
        if not steady or unsure or 8 * abs(streams - self._gate_load) > self._gate_load:
            self.gate.reset()  # (the time to the next step is measured from here)
        c = self.gate.choice(self._gate_load)  # (the one choice `use` can change)
        before = c.best
        self.speculating = self.gate.use(self._gate_load, tokens, self.clock())
        if c.best is not None and c.best != before:
            log.info("speculation %s at %d+ streams: %.2f ms/token with it, %.2f without", "on" if c.best else "off",
                     1 << (StepCosts.bucket(self._gate_load) - 1), 1e3 * c.s_per_token.get(True, 0.0),
                     1e3 * c.s_per_token.get(False, 0.0))

    def gate_load(self) -> int:
        """The load the replica's choice applies to: the streams running here, or the most an engine step ran
        within the last GATE_HOLD_S, if more. Why held: served in waves of 4 streams of 64 tokens, each wave's
        first requests planned their first step before the replica had stepped at 4 streams, and its last ones
        ran on alone below 4: each speculated on its own policy (a drafter prefill and a step at k = 4-8 for
        a few tokens) where the replica had chosen plain decoding for the wave."""
        streams, when = self._gate_peak
        held = streams if self.clock() - when < GATE_HOLD_S else 0
        return max(self.streams, held)

    def costs_for(self, params: SamplingParams, constrained: bool = False) -> StepCosts:
        """The step costs and acceptance shared by this replica's requests at this request's temperature (to
        0.1). Why apart: a sampled draft is accepted less often than a greedy one (served, HumanEval: 2.3
        tokens a step at k = 3 and T = 0.8 against 2.7 greedy) and its step costs more (the drafter ships its
        q), and a replica that served greedy requests first had its sampled ones start from greedy's rates at
        k = 4-8, where k = 3 pays best (docs/decisions/0033-costs-per-temperature.md)."""
        if constrained:  # a grammar's forced punctuation is accepted far more often: its own table
            return self.step_costs.setdefault((round(params.temperature, 1), "constrained"), StepCosts())
        return self.step_costs.setdefault(round(params.temperature, 1), StepCosts())

    def _policy(self, k: int, k_policy: str, params: SamplingParams, constrained: bool, left: int):
        """A request's k policy: ``fixed``, or the adaptive one on this replica's tables for its temperature, under
        the replica's gate, knowing the ``left`` tokens it may emit (a try's cold step is paid over them)."""
        if k_policy != "adaptive":
            return FixedK(k)
        return ReplicaGatedK(AdaptiveK(k, costs=self.costs_for(params, constrained), horizon=left), self)
