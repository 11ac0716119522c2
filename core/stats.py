"""One request's statistics, as data: what its steps did, and, when asked for, where their time went.

The router builds a ``RequestStats`` per choice and records every ``StepInfo`` the verifier
replica streams. ``report`` writes the response's ``speculation`` block: by default vLLM's
counters (drafts, draft tokens, accepted tokens, accepted per position, mean acceptance
length) and what the policy chose (k per step, plain decoding, degraded steps, recomputes);
with ``timing`` the per-step time breakdown joins them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from core.protocol import StepInfo

if TYPE_CHECKING:
    from core.sequence import Sequence


def _ms(seconds: float, n: int) -> float:
    return round(1000 * seconds / max(1, n), 3)


@dataclass
class StepTimes:
    """Speculative steps of one kind, with their drafting and wall time summed."""

    steps: int = 0
    draft_s: float = 0.0
    step_s: float = 0.0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "mean_draft_ms": _ms(self.draft_s, self.steps),
                "mean_step_ms": _ms(self.step_s, self.steps)}


@dataclass
class Timing:
    """Sums over a request's speculative steps: where a step's time went, as the router saw it."""

    spec_steps: int = 0
    step_s: float = 0.0  # wall time between two stream items, split by the replica's own step times
    exposed_s: float = 0.0  # the step's wall time minus the verify forward and drafting
    forward_s: float = 0.0
    draft_s: float = 0.0  # drafting on the critical path (0 on a pre-draft hit)
    draft_engine_s: float = 0.0  # of which inside the drafter engine
    # the exposed time in parts, on steps whose loop timed its verify call and whose engine timed itself
    split_steps: int = 0
    verify_rest_s: float = 0.0  # the verifier engine's call outside its forward pass
    handoff_s: float = 0.0  # the hand-offs to the engine thread and back
    loop_s: float = 0.0  # the replica loop's own work
    transit_s: float = 0.0  # the way from the replica to the router
    emit_s: float = 0.0  # apply, detokenise and stream, on the router
    emit_n: int = 0  # stream items handled
    aux_bytes: int = 0  # EAGLE-3 drafters: target hidden states sent to the drafter pool
    pre_draft_hits: int = 0
    pre_draft_misses: int = 0
    pre_branches: int = 0
    pre_draft_by_outcome: dict[int, list[int]] = field(default_factory=dict)  # outcome j -> [hits, pre-drafts]
    by_pre_draft: dict[str, StepTimes] = field(default_factory=dict)  # "hit", "miss", "none"

    def pre_draft(self, info: StepInfo):
        self.pre_draft_hits += info.pre_draft == "hit"
        self.pre_draft_misses += info.pre_draft != "hit"
        self.pre_branches += info.pre_branches
        if info.pre_outcome is not None:
            row = self.pre_draft_by_outcome.setdefault(info.pre_outcome, [0, 0])
            row[0] += info.pre_draft == "hit"
            row[1] += 1

    def speculative_step(self, info: StepInfo, wall_s: float):
        self.exposed_s += exposed_s(info, wall_s)
        if info.verify_s and info.engine_s:
            self.verify_rest_s += max(0.0, info.engine_s - info.forward_s)
            self.handoff_s += max(0.0, info.verify_s - info.engine_s)
            self.loop_s += max(0.0, info.step_s - info.draft_s - info.verify_s)
            self.transit_s += max(0.0, wall_s - info.step_s)
            self.split_steps += 1
        self.spec_steps += 1
        self.step_s += wall_s
        self.forward_s += info.forward_s
        self.draft_s += info.draft_s
        self.draft_engine_s += info.draft_engine_s
        row = self.by_pre_draft.setdefault(info.pre_draft or "none", StepTimes())
        row.steps += 1
        row.draft_s += info.draft_s
        row.step_s += wall_s

    def as_dict(self, output_tokens: int) -> dict:
        n = self.spec_steps
        parts = ({f"mean_{p}_ms": _ms(getattr(self, f"{p}_s"), self.split_steps)
                  for p in ("verify_rest", "handoff", "loop", "transit")} if self.split_steps else {})
        return {"pre_draft_hits": self.pre_draft_hits, "pre_draft_misses": self.pre_draft_misses,
                "mean_pre_branches": round(self.pre_branches / max(1, self.pre_draft_hits + self.pre_draft_misses), 2),
                "pre_draft_by_outcome": {str(j): list(r) for j, r in sorted(self.pre_draft_by_outcome.items())},
                "aux_bytes_per_token": round(self.aux_bytes / max(1, output_tokens), 1),
                "mean_step_ms": _ms(self.step_s, n), "mean_exposed_ms": _ms(self.exposed_s, n),
                "mean_forward_ms": _ms(self.forward_s, n), "mean_draft_ms": _ms(self.draft_s, n),
                "mean_draft_engine_ms": _ms(self.draft_engine_s, n), **parts,
                "by_pre_draft": {o: t.as_dict() for o, t in sorted(self.by_pre_draft.items())},
                "mean_emit_ms": _ms(self.emit_s, self.emit_n),
                # the last chunk, being handled as the report is written, included
                "replica_chunks": self.emit_n + 1}


def exposed_s(info: StepInfo, wall_s: float) -> float:
    """A speculative step's critical-path time outside the engines' compute: network, queueing,
    (de)serialisation."""
    return max(0.0, wall_s - info.forward_s - info.draft_s)


@dataclass
class RequestStats:
    """One choice's statistics beyond the sequence's own counters (``Sequence.stats``, vLLM's)."""

    k: int  # the most drafts per step the request allowed
    steps_by_k: dict[int, int] = field(default_factory=dict)  # drafts the policy chose per step (not degraded)
    degraded_steps: int = 0  # speculation wanted, no drafter answered
    plain_from_token: int | None = None  # output tokens before the policy chose plain decoding
    timing: Timing = field(default_factory=Timing)
    accepted_hist: list[int] = field(default_factory=list)  # speculative steps by drafts accepted (0..k)
    per_step: list[tuple[int, int]] = field(default_factory=list)  # (accepted, drafted) per speculative step

    def __post_init__(self):
        self.accepted_hist = [0] * (self.k + 1)

    def record(self, info: StepInfo, wall_s: float, output_tokens: int):
        """One step; ``wall_s``: its time as the router saw it; ``output_tokens``: the sequence's
        output after the step was applied."""
        self.degraded_steps += info.degraded
        if info.pre_draft is not None:
            self.timing.pre_draft(info)
        self.timing.aux_bytes += info.aux_bytes
        if not info.degraded:
            self.steps_by_k[info.k] = self.steps_by_k.get(info.k, 0) + 1
        if info.k:
            self.timing.speculative_step(info, wall_s)
            if info.accepted >= len(self.accepted_hist):  # (drafts from a predicted output may exceed k)
                self.accepted_hist += [0] * (info.accepted + 1 - len(self.accepted_hist))
            self.accepted_hist[info.accepted] += 1
            self.per_step.append((info.accepted, info.k))
        elif self.k > 0 and not info.degraded and self.plain_from_token is None:
            self.plain_from_token = output_tokens - 1

    def speculative_decoding(self, detailed: bool = False) -> dict:
        """vLLM 0.32's per-request ``metrics.speculative_decoding`` (``RequestSpecDecodeMetrics.to_dict``):
        the histogram counts speculative steps by drafts accepted, bonus token excluded; ``num_spec_tokens``
        is the request's k; ``detailed`` adds the per-step arrays."""
        steps = sum(self.accepted_hist)
        accepted = sum(j * n for j, n in enumerate(self.accepted_hist))
        drafted = sum(d for _, d in self.per_step)
        out = {"mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
               "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
               "acceptance_histogram": list(self.accepted_hist), "num_spec_steps": steps,
               "num_accepted_draft_tokens": accepted, "num_draft_tokens": drafted, "num_spec_tokens": self.k}
        if detailed and self.per_step:
            out["per_step_accepted"] = [a for a, _ in self.per_step]
            out["per_step_drafted"] = [d for _, d in self.per_step]
        return out

    def emitted(self, seconds: float):
        """One stream item applied, detokenised and passed on by the router."""
        self.timing.emit_s += seconds
        self.timing.emit_n += 1

    def report(self, seq: Sequence, timing: bool = False) -> dict:
        """The response's ``speculation`` block: counters, and the time breakdown with ``timing``."""
        out = {**seq.stats.as_dict(), "k": self.k,
               "steps_by_k": {str(k): n for k, n in sorted(self.steps_by_k.items())},
               "degraded_steps": self.degraded_steps, "plain_from_token": self.plain_from_token,
               "drafter_recomputes": seq.cache_misses["drafter"],
               "verifier_recomputes": seq.cache_misses["verifier"],
               "state_recomputes": seq.cache_misses["states"]}
        if timing:
            out.update(self.timing.as_dict(seq.num_output))
        return out
