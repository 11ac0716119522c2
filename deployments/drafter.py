"""Drafter deployment: a pool of replicas that propose draft tokens, batched across requests."""

from __future__ import annotations

import logging

from pydantic import TypeAdapter

from configs import DrafterConfig
from core.channel import ChannelServer, Endpoint
from core.hub import localize
from core.protocol import DraftRequest, Proposal
from deployments.metrics import where
from deployments.server import EngineServer
from drafter.build import build_drafter

log = logging.getLogger(__name__)


def node_ip() -> str:
    """This node's address as the cluster sees it (loopback outside Ray)."""
    try:
        import ray
        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - not in a Ray worker
        return "127.0.0.1"


class DrafterServer(EngineServer):
    """Receives its engine as a constructor argument, so it can be tested without a cluster."""

    role = "drafter"

    def __init__(self, config: dict, engine=None, max_batch: int = 64, max_queue: int = 1024,
                 stall_timeout_s: float = 30.0):
        # model references: directories on this node
        engine = engine or build_drafter(TypeAdapter(DrafterConfig).validate_python(localize(config)))
        super().__init__(engine, engine.propose, max_batch, max_queue, stall_timeout_s)
        self.channel: ChannelServer | None = None  # started on the replica's event loop, at the first call

    async def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        """A call a verify step waits on (no pre-draft) runs on the event loop when the engine is idle, as a lone
        stream's verify does (``ContinuousBatcher.run_inline``): the hop to the engine's thread and back is
        the largest part of a served draft's time outside its passes (docs/decisions/0057-served-step-time.md).
        Pre-drafts go through the engine's thread: their ``narrow`` must reach the engine while they run."""
        if not any(r.provisional or r.branches for r in requests):
            out = self.batcher.run_inline(requests)
            if out is not None:
                return out
        return await self.batcher.submit(requests)

    async def narrow(self, seq_id: str, context_len: int, branch: tuple[int, int] | None) -> None:
        """A pre-draft tree's outcome (``ModelDrafter.narrow``): set at once, from the event loop, while the
        engine thread runs the tree. Drafters without trees ignore it."""
        narrow = getattr(self.engine, "narrow", None)
        if narrow is not None:
            narrow(seq_id, context_len, branch)

    async def propose_bound(self, requests: list[DraftRequest]) -> tuple[list[Proposal], Endpoint | None]:
        """``propose``, plus where to reach this replica directly (``core.channel``): the
        verifier sends the sequence's later calls there. None when the channel cannot listen."""
        return await self.propose(requests), await self.endpoint()

    async def endpoint(self) -> Endpoint | None:
        if self.channel is None:
            self.channel = ChannelServer({"propose": self.propose, "release": self.release, "narrow": self.narrow},
                                         where().get("replica_id", ""))
        try:
            return await self.channel.start(node_ip())
        except OSError as e:  # no port to listen on: Serve's handles still work
            log.warning("drafter channel cannot listen: %r", e)
            return None
