"""A verifier replica's settings, taken from the app's config."""

from __future__ import annotations

from dataclasses import dataclass

from configs import AppConfig
from drafter.registry import method


@dataclass(frozen=True)
class VerifierOptions:
    """A verifier replica's settings: the app's (``VerifierOptions.of``), or set directly in tests."""

    max_batch: int = 64
    max_queue: int = 1024
    stall_timeout_s: float = 30.0
    pipeline_drafts: bool = True  # pre-draft the next block while one is verified (``core.proposers``)
    drafter_timeout_s: float = 2.0
    drafter_transport: str = "direct"
    drafter_aux_layers: tuple[int, ...] = ()  # an EAGLE-3 drafter's: captured in verification
    drafter_pre_draft: str | None = None  # its method's "tree" or "chain" (``drafter.registry``); None: by the states
    stream_interval_s: float = 0.0  # a stream's steps go to the router at most once per interval (``coalesced``)
    local_drafter: dict | None = None  # drafter_placement verifier: the drafter engine this replica runs itself
    verify_inline: bool = True

    @classmethod
    def of(cls, app: AppConfig, aux_layers: tuple[int, ...] = ()) -> VerifierOptions:
        return cls(max_batch=app.max_batch, max_queue=app.max_queue, stall_timeout_s=app.stall_timeout_s,
                   pipeline_drafts=app.pipeline_drafts, drafter_timeout_s=app.drafter_timeout_s,
                   drafter_transport=app.drafter_transport, drafter_aux_layers=tuple(aux_layers),
                   drafter_pre_draft=method(app.drafter.method).pre_draft,
                   stream_interval_s=app.stream_interval_ms / 1000, verify_inline=app.verify_inline,
                   local_drafter=app.drafter.model_dump(mode="json") if app.drafter_placement == "verifier" else None)
