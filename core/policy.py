"""How many tokens to speculate, step by step.

A request's ``num_speculative_tokens`` is an upper bound. Each step the policy picks the
k in [0, bound] that maximises expected tokens per second of verifier time:

    tokens(k) = (1 - a^(k+1)) / (1 - a)            (Leviathan et al., per-token acceptance a)
    cost(k)   = 1 + k * (c_draft + c_verify * load)  (in units of one plain verify step)

a is the request's own acceptance so far (smoothed, starting from a neutral prior);
c_draft is the drafter's cost per token relative to a verify step and c_verify the
extra verification cost per extra token (both measured from the step timings the
engines report). ``load`` grows with the verifier's batch size: when the verifier is
saturated, every extra token it verifies is throughput taken from other requests, so
speculation is cut back, down to k = 0 when it would cost throughput.

The model above sees engine time only. Across the network a speculative step also pays
round trips and queueing, so the policy also compares what it measures end to end: the
wall time per emitted token of the request's speculative steps against a plain decoding
step's estimated cost (the verify forward pass scaled to one token). When speculation is
measurably slower (after ``min_steps`` steps, by more than ``margin``), it answers 0 for
``recheck_steps`` steps, then measures speculation again: k = 0 is a choice it can return from.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdaptiveK:
    bound: int
    prior: float = 0.6  # per-token acceptance assumed before any evidence
    c_draft: float = 0.05  # drafter cost per token / plain verify step (measured as steps come in)
    c_verify: float = 0.12  # extra verify cost per extra token (0.12 measured on CPU; ~0.01 on a GPU)
    decay: float = 0.9  # weight of older steps in the acceptance estimate
    saturation_batch: int = 16  # verifier batch size at which extra verified tokens cost throughput
    margin: float = 0.1  # speculation must be this much slower than plain decoding, measured, to be stopped
    min_steps: int = 8  # speculative steps measured before that comparison counts
    recheck_steps: int = 32  # plain steps before speculation is measured again
    plain_left: int = 0  # plain steps still to go before the next measurement
    accepted_w: float = 0.0
    tested_w: float = 0.0
    steps: int = 0
    spec_s_per_token: float = 0.0  # smoothed wall seconds per emitted token of speculative steps
    plain_s_per_token: float = 0.0  # smoothed estimate of a plain decoding step

    @property
    def acceptance(self) -> float:
        """Per-token acceptance: accepted / tested draft positions (a position is tested when
        all before it were accepted), smoothed towards the prior with two pseudo-observations."""
        return (self.accepted_w + 2 * self.prior) / (self.tested_w + 2)

    @property
    def slower_than_plain(self) -> bool:
        return (self.steps >= self.min_steps and self.plain_s_per_token > 0
                and self.spec_s_per_token > (1 + self.margin) * self.plain_s_per_token)

    def next_k(self, batch_size: int = 1) -> int:
        if self.bound == 0:
            return 0
        if self.plain_left > 0:
            self.plain_left -= 1
            if self.plain_left == 0:  # measure speculation afresh: conditions may have changed
                self.steps, self.spec_s_per_token = 0, 0.0
            return 0
        if self.slower_than_plain:
            self.plain_left = self.recheck_steps
            return 0
        a = min(max(self.acceptance, 1e-3), 0.999)
        load = max(1.0, 4.0 * batch_size / self.saturation_batch)
        best_k, best = 0, 1.0
        for k in range(1, self.bound + 1):
            value = (1 - a ** (k + 1)) / (1 - a) / (1 + k * (self.c_draft + self.c_verify * load))
            if value > best * 1.0001:
                best_k, best = k, value
        return best_k

    def observe(self, k: int, num_accepted: int, draft_s: float = 0.0, verify_s: float = 0.0,
                step_s: float = 0.0):
        """One speculative step: k drafts, num_accepted accepted; the drafter's and the
        verifier's engine seconds, and the step's wall seconds on the request's critical path."""
        if k <= 0:
            return
        if step_s > 0 and verify_s > 0:
            w = 1.0 if self.steps == 0 else 1 - self.decay
            self.spec_s_per_token += w * (step_s / (num_accepted + 1) - self.spec_s_per_token)
            self.plain_s_per_token += w * (verify_s / (1 + self.c_verify * k) - self.plain_s_per_token)
        self.steps += 1
        tested = num_accepted + (1 if num_accepted < k else 0)
        self.accepted_w = self.decay * self.accepted_w + num_accepted
        self.tested_w = self.decay * self.tested_w + tested
        if draft_s > 0 and verify_s > 0:
            plain = verify_s / (1 + self.c_verify * k)
            self.c_draft += 0.3 * (draft_s / k / plain - self.c_draft)


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
    """A circuit breaker around one sequence's drafter: after a failed or late call, steps skip
    drafting (plain decoding) until the back-off expires, doubling up to ``max_backoff_s``; the
    next call then probes the drafter. One request's slow call never turns speculation off for
    others."""

    max_backoff_s: float = 10.0
    down_until: float = 0.0
    backoff_s: float = 0.0

    def open(self, now: float) -> bool:
        return now < self.down_until

    def failed(self, now: float) -> float:
        self.backoff_s = min(self.max_backoff_s, max(0.5, 2 * self.backoff_s))
        self.down_until = now + self.backoff_s
        return self.backoff_s

    def succeeded(self):
        self.backoff_s = 0.0
