"""Cache affinity without state in the protocol: a Ray Serve request router that sends a
sequence's calls to the replica that holds its KV cache.

Every call carries its sequence id (``requests[0].seq_id``, or the ids passed to
``release``). The router remembers the replica each sequence was last routed to and
prefers it; if that replica is gone or its queue is full, it falls back to the power of
two choices (two random replicas, Serve probes both and takes the shorter queue), and the new replica recomputes the sequence from the full token ids
(a cache miss, never a wrong answer). So affinity never defeats load balancing.
"""

from __future__ import annotations

import random
from collections import OrderedDict

from ray.serve.request_router import FIFOMixin, RequestRouter

ROUTER_PATH = "deployments.affinity.CacheAffinityRouter"


def sequence_id(pending_request) -> str | None:
    args = getattr(pending_request, "args", None)
    if not args or not isinstance(args[0], (list, tuple)) or not args[0]:
        return None
    first = args[0][0]
    return first if isinstance(first, str) else getattr(first, "seq_id", None)


class CacheAffinityRouter(FIFOMixin, RequestRouter):
    """Built on Serve's public request-router API (``ray.serve.request_router``)."""

    def initialize_state(self, max_sequences: int = 100_000, **kwargs):
        super().initialize_state(**kwargs)
        self._home: OrderedDict[str, object] = OrderedDict()  # seq_id -> ReplicaID
        self._max_sequences = max_sequences

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        # ranks in order of preference: the home replica while it has room (a full one is left
        # out: recomputing elsewhere beats waiting), then two random ones, the shorter queue first
        seq = sequence_id(pending_request)
        home_id = self._home.get(seq) if seq is not None else None
        home = next((r for r in self.select_available_replicas(candidate_replicas) if r.replica_id == home_id), None)
        others = [r for r in candidate_replicas if r is not home]
        ranks = [[home]] if home is not None else []
        if others:
            ranks.append(random.sample(others, min(2, len(others))))
        return ranks

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
