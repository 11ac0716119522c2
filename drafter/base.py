"""The drafter interface: propose k tokens for each of many sequences."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from configs import SamplingParams
from verifier.engine import DraftProbs
from verifier.kv_cache import CacheAddressed


@dataclass
class DraftRequest(CacheAddressed):
    """Propose k tokens after a sequence. Same cache protocol as ``VerifyRequest``: the
    replica should hold tokens[:start] (hash ``prefix``), ``new_tokens`` follow them;
    ``full=True`` means new_tokens are the whole sequence."""

    seq_id: str
    start: int
    prefix: str | None
    new_tokens: list[int]
    k: int
    sampling: SamplingParams
    seed: int
    full: bool = False


@dataclass
class Proposal:
    seq_id: str
    tokens: list[int]  # the k draft tokens (fewer when the drafter found nothing to propose)
    probs: DraftProbs | None = None  # q at each draft position; None means one-hot
    cached: int = 0  # tokens the drafter replica now holds for the sequence
    cache_miss: bool = False  # resend with full=True
    draft_s: float = 0.0  # time spent drafting the batch this proposal was part of
    batch_size: int = 1  # sequences in that batch


class Drafter(Protocol):
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]: ...

    def release(self, seq_id: str) -> bool: ...

    def num_cached(self) -> int: ...
