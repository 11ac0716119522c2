"""Cache affinity without state in the protocol: a Ray Serve request router that sends a
sequence's calls to the replica that holds its KV cache.

Every call carries its sequence id (``requests[0].seq_id``, or the ids passed to
``release``). The router remembers the replica each sequence was last routed to and
prefers it; if that replica is gone or its queue is full, it falls back to Serve's
power-of-two-choices, and the new replica recomputes the sequence from the full token ids
(a cache miss, never a wrong answer). So affinity never defeats load balancing.
"""

from __future__ import annotations

from collections import OrderedDict

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter

ROUTER_PATH = "deployments.affinity.CacheAffinityRouter"


def sequence_id(pending_request) -> str | None:
    args = getattr(pending_request, "args", None)
    if not args or not isinstance(args[0], (list, tuple)) or not args[0]:
        return None
    first = args[0][0]
    return first if isinstance(first, str) else getattr(first, "seq_id", None)


class CacheAffinityRouter(PowerOfTwoChoicesRequestRouter):
    def initialize_state(self, max_sequences: int = 100_000, **kwargs):
        super().initialize_state(**kwargs)
        self._home: OrderedDict[str, object] = OrderedDict()  # seq_id -> ReplicaID
        self._max_sequences = max_sequences

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        fallback = await super().choose_replicas(candidate_replicas, pending_request)
        seq = sequence_id(pending_request)
        home_id = self._home.get(seq) if seq is not None else None
        home = next((r for r in candidate_replicas if r.replica_id == home_id), None)
        if home is None:
            return fallback  # new sequence, or its replica is gone: balance load
        queue_len = self._replica_queue_len_cache.get(home_id)
        if queue_len is not None and queue_len >= home.max_ongoing_requests:
            return fallback  # the home replica is full: recomputing elsewhere beats waiting
        return [[home]] + [rank for rank in fallback if home not in rank]

    def on_request_routed(self, pending_request, replica_id, result):
        seq = sequence_id(pending_request)
        if seq is None:
            return
        self._home[seq] = replica_id
        self._home.move_to_end(seq)
        while len(self._home) > self._max_sequences:
            self._home.popitem(last=False)

    def on_replica_actor_died(self, replica_id):
        super().on_replica_actor_died(replica_id)
        for seq in [s for s, r in self._home.items() if r == replica_id]:
            del self._home[seq]
