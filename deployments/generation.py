"""A request's generation: each choice's steps, streamed from a verifier replica, resumed on
another replica when its stream breaks, and the choices merged into one stream.

A choice's speculative loop runs on a verifier replica (one streaming call,
``VerifierServer.speculate``: draft, verify, accept beside the engine, no router round trip per
step), which streams its steps' tokens. The router keeps the text (detokenisation, stop strings),
the statistics (``core.stats``) and the failover: the replicas hold only caches, named by the
stateless protocol, so if a stream breaks (its replica died) the sequence resumes on another
replica from its tokens, no token lost or repeated.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from configs import SamplingParams
from core.grammar import Constraint
from core.loop import own_cancel
from core.protocol import StepInfo, VerifyResult
from core.sequence import Sequence
from core.stats import RequestStats, exposed_s
from deployments.admission import overloaded
from deployments.batcher import Overloaded
from deployments.metrics import Tally, metrics
from deployments.openai_api import OpenAIError
from deployments.vllm_metrics import ChoiceMeter

log = logging.getLogger("ray.serve")


# errors of the code itself, raised in the replica's loop: every replica runs the same code and fails the same
# way, so the request fails at once instead of being resumed on replica after replica until verifier_retry_s
CODE_ERRORS = (TypeError, AttributeError, NameError)


@dataclass
class StepOutput:
    """What one stream item from the verifier (one or more steps) adds to a response."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)
    stats: dict | None = None  # the choice's speculation statistics, on its last step
    spec_metrics: dict | None = None  # vLLM's metrics.speculative_decoding, on its last step (when asked)


@dataclass
class Call:
    """What a verifier replica's loop runs for a choice (``VerifierServer.speculate``'s arguments)."""

    prompt_ids: list[int]
    params: SamplingParams
    k: int
    max_len: int
    logprobs: int | None  # None: none; n: the emitted token's and the top n alternatives'
    k_policy: str
    prediction: list[int] = field(default_factory=list)  # a chat request's predicted output tokens
    interval_s: float | None = None  # how often the replica sends the steps (None: its stream_interval_ms)
    constraint: Constraint | None = None  # a structured output's (core.grammar)
    cache_salt: str | None = None  # the tenant's: prefixes are shared in the verifier's cache only under one salt


class Generation:
    """One choice: its sequence, its statistics, and its failover across verifier replicas.

    ``pools``: the drafter and verifier handles (the drafter None when the verifier drafts
    itself); ``retry_s``: how long after its last progress a broken stream is resumed;
    ``timing``: the statistics carry the time breakdown; ``predicted``: the request's
    predicted-output counters, shared by its choices; ``phases``: tells whether the output is in
    its reasoning (``chat.OutputParser``), for acceptance counted apart for reasoning and answer; ``cached``: the
    request's prompt tokens read from the verifier's prefix cache (usage details), the most of its choices'."""

    def __init__(self, pools: tuple, seq: Sequence, call: Call, retry_s: float, timing: bool = False,
                 predicted: dict | None = None, phases=None, meter: ChoiceMeter | None = None,
                 spec_metrics: str = "none", cached: dict | None = None):
        self.drafter, self.verifier = pools
        self.seq, self.call, self.retry_s, self.timing, self.predicted = seq, call, retry_s, timing, predicted
        self.phases = phases
        self.cached, self.prefilled = cached, False
        # per phase: [speculative steps, drafts, accepted drafts]
        self.by_phase = {"reasoning": [0, 0, 0], "answer": [0, 0, 0]} if phases is not None else None
        self.meter = meter  # vLLM's metric families (GET /metrics)
        self.spec_metrics = spec_metrics  # vLLM's per-request level: none, summary, detailed
        self.stats = RequestStats(call.k)
        self.deadline, self.attempt = 0.0, 0
        self.ended = False  # the replica's loop finished by itself: nothing to cancel
        self.t_prev = 0.0

    async def steps(self):
        """The choice's steps as the router emits them; closing this releases its caches."""
        self._progress()
        try:
            while not self.seq.done:
                stream, failure = self._open(), None
                try:
                    while not self.seq.done:
                        out = await self._next(stream)
                        if out is None:
                            break
                        yield out
                    if not self.ended and self.seq.detok.stopped_at is None:
                        # done for the same reason as the replica's loop (EOS, length): let it end by
                        # itself rather than cancel it (Serve cancels a request's related calls too)
                        with contextlib.suppress(StopAsyncIteration):
                            await anext(stream)
                        self.ended = True
                except (GeneratorExit, OpenAIError):
                    raise
                except asyncio.CancelledError as e:
                    if own_cancel():  # the client went away, or the deadline passed
                        raise
                    failure = e  # the stream was cancelled under us: resume it
                except Exception as e:  # noqa: BLE001 - replica died (or was full): resume elsewhere
                    failure = e
                finally:
                    if not self.ended:  # abandoned mid-way (stop string, failure): stop the replica's loop
                        stream.cancel()
                if failure is not None:
                    await self._failed(failure)
        finally:
            release((self.drafter, self.verifier), self.seq.seq_id)
            if self.meter is not None:
                self.meter.end()

    def _progress(self):
        """The stream moved on: a later failure gets the whole retry window again."""
        self.deadline, self.attempt = time.monotonic() + self.retry_s, 0

    def _open(self):
        c, seq = self.call, self.seq
        self.ended, self.t_prev = False, time.perf_counter()
        return self.verifier.options(stream=True).speculate.remote(
            c.prompt_ids, c.params, seq.seq_id, c.k, c.max_len, c.logprobs, seq.output_ids, c.k_policy,
            list(c.prediction), c.interval_s, c.constraint, cache_salt=c.cache_salt)

    async def _next(self, stream) -> StepOutput | None:
        """The next stream item (the replica's steps since the last one) applied; None: the stream ended."""
        try:
            group = await anext(stream)
        except StopAsyncIteration:
            self.ended = True
            return None
        t_got = time.perf_counter()
        self._progress()
        out = self._apply(group, t_got - self.t_prev)
        self.t_prev = time.perf_counter()
        self.stats.emitted(self.t_prev - t_got)  # apply, detokenise and stream, on the router
        return out

    def _apply(self, group: list, wall_s: float) -> StepOutput:
        seq, n_lp, out_ids, text = self.seq, len(self.seq.logprobs), [], ""
        tally = Tally()  # the group's counters, one call each
        for (ids, lps, info), wall in zip(group, split_wall(group, wall_s)):
            if seq.done:  # a stop string ended it: the rest was decoded past the end
                break
            new, delta = seq.apply(VerifyResult(seq.seq_id, tokens=ids, num_accepted=info.accepted,
                                                num_drafts=info.k,
                                                logprobs=lps if self.call.logprobs is not None else None))
            self.stats.record(info, wall, len(seq.output_ids))
            if not self.prefilled:  # the prompt's prefill (a resumed stream's hits are not the prompt's)
                self.prefilled = True
                if self.cached is not None:
                    self.cached["cached_tokens"] = max(self.cached["cached_tokens"], info.cached_tokens)
            if self.by_phase is not None:
                self._phase(info, new)
            tally_step(seq, info, wall, tally)
            if self.meter is not None:
                self.meter.step(info, len(new), wall)
            if self.predicted is not None and info.predicted:
                self.predicted["accepted_prediction_tokens"] += info.accepted
                self.predicted["rejected_prediction_tokens"] += info.predicted - info.accepted
            out_ids += new
            text += delta
        tally.flush()
        if self.meter is not None:
            self.meter.x.flush()
        report = self.stats.report(seq, self.timing) if seq.done else None
        if report is not None and self.by_phase is not None:
            report["by_phase"] = {phase: {"num_drafts": n, "num_draft_tokens": k, "num_accepted_tokens": a,
                                          "acceptance_rate": round(a / k, 4) if k else None}
                                  for phase, (n, k, a) in self.by_phase.items()}
        spec = (self.stats.speculative_decoding(self.spec_metrics == "detailed")
                if seq.done and self.spec_metrics != "none" else None)
        return StepOutput(out_ids, text, seq.finish_reason, seq.logprobs[n_lp:], report, spec)

    def _phase(self, info: StepInfo, new: list[int]):
        """A step's drafts count to the phase its first token was in (a step crossing the end of
        the reasoning counts to the reasoning)."""
        if info.k:
            counts = self.by_phase["reasoning" if self.phases.in_reasoning() else "answer"]
            counts[0] += 1
            counts[1] += info.k
            counts[2] += info.accepted
        self.phases.advance(new)

    async def _failed(self, e: BaseException):
        """The stream broke: resume on another replica after a back-off, or give up."""
        if self.seq.done:  # the replica failed while ending: nothing is lost
            log.warning("verifier stream failed after the request completed: %r", e)
            return
        self.attempt += 1
        if isinstance(e, Overloaded) and not self.seq.output_ids:
            raise overloaded(e) from None
        if isinstance(e, ValueError):  # the engine refused the sequence: no replica will take it
            raise OpenAIError(400, str(e), code="context_length_exceeded") from None
        if isinstance(e, CODE_ERRORS) or time.monotonic() >= self.deadline:
            raise e
        self.seq.cache_misses["verifier"] += 1
        log.warning("verifier stream failed (attempt %d), resuming on another replica: %r", self.attempt, e)
        await asyncio.sleep(min(2.0, 0.1 * 2 ** self.attempt))


def split_wall(group: list, wall_s: float) -> list[float]:
    """A stream item's wall time as the router saw it, split over its steps by the replica's own
    step times, so per-step statistics add up to the client's time: the item's last speculative
    step takes the rest (a plain step's time is not in the speculative steps' figures, so the rest
    given to one would drop the transit time it absorbed from them)."""
    rest_j = max((j for j, (_, _, info) in enumerate(group) if info.k), default=len(group) - 1)
    walls, left = [0.0] * len(group), wall_s
    for j, (_, _, info) in enumerate(group):
        if j != rest_j:
            walls[j] = min(info.step_s, left)
            left -= walls[j]
    walls[rest_j] = left
    return walls


def tally_step(seq: Sequence, info: StepInfo, wall_s: float, tally: Tally):
    """One step's recomputes (on the sequence) and metrics; counters go to ``tally``, sent once
    per stream item."""
    for pool, n in info.recomputes.items():
        seq.cache_misses[pool] += n
    if info.degraded:
        tally.inc("degraded")
    if info.pre_draft is not None:
        tally.inc("pre_draft", tags={"outcome": info.pre_draft})
    if not info.k:
        return
    tally.inc("num_drafts")
    tally.inc("num_draft_tokens", info.k)
    if info.accepted:
        tally.inc("num_accepted_tokens", info.accepted)
    for pos in range(info.accepted):
        tally.inc("num_accepted_tokens_per_pos", tags={"position": str(pos)})
    metrics()["exposed_rpc"].observe(exposed_s(info, wall_s))


def release(pools: tuple, rid: str):
    """Fire and forget: the request is done, its caches on both pools can go."""
    for handle in pools:
        if handle is None:  # drafter_placement verifier: no drafter pool
            continue
        try:
            handle.release.remote([rid])
        except Exception:  # noqa: BLE001
            pass


async def merged(gens):
    """(choice index, step) from several choices' step generators as each step comes; one
    choice is passed through as it is. Closing this closes every choice (releasing its caches)."""
    if len(gens) == 1:
        try:
            async for s in gens[0]:
                yield 0, s
        finally:
            await gens[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, gen):
        try:
            async for s in gen:
                await queue.put((i, s, None))
            queue.put_nowait((i, None, None))
        except BaseException as e:  # handed to the consumer: it never waits on a choice that is gone
            queue.put_nowait((i, None, e))
            if not isinstance(e, Exception):
                raise
        finally:
            await gen.aclose()

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        live = len(gens)
        while live:
            i, s, err = await queue.get()
            if err is not None:
                raise err
            if s is None:
                live -= 1
                continue
            yield i, s
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def prepend(first, steps):
    if first is not None:
        yield first
    async for s in steps:
        yield s
