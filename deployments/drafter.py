"""Drafter deployment: a pool of replicas that propose draft tokens, batched across requests."""

from __future__ import annotations

from pydantic import TypeAdapter

from configs import DrafterConfig, DraftModelConfig, NgramConfig
from core.protocol import DraftRequest, Proposal
from deployments.server import EngineServer


def build_drafter(config: DraftModelConfig | NgramConfig):
    if config.method == "ngram":
        from drafter.ngram import NgramDrafter
        return NgramDrafter(config)
    from drafter.model_drafter import ModelDrafter
    return ModelDrafter(config)


class DrafterServer(EngineServer):
    """Receives its engine as a constructor argument, so it can be tested without a cluster."""

    role = "drafter"

    def __init__(self, config: dict, engine=None, max_batch: int = 64, max_queue: int = 1024,
                 stall_timeout_s: float = 30.0):
        engine = engine or build_drafter(TypeAdapter(DrafterConfig).validate_python(config))
        super().__init__(engine, engine.propose, max_batch, max_queue, stall_timeout_s)

    async def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        return await self.batcher.submit(requests)
