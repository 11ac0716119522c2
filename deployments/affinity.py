"""Cache affinity without state in the protocol: a Ray Serve request router that sends a
sequence's calls to the replica that holds its KV cache.

Every call carries its sequence id (``requests[0].seq_id``, or the ids passed to
``release``). The router remembers the replica each sequence was last routed to and
prefers it; if that replica is gone or its queue is full, it falls back to the power of
two choices (two random replicas, Serve probes both and takes the shorter queue), and the new
replica recomputes the sequence from the full token ids (a cache miss, never a wrong answer). So
affinity never defeats load balancing.

A request's first call (``speculate`` on the verifier pool, a full draft request on the drafter pool) has
no home yet: it goes to the replica most likely to hold its prompt's prefix in its prefix cache, the one
the longest run of the prompt's blocks (chained hashes, salted by ``cache_salt``, as the replicas key
their caches) was last routed to, unless that replica's queue is ``IMBALANCE`` calls longer than the
shortest (Ray Serve LLM's prefix-aware router does the same with a prefix tree of text). A replica's
death forgets only its prefixes.
"""

from __future__ import annotations

import random
from collections import OrderedDict

from ray.serve.request_router import FIFOMixin, RequestRouter

from core.protocol import block_link, salt_root

ROUTER_PATH = "deployments.affinity.CacheAffinityRouter"


def sequence_id(pending_request) -> str | None:
    """The sequence a call is about: ``propose``/``verify`` (a list of requests), ``release`` (a list
    of ids) and ``speculate`` (``seq_id``, the third argument or a keyword)."""
    args = getattr(pending_request, "args", None) or ()
    kwargs = getattr(pending_request, "kwargs", None) or {}
    if isinstance(kwargs.get("seq_id"), str):
        return kwargs["seq_id"]
    if _method(pending_request) == "speculate":
        return args[2] if len(args) > 2 and isinstance(args[2], str) else None
    if not args or not isinstance(args[0], (list, tuple)) or not args[0]:
        return None
    first = args[0][0]
    return first if isinstance(first, str) else getattr(first, "seq_id", None)


def _method(pending_request) -> str:
    return getattr(getattr(pending_request, "metadata", None), "call_method", "")


ENTRY_BYTES = 160  # an entry's estimated memory besides its id: dict slot, replica id, string header
PREFIX_BLOCK = 16  # tokens per block of a prompt's prefix, as the replicas' KV blocks
IMBALANCE = 4  # a prefix's replica is passed over when its queue is this much longer than the shortest
MIN_MATCH = 0.1  # ... or when it holds less than this share of the prompt (Ray Serve LLM's match_rate_threshold)


def prompt_blocks(pending_request) -> list[bytes]:
    """The tokens a call sends whole, as the chained hashes of their full blocks: a ``speculate`` call's
    prompt (verifier pool), a full draft request's context (drafter pool); [] for any other call."""
    args = getattr(pending_request, "args", None) or ()
    first = args[0][0] if args and isinstance(args[0], list) and args[0] else None
    if _method(pending_request) == "speculate" and args:
        tokens, salt = args[0], (getattr(pending_request, "kwargs", None) or {}).get("cache_salt")
    elif getattr(first, "full", False) and isinstance(getattr(first, "new_tokens", None), list):
        tokens, salt = first.new_tokens, getattr(first, "cache_salt", None)
    else:
        return []
    state, out = salt_root(salt), []
    for i in range(len(tokens) // PREFIX_BLOCK):
        state = block_link(state, tokens[i * PREFIX_BLOCK:(i + 1) * PREFIX_BLOCK])
        out.append(state)
    return out


class CacheAffinityRouter(FIFOMixin, RequestRouter):
    """Built on Serve's public request-router API (``ray.serve.request_router``). Entries are
    bounded in bytes (least recently routed out) and dropped when their sequence is released."""

    def initialize_state(self, max_bytes: int = 32 * 2**20, **kwargs):
        super().initialize_state(**kwargs)
        self._home: OrderedDict[str, object] = OrderedDict()  # seq_id -> ReplicaID
        self._prefix: OrderedDict[bytes, object] = OrderedDict()  # prompt block hash -> the ReplicaID it went to last
        self._max_bytes = max_bytes
        self._bytes = 0

    async def choose_replicas(self, candidate_replicas, pending_request=None):
        # ranks in order of preference: the home replica while it has room (a full one is left
        # out: recomputing elsewhere beats waiting), then two random ones, the shorter queue first
        seq = sequence_id(pending_request)
        home_id = self._home.get(seq) if seq is not None else None
        if home_id is None:
            home_id = self._prefix_home(prompt_blocks(pending_request), candidate_replicas)
        home = next((r for r in self.select_available_replicas(candidate_replicas) if r.replica_id == home_id), None)
        others = [r for r in candidate_replicas if r is not home]
        ranks = [[home]] if home is not None else []
        if others:
            ranks.append(random.sample(others, min(2, len(others))))
        return ranks

    def _prefix_home(self, blocks: list[bytes], candidates) -> object | None:
        """The replica the longest run of these prompt blocks went to, unless it holds too little of the
        prompt or its queue is too long (by Serve's cached queue lengths); None: no preference."""
        home = None
        for i, h in enumerate(blocks):
            if h not in self._prefix:
                break
            home = self._prefix[h] if i + 1 >= MIN_MATCH * len(blocks) else None
        if home is None:
            return None
        queues = getattr(self, "_replica_queue_len_cache", None)
        lens = {r.replica_id: queues.get(r.replica_id) for r in candidates} if queues is not None else {}
        known = [n for n in lens.values() if n is not None]
        if lens.get(home) is not None and lens[home] - min(known) >= IMBALANCE:
            return None
        return home

    def on_request_routed(self, pending_request, replica_id, result):
        if _method(pending_request) == "release":  # the sequence is over: forget it
            for seq in (pending_request.args[0] if pending_request.args else ()):
                self._forget(seq)
            return
        for h in prompt_blocks(pending_request):  # the replica's prefix cache will hold them
            if h not in self._prefix:
                self._bytes += len(h) + ENTRY_BYTES
            self._prefix[h] = replica_id
            self._prefix.move_to_end(h)
        seq = sequence_id(pending_request)
        if seq is not None:
            if seq not in self._home:
                self._bytes += len(seq) + ENTRY_BYTES
            self._home[seq] = replica_id
            self._home.move_to_end(seq)
        while self._bytes > self._max_bytes and (self._home or self._prefix):
            if self._prefix and (not self._home or len(self._prefix) >= len(self._home)):
                self._bytes -= len(self._prefix.popitem(last=False)[0]) + ENTRY_BYTES
            else:
                self._forget(next(iter(self._home)))

    def _forget(self, seq) -> None:
        if isinstance(seq, str) and self._home.pop(seq, None) is not None:
            self._bytes -= len(seq) + ENTRY_BYTES

    def on_replica_actor_died(self, replica_id):
        super().on_replica_actor_died(replica_id)
        for seq in [s for s, r in self._home.items() if r == replica_id]:
            self._forget(seq)
        for h in [h for h, r in self._prefix.items() if r == replica_id]:  # its prefix cache is gone with it
            del self._prefix[h]
            self._bytes -= len(h) + ENTRY_BYTES
