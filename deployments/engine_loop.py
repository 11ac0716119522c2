"""The speculative loop run by the engine itself (a backend whose capabilities say ``engine_loop``: vLLM's, with
``verifier.vllm.loop: engine``): one engine request for the rest of a sequence; the engine verifies, and
drafts through splitspec's proposer in its worker (``verifier.vllm_proposer``), which calls the drafter pool.
This module is the verifier replica's side: each stream's engine request, and telling the proposer where the
drafter pool's replicas listen."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time

from configs import SamplingParams
from core.channel import Endpoint
from core.protocol import StepInfo

log = logging.getLogger(__name__)
REBIND_S = 10.0  # the drafter endpoints are refreshed this often while streams start


class EngineLoop:
    """A verifier replica's streams on its engine's own loop. ``server``: the replica
    (``deployments.verifier.VerifierServer``: its engine, drafter pool handle, batcher bound, load and drafter
    call counters); ``tree``: the pre-draft alternatives per outcome the proposer asks for (-1: none)."""

    def __init__(self, server, tree: int):
        self.server, self.engine, self.tree = server, server.engine, tree
        self._drafters_at, self._drafters_lock, self._watch = 0.0, None, None
        self._drafter_eps: list[Endpoint] = []  # the drafter replicas the proposer was last told of
        self._ids, self._streams = itertools.count(), 0

    def _k(self, k: int) -> int:
        """A request's k on the engine's loop: the engine's own when it drafts in the engine (every request
        speculates it), 0 without drafting, else the request's; at most what the loop verifies per step."""
        eng = self.engine
        if eng.in_engine:
            k = eng.max_k
        elif self.server.drafter is None or not eng.speculative:
            k = 0
        return min(k, eng.max_k)

    async def steps(self, prompt_ids, params: SamplingParams, seq_id: str, k: int, max_len: int | None,
                    logprobs: int | None, output_ids, cache_salt: str | None = None, constraint=None):
        """``VerifierServer._steps`` on the engine's loop. k is per request (``_k``), no adaptive policy (the
        engine schedules k). Each stream item is what one engine step emitted (vLLM coalesces steps when the
        stream is read late: then ``accepted`` is capped at k). ``constraint``: the engine's structured outputs
        mask p, the drafter pool q."""
        from deployments.batcher import Overloaded

        eng, k = self.engine, self._k(k)
        if eng.inflight + 1 > self.server.batcher.max_queue:
            raise Overloaded(f"queue full ({eng.inflight} streams)")
        tokens = list(prompt_ids) + list(output_ids)
        limit = min(max_len or eng.max_len, eng.max_len)
        if len(tokens) >= limit:
            raise ValueError(f"{len(tokens)} tokens reach the context limit {limit}")
        if constraint is not None and output_ids:  # the engine's grammar starts where its request does
            raise ValueError("a structured output cannot resume part-way on the engine's loop")
        max_tokens = min(params.max_tokens - len(output_ids), limit - len(tokens))
        if max_tokens <= 0:
            return
        if k > 0 and not eng.in_engine:
            await self.bind_drafters()
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        # a resumed stream has emitted output_ids already: they count towards min_tokens
        params = params.model_copy(update={"min_tokens": max(0, params.min_tokens - len(output_ids))})
        sp = eng.sampling_params(params, k, seq_id, seed, len(prompt_ids), max_tokens, logprobs, constraint)
        if not self._streams:  # autoscaling load: busy while any stream runs in the engine
            self.server.load.begin()
        self._streams += 1
        try:
            async for item in self._outputs(tokens, sp, seq_id, k, cache_salt):
                yield item
        finally:
            self._streams -= 1
            if not self._streams:
                self.server.load.end([])
            # the sequence's drafter cache is released by the proposer, on the replica it bound it to
            # (Serve's router never placed it, so a release through Serve would reach a random replica)

    async def _outputs(self, tokens: list[int], sp, seq_id: str, k: int, cache_salt: str | None):
        """The engine request's outputs as (new ids, logprobs, ``StepInfo``)."""
        eng = self.engine
        t_prev = time.perf_counter()
        drafted = accepted = 0  # as reported so far
        cached = {"tokens": 0}  # the prompt's tokens the engine read from its prefix cache
        first = True
        async for ids, lps, spec in eng.generate(tokens, sp, f"{seq_id}-{next(self._ids)}", cache_salt, cached):
            if not ids and spec is None:
                continue
            now = time.perf_counter()
            # per output: k drafts (none in the prefill's), those of its tokens but the last accepted;
            # the engine's own counts, which come with the last output, make the request's totals exact
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

    async def bind_drafters(self, force: bool = False, failed: list[str] | None = None):
        """Tell the engine's proposer where the drafter pool's replicas listen: learned from the pool through
        Serve (its router picks live replicas), refreshed every ``REBIND_S`` and at once when the proposer
        reports a failed endpoint (``_watch_proposer``)."""
        if not force and time.monotonic() - self._drafters_at < REBIND_S:
            return
        if self._drafters_lock is None:
            self._drafters_lock = asyncio.Lock()
        async with self._drafters_lock:
            if not force and time.monotonic() - self._drafters_at < REBIND_S:
                return
            eps = await self._endpoints(set(failed or ()))
            if not eps:
                log.warning("no drafter replica answered: the proposer keeps its endpoints")
                return
            self._drafter_eps = eps
            await self.engine.bind({"endpoints": [[e.host, e.port, e.token.hex(), e.replica] for e in eps],
                                    "timeout_s": 0.9 * self.server.drafter_timeout_s, "tree": self.tree})
            self._drafters_at = time.monotonic()
            log.info("the engine's proposer bound to %d drafter replica(s)", len(eps))
        if self._watch is None:
            self._watch = asyncio.create_task(self._watch_proposer())

    async def _endpoints(self, failed: set[str]) -> list[Endpoint]:
        """The drafter replicas to bind: those a few calls through Serve reach, and the ones known before
        unless the proposer saw them fail (or they were all that answered)."""
        try:  # several calls, so Serve's router spreads them over the pool's replicas
            found = await asyncio.wait_for(asyncio.gather(*(self.server.drafter.endpoint.remote() for _ in range(4)),
                                                          return_exceptions=True), 10.0)
        except TimeoutError:
            found = []
        new = {e for e in found if isinstance(e, Endpoint)}
        return sorted(new | {e for e in self._drafter_eps if f"{e.host}:{e.port}" not in failed},
                      key=lambda e: (e.host, e.port))

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
                    self.server.drafter_calls["fallback"] += 1
                    await self.bind_drafters(force=True, failed=failed)
            except Exception as e:  # noqa: BLE001 - keep watching; the streams go on without drafts meanwhile
                log.warning("the engine's proposer status failed: %r", e)

    async def proposer_status(self) -> list[dict] | None:
        """Each worker's proposer (``stats()``); None where the engine drafts without the pool, or not at all."""
        eng = self.engine
        return await eng.proposer_status() if eng.speculative and not eng.in_engine else None
