"""The verifier on vLLM's engine (``backend: vllm``): same verify call, same guarantees.

vLLM's ``AsyncLLM`` (one per verifier replica) does the paged attention, the continuous
batching and the prefix caching; this module turns one ``VerifyRequest`` into engine
requests that return the target's log-probabilities at the k + 1 positions, then calls
``verifier.engine.decide``, the backend-independent accept/reject step. Log-probabilities
give the same softmax and argmax as logits, so the rejection sampler and the greedy check
see exactly what the transformers backend gives them (up to float noise between kernels).

The protocol stays stateless: the replica remembers each sequence's token ids (an LRU dict,
honouring ``release``) so it can rebuild the full prompt from (start, prefix hash, new
tokens); an unknown sequence or a hash mismatch answers ``cache_miss=True``, exactly as
the transformers engine does. The K/V of the earlier tokens lives in vLLM's prefix cache
(hashed whole blocks), so a step computes only the new tokens, the drafts and the partial
last block.

Two ways to get the distributions, both costing work proportional to the new tokens:

* greedy without logprobs (only the argmax matters): one engine request over
  tokens + drafts with ``prompt_logprobs=1`` and prefix-cache reads on
  (``skip_reading_prefix_cache=False``; vLLM then computes prompt logprobs only for the
  uncached positions). Should a row we need have come from the cache (the same tokens were
  computed before, e.g. a retried step), the request is rerun without cache reads.
* anything else (sampling, or logprobs asked): vLLM would return full-vocabulary prompt
  logprobs for *every* prompt position (a [L, V] tensor, copied and turned into Python
  lists per step, O(L·V)), so instead k + 1 engine requests go out at once, the j-th over
  tokens + drafts[:j], each returning the full-vocabulary log-probabilities of its one
  sampled position (``logprobs=-1``); they share the cached prefix and vLLM batches them
  into one step.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import json
import os
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

from core.backends import capabilities
from core.grammar import Constraint
from core.models import eos_token_ids, pin_process, resolve_dtype
from core.protocol import VerifyRequest, VerifyResult
from core.rejection import decide
from verifier import vllm_compat as compat

# the cache_salt of the verify call a task serves (each call of a batch runs in a task of its own)
_SALT: contextvars.ContextVar[str | None] = contextvars.ContextVar("cache_salt", default=None)
# the prompt tokens each engine request of the verify call a task serves read from vLLM's prefix cache
_READ: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("cached_reads", default=None)

if TYPE_CHECKING:  # pydantic stays out of engine-level imports
    from configs import VerifierConfig


def _stat_logger_class():
    """A vLLM stat logger that records the most requests vLLM finished in one engine step:
    evidence that concurrent verify calls were batched by vLLM itself."""
    class MaxRunning(compat.stat_logger_base()):
        seen = {"max_running": 0, "steps": 0, "max_scheduled": 0}

        def __init__(self, vllm_config, engine_index: int = 0):
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
            if iteration_stats is not None:  # every engine request ends in the step that ran it (max_tokens=1)
                self.seen["steps"] += 1
                self.seen["max_running"] = max(self.seen["max_running"], len(iteration_stats.finished_requests))
            if scheduler_stats is not None:  # vLLM's own loop: requests running in one engine step
                self.seen["max_scheduled"] = max(self.seen["max_scheduled"], scheduler_stats.num_running_reqs)

        def log_engine_initialized(self):
            pass

    MaxRunning.seen = {"max_running": 0, "steps": 0, "max_scheduled": 0}  # one dict per engine
    return MaxRunning


def _row(flat, i: int, out: torch.Tensor):
    """Write position i of a vLLM FlatLogprobs into the dense row ``out`` (others stay -inf)."""
    s, e = flat.start_indices[i], flat.end_indices[i]
    out[torch.tensor(flat.token_ids[s:e], dtype=torch.long)] = torch.tensor(flat.logprobs[s:e], dtype=torch.float32)


def _token_logprobs(logprobs, i: int, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """Position i of vLLM's logprobs (a list of {id: Logprob} or FlatLogprobs) as splitspec's
    (the emitted token's logprob, its top alternatives [(id, logprob)], best first)."""
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs
        s, e = logprobs.start_indices[i], logprobs.end_indices[i]
        entries = list(zip(logprobs.token_ids[s:e], logprobs.logprobs[s:e], logprobs.ranks[s:e]))
    else:
        entries = [(tid, lp.logprob, lp.rank) for tid, lp in logprobs[i].items()]
    own = next(lp for tid, lp, _ in entries if tid == token)
    ranked = sorted(((tid, lp) for tid, lp, rank in entries if rank is not None and rank <= top), key=lambda t: -t[1])
    return own, ranked[:top]


def _share_cpus() -> None:
    """The CPU backend binds OpenMP threads to cores by default, which fights every other process on a shared
    machine; and its legacy KV-space variable would override ours."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)


def _engine_args(config: VerifierConfig, max_len: int, enable_prefix_caching: bool, spec_metrics: str):
    """vLLM's engine arguments for the verifier's model, before any speculation (``_speculate``)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(
        model=config.model, tokenizer=config.model, dtype=resolve_dtype(config.dtype, config.device), seed=0,
        max_model_len=max_len, enable_prefix_caching=enable_prefix_caching, block_size=config.vllm.block_size,
        kv_cache_memory_bytes=int(config.vllm.kv_cache_gib * 2**30), max_num_seqs=config.vllm.max_num_seqs,
        max_num_batched_tokens=max(config.max_batch_tokens, max_len),
        max_logprobs=-1,  # full-vocabulary log-probabilities: p itself, not its top 20
        # token ids in and out, nothing detokenised (detokenize=False); the tokenizer is for structured outputs,
        # whose grammars vLLM compiles as core.grammar does: xgrammar, compact JSON
        structured_outputs_config=_structured_outputs_config(),
        enforce_eager=config.vllm.enforce_eager if config.vllm.enforce_eager is not None else config.device == "cpu",
        tensor_parallel_size=config.tensor_parallel_size,
        # one worker per GPU as Ray actors, in the replica's placement group (Serve's bundles)
        distributed_executor_backend="ray" if config.tensor_parallel_size > 1 else None, disable_log_stats=True,
        per_request_spec_decode_metrics=spec_metrics)


def _structured_outputs_config():
    from vllm.config import StructuredOutputsConfig

    return StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True)


def structured_outputs(c: Constraint):
    """vLLM's StructuredOutputsParams for a constraint (``core.grammar``): vLLM masks p itself, in its loop."""
    from vllm.sampling_params import StructuredOutputsParams

    if c.kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if c.kind == "choice":
        return StructuredOutputsParams(choice=json.loads(c.spec))
    return StructuredOutputsParams(**{c.kind: c.spec})


def _speculate(args, config: VerifierConfig, speculative: bool, aux_layers: tuple[int, ...],
               eagle3: tuple[str, int] | None) -> None:
    """How vLLM's loop drafts, set on ``args``: the EAGLE-3 head in the engine (``eagle3``: its directory and
    k), or splitspec's proposer calling the drafter pool (``speculative``), which reads the states entering
    ``aux_layers`` for an EAGLE-3 head on the pool; neither: no speculation."""
    if eagle3 is not None:
        head, k = eagle3
        args.speculative_config = {"method": "eagle3", "model": head, "num_speculative_tokens": k}
    elif speculative:
        args.speculative_config = {"method": "custom_class", "model": "verifier.vllm_proposer.SplitspecProposer",
                                   "num_speculative_tokens": config.vllm.num_speculative_tokens}
        args.worker_extension_cls = "verifier.vllm_proposer.ProposerWorker"
        if aux_layers:  # (the states of a prefix vLLM reads from its cache: kept by the proposer, by prefix)
            args.additional_config = {"splitspec": {"aux_layers": sorted(set(aux_layers))}}


def build(config: VerifierConfig, *, drafting: bool = False, aux_layers: tuple[int, ...] = (),
          head: tuple[str, int] | None = None) -> VllmVerifierEngine:
    """The vllm backend's engine (``core.backends``). ``drafting``: the replica has a drafter pool, which vLLM's
    loop (``vllm.loop: engine``) drafts from, reading the states entering ``aux_layers`` for a head there;
    ``head``: (directory, k) of an EAGLE-3 head vLLM runs in its own engine instead."""
    return VllmVerifierEngine(config, speculative=drafting and config.vllm.loop == "engine",
                              aux_layers=aux_layers if drafting else (), eagle3=head)


class VllmVerifierEngine:
    """Answers ``VerifyRequest``s with vLLM's AsyncLLM. Its ``verify`` is a coroutine: vLLM
    batches concurrent calls by itself, so callers gather them instead of queueing them."""

    is_async = True

    def __init__(self, config: VerifierConfig, tokenizer=None, enable_prefix_caching: bool = True,
                 speculative: bool = False, aux_layers: tuple[int, ...] = (), eagle3: tuple[str, int] | None = None,
                 per_step_metrics: bool = False):
        """``enable_prefix_caching=False`` only for the benchmark's baseline (every step recomputes).
        ``speculative``: vLLM runs the speculative loop (``generate``), drafting through
        ``verifier.vllm_proposer`` (the drafter pool's endpoints are pushed with ``bind``).
        ``aux_layers``: the drafter pool runs an EAGLE-3 head that reads the states entering these
        layers; the proposer gets them from vLLM's runner. ``eagle3``: (head directory, k): vLLM runs
        the head itself, in the engine (its ``eagle3`` speculative method), and no drafter pool is used.
        ``per_step_metrics``: vLLM's per-request speculation counts list each step's accepted drafts."""
        from transformers import AutoConfig, AutoTokenizer

        compat.check()  # a vLLM whose internals this backend was not written against fails here, naming it
        if config.device == "cpu":
            _share_cpus()
        pin_process(config.cpu_affinity)  # vLLM's engine processes, started below, inherit it
        self.config = config
        self.capabilities = capabilities(config)
        # the most drafts vLLM's loop verifies per step (its own EAGLE-3's k, with the head in the engine)
        k_max = config.vllm.num_speculative_tokens
        self.max_k = min(eagle3[1], k_max) if eagle3 else k_max
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(config.model)
        text = AutoConfig.from_pretrained(config.model).get_text_config()
        self.vocab_size = text.vocab_size
        self.max_len = config.max_model_len or text.max_position_embeddings
        self.eos_ids = eos_token_ids(self.tokenizer, model_dir=config.model)
        self._stats_cls = _stat_logger_class()
        self.speculative = speculative or eagle3 is not None
        self.in_engine = eagle3 is not None  # vLLM drafts itself: no proposer to bind
        metrics = ("detailed" if per_step_metrics else "summary") if self.speculative else "none"
        args = _engine_args(config, self.max_len, enable_prefix_caching, metrics)
        _speculate(args, config, speculative, aux_layers, eagle3)
        self.llm = compat.async_llm().from_engine_args(args, stat_loggers=[self._stats_cls])
        self.seqs: OrderedDict[str, list[int]] = OrderedDict()  # token ids whose K/V vLLM may hold
        # computed_tokens: prompt tokens vLLM computed (not read from its prefix cache), the work measure
        self.stats = {"hits": 0, "misses": 0, "evictions": 0, "rereads": 0, "engine_requests": 0,
                      "prompt_tokens": 0, "computed_tokens": 0}
        self._ids = itertools.count()
        self.inflight = 0  # sequences being verified now
        self.max_seen = 0  # most verified at once
        self.busy_s = 0.0

    # --- the cache protocol -------------------------------------------------------------

    def release(self, seq_id: str) -> bool:
        return self.seqs.pop(seq_id, None) is not None

    def num_cached(self) -> int:
        return len(self.seqs)

    def _claim(self, r: VerifyRequest) -> list[int] | None:
        """The sequence's tokens before its drafts, or None on a cache miss."""
        tokens = r.resumed(self.seqs.get(r.seq_id))
        if tokens is None:
            self.stats["misses"] += 1
            return None
        if not r.full:
            self.stats["hits"] += 1
        self.seqs[r.seq_id] = tokens
        self.seqs.move_to_end(r.seq_id)
        while len(self.seqs) > self.config.vllm.tracked_sequences:
            self.seqs.popitem(last=False)
            self.stats["evictions"] += 1
        return tokens

    # --- verification -------------------------------------------------------------------

    async def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        if len({r.seq_id for r in requests}) != len(requests):
            raise ValueError("a sequence appears twice in one batch")
        self.inflight += len(requests)
        self.max_seen = max(self.max_seen, self.inflight)
        try:
            return list(await asyncio.gather(*(self._verify_one(r) for r in requests)))
        finally:
            self.inflight -= len(requests)

    async def _verify_one(self, r: VerifyRequest) -> VerifyResult:
        t_call = time.perf_counter()
        _SALT.set(r.cache_salt)  # its engine requests read vLLM's prefix cache under the tenant's salt
        room = self.max_len - (0 if r.full else r.start) - len(r.new_tokens)
        if room < 0:
            return VerifyResult(r.seq_id, error=f"{self.max_len - room} tokens exceed the context limit {self.max_len}")
        if r.k > room:  # verifying fewer drafts is still lossless
            r.draft_tokens = r.draft_tokens[:room]
            if r.draft_probs is not None:
                r.draft_probs = r.draft_probs.head(room)
        tokens = self._claim(r)
        if tokens is None:
            return VerifyResult(r.seq_id, cache_miss=True, num_drafts=r.k)
        t0 = time.perf_counter()
        reads: list[int] = []
        _READ.set(reads)  # (the call's engine requests run in tasks of their own: they share the list)
        try:
            if r.sampling.greedy and r.logprobs is None and not r.sampling.processed:
                logprobs = await self._argmax_rows(r.seq_id, tokens, r.draft_tokens)
            else:
                logprobs = await self._full_rows(r.seq_id, tokens, r.draft_tokens)
        except Exception as e:  # this sequence only; the others in the call go on
            self.seqs.pop(r.seq_id, None)
            return VerifyResult(r.seq_id, error=f"vLLM engine: {e!r}", num_drafts=r.k, retryable=True)
        dt = time.perf_counter() - t0
        self.busy_s += dt
        res = decide(r, logprobs, tokens + r.draft_tokens, self.eos_ids)
        res.forward_s = dt
        res.batch_size = self.inflight
        kept = tokens + r.draft_tokens[: res.num_accepted]  # the recovered/bonus token was never fed
        if r.seq_id in self.seqs:  # not released meanwhile
            self.seqs[r.seq_id] = kept
        res.cached = len(kept)
        if r.full and reads:  # a sequence's first call (or a resend): its prompt's tokens read from the cache;
            # the least of its requests': a rerun without reads read none, and of k + 1 requests sent at once the
            # later ones may read the blocks the first wrote in the same engine step
            res.prefix_hit = min(min(reads), len(tokens))
        res.engine_s = time.perf_counter() - t_call  # the sequence's whole call: claim, vLLM's pass, decision
        return res

    def _params(self, **kw):
        from vllm import SamplingParams

        return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False,
                              flat_logprobs=True, **kw)

    async def _run(self, seq_id: str, prompt: list[int], params):
        from vllm import TokensPrompt

        out, salt = None, _SALT.get()
        prompt_in = TokensPrompt(prompt_token_ids=prompt, **({"cache_salt": salt} if salt else {}))
        async for out in self.llm.generate(prompt_in, params, f"{seq_id}-{next(self._ids)}"):  # noqa: B007 (returned)
            pass
        self.stats["engine_requests"] += 1
        self.stats["prompt_tokens"] += len(prompt)
        self.stats["computed_tokens"] += len(prompt) - (out.num_cached_tokens or 0)
        reads = _READ.get()
        if reads is not None:
            reads.append(out.num_cached_tokens or 0)
        return out

    async def _argmax_rows(self, seq_id: str, tokens: list[int], drafts: list[int]) -> torch.Tensor:
        """[k+1, V] rows that are -inf except at each position's argmax (and the fed token):
        enough for greedy verification. One engine request, prompt logprobs of rank 1."""
        prompt = tokens + drafts
        first = len(tokens) - 1  # the position that predicts draft 1 (the bonus when k = 0)
        k = len(drafts)
        kw = dict(logprobs=1)
        if k:
            kw.update(prompt_logprobs=1, skip_reading_prefix_cache=False)
        out = await self._run(seq_id, prompt, self._params(**kw))
        if k and (out.num_cached_tokens or 0) > first:  # a row we need was read from the cache
            self.stats["rereads"] += 1
            out = await self._run(seq_id, prompt, self._params(logprobs=1, prompt_logprobs=1,
                                                               skip_reading_prefix_cache=True))
        rows = torch.full((k + 1, self.vocab_size), float("-inf"))
        for j in range(k):  # prompt_logprobs[i] is the distribution of prompt token i (row 0 is empty)
            _row(out.prompt_logprobs, first + j + 1, rows[j])
        _row(out.outputs[0].logprobs, 0, rows[k])
        return rows

    async def _full_rows(self, seq_id: str, tokens: list[int], drafts: list[int]) -> torch.Tensor:
        """[k+1, V] full-vocabulary log-probabilities: k + 1 engine requests sharing the cached
        prefix, the j-th ending after draft j, each reporting its one sampled position."""
        params = self._params(logprobs=-1)
        outs = await asyncio.gather(*(self._run(seq_id, tokens + drafts[:j], params)
                                      for j in range(len(drafts) + 1)))
        rows = torch.full((len(drafts) + 1, self.vocab_size), float("-inf"))
        for j, out in enumerate(outs):
            _row(out.outputs[0].logprobs, 0, rows[j])
        return rows

    # --- vLLM's own loop (vllm.loop: engine) ----------------------------------------------

    async def bind(self, config: dict) -> list[dict]:
        """Push the drafter endpoints (and the proposer's settings, with ``vllm.speculate``) to every worker's
        proposer."""
        config = {"speculate": self.config.vllm.speculate, **config}
        return await self.llm.collective_rpc("splitspec_bind", args=(config,))

    async def proposer_status(self, consume: bool = False) -> list[dict]:
        """Each worker's proposer: counters, and the endpoints that failed (since the last consuming call);
        none when vLLM drafts in the engine."""
        if self.in_engine:
            return []
        return await self.llm.collective_rpc("splitspec_status", args=(consume,))

    def sampling_params(self, params, k: int, seq_id: str, seed: int, num_prompt: int, max_tokens: int,
                        logprobs: int | None, constraint: Constraint | None = None):
        """vLLM's SamplingParams for a request (``configs.SamplingParams`` ``params``), with splitspec's
        settings for the proposer in ``extra_args``. EOS is a stop token id here: token ids in and out,
        vLLM's own EOS check is off (``ignore_eos``). ``constraint``: a structured output's, which vLLM's
        structured outputs apply to p at every position (the drafts' and the bonus); the proposer has the
        drafter pool draw under the same grammar, so that q is what the drafts were drawn from."""
        import pickle

        from vllm import SamplingParams as VllmParams
        from vllm.sampling_params import RequestOutputKind

        if params.verification != "rejection":
            raise ValueError(f"verification={params.verification!r} is not supported by the vllm backend's engine "
                             "loop (vLLM's rejection sampler); use rejection or vllm.loop: per_step")
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_ids))
        extra = {"splitspec": {"seq": seq_id, "k": int(k), "seed": int(seed), "num_prompt": int(num_prompt),
                               "sampling": pickle.dumps(params.model_copy(update={"stop": ()})),
                               "grammar": None if constraint is None else [constraint.kind, constraint.spec]}}
        extra = extra if k > 0 else None
        return VllmParams(
            n=1, max_tokens=max_tokens, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1, min_p=params.min_p, seed=params.seed,
            repetition_penalty=params.repetition_penalty, frequency_penalty=params.frequency_penalty,
            presence_penalty=params.presence_penalty, logit_bias=dict(params.logit_bias) or None,
            min_tokens=min(params.min_tokens, max_tokens), ignore_eos=True, stop_token_ids=sorted(stops),
            logprobs=logprobs, detokenize=False, skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA, extra_args=extra,
            structured_outputs=None if constraint is None else structured_outputs(constraint))

    async def generate(self, tokens: list[int], params, request_id: str, cache_salt: str | None = None,
                       cached: dict | None = None):
        """Stream (new token ids, their logprobs or None, vLLM's speculation counts for the request or
        None) from vLLM's loop for one request; the counts come with the last output. ``cache_salt``: the
        tenant's, for vLLM's prefix cache; ``cached["tokens"]``: the prompt tokens it read from that cache."""
        from vllm import TokensPrompt

        self.inflight += 1
        self.max_seen = max(self.max_seen, self.inflight)
        prompt = TokensPrompt(prompt_token_ids=tokens, **({"cache_salt": cache_salt} if cache_salt else {}))
        if cache_salt and (params.extra_args or {}).get("splitspec"):  # the proposer names kept prefix states by it
            params.extra_args["splitspec"]["salt"] = cache_salt
        try:
            async for out in self.llm.generate(prompt, params, request_id):
                if cached is not None and out.num_cached_tokens is not None:
                    cached["tokens"] = out.num_cached_tokens
                o = out.outputs[0]
                lps = None
                if params.logprobs is not None and o.logprobs is not None:
                    lps = [_token_logprobs(o.logprobs, i, tid, params.logprobs) for i, tid in enumerate(o.token_ids)]
                yield list(o.token_ids), lps, o.spec_decode_metrics if out.finished else None
        except Exception as e:
            if type(e).__name__ == "VLLMValidationError":  # vLLM refused the request: no replica will take it
                raise ValueError(str(e)) from None
            raise
        finally:
            self.inflight -= 1

    def check_health(self):
        if self.llm.errored:
            raise RuntimeError("vLLM engine is dead")

    def report(self) -> dict:
        """The replica's ``stats()``: the engine's counters and vLLM's."""
        return {"backend": "vllm", "vllm_loop": self.config.vllm.loop, "queued": self.inflight, "busy_s": self.busy_s,
                "max_batch": self.max_seen, "cached_sequences": self.num_cached(), "cache": self.engine_stats()}

    def engine_stats(self) -> dict:
        return {**self.stats, "vllm_max_running": self._stats_cls.seen["max_running"],
                "vllm_steps": self._stats_cls.seen["steps"],
                "vllm_max_scheduled": self._stats_cls.seen["max_scheduled"]}

    def shutdown(self):
        self.llm.shutdown()
