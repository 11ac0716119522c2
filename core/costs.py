"""What the adaptive policy (``core.policy``) measures: acceptance per draft position, and what a
step with k drafts costs where the loop runs, shared by the sequences of a replica."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# plain steps (any sequence's on a replica) after which its cold steps' cost is measured again (see cold_extra_s)
COLD_STALE = 1024


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
    plain_steps: int = 0  # steps behind plain_est_s
    draft_steps: int = 0  # ... behind draft_per_token_s
    recheck_in: int = 0  # plain steps (any sequence's) before the sequences here recheck speculation again
    table: dict[int, dict[int, deque]] = field(default_factory=dict)  # bucket -> k -> recent wall seconds
    spec_steps: dict[int, int] = field(default_factory=dict)  # bucket -> speculative steps measured
    # bucket -> recent (k, wall seconds) of cold speculative steps: a sequence's first, or the first after plain
    # steps (the drafter catches up on the tokens decoded meanwhile, the pre-draft made before them is gone),
    # with the drafting its prompt's prefill step waited for; ``cold_extra_s`` reads what they cost beyond steady
    cold: dict[int, deque] = field(default_factory=dict)
    plain_since_cold: int = 0  # plain steps (any sequence's) since the last cold step
    rechecks: tuple[float, float] = (0.0, 0.0)  # rechecks that resumed speculation, rechecks (decayed)
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

    def observe_cold(self, batch_size: int, k: int, step_s: float):
        self.cold.setdefault(self.bucket(batch_size), deque(maxlen=self.per_k)).append((k, step_s))
        self.plain_since_cold = 0

    def cold_extra_s(self, batch_size: int, steady) -> float | None:
        """What a cold speculative step costs beyond a steady step at its k (``steady[k]``, seconds), the median
        of the recent ones at (or nearest) this batch size; None while fewer than three are measured, or after
        ``COLD_STALE`` plain steps without one (no try would measure it again). Why: the tables hold steady
        steps only, so a try's first step, its drafter catching up, was invisible to the policy; served at
        T = 0.8, requests that tried speculation and left it ran slower than plain decoding, their few
        speculative steps far dearer than steady ones. The median: a fresh replica's first calls cost
        tens of times a step (docs/decisions/0056-cold-tries.md)."""
        entries = self._near(self.cold, batch_size)
        if not entries or len(entries) < 3 or self.plain_since_cold > COLD_STALE:
            return None
        extra = sorted(max(0.0, s - steady[k]) for k, s in entries if k < len(steady))  # (a request's k, at most)
        return extra[len(extra) // 2] if len(extra) >= 3 else None

    def recheck_won(self, won: bool):
        n, w = self.rechecks
        self.rechecks = (0.9 * n + won, 0.9 * w + 1)

    def rechecks_win(self) -> bool:
        """Whether a sequence that left speculation should recheck it: while fewer than 4 rechecks are measured
        here, or a quarter or more of them resumed speculation. A recheck skipped ages the evidence, so one in
        several comes anyway. Why: served at T = 0.8, a request whose text defeated the drafter rechecked 3
        times in 128 tokens, each a cold step and two more, and none resumed; greedy, rechecks often find
        predictable text again (docs/decisions/0056-cold-tries.md)."""
        won, tried = self.rechecks
        if tried < 4 or won >= 0.25 * tried:
            return True
        self.rechecks = (0.9 * won, 0.9 * tried)
        return False

    def prior(self, default: float, weight: float) -> float:
        """The per-token acceptance (accepted over tested draft positions) every sequence here measured, shrunk
        towards ``default`` with ``weight`` pseudo-tests: a new request's prior."""
        a = self.acceptance
        return (sum(a.accepted) + weight * default) / (sum(a.tested) + weight)

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


def monotone(costs: list[float], weights: list[float]) -> list[float]:
    """``costs`` (indexed by k) made non-decreasing in k over the speculative ks (k = 0 as it is), by
    pooling adjacent violators, weighted by the steps behind each estimate: a step with more drafts
    verifies and drafts more, so it never costs less. Why: the per-k means are noisy and biased by where
    each k was used (a k tried a few times on text where its pre-drafts missed); served, smaller ks read
    dearer than larger ones, which held a request at k = 2 (docs/decisions/0032-policy-cold-start.md)."""
    blocks: list[list[float]] = []  # [pooled cost, weight, count], from k = 1 on
    for c, w in zip(costs[1:], weights[1:]):
        blocks.append([c, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            c2, w2, n2 = blocks.pop()
            c1, w1, n1 = blocks[-1]
            blocks[-1] = [(c1 * w1 + c2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
    return costs[:1] + [c for c, _, n in blocks for _ in range(n)]
