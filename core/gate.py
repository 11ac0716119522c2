"""Whether a whole engine step speculates, measured: the replica's gate (``deployments.verifier``,
docs/decisions/0016-replica-gate.md) and vLLM's proposer (``verifier.vllm_proposer``), where the
per-sequence policies do not see what the batch as a whole costs."""

from __future__ import annotations

from dataclasses import dataclass, field

from core.costs import StepCosts


@dataclass
class MeasuredChoice:
    """A yes/no choice made by what it measures: seconds per emitted token of the steps taken
    with each arm. An arm's cost may show in the step after the one that used it, so an arm is
    measured on steady-state steps only, those whose previous step used the same arm: their cost
    includes both sides, which a step right after a switch would split between the arms. Both arms
    are tried first, in runs of ``run`` steps; then the faster is used, and the other is tried for
    a run every ``explore_every`` steps. ``use()`` picks the arm of a step; ``observe`` records the
    step once it is done.

    ``prefer``: the safe arm (plain decoding), left only where the other measures ``margin`` times
    faster in a run of it and again in a second run, and returned to once it measures ``back_margin``
    times faster. ``max_explore_every``: each try that confirms the arm in use doubles the steps to
    the next, up to this; a change of arm starts again from ``explore_every``. Why both: served in
    waves of 16 streams, where a speculating batch was slower a token than a plain one, a try's few
    steps on lucky text measured speculation faster; with a symmetric margin of 1.2 the replica then
    speculated on while it measured less than 1.2x slower, and tries every 128 steps landed in every
    wave (docs/decisions/0016-replica-gate.md)."""

    always: bool = False  # always the first arm, measuring nothing (pre-drafting: pools on hardware of their own)
    explore_every: int = 32
    run: int = 3  # steps an arm is used in a row when it is tried (the first is a switch: not measured)
    first: int = 3  # steady-state steps measured per arm before choosing
    weight: float = 0.2  # of the newest step in an arm's seconds per token
    window: int = 0  # > 0: an arm's seconds per token is that of its last `window` steps instead of an average
    margin: float = 1.0  # the other arm must measure this many times faster to replace the chosen one
    settle: int = 1  # an arm is measured once it has been used this many steps in a row (its caches warm)
    prefer: bool | None = None  # the safe arm (None: both alike, ``margin`` either way)
    back_margin: float = 1.0  # with ``prefer``: how much faster it must measure to be returned to
    max_explore_every: int = 0  # > explore_every: tries back off, doubling while they confirm the arm in use
    # > 0, with ``prefer``: a try of the other arm costs at most this share of the steps to the next, by what it
    # measured the other arm to lose (the wait at least that long, up to ``max_explore_every``)
    budget: float = 0.0
    _try: list = field(default_factory=lambda: [0.0, 0])  # seconds and tokens of the other arm's run, every step
    _plain_step_s: float = 0.0  # a steady step of the preferred arm (decayed mean)
    _best: bool | None = None
    _interval: int = 0  # steps from one try to the next (explore_every, doubled while tries confirm)
    _next_try: int = 0  # the step of the next try
    _confirming: bool = False  # a second run of the other arm is on, before leaving the safe one
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
            order = (True, False) if self.prefer is None else (self.prefer, not self.prefer)
            unmeasured = [a for a in order if self.n[a] < self.first]
            best = None if unmeasured else self._choose()
            if best is not None and best != self.prefer and best != self._best and self.prefer is not None \
                    and not self._confirming:  # leaving the safe arm: on a second run of the other, measured anew
                self._confirming, self._left, arm = True, self.run - 1, best
            else:
                self._confirming = False
                arm = unmeasured[0] if unmeasured else self._settle(best)
                if arm != best:
                    self._left = self.run - 1
        self._streak = self._streak + 1 if arm == self._arms[1] else 1
        if self._streak == 1 and arm != self.prefer:
            self._try = [0.0, 0]  # (a run of the other arm begins)
        self._arms = [self._arms[1], arm]
        return arm

    def _settle(self, best: bool) -> bool:
        """Make ``best`` the choice (both arms measured) and pick this step's arm: it, or the other on a try.
        A try that just ended confirming the choice doubles the wait for the next; a change of choice starts
        the tries again from ``explore_every``; with a ``budget``, a choice of the preferred arm waits at least
        ``_paid_wait``."""
        if self._interval and best == self._best and self._arms[1] == (not best):
            paid = self._paid_wait() if best == self.prefer else 0
            self._interval = min(self.max_explore_every, max(2 * self._interval, paid))
            self._next_try = self.steps + self._interval
        if best != self._best:
            self._interval = self.explore_every if self.max_explore_every > self.explore_every else 0
            if self._interval and best == self.prefer:
                self._interval = min(self.max_explore_every, max(self._interval, self._paid_wait()))
            self._next_try = self.steps + (self._interval or self.explore_every)
        self._best = best
        return (not best) if self._due() else best

    def _paid_wait(self) -> int:
        """Steps to wait for a try of the arm not preferred to cost ``budget`` of them, the longer of: its ``run``
        steps times what it measured to lose a token against the preferred arm; what its last run cost in all
        beyond plain steps for its tokens, in plain steps. Why: served on two cores, waves of 16 and
        64 streams with a try's run of speculation in them ran 1.15-1.7x slower than plain ones, and tries
        backing off from every 128 steps landed in wave after wave (docs/decisions/0066-gate-try-budget.md)."""
        s = self.s_per_token
        if self.budget <= 0 or self.prefer is None or len(s) < 2:
            return 0
        loss = s[not self.prefer] / s[self.prefer] - 1
        wait = self.run * loss / self.budget if loss > 0 else 0.0
        # what the last run of it cost in all, its first steps too (not measured for the arms' speeds: cold, the
        # drafter catching up on what plain steps decoded), over what plain steps take for its tokens
        extra = self._try[0] - self._try[1] * s[self.prefer]
        if extra > 0 and self._plain_step_s > 0:
            wait = max(wait, extra / (self.budget * self._plain_step_s))
        return int(wait)

    def _choose(self) -> bool:
        """The faster arm, both measured: the arm in use stays unless the other is faster by ``margin`` (noise
        would flip it back and forth), or, with ``prefer``, the safe arm unless the other is faster by it."""
        s = self.s_per_token
        if self.prefer is not None:
            other = not self.prefer
            if self._best == other:
                return self.prefer if s[self.prefer] * self.back_margin < s[other] else other
            # (only on a run of the other just ended: its window is fresh)
            return other if self._arms[1] == other and s[other] * self.margin < s[self.prefer] else self.prefer
        best = min((True, False), key=lambda a: s[a])
        if self._best is not None and best != self._best and s[best] * self.margin > s[self._best]:
            return self._best
        return best

    def _due(self) -> bool:
        """Whether the arm not in use is tried now: every ``explore_every`` steps, or backed off."""
        if not self._interval:
            return self.steps % self.explore_every == 0
        return self.steps >= self._next_try  # (the try's end sets the next: ``use``)

    def inherit(self, other: MeasuredChoice) -> None:
        """Start on ``other``'s choice as if both arms had been measured here, their speeds ``other``'s until
        this choice's own steps replace them; the other arm's first try after ``explore_every`` steps."""
        self._best = other.best
        self.s_per_token = dict(other.s_per_token)
        self.n = {arm: max(self.first, 1) for arm in (True, False)}
        self._interval = self.explore_every if self.max_explore_every > self.explore_every else 0
        if self._interval and self._best == self.prefer:  # (a try here loses at least what it lost there)
            self._interval = min(self.max_explore_every, max(self._interval, self._paid_wait()))
        self._next_try = self.steps + (self._interval or self.explore_every)

    @property
    def best(self) -> bool | None:
        """The arm chosen as the faster by the last ``use`` (None until both arms are measured)."""
        return self._best

    def observe(self, arm: bool, step_s: float, tokens: int):
        if arm != self.prefer and self.prefer is not None and tokens > 0 and step_s > 0:
            self._try[0] += step_s
            self._try[1] += tokens
        if tokens <= 0 or step_s <= 0 or self._arms != [arm, arm] or self._streak <= self.settle:
            return  # not steady state: the previous step used the other arm (or the arm is not settled yet)
        if arm == self.prefer:
            self._plain_step_s += (step_s - self._plain_step_s) * (self.weight if self._plain_step_s else 1.0)
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
    window: int = 6  # measured steps an arm's speed is pooled over (each arm's own last ones)
    margin: float = 1.2
    prefer: bool | None = None  # (``MeasuredChoice``)
    back_margin: float = 1.0
    max_explore_every: int = 0
    budget: float = 0.0  # (``MeasuredChoice``)
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
        """The choice for this batch size's bucket (made on first use). A new bucket above one that chose the
        safe arm starts on it, as if measured, and tries the other arm only when its first try is due: a
        verify pass costs more a token the larger the batch while the drafts it checks stay as good, so
        where speculation lost at a smaller load it loses at a larger one. Measuring both arms afresh at
        each larger load ran speculation for a run of steps at every new load, and a wave's first steps at
        16 and 64 streams paid for it (docs/decisions/0056-cold-tries.md)."""
        bucket = StepCosts.bucket(batch)
        if bucket not in self.choices:
            self.choices[bucket] = c = MeasuredChoice(
                explore_every=self.explore_every, run=self.run, first=self.window, window=self.window,
                margin=self.margin, settle=self.settle, prefer=self.prefer, back_margin=self.back_margin,
                max_explore_every=self.max_explore_every, budget=self.budget)
            below = [self.choices[b] for b in sorted(self.choices) if b < bucket]
            if self.prefer is not None and below and below[-1].best == self.prefer:
                c.inherit(below[-1])
        return self.choices[bucket]

    def reset(self) -> None:
        """Forget the step in progress: the next ``use`` starts a fresh measurement (the steps between were
        not this choice's)."""
        self._last = None

    def report(self) -> dict:
        """Per batch-size bucket (lowest batch size in it): ms per token of each arm, measured steps."""
        return {str(1 << (b - 1)): {"spec_ms": round(1000 * c.s_per_token.get(True, 0.0), 3),
                                     "off_ms": round(1000 * c.s_per_token.get(False, 0.0), 3),
                                     "steps": [c.n[True], c.n[False]]} for b, c in sorted(self.choices.items())}
