"""Prometheus metrics through Ray's metrics export (Ray prefixes every name with ``ray_``).

Speculation counters mirror vLLM's ``spec_decode`` names.
"""

from __future__ import annotations

import os
from functools import cache

BATCH_BOUNDARIES = [1, 2, 4, 8, 16, 32, 64, 128]
LATENCY_BOUNDARIES_S = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]


@cache
def metrics():
    from ray.serve import metrics as m

    return {
        "batch_size": m.Histogram("splitspec_batch_size", description="Sequences per batched forward pass.",
                                  boundaries=BATCH_BOUNDARIES, tag_keys=("role",)),
        "batch_latency": m.Histogram("splitspec_batch_latency_s", description="Seconds per batched engine call.",
                                     boundaries=LATENCY_BOUNDARIES_S, tag_keys=("role",)),
        "queue": m.Gauge("splitspec_queue_length", description="Sequence steps waiting for the engine.",
                         tag_keys=("role",)),
        "cache_hits": m.Counter("splitspec_cache_affinity_hits",
                                description="Calls whose sequence prefix was cached on the replica.",
                                tag_keys=("role",)),
        "cache_misses": m.Counter("splitspec_cache_recomputes", description=(
            "Calls that missed the replica's cache and were resent in full (recomputed)."),
                                  tag_keys=("role",)),
        "cached_seqs": m.Gauge("splitspec_cached_sequences", description="Sequences holding a KV cache slot.",
                               tag_keys=("role",)),
        "requests": m.Counter("splitspec_requests", description="HTTP requests by endpoint and status.",
                              tag_keys=("endpoint", "status")),
        "request_latency": m.Histogram("splitspec_request_latency_s", description="End-to-end request seconds.",
                                       boundaries=LATENCY_BOUNDARIES_S, tag_keys=("endpoint",)),
        "exposed_rpc": m.Histogram("splitspec_exposed_rpc_s", description=(
            "Per speculative step: seconds on the router's critical path outside drafter and verifier engine time "
            "(network, queueing, serialisation)."),
                                   boundaries=LATENCY_BOUNDARIES_S),
        "num_drafts": m.Counter("spec_decode_num_drafts", description="Speculative steps that proposed tokens."),
        "num_draft_tokens": m.Counter("spec_decode_num_draft_tokens", description="Draft tokens proposed."),
        "num_accepted_tokens": m.Counter("spec_decode_num_accepted_tokens", description="Draft tokens accepted."),
        "num_accepted_tokens_per_pos": m.Counter("spec_decode_num_accepted_tokens_per_pos",
                                                 description="Draft tokens accepted, by position in the draft.",
                                                 tag_keys=("position",)),
        "pre_draft": m.Counter("splitspec_pre_drafts", description=(
            "Blocks drafted while the previous one was verified, by outcome (hit: used; miss: discarded)."),
                               tag_keys=("outcome",)),
        "cancelled": m.Counter("splitspec_cancelled_requests",
                               description="Requests stopped because the client disconnected."),
        "deadline_exceeded": m.Counter("splitspec_deadline_exceeded", description=(
            "Requests stopped at their deadline (request_timeout_s or the request's timeout).")),
        "active_requests": m.Gauge("splitspec_active_requests",
                                   description="Requests running on a router replica (admitted, not yet finished)."),
        "drafter_calls": m.Counter("splitspec_drafter_calls", description=(
            "Drafter calls made by verifier replicas, by transport (direct: down the channel to the sequence's bound "
            "replica; serve: through a Serve handle) and outcome (ok; fallback: the channel broke and the call went "
            "through Serve)."),
                                   tag_keys=("transport", "outcome")),
        "degraded": m.Counter("splitspec_speculation_degraded",
                              description="Steps decoded without speculation because no drafter answered."),
    }


class Tally:
    """Counter increments summed here and sent by ``flush``, one Ray call per counter and tag set.

    Why: a Serve metric call costs microseconds (it looks up its replica's context tags each time). A
    router applying a chunk of about a second's steps (a non-streaming request) made 7 of them per
    step, most of the time it took per chunk, and the last chunk's on the request's critical path.
    Not thread-safe: one event loop's."""

    def __init__(self):
        self._n: dict[tuple, float] = {}
        self.flushed_at = 0.0  # (time.monotonic) for callers that flush at most so often

    def inc(self, name: str, value: float = 1, tags: dict | None = None):
        key = (name, tuple(tags.items()) if tags else ())
        self._n[key] = self._n.get(key, 0) + value

    def flush(self, now: float = 0.0):
        self.flushed_at = now
        if not self._n:
            return
        m = metrics()
        for (name, tags), value in self._n.items():
            m[name].inc(value, tags=dict(tags) if tags else None)
        self._n.clear()


def rss_bytes() -> int | None:
    """This process's resident memory now (None where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def where() -> dict:
    """This replica's node and id, for placement checks (empty outside a Ray actor)."""
    try:
        import ray
        from ray import serve
        if not ray.is_initialized():  # (asking for the runtime context would start a local Ray instance)
            return {}
        return {"node_id": ray.get_runtime_context().get_node_id(),
                "replica_id": serve.get_replica_context().replica_id.unique_id}
    except Exception:  # noqa: BLE001 - not running inside a Serve replica
        return {}
