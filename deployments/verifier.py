"""Verifier deployment: a pool of target-model replicas, each running the speculative loop of
its requests beside its engine (drafts from the drafter pool), verification batched across
requests. Its engine is its config's backend's (``core.backends``); one that runs the loop itself
(``engine_loop``) serves each stream as one engine request (``deployments.engine_loop``)."""

from __future__ import annotations

import asyncio
import logging
import time

from configs import SamplingParams, VerifierConfig
from core.backends import build, capabilities
from core.grammar import Constraint, SequenceMasks
from core.hub import localize
from core.loop import speculate
from core.policy import Breaker, FixedK
from core.prediction import PredictedOutput
from core.protocol import VerifyRequest, VerifyResult
from core.sequence import Sequence
from deployments.coalesce import coalesced
from deployments.drafter_link import DrafterLink
from deployments.engine_loop import EngineLoop
from deployments.replica_gate import ReplicaGate
from deployments.server import EngineServer
from deployments.verifier_options import VerifierOptions

log = logging.getLogger(__name__)
# m: a pre-draft tree's guesses per outcome (``core.proposers.tree_branches``); the one m that paid
# (docs/decisions/0004-pre-drafting.md, docs/decisions/0027-one-policy.md), for sampled requests too
# (docs/decisions/0055-goodput.md)
PRE_DRAFT_ALTERNATIVES = 1


class VerifierServer(ReplicaGate, DrafterLink, EngineServer):
    """Receives its engine as a constructor argument, so it can be tested without a cluster. The engine's
    ``capabilities`` say what it serves; ``is_async``: its verify is a coroutine and it batches concurrent
    calls itself (no batcher thread); ``engine_loop``: it runs each stream's loop itself."""

    role = "verifier"

    def __init__(self, config: dict, engine=None, drafter=None, options: VerifierOptions | None = None):
        """``config``: the verifier's (``VerifierConfig``, as a dict); ``engine``: built from it when None;
        ``drafter``: a handle to the drafter pool (None: plain decoding only, unless ``options.local_drafter``)."""
        o = self.options = options or VerifierOptions()
        cfg = None if engine is not None else VerifierConfig.model_validate(localize(config))  # (node-local models)
        caps = engine.capabilities if engine is not None else capabilities(cfg)
        self.drafter, self.local = drafter, None  # local: a drafter engine in this process, behind its own batcher
        # drafter_placement verifier on a backend that cannot run a drafter beside it: its engine runs the head
        in_engine = o.local_drafter is not None and not caps.local_drafter
        if o.local_drafter is not None and not in_engine:
            from deployments.drafter import DrafterServer
            self.local = DrafterServer(o.local_drafter, max_batch=o.max_batch, max_queue=o.max_queue,
                                       stall_timeout_s=o.stall_timeout_s)
        self._init_link(o.drafter_transport, o.drafter_timeout_s)
        self._init_gate()
        self.drafter_aux_layers, self.pipeline_drafts = tuple(o.drafter_aux_layers), o.pipeline_drafts
        self.stream_interval_s, self.verify_inline = o.stream_interval_s, o.verify_inline
        engine = engine or self._engine(cfg, in_engine)
        self.is_async = getattr(engine, "is_async", False)
        self._in_engine, self._period = 0, []  # calls inside an async engine now; those of this busy period
        # a batch's sequences decoding plain queue their next verify at once: the next batch waits for them up
        # to a quarter of the batch's time, at most 5 ms, so a split batch merges again (batcher). Not for one
        # that speculated: its next step may wait on a draft (waiting for those cost: docs/decisions/0031-regrouping.md)
        super().__init__(engine, engine.verify, o.max_batch, o.max_queue, o.stall_timeout_s, regroup=0.25,
                         at_once=lambda r: not r.draft_tokens)
        tree = PRE_DRAFT_ALTERNATIVES if self.pipeline_drafts else -1
        self.engine_loop = EngineLoop(self, tree) if engine.capabilities.engine_loop else None

    def _engine(self, cfg: VerifierConfig, in_engine: bool):
        """The engine of the config's backend; ``in_engine``: with the drafter's head in it (its reference, a
        local directory on this node, and k)."""
        local = self.options.local_drafter
        head = (localize(local)["model"], local["num_speculative_tokens"]) if in_engine else None
        drafting = self.drafter is not None
        return build(cfg, drafting=drafting, aux_layers=self.drafter_aux_layers if drafting else (), head=head)

    def queued(self) -> int:
        return self.engine.inflight if self.is_async else super().queued()

    def _run(self, requests: list) -> list:
        out = super()._run(requests)
        self._gate_step(out, prefill=any(r.full or r.start == 0 for r in requests))
        return out

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
        """A verify call on an engine that batches concurrent calls itself."""
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
        """Log-probabilities of a prompt's tokens (``echo`` with ``logprobs``), where the engine has them."""
        if not self.engine.capabilities.echo_logprobs:
            raise ValueError(f"echo with logprobs is not supported with {self.engine.capabilities.label}")
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

        proposer = await self.engine_loop.proposer_status() if self.engine_loop is not None else None
        return {**self.engine.report(), "proposer": proposer, "drafter_calls": dict(self.drafter_calls), **where()}

    async def ready(self, need_drafter: bool = True, timeout_s: float = 2.0) -> str | None:
        """None when this replica can serve a request end to end: its engine is up (``check_health``) and, with a
        drafter pool and ``need_drafter``, a drafter replica answers within ``timeout_s``; else what is missing
        (GET /ready)."""
        try:
            self.check_health()
        except RuntimeError as e:
            return f"verifier: {e}"
        return await self._drafter_problem(timeout_s) if need_drafter else None

    def check_health(self):
        if self.local is not None:
            self.local.check_health()  # a stalled drafter engine here stalls this replica's streams
        if not self.is_async:
            return super().check_health()
        self.engine.check_health()

    async def speculate(self, prompt_ids: list[int], params: SamplingParams, seq_id: str, k: int = 0,
                        max_len: int | None = None, logprobs: int | None = None, output_ids: list[int] = (),
                        k_policy: str = "fixed", prediction: list[int] = (), interval_s: float | None = None,
                        constraint: Constraint | None = None, cache_salt: str | None = None):
        """A request's whole speculative loop on this replica (``_steps``), streamed as lists of its
        steps, each (new token ids, their logprobs, ``StepInfo``): at most one list per
        ``interval_s`` (``coalesced``; None: the replica's ``stream_interval_s``), the first step and
        the last at once. ``constraint``: a structured output's (``core.grammar``); ``cache_salt``: the
        tenant's, which the prefix cache is keyed by."""
        steps = self._steps(prompt_ids, params, seq_id, k, max_len, logprobs, output_ids, k_policy, prediction,
                            constraint, cache_salt)
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
        if self.engine_loop is not None:
            async for item in self.engine_loop.steps(prompt_ids, params, seq_id, k, max_len, logprobs, output_ids,
                                                     cache_salt, constraint):
                yield item
            return
        eng = self.engine
        if constraint is not None:  # a structured output's, compiled off the engine's thread: it holds no batch
            await asyncio.to_thread(eng.masks.grammars.compile, constraint)
        seq = Sequence(prompt_ids, params.model_copy(update={"stop": ()}), k, None, eng.eos_ids,
                       min(max_len or eng.max_len, eng.max_len), seq_id=seq_id, logprobs=logprobs,
                       output_ids=output_ids, constraint=constraint, cache_salt=cache_salt)
        policy = self._policy(k, k_policy, params, constraint is not None, params.max_tokens - len(output_ids))
        if self.drafter is None and self.local is None:
            policy = FixedK(0)
        elif k > 0:
            self._speculating(seq)

        async def verify(requests):
            return await self._verify_waiting(requests, running=bool(seq.output_ids))

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

    async def _verify_waiting(self, requests: list[VerifyRequest], running: bool) -> list[VerifyResult]:
        """A stream's verify call: a new one (not ``running``) that finds the replica full is refused (the caller
        tells the client to come back: 503); a running one is never dropped: it waits for room."""
        from deployments.batcher import Overloaded

        delay = 0.01
        while True:
            try:
                return await self.verify(requests)
            except Overloaded:
                if not running:
                    raise
                await asyncio.sleep(delay)
                delay = min(0.5, 2 * delay)

    def _speculating(self, seq: Sequence) -> None:
        """A sequence that drafts: a head's states captured for it; a structured output's forced tokens drafted
        for free, the drafter's after them (docs/decisions/0034-grammar-masks.md)."""
        seq.capture = self.drafter_aux_layers
        if seq.constraint is not None and not seq.capture:
            seq.forced_masks = SequenceMasks(self.engine.masks.grammars)
