"""Autoscaling that follows speculation: each pool scales on what limits it.

Serve's default policy scales a deployment on its ongoing requests. In splitspec every active
request keeps one call in flight on *each* pool (a verify step on the verifier, the next draft
on the drafter), so both pools see the same ongoing-request count whatever the speculation
does: a longer k makes every draft k sequential drafter passes and every verify pass k + 1
tokens wide; a lower acceptance rate means more steps per emitted token. The default policy
cannot tell which pool needs the capacity; it scales both alike.

Here each replica reports, through Serve's ``record_autoscaling_stats`` hook (see
``EngineServer.record_autoscaling_stats``), what its engine actually did over the last
recording interval (a :class:`LoadWindow`):

- ``busy_frac``: the fraction of wall time its engine spent in batched forward passes;
- ``queued``: sequence steps waiting for the engine (the continuous batcher's queue);
- ``batch_fill``: sequences per forward pass over the replica's ``max_batch``;
- ``batch_tokens``: tokens per forward pass (verified tokens plus the cache prefill; for the
  drafter its k draft positions plus the prefill), the quantity a GPU verifier's cost follows.

:func:`pool_decision` (a pure function of Serve's ``AutoscalingContext``) turns these into a
replica count: for each signal with a target, the replicas needed to bring the per-replica
value to the target (sum over replicas / target), and the largest of those wins. Within a
tolerance band around the current count it holds. Serve's wrapper then applies
``min_replicas``/``max_replicas``, ``upscale_delay_s``/``downscale_delay_s`` and the
up/downscaling factors, exactly as for its own policy.

Serve config (per deployment)::

    autoscaling_config:
      min_replicas: 1
      max_replicas: 8
      policy:
        policy_function: deployments.autoscaling:PoolPolicy
        policy_kwargs: {target_busy: 0.75, target_queue: 8}

or, with the defaults below, ``policy_function: deployments.autoscaling:verifier_policy`` /
``deployments.autoscaling:drafter_policy``.
"""

from __future__ import annotations

import math
import time
from typing import Any

BUSY = "busy_frac"
QUEUED = "queued"
BATCH_FILL = "batch_fill"
BATCH_TOKENS = "batch_tokens"
SIGNALS = (BUSY, QUEUED, BATCH_FILL, BATCH_TOKENS)


def work_tokens(request) -> int:
    """Tokens a request puts through the engine: new (prefill) tokens plus the verified drafts
    (verifier) or the k sequential draft positions (drafter)."""
    new = len(getattr(request, "new_tokens", ()) or ())
    drafts = getattr(request, "draft_tokens", None)
    return new + (len(drafts) if drafts is not None else int(getattr(request, "k", 0) or 0))


class LoadWindow:
    """What a replica's engine did since the previous report. ``begin``/``end`` run on the
    engine thread around each batch; ``report`` on the replica's event loop, each time Serve
    records autoscaling stats. A batch still running counts up to the report, the rest of it
    in the next window, so a forward pass longer than the recording interval reads as busy
    throughout, not as idle windows and one clamped spike. Plain counters: a report racing a
    batch's end at most shifts that batch's counts into the next window."""

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.t0 = clock()
        self.busy = 0.0
        self.running_since: float | None = None
        self.batches = self.seqs = self.tokens = 0

    def begin(self) -> None:
        self.running_since = self.clock()

    def end(self, requests: list) -> None:
        now = self.clock()
        start = self.running_since if self.running_since is not None else now
        self.busy += max(0.0, now - max(start, self.t0))
        self.running_since = None
        self.batches += 1
        self.seqs += len(requests)
        self.tokens += sum(work_tokens(r) for r in requests)

    def report(self, queued: int, max_batch: int) -> dict[str, float]:
        now = self.clock()
        busy = self.busy
        running = self.running_since
        if running is not None:
            busy += max(0.0, now - max(running, self.t0))
        batches = self.batches
        out = {
            BUSY: min(1.0, max(0.0, busy / max(now - self.t0, 1e-6))),
            QUEUED: float(queued),
            BATCH_FILL: (self.seqs / batches / max_batch) if batches else 0.0,
            BATCH_TOKENS: (self.tokens / batches) if batches else 0.0,
        }
        self.t0, self.busy = now, 0.0
        self.batches = self.seqs = self.tokens = 0
        return out


def _per_replica(ctx, name: str) -> dict:
    metrics = ctx.aggregated_metrics or {}
    return dict(metrics.get(name) or {})


def pool_decision(ctx, target_busy: float | None = 0.75, target_queue: float | None = 8.0,
                  target_batch_fill: float | None = None, target_batch_tokens: float | None = None,
                  tolerance: float = 0.1) -> tuple[float, dict[str, Any]]:
    """Replicas this pool needs, from its replicas' reported engine load.

    Each signal with a target asks for ``sum over replicas / target`` replicas (the count at
    which the average replica sits at the target); the largest ask wins. A signal set to None
    is ignored. While a running replica has not reported yet (just started), or none has, the
    current target is kept: a missing report is not an idle replica. Within ``tolerance``
    (relative) of the current count, nothing changes, so a load right at the target does not
    flap. Returns (replicas, policy state); the state records the signals for inspection.
    """
    n = ctx.current_num_replicas
    hold = ctx.target_num_replicas
    targets = {BUSY: target_busy, QUEUED: target_queue, BATCH_FILL: target_batch_fill,
               BATCH_TOKENS: target_batch_tokens}
    targets = {k: v for k, v in targets.items() if v is not None}
    for name, value in targets.items():
        if value <= 0:
            raise ValueError(f"target for {name} must be positive, got {value}")
    if n == 0:
        return hold, {}
    running = set(ctx.running_replicas or ())
    values = {name: _per_replica(ctx, name) for name in targets}
    reported = set(values[BUSY] if BUSY in values else next(iter(values.values()), {}))
    if targets and (not reported or not running <= reported):
        return hold, {"waiting_for_reports": sorted(str(r) for r in running - reported)}
    asks = {name: sum(v for r, v in values[name].items() if (not running or r in running) and _finite(v)) / target
            for name, target in targets.items()}
    desired = max(asks.values()) if asks else float(n)
    state = {"asks": {k: round(v, 3) for k, v in asks.items()}}
    if abs(desired - n) <= tolerance * n:
        return n, state
    # never ask for fewer than one replica from load alone; scaling to zero is min_replicas' call
    return max(desired, 1.0 if ctx.capacity_adjusted_min_replicas > 0 else 0.0), state


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


class PoolPolicy:
    """Class form for serve configs: ``policy_kwargs`` are :func:`pool_decision`'s targets.
    Serve instantiates it once per deployment and calls it every control-loop tick."""

    def __init__(self, target_busy: float | None = 0.75, target_queue: float | None = 8.0,
                 target_batch_fill: float | None = None, target_batch_tokens: float | None = None,
                 tolerance: float = 0.1):
        self.kwargs = dict(target_busy=target_busy, target_queue=target_queue,
                           target_batch_fill=target_batch_fill, target_batch_tokens=target_batch_tokens,
                           tolerance=tolerance)
        # fail at deploy time on a bad target, not on the first tick
        for name in ("target_busy", "target_queue", "target_batch_fill", "target_batch_tokens"):
            value = self.kwargs[name]
            if value is not None and not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number or null, got {value!r}")

    def __call__(self, ctx) -> tuple[float, dict[str, Any]]:
        return pool_decision(ctx, **self.kwargs)


def verifier_policy(ctx) -> tuple[float, dict[str, Any]]:
    """The verifier pool: engine time (a lower acceptance rate means more verify steps per
    token; a longer k, wider passes) and its queue of verify steps."""
    return pool_decision(ctx, target_busy=0.75, target_queue=8.0)


def drafter_policy(ctx) -> tuple[float, dict[str, Any]]:
    """The drafter pool: engine time (k sequential passes per draft) and its own queue."""
    return pool_decision(ctx, target_busy=0.75, target_queue=8.0)
