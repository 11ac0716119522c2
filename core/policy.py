"""How many tokens to speculate, step by step, from what each step costs where it runs.

A request's ``num_speculative_tokens`` is an upper bound. Each step the policy picks the
k in [0, bound] that maximises expected tokens per second of wall time:

    tokens(k) = 1 + sum_{j<=k} S(j)        (S(j): the measured chance that drafts 1..j are all
                                            accepted; for i.i.d. acceptance a, (1 - a^(k+1)) / (1 - a))
    value(k)  = tokens(k) / t(k) / (1 + c_verify * k * extra_load)

S(j) comes from the request's own acceptance per draft position (decayed; plain steps age it slowly), each position
shrunk towards what every sequence on the replica measured there, plus one pseudo-acceptance of optimism while the
request has never tested it: such a position looks as likely as the replica's sequences found it, never as unlikely
as the last one this request tested (which would trap a request at a low k), and under-speculating on predictable
text loses more than over-speculating on hard text. t(k) is the wall time of a step with k drafts where the loop
runs (on the verifier replica: queueing, batching, drafting on the critical path, everything), measured at this
batch size by every sequence on the replica at this temperature (``StepCosts``: per k, shrunk towards a line through
the measured ks), and this request's own steps shrunk towards that (a step's cost depends on the request too: its
pre-drafts hit as often as its drafts are accepted), made non-decreasing in k (``monotone``). A new request thus
starts from what the replica knows; a cold replica tries a coarse grid of k once (``_sparse_k``), so that its cost
line has a spread of ks behind it. Until ``min_steps`` speculative steps are measured, the engine model
t0 (1 + c_verify k) + k d stands in, with t0 the verify forward scaled to one token and d the drafter's time per
token on the critical path; an unmeasured plain step is the model's t0, so speculation must beat plain decoding as
measured (once chosen, plain steps are measured too). No CPU or GPU constant decides: c_verify only shapes estimates
until the measurements exist. ``extra_load`` grows with the verifier's batch beyond ``saturation_batch``: there every
extra verified token is throughput taken from other requests, so speculation is cut back.

k = 0 is one of the choices, and one it returns from: a plain stretch lasts until the best
speculative k is tried again, twice as long after each failed recheck and long enough that what
speculating cost before it is ``recheck_budget`` of the stretch (``_verdict``), while the replica's
rechecks win (``StepCosts.rechecks_win``). A try from plain decoding by a request plain from its
start must pay for its cold step, measured apart (``_try_pays``). Every ``explore_every`` steps a
neighbour of the best k is tried; a k is tried for ``run`` steps and measured on steady-state steps
only (the step after a change pays for it: its pre-draft misses). Why: docs/decisions/0006-default-policy.md,
0027-one-policy.md, 0032-policy-cold-start.md, 0033-costs-per-temperature.md, 0056-cold-tries.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from core.costs import PositionAcceptance, StepCosts, monotone

__all__ = ["AdaptiveK", "Breaker", "FixedK", "PositionAcceptance", "StepCosts"]


@dataclass
class AdaptiveK:
    bound: int
    prior: float = 0.6  # per-token acceptance assumed before any evidence
    c_verify: float = 0.12  # prior: extra verify cost per extra token, relative to a plain step (until measured)
    decay: float = 0.9  # weight of older steps in the acceptance estimate
    plain_decay: float = 0.97  # ... per plain step
    replica_plain_decay: float = 0.998  # the replica's acceptance, per plain step of any sequence there
    step_weight: float = 0.2  # weight of the newest step in the engine model's estimates
    saturation_batch: int = 16  # verifier batch size beyond which extra verified tokens cost throughput
    min_steps: int = 8  # steps measured (by any sequence sharing ``costs``) before measured costs are trusted
    recheck_steps: int = 16  # plain steps before speculation is measured again (doubling while rechecks fail)
    max_recheck_steps: int = 1024
    recheck_budget: float = 0.02  # what failed rechecks may cost, as a share of the plain stretch between them
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
    _tokens: dict = field(default_factory=dict)  # k -> this request's steps at k and their tokens (decayed)
    _prev_k: int | None = None  # the k of the previous observed step
    _start_s: float = 0.0  # drafting the prompt's prefill step waited for (charged to the first cold step)
    horizon: int | None = None  # tokens the request may emit (max_tokens; None: unknown)
    _emitted: int = 0
    current: int | None = None  # the k chosen last (None: not yet)

    @property
    def acceptance(self) -> float:
        """Per-token acceptance: accepted / tested draft positions, shrunk towards ``base_prior`` (2 pseudo-tests)."""
        return (self.accepted_w + 2 * self.base_prior) / (self.tested_w + 2)

    @property
    def base_prior(self) -> float:
        """Before its own evidence, a request assumes what the replica's sequences measured at its temperature,
        shrunk towards ``prior`` (``StepCosts.prior``). Why: docs/decisions/0056-cold-tries.md."""
        return self.costs.prior(self.prior, self.min_steps)

    def __post_init__(self):
        if self.positions is None:
            self.positions = PositionAcceptance(self.decay)
        self._recheck = self.recheck_steps

    def expected_tokens(self, bound: int, optimism: float | None = None) -> list[float]:
        """Expected tokens of a step with k drafts, k = 0..bound: 1 + sum over j <= k of S(j), the chance the
        first j drafts are all accepted, S(j) the product of this request's measured acceptance of draft j given
        the ones before. On predictable text acceptance comes in runs, so a draft after accepted ones is
        likelier accepted than the pooled rate says (the i.i.d. model, a^j, undervalues large k there). Each
        position is shrunk towards what the replica's sequences measured there or this request's rate at the
        position before, whichever is higher: a request that beats the replica where it has tested expects to
        where it has not. Why: served, with hard prompts on the replica, easy ones took the replica's low rates
        past their k, never tested them, and stayed at k = 1-2 where k = 4 emitted twice the tokens a step
        (docs/decisions/0027-one-policy.md)."""
        a = min(max(self.acceptance, 1e-3), 0.999)
        shared = self.costs.acceptance
        out, surv, c, opt = [1.0], 1.0, a, self.optimism if optimism is None else optimism
        for j in range(bound):
            prior = max(c, shared.rate(j, c)) if j < len(shared.tested) and shared.tested[j] > 1 else c
            c = self.positions.rate(j, prior)  # (the next untested position's prior, without optimism)
            surv *= min(max(self.positions.rate(j, prior, optimism=opt), 1e-3), 0.999)
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
        plain decoding as measured (once chosen, plain steps are measured too). Made non-decreasing in k
        over every k up to the bound (``monotone``), whichever ``ks`` are asked for."""
        wanted, ks = list(ks), range(max([self.bound, *ks]) + 1)
        if self.costs.measured(batch_size) < self.min_steps:
            replica = [self.model_s(k) for k in ks]
        else:
            replica = [r if r is not None else self.model_s(k)
                       for k, r in zip(ks, self.costs.step_all(batch_size, ks, self.model_s))]
        own, row = self.own.row(batch_size), self.costs.row(batch_size)
        out, weights = [], []
        for k, r in zip(ks, replica):
            mine = own.get(k)
            # this request's own steps, shrunk towards the replica's: what a step costs depends on the
            # request too (its pre-drafts hit as often as its drafts are accepted)
            out.append((sum(mine) + self.costs.shrink * r) / (len(mine) + self.costs.shrink) if mine else r)
            weights.append(1 + len(row.get(k, ())) + len(mine or ()))
        full = monotone(out, weights)
        return [full[k] for k in wanted]

    def tokens_all(self, optimism: float | None = None) -> list[float]:
        """Expected tokens of a step with k drafts, k = 0..bound: where this request has steps at k, their
        mean tokens shrunk towards the per-position model (``expected_tokens``) with ``costs.shrink``
        pseudo-steps. Why: on text that repeats, what k emits depends on where its blocks end, which no
        per-position rate predicts (one held-out prompt: k = 3 emits 2.65 tokens a step, k = 4 3.85; the
        model put k = 4 at 2.8, and the policy kept k = 3: docs/decisions/0027-one-policy.md)."""
        out = self.expected_tokens(self.bound, optimism)
        for k, (n, total) in self._tokens.items():
            if 0 < k <= self.bound and n > 0:
                out[k] = (total + self.costs.shrink * out[k]) / (n + self.costs.shrink)
        return out

    def values(self, batch_size: int = 1) -> list[float]:
        extra_load = max(0.0, batch_size / self.saturation_batch - 1)
        tokens = self.tokens_all()
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

    def plain_ahead(self) -> int:
        """Plain steps certain to follow the one last planned: the rest of a plain stretch."""
        if self.current != 0 or self.plain_run == 0:
            return 0
        return max(self._recheck - self.plain_run, self.costs.recheck_in)

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
        if plain and (self.plain_run < self._recheck or self.costs.recheck_in > 0
                      or self.costs.step_s(batch_size, 0, self.model_s) is None):
            self.plain_run += 1
            self.costs.recheck_in = max(0, self.costs.recheck_in - 1)
            return 0
        v = self.values(batch_size)
        best_spec = max(range(1, len(v)), key=lambda k: (v[k], -k))
        # a request plain from its start tries on the replica's evidence; one that speculated rechecks as it waits
        # (its text may turn predictable again: greedy, rechecks often find it), while rechecks here win
        if (plain and self.steps == 0 and self._recheck < self.max_recheck_steps
                and not self._try_pays(best_spec, batch_size)):
            self.plain_run = 1  # skipped; asked again after as many plain steps (the evidence ages meanwhile)
            self._replica_wait(best_spec, batch_size)
            return 0
        if plain and self.steps > 0 and not self.costs.rechecks_win():
            self._recheck = min(self.max_recheck_steps, 2 * self._recheck)  # skipped, as if failed
            return 0
        if plain:  # measure speculation again: conditions may have changed
            self.plain_run, self.current, self._rechecking = 0, best_spec, True
            return self._try(best_spec)
        plain_pays = v[0] > (1 + self.plain_margin) * v[best_spec] and self._plain_shown(best_spec, batch_size)
        best = 0 if plain_pays else best_spec
        cur = self.current
        if cur is not None and cur != best and v[best] <= (1 + self.margin) * v[cur]:
            best = cur  # not clearly better: stay, measurements are noisy
        self.current = best
        if best == 0 and cur != 0 or self._rechecking:
            self._verdict(best, batch_size, k)
        if cur is None and best > 0:  # a request's first k: judged on a run of steps, not on its first
            if self.costs.recheck_in == 0 and self._try_pays(best, batch_size):
                return self._try(best)
            best = self.current = 0  # plain from the start, rechecking as a plain stretch does
        if best == 0:
            self.plain_run = 1
            return 0
        self.plain_run = 0
        due = self.steps >= self.min_steps and self.steps % (2 * self.run) == 0
        sparse = self._sparse_k(batch_size) if due else None
        if sparse is not None and sparse != best:
            return self._try(sparse)
        if self.steps >= self.min_steps and self.steps % self.explore_every == 0:
            self._explore_up = not self._explore_up
            step = 1 if self._explore_up else -1
            if 1 <= best + step <= self.bound:
                return self._try(best + step)
        return best

    def _try_pays(self, k: int, batch_size: int) -> bool:
        """A try of k from plain decoding (a request's first, a recheck) is expected to beat plain steps with its
        cold step (``StepCosts.cold_extra_s``) charged to the tokens it may speculate: those left (``horizon``),
        else the try's own; True while no cold step is measured. Why: docs/decisions/0056-cold-tries.md."""
        steady = self.costs_all(range(self.bound + 1), batch_size)
        extra = self.costs.cold_extra_s(batch_size, steady)
        if extra is None or steady[0] <= 0:
            return True
        t = self.tokens_all(optimism=0.0)[k]  # (what the replica measured, no optimism: it decides whether to draft)
        cost = steady[k] * (1 + self.c_verify * k * max(0.0, batch_size / self.saturation_batch - 1))
        # over the tokens left (a try that pays goes on), at least the try's own
        n = self.run * t if self.horizon is None else max(self.run * t, self.horizon - self._emitted)
        return n * cost / t + extra < n * steady[0] / (1 + self.plain_margin)

    def _sparse_k(self, batch_size: int) -> int | None:
        """A k of a coarse grid (1, 2, 4, 8, the bound) the replica has not measured a try of at this batch
        size, else None. Why: a cold replica's cost line is fitted where its first requests ran (k = 1-2,
        on text the drafter missed), and its steep slope kept every k above out of reach; one try at each
        grid point spreads the line and tests the deep draft positions once for the replica's lifetime."""
        row = self.costs.row(batch_size)
        for k in sorted({1, 2, 4, 8, self.bound}):
            if k <= self.bound and len(row.get(k, ())) < self.run - 1:
                return k
        return None

    def _plain_shown(self, k: int, batch_size: int) -> bool:
        """Plain decoding beats speculating at k on evidence enough: ``min_steps`` speculative steps of this
        request, or a step at k measured to cost more than the k + 1 plain steps it could save (no acceptance
        pays, so no more steps need to show it)."""
        if self.steps >= self.min_steps:
            return True
        plain, spec = self.costs_all([0, k], batch_size)
        return plain > 0 and spec > (k + 1) * plain

    def _verdict(self, best: int, batch_size: int, tried: int) -> None:
        """Speculation turned to plain, or a recheck ended. After a failed recheck the next waits twice as
        long, and no sequence here rechecks until the replica's sequences have taken enough plain steps
        (``StepCosts.recheck_in``, counted down by each; only where a step at that k costs more than
        the k + 1 plain steps it could save) that what a recheck at its k costs (a step's
        measured time beyond what plain steps take for its expected tokens, for ``run`` steps: the tables,
        not the recheck's own steps, which one stall would inflate) is ``recheck_budget`` of them. A
        recheck that speculates resets
        both. Why: with a drafter whose step costs more than the target's, each request rechecking every
        16-64 steps, 3 speculative steps each, ran slower than plain decoding; counted per replica, not
        per request, rechecks still come (docs/decisions/0027-one-policy.md)."""
        if self._rechecking:
            self.costs.recheck_won(best > 0)
        if best > 0:
            self._rechecking = False
            self._recheck, self.costs.recheck_in = self.recheck_steps, 0
            return
        if self._rechecking:
            self._replica_wait(tried, batch_size)
        wait = 2 * self._recheck if self._rechecking else self._recheck
        self._rechecking = False
        self._recheck = min(self.max_recheck_steps, wait)

    def _replica_wait(self, tried: int, batch_size: int) -> None:
        """A recheck at ``tried`` failed (or was skipped): the replica's wait, only where speculating loses at any
        acceptance (a step costs more than the k + 1 plain steps it could save: the drafter's and the hardware's
        fault, shared by every sequence here); a recheck failed on its text's acceptance is the request's alone."""
        plain, spec = self.costs_all([0, tried], batch_size) if tried > 0 else (0.0, 0.0)
        if plain > 0 and spec > (tried + 1) * plain:
            loss = self.run * (spec - self.tokens_all()[tried] * plain)
            need = loss / (self.recheck_budget * plain)
            self.costs.recheck_in = min(self.max_recheck_steps, max(self.costs.recheck_in, int(need)))

    def observe(self, k: int, num_accepted: int, draft_s: float | None = None, verify_s: float = 0.0,
                step_s: float = 0.0, batch_size: int = 1, start_s: float = 0.0):
        """One step: k drafts, num_accepted accepted; drafting on the critical path and the verify
        forward pass (engine seconds), the step's wall seconds where the loop runs, and the
        verifier's batch size in that step (no times: only its acceptance counts, as for a prompt's
        prefill, whose drafting on the critical path is ``start_s``). The engine model's inputs are running
        means over their first 1 / ``step_weight`` steps, then exponentially weighted (from zero, drafting
        read cheap for a dozen steps)."""
        costs = self.costs
        self._start_s += start_s
        self._emitted += num_accepted + 1
        if verify_s > 0:
            costs.plain_steps += 1
            w = max(self.step_weight, 1 / costs.plain_steps)
            costs.plain_est_s += w * (verify_s / (1 + self.c_verify * k) - costs.plain_est_s)
        if k > 0 and draft_s is not None:
            costs.draft_steps += 1
            w = max(self.step_weight, 1 / costs.draft_steps)
            costs.draft_per_token_s += w * (draft_s / k - costs.draft_per_token_s)
        wall = step_s if step_s > 0 else verify_s + (draft_s or 0.0)
        # steady state only: a step right after a change of k pays for it (a pre-draft made for the old k misses),
        # which would make every k tried once look slower than the one in use; nor the sequence's first decoding
        # step (after the prefill, which has no times), nor one after plain steps: cold, the drafter catches up
        # (docs/decisions/0033-costs-per-temperature.md): measured apart, what a try from plain decoding pays
        if wall > 0 and self._prev_k == k:
            costs.observe(batch_size, k, wall)
            self.own.observe(batch_size, k, wall)
        elif wall > 0 and k > 0 and not self._prev_k:
            costs.observe_cold(batch_size, k, wall + self._start_s)
            self._start_s = 0.0
        self._prev_k = k if wall > 0 else None
        if k <= 0:
            # plain steps age the evidence slowly (half of it in about 23 of them): text changes, and
            # speculation tried again after a plain stretch must be judged on what it meets then; the replica's
            # too, more slowly (half in 350 of its sequences' plain steps): its prior returns to ``prior``
            self.accepted_w *= self.plain_decay
            self.tested_w *= self.plain_decay
            self.positions.age(self.plain_decay)
            self.costs.acceptance.age(self.replica_plain_decay)
            self.costs.plain_since_cold += 1  # (see StepCosts.cold_extra_s)
            return
        self.steps += 1
        self.accepted_w = self.decay * self.accepted_w + num_accepted
        self.tested_w = self.decay * self.tested_w + num_accepted + (1 if num_accepted < k else 0)
        self.positions.observe(k, num_accepted)
        # (decayed as the positions are: a k's steps from another stretch of text fade)
        self._tokens = {m: (self.decay * n, self.decay * t) for m, (n, t) in self._tokens.items()}
        n, t = self._tokens.get(k, (0.0, 0.0))
        self._tokens[k] = (n + 1, t + num_accepted + 1)
        self.costs.acceptance.observe(k, num_accepted)


@dataclass
class FixedK:
    """Always the request's k (vLLM's behaviour)."""

    bound: int

    def next_k(self, batch_size: int = 1) -> int:
        return self.bound

    def plain_ahead(self) -> int:
        return 0

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
