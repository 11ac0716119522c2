"""Verifier deployment: a pool of target-model replicas, each running the speculative loop of
its requests beside its engine (drafts from the drafter pool), verification batched across
requests."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from dataclasses import dataclass

from configs import AppConfig, SamplingParams, VerifierConfig
from core.channel import ChannelClient, Endpoint
from core.gate import BatchSpeculation
from core.grammar import Constraint, SequenceMasks
from core.hub import localize
from core.loop import speculate
from core.policy import AdaptiveK, Breaker, FixedK, StepCosts
from core.prediction import PredictedOutput
from core.protocol import StepInfo, VerifyRequest, VerifyResult
from core.sequence import Sequence
from deployments.metrics import Tally
from deployments.server import EngineServer, within
from drafter.registry import method
from verifier.engine import VerifierEngine

log = logging.getLogger(__name__)
# a drafter replica's breaker: one whose channel failed is reached through Serve for at least this long,
CHANNEL_DOWN_S = 30.0
SLOW_S = 5.0  # ... one that did not answer within 90% of drafter_timeout_s at least this long,
REPLICA_MAX_BACKOFF_S = 300.0  # doubling on each failure after a probe, up to this
# from this many streams on the replica, its measured choice (``BatchSpeculation``) may turn the adaptive
# requests' speculation off; below it their own policies decide alone
GATE_MIN_STREAMS = 4
# ... and for this long after the replica last ran that many: the first and last requests of a burst (a wave's
# first arrivals, its stragglers) follow the choice made for the burst, not their own policies
GATE_HOLD_S = 1.0
# m: a pre-draft tree's guesses per outcome (``core.proposers.tree_branches``); the one m that paid
# (docs/decisions/0004-pre-drafting.md, docs/decisions/0027-one-policy.md), for sampled requests too
# (docs/decisions/0055-goodput.md)
PRE_DRAFT_ALTERNATIVES = 1


class ReplicaGatedK:
    """An adaptive request's policy under its replica's choice: where the replica measured that engine steps
    at its present load (streams running) emit tokens faster without speculation, the step is plain.

    Why: each request's policy charges itself a step's whole wall time, but in a batch most of that
    time is the other sequences' rows. A request that stops speculating alone saves almost nothing, so
    every policy keeps speculating where the batch as a whole would be faster without. The replica sees
    the whole step: tokens emitted per second of engine steps, with and without.
    See docs/decisions/0016-replica-gate.md."""

    def __init__(self, policy: AdaptiveK, server: VerifierServer):
        self.policy, self.server = policy, server

    def next_k(self, batch_size: int = 1) -> int:
        if not self.server.speculating and self.server.gate_load() >= GATE_MIN_STREAMS:
            return 0
        return self.policy.next_k(batch_size)

    def plain_ahead(self) -> int:
        return self.policy.plain_ahead()

    def observe(self, *args, **kwargs):
        self.policy.observe(*args, **kwargs)


async def coalesced(steps, interval_s: float, clock=time.monotonic):
    """Groups a stream of steps (new ids, logprobs, ``StepInfo``) into lists, at most one list per
    ``interval_s``: the first step goes out at once, later ones wait for the first step that
    arrives once the interval has passed (a step is held at most the interval plus one step),
    and a step that completes the sequence (``StepInfo.done``) goes out at once with what is
    held. The loop producing the steps never waits for them to be sent.

    Why: every stream item costs the replica process a cross-thread hand-off and a Ray object
    (serialisation, a report to the router), then the router, Serve's proxy and HTTP one chunk
    each, and on a replica pinned to the engine's cores that work takes the engine's time, so
    fewer, larger items serve each token faster (docs/decisions/0008-stream-interval.md).
    interval_s = 0 sends every item alone."""
    held, last = [], float("-inf")
    async with contextlib.aclosing(steps):  # closed with this stream (a cancel at a yield): caches freed at once
        async for item in steps:
            held.append(item)
            now = clock()
            if now - last >= interval_s or item[2].done:
                yield held
                held, last = [], now
    if held:
        yield held


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


class VerifierServer(EngineServer):
    """Receives its engine as a constructor argument, so it can be tested without a cluster."""

    role = "verifier"

    def __init__(self, config: dict, engine: VerifierEngine | None = None, drafter=None,
                 options: VerifierOptions | None = None):
        """``config``: the verifier's (``VerifierConfig``, as a dict); ``drafter``: a handle to the
        drafter pool (None: plain decoding only, unless ``options.local_drafter``)."""
        o = self.options = options or VerifierOptions()
        self.drafter = drafter
        self.local = None  # the drafter engine in this process, behind a batcher (and thread) of its own
        # backend vllm with drafter_placement verifier: vLLM runs the EAGLE-3 head in its engine, not a drafter here
        in_engine = o.local_drafter is not None and config.get("backend") == "vllm"
        if o.local_drafter is not None and not in_engine:
            from deployments.drafter import DrafterServer
            self.local = DrafterServer(o.local_drafter, max_batch=o.max_batch, max_queue=o.max_queue,
                                       stall_timeout_s=o.stall_timeout_s)
        self.drafter_transport, self.drafter_timeout_s = o.drafter_transport, o.drafter_timeout_s
        self.drafter_aux_layers, self.pipeline_drafts = tuple(o.drafter_aux_layers), o.pipeline_drafts
        self.stream_interval_s, self.verify_inline = o.stream_interval_s, o.verify_inline
        self.channel = ChannelClient()
        self._bound: dict[str, Endpoint] = {}  # seq_id -> the drafter replica its calls go to directly
        self.drafter_calls = {"direct": 0, "serve": 0, "fallback": 0, "local": 0}  # this replica's, for stats()
        self.tally = Tally()  # drafter call counters, sent at most once a second and as each stream ends
        self._breakers: dict[Endpoint, Breaker] = {}  # per drafter replica reached directly
        # what a step costs here and how often drafts are accepted, measured by every sequence (the adaptive
        # policy), per temperature (``costs_for``)
        self.step_costs: dict[float | tuple, StepCosts] = {}
        # whether adaptive requests speculate while GATE_MIN_STREAMS or more run here, measured per load bucket;
        # None: no measuring, ``speculating`` stays as set
        # plain decoding is the safe arm: speculation is chosen where it measures 1.1x faster, and left where it
        # measures 1.05x slower; the arm not in use is re-measured for 16 engine steps (12 measured: a stretch of
        # text long enough that its luck does not decide) after 128, backing off to one try in 1,024 steps while
        # tries confirm the choice (docs/decisions/0016-replica-gate.md)
        self.gate: BatchSpeculation | None = BatchSpeculation(
            explore_every=128, run=16, settle=4, window=12, margin=1.1, prefer=False, back_margin=1.05,
            max_explore_every=1024)
        self.speculating = True
        self.clock = time.perf_counter
        self.streams = 0  # requests whose loop runs here now (the gate's load measure)
        self._gate_load = 0  # the stream count the gate's choice is keyed by (see _gate_step)
        self._gate_prev = (0, False)  # (streams, prefill) of the engine step before
        self._gate_peak = (0, float("-inf"))  # (streams, when) of the last engine step at GATE_MIN_STREAMS or more
        engine = engine or self._engine(config, in_engine)
        # the vLLM engine batches by itself (AsyncLLM): its calls go straight to it, concurrently
        self.is_async = getattr(engine, "is_async", False)
        # vLLM's own loop (vllm_loop: engine): one engine request per stream, drafting from its worker
        self.vllm_loop = self.is_async and engine.config.vllm_loop == "engine"
        self._drafters_at, self._drafters_lock, self._watch = 0.0, None, None
        self._drafter_eps: list[Endpoint] = []  # the drafter replicas the proposer was last told of
        self._vllm_ids, self._streams = itertools.count(), 0
        self._in_engine, self._period = 0, []  # calls inside the async engine now; those of this busy period
        # a batch's sequences decoding plain queue their next verify at once: the next batch waits for them up
        # to a quarter of the batch's time, at most 5 ms, so a split batch merges again (batcher). Not for one
        # that speculated: its next step may wait on a draft (waiting for those cost: docs/decisions/0031-regrouping.md)
        super().__init__(engine, engine.verify, o.max_batch, o.max_queue, o.stall_timeout_s, regroup=0.25,
                         at_once=lambda r: not r.draft_tokens)

    def _engine(self, config: dict, in_engine: bool):
        """The engine this replica builds from its config: its own, or vLLM's (then with the EAGLE-3 head in
        it, ``in_engine``)."""
        cfg = VerifierConfig.model_validate(localize(config))  # model references: directories on this node
        if cfg.backend != "vllm":
            return VerifierEngine(cfg)
        from verifier.vllm_engine import VllmVerifierEngine
        head = None
        if in_engine:  # (a head reference, a local directory on this node)
            local = self.options.local_drafter
            head = (localize(local)["model"], local["num_speculative_tokens"])
        return VllmVerifierEngine(cfg, speculative=self.drafter is not None and cfg.vllm_loop == "engine",
                                  aux_layers=self.drafter_aux_layers if self.drafter is not None else (), eagle3=head)

    def queued(self) -> int:
        return self.engine.inflight if self.is_async else super().queued()

    def _run(self, requests: list) -> list:
        out = super()._run(requests)
        self._gate_step(out, prefill=any(r.full or r.start == 0 for r in requests))
        return out

    def _gate_step(self, out: list[VerifyResult], streams: int | None = None, prefill: bool = False) -> None:
        """An engine step ended (on the engine's thread): credit its emitted tokens and the time since the step
        before to the arm in use, and choose the arm of the steps that follow, per bucket of ``streams`` (the
        requests running here). Keyed by streams, not by the step's batch: speculating sequences wait on drafts
        and fill smaller batches than plain ones, so batch-size buckets each see one arm only: they hand the
        choice back and forth and speculation runs on where plain decoding is faster
        (docs/decisions/0016-replica-gate.md). A few streams are the requests' own policies' business.
        A step that carries a prompt's prefill (or a resend of a whole sequence) is credited to neither arm:
        it costs many times a decoding step for one token a sequence, and a burst of new requests landing
        in one arm's few measured steps made that arm look slower for as long as its window held them. Nor is
        the step after one (its sequences send their first tokens out), one right after a stream started or
        ended, or one whose streams are more than an eighth off the load its choice is keyed by: the last
        steps of a wave, a few sequences left at the same fixed cost a step, read plain decoding slower
        than it was, and the next wave then speculated (docs/decisions/0016-replica-gate.md)."""
        if self.gate is None:
            return
        streams = self.streams if streams is None else streams
        steady = not (prefill or self._gate_prev[1]) and streams == self._gate_prev[0]
        self._gate_prev = (streams, prefill)
        if streams < GATE_MIN_STREAMS:
            self.gate.reset()  # (the next large load starts a fresh measurement)
            if self.gate_load() < GATE_MIN_STREAMS:
                self.speculating = True
            return  # (a burst's stragglers: its choice holds, but they are not credited to it)
        self._gate_peak = (streams, self.clock())
        # the load the choice is keyed by moves only past a quarter of itself: streams ending and starting
        # around a bucket's edge (63, 64, 63) would hand the choice back and forth between two buckets
        if not 0.75 * self._gate_load <= streams <= 1.25 * self._gate_load:
            self._gate_load = streams
        tokens = sum(r.num_accepted + 1 for r in out if not (r.cache_miss or r.error))
        # (a step allowed to speculate where no sequence drafted says nothing of speculation's cost)
        unsure = self.speculating and not any(r.num_drafts for r in out)
        if not steady or unsure or 8 * abs(streams - self._gate_load) > self._gate_load:
            self.gate.reset()  # (the time to the next step is measured from here)
        c = self.gate.choice(self._gate_load)  # (the one choice `use` can change)
        before = c.best
        self.speculating = self.gate.use(self._gate_load, tokens, self.clock())
        if c.best is not None and c.best != before:
            log.info("speculation %s at %d+ streams: %.2f ms/token with it, %.2f without", "on" if c.best else "off",
                     1 << (StepCosts.bucket(self._gate_load) - 1), 1e3 * c.s_per_token.get(True, 0.0),
                     1e3 * c.s_per_token.get(False, 0.0))

    def gate_load(self) -> int:
        """The load the replica's choice applies to: the streams running here, or the most an engine step ran
        within the last GATE_HOLD_S, if more. Why held: served in waves of 4 streams of 64 tokens, each wave's
        first requests planned their first step before the replica had stepped at 4 streams, and its last ones
        ran on alone below 4: each speculated on its own policy (a drafter prefill and a step at k = 4-8 for
        a few tokens) where the replica had chosen plain decoding for the wave."""
        streams, when = self._gate_peak
        held = streams if self.clock() - when < GATE_HOLD_S else 0
        return max(self.streams, held)

    async def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        if self.is_async:
            return await self._verify_async(requests)
        # a lone stream verifies on the event loop (``ContinuousBatcher.run_inline``: why); a drafter in
        # this process is left the loop's turns it needs to start a pre-draft
        if self.verify_inline and self.streams <= 1 and self.local is None:
            out = self.batcher.run_inline(requests)
            if out is not None:
                return out
        return await self.batcher.submit(requests)

    async def _verify_async(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        from deployments.batcher import Overloaded
        from deployments.metrics import metrics

        if self.engine.inflight + len(requests) > self.batcher.max_queue:  # same fail-fast bound as the batcher
            raise Overloaded(f"queue full ({self.engine.inflight} in flight)")
        # autoscaling load: the engine counts as busy while any verify call is in it; each busy
        # period counts as one batch of the calls it served
        if not self._period:
            self.load.begin()
        self._period.append(requests)
        self._in_engine += 1
        try:
            out = await self.engine.verify(requests)
        finally:
            self._in_engine -= 1
            if self._in_engine == 0:
                self.load.end([r for reqs in self._period for r in reqs])
                self._period = []
        self._count_cache(requests, out)
        metrics()["batch_size"].observe(max((res.batch_size for res in out), default=0), tags={"role": self.role})
        self._report_cache()
        return out

    async def prompt_logprobs(self, tokens: list[int], top: int) -> list:
        """Log-probabilities of a prompt's tokens (``echo`` with ``logprobs``): transformers backend."""
        if self.is_async:
            raise ValueError("echo with logprobs is not supported with the vllm verifier backend")
        return await asyncio.to_thread(self.engine.prompt_logprobs, tokens, top)

    async def release(self, seq_ids: list[str]) -> int:
        if not self.is_async:
            return await super().release(seq_ids)
        released = sum(self.engine.release(s) for s in seq_ids)  # on the event loop, like every verify
        self._report_cache()
        return released

    async def stats(self) -> dict:
        if not self.is_async:
            return {**await super().stats(), "drafter_calls": dict(self.drafter_calls),
                    "batch_speculation": self.gate.report() if self.gate is not None else None,
                    **({"local_drafter": await self.local.stats()} if self.local is not None else {})}
        from deployments.metrics import where

        eng = self.engine
        proposer = await eng.proposer_status() if getattr(eng, "speculative", False) and not getattr(eng, "in_engine", False) else None
        return {"backend": "vllm", "vllm_loop": eng.config.vllm_loop, "proposer": proposer, "drafter_calls": dict(self.drafter_calls),
                "queued": eng.inflight, "busy_s": eng.busy_s, "max_batch": eng.max_seen,
                "cached_sequences": eng.num_cached(), **where(), "cache": eng.engine_stats()}

    async def ready(self, need_drafter: bool = True, timeout_s: float = 2.0) -> str | None:
        """None when this replica can serve a request end to end: its engine is up (``check_health``) and, with a
        drafter pool and ``need_drafter``, a drafter replica answers this replica's handle within ``timeout_s``;
        else what is missing (GET /ready)."""
        try:
            self.check_health()
        except RuntimeError as e:
            return f"verifier: {e}"
        if self.drafter is None or not need_drafter:
            return None
        try:
            problem = await within(self.drafter.ready.remote(), timeout_s)
        except TimeoutError:
            return f"no drafter replica answered within {timeout_s:g} s (the pool is starting or down)"
        except Exception as e:  # noqa: BLE001 - a replica that died under the call: not ready, and why
            return f"drafter: {type(e).__name__}: {e}"
        return f"drafter: {problem}" if problem else None

    def check_health(self):
        if self.local is not None:
            self.local.check_health()  # a stalled drafter engine here stalls this replica's streams
        if not self.is_async:
            return super().check_health()
        if self.engine.llm.errored:
            raise RuntimeError("vLLM engine is dead")

    def costs_for(self, params: SamplingParams, constrained: bool = False) -> StepCosts:
        """The step costs and acceptance shared by this replica's requests at this request's temperature (to
        0.1). Why apart: a sampled draft is accepted less often than a greedy one (served, HumanEval: 2.3
        tokens a step at k = 3 and T = 0.8 against 2.7 greedy) and its step costs more (the drafter ships its
        q), and a replica that served greedy requests first had its sampled ones start from greedy's rates at
        k = 4-8, where k = 3 pays best (docs/decisions/0033-costs-per-temperature.md)."""
        if constrained:  # a grammar's forced punctuation is accepted far more often: its own table
            return self.step_costs.setdefault((round(params.temperature, 1), "constrained"), StepCosts())
        return self.step_costs.setdefault(round(params.temperature, 1), StepCosts())

    async def speculate(self, prompt_ids: list[int], params: SamplingParams, seq_id: str, k: int = 0,
                        max_len: int | None = None, logprobs: int | None = None, output_ids: list[int] = (),
                        k_policy: str = "fixed", prediction: list[int] = (), interval_s: float | None = None,
                        constraint: Constraint | None = None, cache_salt: str | None = None):
        """A request's whole speculative loop on this replica (``_steps``), streamed as lists of its
        steps, each (new token ids, their logprobs, ``StepInfo``): at most one list per
        ``interval_s`` (``coalesced``; None: the replica's ``stream_interval_s``), the first step and
        the last at once. ``constraint``: a structured output's (``core.grammar``); ``cache_salt``: the
        tenant's, which the prefix cache is keyed by."""
        steps = self._steps(prompt_ids, params, seq_id, k, max_len, logprobs, output_ids, k_policy, prediction, constraint,
                            cache_salt)
        async for group in coalesced(steps, self.stream_interval_s if interval_s is None else interval_s):
            yield group

    async def _steps(self, prompt_ids: list[int], params: SamplingParams, seq_id: str, k: int,
                     max_len: int | None, logprobs: int | None, output_ids, k_policy: str, prediction: list[int] = (),
                     constraint: Constraint | None = None, cache_salt: str | None = None):
        """A request's whole speculative loop on this replica (``core.loop.speculate``), yielding each step's new
        token ids, their logprobs and a ``StepInfo``. Only drafting crosses the network (to the drafter pool,
        overlapped with verification by pre-drafting); verification shares the batched forward passes with every
        other sequence here. k = 0 (or no drafter pool) is plain decoding. It stops at EOS, max_tokens or the
        context limit; stop strings and text stay with the caller, which closes the stream when it is done, and
        which can resume the sequence on any replica from its tokens (``output_ids``): randomness is keyed by
        position, so a seeded request continues exactly as it would have. ``prediction``: the client's predicted
        output, drafted from where it continues the sequence."""
        from deployments.batcher import Overloaded
        if self.vllm_loop:
            async for item in self._speculate_vllm(prompt_ids, params, seq_id, k, max_len, logprobs, output_ids,
                                                   cache_salt, constraint):
                yield item
            return
        eng = self.engine
        if constraint is not None:  # a structured output's, compiled off the engine's thread: it holds no batch
            await asyncio.to_thread(eng.masks.grammars.compile, constraint)
        seq = Sequence(prompt_ids, params.model_copy(update={"stop": ()}), k, None, eng.eos_ids, min(max_len or eng.max_len, eng.max_len),
                       seq_id=seq_id, logprobs=logprobs, output_ids=output_ids, constraint=constraint, cache_salt=cache_salt)
        policy = self._policy(k, k_policy, params, constraint is not None, params.max_tokens - len(output_ids))
        if self.drafter is None and self.local is None:
            policy = FixedK(0)
        elif k > 0:
            self._speculating(seq)

        async def verify(requests):
            delay = 0.01
            while True:
                try:
                    return await self.verify(requests)
                except Overloaded:
                    if not seq.output_ids:
                        raise  # a new request: the caller tells the client to come back (503)
                    await asyncio.sleep(delay)  # a running one is never dropped: it waits for room
                    delay = min(0.5, 2 * delay)

        async def recompute_aux(tokens):  # on the engine thread, between batches
            return await self.batcher.call(self.engine.aux_states, tokens, seq.capture)

        self.streams += 1
        try:
            async for new, lps, info in speculate(seq, self._propose, verify, policy, Breaker(), self.pipeline_drafts,
                                                  self.drafter_timeout_s, recompute_aux=recompute_aux,
                                                  alternatives=PRE_DRAFT_ALTERNATIVES, narrow=self._narrow,
                                                  predicted=PredictedOutput(prediction) if prediction else None,
                                                  pre_draft=self.options.drafter_pre_draft):
                if info.done:  # (its last verify: the next batch need not wait for it)
                    self.batcher.arrived([seq_id])
                yield new, lps, info
        finally:
            self.streams -= 1
            self.tally.flush(time.monotonic())
            self._bound.pop(seq_id, None)
            # (one that never drafted, plain throughout under the replica's choice, holds nothing there: no
            # call; one resumed here may have drafted on the replica it left)
            await self._release_drafts(seq_id, k > 0 and (seq.drafter_asked or bool(output_ids)))
            await self.release([seq_id])

    def _policy(self, k: int, k_policy: str, params: SamplingParams, constrained: bool, left: int):
        """A request's k policy: ``fixed``, or the adaptive one on this replica's tables for its temperature, under
        the replica's gate, knowing the ``left`` tokens it may emit (a try's cold step is paid over them)."""
        if k_policy != "adaptive":
            return FixedK(k)
        return ReplicaGatedK(AdaptiveK(k, costs=self.costs_for(params, constrained), horizon=left), self)

    async def _release_drafts(self, seq_id: str, drafted: bool) -> None:
        """Free a finished sequence's drafter cache, if it may hold one."""
        if self.local is not None and drafted:
            await self.local.release([seq_id])
        elif self.drafter is not None and drafted:
            self.drafter.release.remote([seq_id])  # via Serve: its router forgets the sequence too

    def _speculating(self, seq: Sequence) -> None:
        """A sequence that drafts: a head's states captured for it; a structured output's forced tokens drafted
        for free, the drafter's after them (docs/decisions/0034-grammar-masks.md)."""
        seq.capture = self.drafter_aux_layers
        if seq.constraint is not None and not seq.capture:
            seq.forced_masks = SequenceMasks(self.engine.masks.grammars)

    async def _speculate_vllm(self, prompt_ids, params: SamplingParams, seq_id: str, k: int, max_len: int | None,
                              logprobs: int | None, output_ids, cache_salt: str | None = None, constraint=None):
        """``speculate`` on vLLM's own loop: one engine request for the rest of the sequence; vLLM verifies, and drafts
        through splitspec's proposer in its worker (``verifier.vllm_proposer``), which calls the drafter pool. k is per
        request (at most ``vllm_num_speculative_tokens``), no adaptive policy (vLLM schedules k). Each stream item is what
        one engine step emitted (vLLM coalesces steps when the stream is read late: then ``accepted`` is capped at k).
        ``constraint``: vLLM's structured outputs mask p, the drafter pool q."""
        from deployments.batcher import Overloaded

        eng = self.engine
        if getattr(eng, "in_engine", False):  # vLLM's own EAGLE-3: every request speculates the engine's k
            k = eng.llm.vllm_config.speculative_config.num_speculative_tokens
        elif self.drafter is None or not eng.speculative:
            k = 0
        k = min(k, eng.config.vllm_num_speculative_tokens)
        if eng.inflight + 1 > self.batcher.max_queue:
            raise Overloaded(f"queue full ({eng.inflight} streams)")
        tokens = list(prompt_ids) + list(output_ids)
        limit = min(max_len or eng.max_len, eng.max_len)
        if len(tokens) >= limit:
            raise ValueError(f"{len(tokens)} tokens reach the context limit {limit}")
        if constraint is not None and output_ids:  # vLLM's grammar starts where its request does
            raise ValueError("a structured output cannot resume part-way on vLLM's loop")
        max_tokens = min(params.max_tokens - len(output_ids), limit - len(tokens))
        if max_tokens <= 0:
            return
        if k > 0 and not getattr(eng, "in_engine", False):
            await self._bind_drafters()
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        # a resumed stream has emitted output_ids already: they count towards min_tokens
        params = params.model_copy(update={"min_tokens": max(0, params.min_tokens - len(output_ids))})
        sp = eng.sampling_params(params, k, seq_id, seed, len(prompt_ids), max_tokens, logprobs, constraint)
        if not self._streams:  # autoscaling load: busy while any stream runs in the engine
            self.load.begin()
        self._streams += 1
        t_prev = time.perf_counter()
        drafted = accepted = 0  # as reported so far
        cached = {"tokens": 0}  # the prompt's tokens vLLM read from its prefix cache
        try:
            first = True
            async for ids, lps, spec in eng.generate(tokens, sp, f"{seq_id}-{next(self._vllm_ids)}", cache_salt, cached):
                if not ids and spec is None:
                    continue
                now = time.perf_counter()
                # per output: k drafts (none in the prefill's), those of its tokens but the last accepted;
                # vLLM's own counts, which come with the last output, make the request's totals exact
                k_i, a_i = (0, 0) if first or not k else (k, min(len(ids) - 1, k))
                if spec is not None:
                    k_i = max(0, spec.num_draft_tokens - drafted)
                    a_i = max(0, sum(j * c for j, c in enumerate(spec.histogram)) - accepted)
                c_i = cached["tokens"] if first else 0
                drafted, accepted, first = drafted + k_i, accepted + a_i, False
                yield ids, lps or [], StepInfo(k=k_i, accepted=a_i, step_s=now - t_prev, batch_size=eng.inflight,
                                               done=spec is not None,  # (else the stream's end sends it at once)
                                               cached_tokens=c_i)
                t_prev = now
        finally:
            self._streams -= 1
            if not self._streams:
                self.load.end([])
            # the sequence's drafter cache is released by the proposer, on the replica it bound it to
            # (Serve's router never placed it, so a release through Serve would reach a random replica)

    async def _bind_drafters(self, force: bool = False, failed: list[str] | None = None):
        """Tell vLLM's proposer where the drafter pool's replicas listen: learned from the pool through
        Serve (its router picks live replicas), refreshed every 10 s and at once when the proposer
        reports a failed endpoint (the watcher below)."""
        if not force and time.monotonic() - self._drafters_at < 10.0:
            return
        if self._drafters_lock is None:
            self._drafters_lock = asyncio.Lock()
        async with self._drafters_lock:
            if not force and time.monotonic() - self._drafters_at < 10.0:
                return
            try:  # several calls, so Serve's router spreads them over the pool's replicas
                found = await asyncio.wait_for(asyncio.gather(*(self.drafter.endpoint.remote() for _ in range(4)),
                                                              return_exceptions=True), 10.0)
            except TimeoutError:
                found = []
            new = {e for e in found if isinstance(e, Endpoint)}
            failed = set(failed or ())
            # a refresh reaches a few replicas through Serve's router: the ones known before stay
            # unless the proposer saw them fail (or they were all that answered)
            eps = sorted(new | {e for e in self._drafter_eps if f"{e.host}:{e.port}" not in failed},
                         key=lambda e: (e.host, e.port))
            if not eps:
                log.warning("no drafter replica answered: the proposer keeps its endpoints")
                return
            self._drafter_eps = eps
            await self.engine.bind({"endpoints": [[e.host, e.port, e.token.hex(), e.replica] for e in eps],
                                    "timeout_s": 0.9 * self.drafter_timeout_s,
                                    "tree": PRE_DRAFT_ALTERNATIVES if self.pipeline_drafts else -1,
                                    "speculate": self.engine.config.vllm_speculate})
            self._drafters_at = time.monotonic()
            log.info("vLLM proposer bound to %d drafter replica(s)", len(eps))
        if self._watch is None:
            self._watch = asyncio.create_task(self._watch_proposer())

    async def _watch_proposer(self):
        """While streams run, ask the proposer every second whether an endpoint failed; rebind then."""
        while True:
            await asyncio.sleep(1.0)
            if not self.engine.inflight:
                continue
            try:
                status = await self.engine.proposer_status(consume=True)
                failed = [f for s in status for f in s.get("failed", [])]
                if failed:
                    self.drafter_calls["fallback"] += 1
                    await self._bind_drafters(force=True, failed=failed)
            except Exception as e:  # noqa: BLE001 - keep watching; the streams go on without drafts meanwhile
                log.warning("vLLM proposer status failed: %r", e)

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
