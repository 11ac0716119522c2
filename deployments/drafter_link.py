"""How a verifier replica reaches its drafter: the engine beside it in its process (``drafter_placement:
verifier``), else the drafter pool, through Serve's handle or down a direct channel to the replica a
sequence is bound to (``core.channel``), each replica behind a breaker."""

from __future__ import annotations

import asyncio
import logging
import time

from core.channel import ChannelClient, Endpoint
from core.policy import Breaker
from deployments.metrics import Tally
from deployments.server import within

log = logging.getLogger(__name__)
# a drafter replica's breaker: one whose channel failed is reached through Serve for at least this long,
CHANNEL_DOWN_S = 30.0
SLOW_S = 5.0  # ... one that did not answer within 90% of drafter_timeout_s at least this long,
REPLICA_MAX_BACKOFF_S = 300.0  # doubling on each failure after a probe, up to this


class DrafterLink:
    """The replica's drafter calls (a mixin of ``deployments.verifier.VerifierServer``, which sets ``drafter``,
    the pool's handle or None, and ``local``, the engine beside it or None)."""

    def _init_link(self, transport: str, timeout_s: float) -> None:
        self.drafter_transport, self.drafter_timeout_s = transport, timeout_s
        self.channel = ChannelClient()
        self._bound: dict[str, Endpoint] = {}  # seq_id -> the drafter replica its calls go to directly
        self.drafter_calls = {"direct": 0, "serve": 0, "fallback": 0, "local": 0}  # this replica's, for stats()
        self.tally = Tally()  # drafter call counters, sent at most once a second and as each stream ends
        self._breakers: dict[Endpoint, Breaker] = {}  # per drafter replica reached directly

    async def _drafter_problem(self, timeout_s: float) -> str | None:
        """None when there is no drafter pool or one of its replicas answers this replica's handle within
        ``timeout_s``; else what is missing."""
        if self.drafter is None:
            return None
        try:
            problem = await within(self.drafter.ready.remote(), timeout_s)
        except TimeoutError:
            return f"no drafter replica answered within {timeout_s:g} s (the pool is starting or down)"
        except Exception as e:  # noqa: BLE001 - a replica that died under the call: not ready, and why
            return f"drafter: {type(e).__name__}: {e}"
        return f"drafter: {problem}" if problem else None

    async def _release_drafts(self, seq_id: str, drafted: bool) -> None:
        """Free a finished sequence's drafter cache, if it may hold one."""
        if self.local is not None and drafted:
            await self.local.release([seq_id])
        elif self.drafter is not None and drafted:
            self.drafter.release.remote([seq_id])  # via Serve: its router forgets the sequence too

    async def _propose(self, requests):
        """One sequence's drafter call: to the drafter engine in this process (``drafter_placement:
        verifier``), else to the pool. The first goes through Serve's handle (its router places the
        sequence); with ``drafter_transport: direct`` the later ones go down a connection to the
        replica that answered (``core.channel``), back to the handle if it breaks."""
        if self.local is not None:  # drafter_placement verifier: the engine beside this one, no hop
            self._count_call("local")
            return await self.local.propose(requests)
        if self.drafter_transport != "direct":
            self._count_call("serve")
            return await self.drafter.propose.remote(requests)
        seq_id = requests[0].seq_id
        ep = self._bound.get(seq_id)
        if ep is not None:
            try:
                async with asyncio.timeout(0.9 * self.drafter_timeout_s):  # (no task of its own: the frame goes now)
                    out = await self.channel.call(ep, "propose", requests)
            except OSError as e:  # gone, unreachable (ConnectionError, a connect timeout) or silent too long
                log.warning("drafter channel to %s:%d failed (%r): back to Serve's router", ep.host, ep.port, e)
                # a silent replica may only be overloaded: Serve's router, which sees queues, decides for a while
                self._avoid(ep, SLOW_S if isinstance(e, TimeoutError) else CHANNEL_DOWN_S)
                self._count_call("direct", "fallback")
            else:
                self._count_call("direct")
                if ep in self._breakers:
                    self._breakers[ep].succeeded()
                return out
        self._count_call("serve")
        proposals, ep = await self.drafter.propose_bound.remote(requests)
        if ep is not None and not (ep in self._breakers and self._breakers[ep].open(time.monotonic())):
            self._bound[seq_id] = ep  # (an expired breaker: this binding probes the replica again)
        return proposals

    def _count_call(self, transport: str, outcome: str = "ok"):
        """A drafter call, in ``stats()`` and in the ``drafter_calls`` metric (sent at most once a second)."""
        self.drafter_calls[transport if outcome == "ok" else outcome] += 1
        self.tally.inc("drafter_calls", tags={"transport": transport, "outcome": outcome})
        now = time.monotonic()
        if now - self.tally.flushed_at >= 1.0:
            self.tally.flush(now)

    def _narrow(self, seq_id: str, context_len: int, branch: tuple[int, int] | None) -> None:
        """Tell the drafter a pre-draft tree's outcome (``ModelDrafter.narrow``), without waiting: to the
        engine beside this one, or down the bound replica's channel (through Serve's router it would
        reach a random replica: not sent; the tree then runs to its end, as before)."""
        if self.local is not None:
            coro = self.local.narrow(seq_id, context_len, branch)
        elif self.drafter_transport == "direct" and seq_id in self._bound:
            coro = self.channel.call(self._bound[seq_id], "narrow", seq_id, context_len, branch)
        else:
            return
        task = asyncio.ensure_future(coro)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # (a lost one only costs drafter time)

    def _avoid(self, ep: Endpoint, seconds: float) -> float:
        """A replica's channel failed: open its breaker (at least ``seconds``, doubling while it keeps
        failing) and unbind its sequences (their calls go through Serve meanwhile). -> the back-off."""
        now = time.monotonic()
        self._breakers = {e: b for e, b in self._breakers.items()  # forget replicas long healthy or gone
                          if b.open(now) or now < b.down_until + REPLICA_MAX_BACKOFF_S}
        backoff = self._breakers.setdefault(ep, Breaker(max_backoff_s=REPLICA_MAX_BACKOFF_S)).failed(now, seconds)
        for s in [s for s, bound in self._bound.items() if bound == ep]:
            del self._bound[s]
        return backoff
