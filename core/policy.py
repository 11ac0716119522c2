"""How many tokens to speculate, step by step, from what each step costs where it runs.

A request's ``num_speculative_tokens`` is an upper bound. Each step the policy picks the
k in [0, bound] that maximises expected tokens per second of wall time:

    tokens(k) = 1 + sum_{j<=k} S(j)        (S(j): the measured chance that drafts 1..j are all
                                            accepted; for i.i.d. acceptance a, (1 - a^(k+1)) / (1 - a))
    value(k)  = tokens(k) / t(k) / (1 + c_verify * k * extra_load)

S(j) comes from the request's own acceptance per draft position (decayed; plain steps age it
slowly), each position shrunk towards what every sequence on the replica measured there, plus
one pseudo-acceptance of optimism while the request has never tested it: such a position looks
as likely as the replica's sequences found it, never as unlikely as the last one this request
tested (which would trap a request at a low k), and under-speculating on predictable text loses
more than over-speculating on hard text. t(k) is the wall time of a step with k drafts where the loop runs
(on the verifier replica: queueing, batching, drafting on the critical path, everything), measured
at this batch size by every sequence on the replica (``StepCosts``: per k, shrunk towards a line
through the measured ks), and this request's own steps shrunk towards that (a step's cost depends
on the request too: its pre-drafts hit as often as its drafts are accepted). A new request thus
starts from what the replica knows. Until ``min_steps`` speculative steps are measured, the
engine model t0 (1 + c_verify k) + k d stands in, with t0 the verify forward scaled to one token
and d the drafter's time per token on the critical path; an unmeasured plain step is the model's
t0, so speculation must beat plain decoding as measured (once chosen, plain steps are measured
too). No CPU or GPU constant decides: c_verify only shapes estimates until the measurements
exist. ``extra_load`` grows with the verifier's batch beyond ``saturation_batch``: there every
extra verified token is throughput taken from other requests, so speculation is cut back.

k = 0 is one of the choices, and one it returns from: a plain stretch lasts ``recheck_steps``
steps, then the best speculative k is tried again (a stretch twice as long after each recheck
that went back to plain, up to ``max_recheck_steps``: on text the drafter cannot guess, rechecks
would cost more than they find). Every ``explore_every`` steps a neighbour of the best k
is tried, so the measured costs follow the cost curve as load changes. A k is tried for ``run``
steps in a row and its step time measured on steady-state steps only (the previous step used the
same k): the step right after a change pays for it (its pre-draft, made for the old k, misses).
Why adaptive is the default: docs/decisions/0006-default-policy.md.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class PositionAcceptance:
    """Acceptance per draft position, decayed: draft j + 1 is tested when the j drafts before it
    were accepted, so ``rate(j)`` is the chance draft j + 1 is accepted given the ones before."""

    decay: float
    tested: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def observe(self, k: int, num_accepted: int):
        if len(self.tested) < k:
            self.tested += [0.0] * (k - len(self.tested))
            self.accepted += [0.0] * (k - len(self.accepted))
        for j in range(len(self.tested)):
            self.tested[j] *= self.decay
            self.accepted[j] *= self.decay
            if j < k and j <= num_accepted:
                self.tested[j] += 1
                self.accepted[j] += j < num_accepted

    def age(self, factor: float):
        self.tested = [x * factor for x in self.tested]
        self.accepted = [x * factor for x in self.accepted]

    def rate(self, j: int, prior: float, weight: float = 2.0, optimism: float = 0.0) -> float:
        """Draft j + 1's acceptance, shrunk towards ``prior`` with ``weight`` pseudo-observations,
        plus ``optimism`` pseudo-acceptances while it has never been tested."""
        n = self.tested[j] if j < len(self.tested) else 0.0
        a = self.accepted[j] if j < len(self.accepted) else 0.0
        optimism = optimism if j >= len(self.tested) else 0.0  # (once tested, the evidence speaks)
        return (a + weight * prior + optimism) / (n + weight + optimism)


@dataclass
class StepCosts:
    """What a step costs where the loop runs, shared by every sequence on a replica: the wall
    seconds of a step with k drafts, per verifier batch size (power-of-two buckets), each k from its
    last ``per_k`` steady-state steps (see ``step_s``). A step's cost belongs to the replica (its
    engines, its load, its network), so a new request starts from what the others measured (each
    request measuring costs alone rarely got past k = 3 in a 256-token request served). Also the
    replica's acceptance per draft position (a new request's prior), and the engine model's inputs,
    ``plain_est_s`` and ``draft_per_token_s`` (engine seconds), used until steps are measured."""

    per_k: int = 24  # recent steps per k and bucket
    shrink: float = 4.0  # pseudo-steps of the line in a k's estimate
    plain_est_s: float = 0.0  # a plain step, from the verify forward passes (engine time only)
    draft_per_token_s: float = 0.0  # drafting on the critical path, per draft token
    table: dict[int, dict[int, deque]] = field(default_factory=dict)  # bucket -> k -> recent wall seconds
    spec_steps: dict[int, int] = field(default_factory=dict)  # bucket -> speculative steps measured
    # every sequence's acceptance per draft position: a request's prior for each position (taking
    # its last tested position's rate for the ones it has not tested traps a request at a low k)
    acceptance: PositionAcceptance = field(default_factory=lambda: PositionAcceptance(0.98))

    @staticmethod
    def bucket(batch_size: int) -> int:
        return max(1, batch_size).bit_length()

    def _near(self, table: dict, batch_size: int):
        """The entry of the batch's bucket, else of the nearest bucket measured (None: nothing yet)."""
        if not table:
            return None
        b = self.bucket(batch_size)
        return table[min(table, key=lambda x: (abs(x - b), x))]

    def observe(self, batch_size: int, k: int, step_s: float):
        b = self.bucket(batch_size)
        self.table.setdefault(b, {}).setdefault(k, deque(maxlen=self.per_k)).append(step_s)
        if k > 0:
            self.spec_steps[b] = self.spec_steps.get(b, 0) + 1

    def row(self, batch_size: int) -> dict[int, deque]:
        """The recent wall seconds of steps, per k, at (or nearest) this batch size."""
        return self._near(self.table, batch_size) or {}

    def measured(self, batch_size: int) -> int:
        """Speculative steps measured in (or nearest) this batch size's bucket."""
        return self._near(self.spec_steps, batch_size) or 0

    def step_s(self, batch_size: int, k: int, model) -> float | None:
        """A step with k drafts (None: for k > 0, no speculative k measured; for k = 0, plain steps not
        measured). Each k's mean, shrunk towards the line through every speculative k's mean (weighted
        by its steps) with ``shrink`` pseudo-steps: steps are skewed (a late pre-draft or a queued
        batch adds a drafting pass or a forward), and a k measured on a few bad ones must not be
        written off for good; an unmeasured k is read off the line. With one k measured, the line
        is its mean scaled by ``model(k)``, the engine model."""
        return self.step_all(batch_size, [k], model)[0]

    def step_all(self, batch_size: int, ks, model) -> list[float | None]:
        """``step_s`` for each of ``ks``, the means and the line computed once (the policy asks for
        every k each step, on the verifier's critical path)."""
        row = self.row(batch_size)
        mean = {m: sum(v) / len(v) for m, v in row.items() if v}
        spec = {m: t for m, t in mean.items() if m > 0}
        if spec:
            w = {m: len(row[m]) for m in spec}
            n = sum(w.values())
            mk = sum(w[m] * m for m in spec) / n
            mt = sum(w[m] * spec[m] for m in spec) / n
            var = sum(w[m] * (m - mk) ** 2 for m in spec)
            if var <= 0:
                base = model(mk)
            else:
                slope = max(0.0, sum(w[m] * (m - mk) * (spec[m] - mt) for m in spec) / var)
        out = []
        for k in ks:
            if k == 0 or not spec:
                out.append(mean.get(0) if k == 0 else None)
                continue
            if var <= 0:
                line = mt * model(k) / base if base > 0 else mt
            else:
                line = max(1e-6, mt + slope * (k - mk))
            out.append(line if k not in spec else (w[k] * spec[k] + self.shrink * line) / (w[k] + self.shrink))
        return out


@dataclass
class AdaptiveK:
    bound: int
    prior: float = 0.6  # per-token acceptance assumed before any evidence
    c_verify: float = 0.12  # prior: extra verify cost per extra token, relative to a plain step (until measured)
    decay: float = 0.9  # weight of older steps in the acceptance estimate
    plain_decay: float = 0.97  # ... per plain step
    step_weight: float = 0.2  # weight of the newest step in the engine model's estimates
    saturation_batch: int = 16  # verifier batch size beyond which extra verified tokens cost throughput
    min_steps: int = 8  # steps measured (by any sequence sharing ``costs``) before measured costs are trusted
    recheck_steps: int = 16  # plain steps before speculation is measured again (doubling while rechecks fail)
    max_recheck_steps: int = 64
    margin: float = 0.03  # a k must look this much better than the current one to switch to it (noise)
    plain_margin: float = 0.02  # and plain decoding this much better than every speculative k
    explore_every: int = 16  # steps between tries of a neighbour of the best k
    run: int = 3  # steps a k is tried in a row: a step right after a change of k is not measured
    optimism: float = 1.0  # pseudo-acceptances per draft position: little-tested positions look likelier
    costs: StepCosts = field(default_factory=StepCosts)  # the replica's, shared by its sequences
    own: StepCosts = field(default_factory=StepCosts)  # this request's steps alone
    accepted_w: float = 0.0
    tested_w: float = 0.0
    steps: int = 0
    plain_run: int = 0
    positions: PositionAcceptance | None = None  # this request's acceptance per draft position
    _explore_up: bool = True
    _trying: tuple[int, int] = (0, 0)  # (k, steps left) of a try in progress
    _recheck: int = 16  # plain steps before the next recheck
    _rechecking: bool = False  # the try in progress is a recheck from plain decoding
    _prev_k: int | None = None  # the k of the previous observed step
    current: int | None = None  # the k chosen last (None: not yet)

    @property
    def acceptance(self) -> float:
        """Per-token acceptance: accepted / tested draft positions (a position is tested when
        all before it were accepted), smoothed towards the prior with two pseudo-observations."""
        return (self.accepted_w + 2 * self.prior) / (self.tested_w + 2)

    def __post_init__(self):
        if self.positions is None:
            self.positions = PositionAcceptance(self.decay)
        self._recheck = self.recheck_steps

    def expected_tokens(self, bound: int) -> list[float]:
        """Expected tokens of a step with k drafts, k = 0..bound: 1 + sum over j <= k of S(j), the
        chance the first j drafts are all accepted, S(j) the product of this request's measured
        acceptance of draft j given the ones before. On predictable text acceptance comes in runs,
        so a draft after accepted ones is likelier accepted than the pooled rate says (the i.i.d.
        model, a^j, undervalues large k there). Each position is shrunk towards what the replica's
        sequences measured there (a position this request has not tested takes that; before the
        replica has, the rate of the position before it)."""
        a = min(max(self.acceptance, 1e-3), 0.999)
        shared = self.costs.acceptance
        out, surv, c = [1.0], 1.0, a
        for j in range(bound):
            prior = shared.rate(j, c) if j < len(shared.tested) and shared.tested[j] > 1 else c
            c = self.positions.rate(j, prior)  # (the next untested position's prior, without optimism)
            surv *= min(max(self.positions.rate(j, prior, optimism=self.optimism), 1e-3), 0.999)
            out.append(out[-1] + surv)
        return out

    def model_s(self, k: float) -> float:
        """Engine-model step time: a plain step, extra verified tokens, drafting on the critical path."""
        return self.costs.plain_est_s * (1 + self.c_verify * k) + k * self.costs.draft_per_token_s

    def costs_all(self, ks, batch_size: int = 1) -> list[float]:
        """Wall time of a step with each of ``ks`` drafts at this batch size (each table read once):
        measured on this replica (``StepCosts``) once ``min_steps`` speculative steps are, else the
        engine model; where this request has steps of its own at k, their mean shrunk towards that.
        An unmeasured plain step is the model's (the verify forward alone), so speculation must beat
        plain decoding as measured (once chosen, plain steps are measured too)."""
        if self.costs.measured(batch_size) < self.min_steps:
            replica = [self.model_s(k) for k in ks]
        else:
            replica = [r if r is not None else self.model_s(k)
                       for k, r in zip(ks, self.costs.step_all(batch_size, ks, self.model_s))]
        own = self.own.row(batch_size)
        out = []
        for k, r in zip(ks, replica):
            mine = own.get(k)
            # this request's own steps, shrunk towards the replica's: what a step costs depends on the
            # request too (its pre-drafts hit as often as its drafts are accepted)
            out.append((sum(mine) + self.costs.shrink * r) / (len(mine) + self.costs.shrink) if mine else r)
        return out

    def values(self, batch_size: int = 1) -> list[float]:
        extra_load = max(0.0, batch_size / self.saturation_batch - 1)
        tokens = self.expected_tokens(self.bound)
        out = []
        for k, cost in enumerate(self.costs_all(range(self.bound + 1), batch_size)):
            if cost <= 0:  # nothing measured at all yet
                cost = 1 + self.c_verify * k
            out.append(tokens[k] / cost / (1 + self.c_verify * k * extra_load))
        return out

    @property
    def slower_than_plain(self) -> bool:
        """Measured: a plain step brings more tokens per second than any speculative k."""
        v = self.values()
        return self.steps >= self.min_steps and len(v) > 1 and v[0] > max(v[1:])

    def _try(self, k: int) -> int:
        self._trying = (k, self.run - 1)
        return k

    def next_k(self, batch_size: int = 1) -> int:
        if self.bound == 0:
            return 0
        k, left = self._trying
        if left > 0:  # a try runs `run` steps: its first pays for the change, the others are measured
            self._trying = (k, left - 1)
            return k
        plain = self.current == 0 and self.plain_run > 0
        # a plain stretch lasts until its recheck (aged evidence would otherwise lure the policy
        # into one-step probes at a large k, each paying a whole drafting pass)
        if plain and (self.plain_run < self._recheck or self.costs.step_s(batch_size, 0, self.model_s) is None):
            self.plain_run += 1
            return 0
        v = self.values(batch_size)
        best_spec = max(range(1, len(v)), key=lambda k: (v[k], -k))
        if plain:  # measure speculation again: conditions may have changed
            self.plain_run, self.current, self._rechecking = 0, best_spec, True
            return self._try(best_spec)
        best = 0 if v[0] > (1 + self.plain_margin) * v[best_spec] else best_spec
        cur = self.current
        if cur is not None and cur != best and v[best] <= (1 + self.margin) * v[cur]:
            best = cur  # not clearly better: stay, measurements are noisy
        self.current = best
        if self._rechecking:  # a recheck's verdict: back to plain waits twice as long next time
            self._rechecking = False
            self._recheck = min(self.max_recheck_steps, 2 * self._recheck) if best == 0 else self.recheck_steps
        if best == 0:
            self.plain_run = 1
            return 0
        self.plain_run = 0
        if self.steps >= self.min_steps and self.steps % self.explore_every == 0:
            self._explore_up = not self._explore_up
            step = 1 if self._explore_up else -1
            if 1 <= best + step <= self.bound:
                return self._try(best + step)
        return best

    def observe(self, k: int, num_accepted: int, draft_s: float = 0.0, verify_s: float = 0.0,
                step_s: float = 0.0, batch_size: int = 1):
        """One step: k drafts, num_accepted accepted; drafting on the critical path and the verify
        forward pass (engine seconds), the step's wall seconds where the loop runs, and the
        verifier's batch size in that step."""
        costs, w = self.costs, self.step_weight
        if verify_s > 0:
            plain = verify_s / (1 + self.c_verify * k)
            costs.plain_est_s = plain if costs.plain_est_s == 0 else costs.plain_est_s + w * (plain - costs.plain_est_s)
        if k > 0:
            costs.draft_per_token_s += w * (draft_s / k - costs.draft_per_token_s)
        wall = step_s if step_s > 0 else verify_s + draft_s
        # steady state only: a step right after a change of k pays for it (a pre-draft made for the
        # old k misses), which would make every k tried once look slower than the one in use
        if wall > 0 and self._prev_k == k:  # (a sequence's first step, cold, is never measured)
            costs.observe(batch_size, k, wall)
            self.own.observe(batch_size, k, wall)
        self._prev_k = k
        if k <= 0:
            # plain steps age the evidence slowly (half of it in about 23 of them): text changes, and
            # speculation tried again after a plain stretch must be judged on what it meets then
            self.accepted_w *= self.plain_decay
            self.tested_w *= self.plain_decay
            self.positions.age(self.plain_decay)
            return
        self.steps += 1
        self.accepted_w = self.decay * self.accepted_w + num_accepted
        self.tested_w = self.decay * self.tested_w + num_accepted + (1 if num_accepted < k else 0)
        self.positions.observe(k, num_accepted)
        self.costs.acceptance.observe(k, num_accepted)


@dataclass
class FixedK:
    """Always the request's k (vLLM's behaviour)."""

    bound: int

    def next_k(self, batch_size: int = 1) -> int:
        return self.bound

    def observe(self, *args, **kwargs):
        pass


@dataclass
class Breaker:
    """A circuit breaker: after a failed or late call, the guarded thing is left alone until the
    back-off expires, doubling from ``min_backoff_s`` up to ``max_backoff_s``; the next call then
    probes it, and a success resets the back-off. Around one sequence's drafter (its steps decode
    without speculation meanwhile: one request's slow call never turns speculation off for
    others), and around each drafter replica a verifier replica reaches directly (its sequences
    are placed by Serve's router meanwhile, on the others)."""

    max_backoff_s: float = 10.0
    min_backoff_s: float = 0.5
    down_until: float = 0.0
    backoff_s: float = 0.0

    def open(self, now: float) -> bool:
        return now < self.down_until

    def failed(self, now: float, at_least: float = 0.0) -> float:
        self.backoff_s = min(self.max_backoff_s, max(self.min_backoff_s, at_least, 2 * self.backoff_s))
        self.down_until = now + self.backoff_s
        return self.backoff_s

    def succeeded(self):
        self.backoff_s = 0.0


@dataclass
class MeasuredChoice:
    """A yes/no choice made by what it measures: seconds per emitted token of the steps taken
    with each arm. An arm's cost may show in the step after the one that used it, so an arm is
    measured on steady-state steps only, those whose previous step used the same arm: their cost
    includes both sides, which a step right after a switch would split between the arms. Both arms
    are tried first, in runs of ``run`` steps; then the faster is used, and the other is tried for
    a run every ``explore_every`` steps. ``use()`` picks the arm of a step; ``observe`` records the
    step once it is done."""

    always: bool = False  # always the first arm, measuring nothing (pre-drafting: pools on hardware of their own)
    explore_every: int = 32
    run: int = 3  # steps an arm is used in a row when it is tried (the first is a switch: not measured)
    first: int = 3  # steady-state steps measured per arm before choosing
    weight: float = 0.2  # of the newest step in an arm's seconds per token
    window: int = 0  # > 0: an arm's seconds per token is that of its last `window` steps instead of an average
    margin: float = 1.0  # the other arm must measure this many times faster to replace the chosen one
    settle: int = 1  # an arm is measured once it has been used this many steps in a row (its caches warm)
    _best: bool | None = None
    _streak: int = 0
    s_per_token: dict[bool, float] = field(default_factory=dict)
    _recent: dict[bool, list] = field(default_factory=lambda: {True: [], False: []})
    n: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    steps: int = 0
    _arms: list = field(default_factory=lambda: [None, None])  # the arms of the previous step and this one
    _left: int = 0  # steps left in the run being tried

    def use(self) -> bool:
        if self.always:
            return True
        self.steps += 1
        if self._left > 0:  # stay on the arm being tried
            self._left -= 1
            arm = self._arms[1]
        else:
            unmeasured = [a for a in (True, False) if self.n[a] < self.first]
            best = None if unmeasured else min((True, False), key=lambda a: self.s_per_token[a])
            if best is not None and self._best is not None and best != self._best \
                    and self.s_per_token[best] * self.margin > self.s_per_token[self._best]:
                best = self._best  # not faster by the margin: stay (noise would flip it back and forth)
            self._best = best
            arm = unmeasured[0] if unmeasured else (not best) if self.steps % self.explore_every == 0 else best
            if arm != best:
                self._left = self.run - 1
        self._streak = self._streak + 1 if arm == self._arms[1] else 1
        self._arms = [self._arms[1], arm]
        return arm

    @property
    def best(self) -> bool | None:
        """The arm chosen as the faster by the last ``use`` (None until both arms are measured)."""
        return self._best

    def observe(self, arm: bool, step_s: float, tokens: int):
        if tokens <= 0 or step_s <= 0 or self._arms != [arm, arm] or self._streak <= self.settle:
            return  # not steady state: the previous step used the other arm (or the arm is not settled yet)
        x = step_s / tokens
        self.n[arm] += 1
        if self.window:  # seconds over tokens of the last `window` steps: long enough to span a stretch of
            recent = self._recent[arm]  # text the drafter guesses badly (or well), which shorter ones see as noise
            recent.append((step_s, tokens))
            del recent[: -self.window]
            self.s_per_token[arm] = sum(t for t, _ in recent) / sum(n for _, n in recent)
            return
        old = self.s_per_token.get(arm)
        self.s_per_token[arm] = x if old is None else old + self.weight * (x - old)


class TrimmedMean:
    """The mean of the last ``window`` observations with the highest and lowest ``trim`` share of them (at
    least one each, from 3 observations) left out: steps the host stalled (several times their usual
    length, on a shared machine) do not move it unless they are more than that share, yet it follows a
    lasting change within about half a window. From 3 observations it is their median."""

    def __init__(self, window: int = 32, trim: float = 0.25):
        self.window, self.trim = window, trim
        self._xs: deque[float] = deque(maxlen=window)
        self._value: float | None = None  # kept until the next observation (read every step, added to less)

    def add(self, x: float) -> None:
        self._xs.append(x)
        self._value = None

    def __len__(self) -> int:
        return len(self._xs)

    @property
    def value(self) -> float:
        if self._value is None:
            xs = sorted(self._xs)
            cut = max(1, int(self.trim * len(xs))) if len(xs) >= 3 else 0
            kept = xs[cut: len(xs) - cut]
            self._value = sum(kept) / len(kept)
        return self._value


@dataclass
class PreDraftCosts:
    """What pre-drafting costs and saves where the loop runs, measured by every sequence on a verifier
    replica (a property of its drafter and verifier hardware, not of one request), per number of
    drafts k of the step, each as the trimmed mean (``TrimmedMean``) of its last ``window``
    observations, in seconds:
    - ``draft``: drafting on a step's critical path, by how the step's drafts came: "none" (the step
      before did not pre-draft), "hit" (a pre-drafted branch was used), "miss" (the pre-draft was
      discarded, and the drafter may still be busy with it);
    - ``rest``: the step's time outside that drafting (the verify forward, the loop, the hand-off),
      by whether the step itself pre-drafted (a pre-draft computed beside the verify slows it where
      drafter and verifier share cores);
    - ``hit``: the share of pre-drafts that hit, over every k (a sequence's own, once it has some,
      counts more).
    Each is measured as a step's components, not as seconds per token: a step's tokens depend on
    the text, not on whether it was pre-drafted, and dividing by them made the comparison noise.

    Why per k: a replica's steps differ in k (requests ask for different k, the adaptive policy
    changes it step by step), and a step's time and its pre-draft's size grow with k. Pooled, the
    arms compare steps of different sizes: on a replica serving k = 4 and k = 8 requests in turn,
    the k = 8 steps' costs decide for the k = 4 requests, which then rarely pre-draft.

    Why trimmed means: the arm not in use is measured only in short runs, so its figure is a few
    steps old and few. With exponentially weighted means, one stalled step in such a run (a
    scheduling hiccup on a busy machine) is enough to turn pre-drafting off for whole requests
    where pre-drafting every step is faster than never. See docs/decisions/0004-pre-drafting.md."""

    window: int = 32  # observations per term
    weight: float = 0.1  # of the newest pre-draft outcome in the hit rate
    min_obs: int = 3  # per term, before a saving is estimated from it
    draft: dict[tuple[int, str], TrimmedMean] = field(default_factory=dict)  # (k, outcome)
    rest: dict[tuple[int, bool], TrimmedMean] = field(default_factory=dict)  # (k, pre-drafted)
    hit: float | None = None

    def observe(self, k: int, pre_drafted: bool, outcome: str | None, draft_s: float, step_s: float) -> None:
        self.draft.setdefault((k, outcome or "none"), TrimmedMean(self.window)).add(draft_s)
        self.rest.setdefault((k, pre_drafted), TrimmedMean(self.window)).add(max(0.0, step_s - draft_s))
        if outcome is not None:
            x = float(outcome == "hit")
            self.hit = x if self.hit is None else self.hit + self.weight * (x - self.hit)

    def term(self, terms: dict, key) -> float | None:
        """A term's trimmed mean (``draft`` by (k, outcome), ``rest`` by (k, arm)), None while it has
        fewer than ``min_obs``."""
        t = terms.get(key)
        return t.value if t is not None and len(t) >= self.min_obs else None

    def report(self) -> dict:
        """In milliseconds, per k: what a replica's ``stats()`` shows of its pre-drafting."""
        out = {"hit_rate": None if self.hit is None else round(self.hit, 3), "by_k": {}}
        for k in sorted({k for k, _ in self.draft} | {k for k, _ in self.rest}):
            saving = self.saving_s(k)
            out["by_k"][k] = {
                "draft_ms": {o: round(1000 * t.value, 3) for (kk, o), t in sorted(self.draft.items()) if kk == k},
                "rest_ms": {("pre_draft" if a else "no_pre_draft"): round(1000 * t.value, 3)
                            for (kk, a), t in sorted(self.rest.items()) if kk == k},
                "saving_ms_per_step": None if saving is None else round(1000 * saving, 3)}
        return out

    def saving_s(self, k: int, hit: float | None = None) -> float | None:
        """Expected seconds a pre-draft saves per step of k drafts (negative: it costs), at hit rate
        ``hit`` (default: the replica's); None until every term for k has been measured ``min_obs`` times."""
        hit = self.hit if hit is None else hit
        none, rest_pre, rest_plain = (self.term(self.draft, (k, "none")), self.term(self.rest, (k, True)),
                                      self.term(self.rest, (k, False)))
        if hit is None or none is None or rest_pre is None or rest_plain is None:
            return None
        # (a term not seen yet: a hit drafts nothing on the critical path, a miss drafts as if none was made)
        d_hit, d_miss = self.term(self.draft, (k, "hit")), self.term(self.draft, (k, "miss"))
        with_pre = hit * (d_hit or 0.0) + (1 - hit) * (none if d_miss is None else d_miss) + rest_pre
        return none + rest_plain - with_pre


@dataclass
class PreDraftChoice:
    """Whether to pre-draft the next block of a step of k drafts: where ``PreDraftCosts`` (shared by a
    replica's sequences) says it saves time for that k at this sequence's hit rate. Until every term
    for k is measured it takes the arm that measures a missing one (without pre-drafting first), in
    runs of ``run`` steps; then it keeps the arm that saves, and tries the other for a run every
    ``explore_every`` steps so the means stay current. ``margin``: the other arm must save this share
    of a step to replace the chosen one."""

    always: bool = False  # pre-draft every step, measuring nothing (pools on hardware of their own)
    costs: PreDraftCosts = field(default_factory=PreDraftCosts)
    explore_every: int = 24
    run: int = 3
    margin: float = 0.02
    prior: int = 4  # pseudo-observations of the replica's hit rate in this sequence's
    _hits: int = 0
    _pre: int = 0  # this sequence's pre-drafts that were checked (hits + misses)
    _best: dict[int, bool] = field(default_factory=dict)  # per k
    _left: int = 0
    steps: int = 0
    _arm: bool = True

    def hit_rate(self) -> float | None:
        rep = self.costs.hit
        if rep is None:
            return self._hits / self._pre if self._pre else None
        return (self._hits + self.prior * rep) / (self._pre + self.prior)

    def use(self, k: int) -> bool:
        """Whether the next step, of k drafts, pre-drafts the block after it."""
        if self.always:
            return True
        self.steps += 1
        if self._left > 0:
            self._left -= 1
            return self._arm
        c = self.costs
        saving = c.saving_s(k, self.hit_rate())
        if saving is None:  # a term unmeasured: take the arm that measures it
            if c.term(c.rest, (k, False)) is None:  # steps without pre-drafting
                arm = False
            elif c.term(c.rest, (k, True)) is None or c.hit is None:  # steps that pre-draft, and their hit rate
                arm = True
            else:  # only steps not pre-drafted for are missing
                arm = False
        else:
            step = c.term(c.draft, (k, "none")) + c.term(c.rest, (k, False))
            if abs(saving) > self.margin * step:
                self._best[k] = saving > 0
            best = self._best.get(k, True)
            explore = self.steps % self.explore_every == 0
            arm = (not best) if explore else best
        if arm != self._arm:
            self._left = self.run - 1
        self._arm = arm
        return arm

    def observe(self, k: int, pre_drafted: bool, outcome: str | None, draft_s: float, step_s: float) -> None:
        """A finished speculative step of k drafts: whether it pre-drafted, how its own drafts came
        ("hit", "miss", None), its drafting on the critical path and its wall time."""
        if outcome is not None:
            self._pre += 1
            self._hits += outcome == "hit"
        if not self.always:
            self.costs.observe(k, pre_drafted, outcome, draft_s, step_s)


@dataclass
class BatchSpeculation:
    """Whether a whole engine step speculates, chosen per batch size (buckets of powers of two) by
    measured tokens per second of engine steps: where verification saturates, or the drafter pool
    cannot keep up, speculation is turned off for that batch size and tried again now and then.
    For an engine that runs the loop itself and asks for drafts once per step (vLLM's proposer),
    where per-sequence policies do not see the batch's cost."""

    always: bool = False
    explore_every: int = 64  # engine steps between runs that re-measure the arm not in use
    run: int = 12  # steps of such a run; the first `settle` of them are not measured (the switch's lag)
    settle: int = 6
    choices: dict[int, MeasuredChoice] = field(default_factory=dict)
    _last: tuple | None = None  # (choice, arm, time) of the previous step

    def use(self, batch: int, tokens: int, now: float) -> bool:
        """``tokens``: emitted by the step that just ended (the previous call's arm); -> this step's arm."""
        if self._last is not None:
            choice, arm, t = self._last
            choice.observe(arm, now - t, tokens)
        if self.always:
            return True
        choice = self.choice(batch)
        arm = choice.use()
        self._last = (choice, arm, now)
        return arm

    def choice(self, batch: int) -> MeasuredChoice:
        """The choice for this batch size's bucket (made on first use)."""
        return self.choices.setdefault(StepCosts.bucket(batch), MeasuredChoice(
            explore_every=self.explore_every, run=self.run, first=6, window=6, margin=1.2, settle=self.settle))

    def reset(self) -> None:
        """Forget the step in progress: the next ``use`` starts a fresh measurement (the steps between were
        not this choice's)."""
        self._last = None

    def report(self) -> dict:
        """Per batch-size bucket (lowest batch size in it): ms per token of each arm, measured steps."""
        return {str(1 << (b - 1)): {"spec_ms": round(1000 * c.s_per_token.get(True, 0.0), 3),
                                     "off_ms": round(1000 * c.s_per_token.get(False, 0.0), 3),
                                     "steps": [c.n[True], c.n[False]]} for b, c in sorted(self.choices.items())}
