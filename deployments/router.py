"""Router deployment: the request's edge, the OpenAI endpoints over the two pools.

The router keeps the request: HTTP (``edge``: the app, keys, error bodies), the prompt and its
sampling parameters (``openai_api``), admission and deadlines (``admission``), the choices'
generation with failover and their statistics (``generation``), and the response bodies and
stream (``responses``). Its speculative loop runs on a verifier replica (one streaming call per
choice, ``VerifierServer.speculate``), which drafts on the drafter pool and verifies beside its
engine, so no step crosses back to the router. The replicas hold only caches, named by the
stateless protocol: a request whose replica dies resumes on another one from its tokens.
"""

import asyncio
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from ray import serve

from configs import AppConfig, SamplingParams
from core.backends import Capabilities, capabilities
from core.grammar import Constraint, GrammarError, Grammars
from core.models import context_limit, eos_token_ids
from core.sequence import Sequence
from deployments.admission import Admission, admit, until_deadline
from deployments.chat import ChatFormat
from deployments.edge import app, configure_edge
from deployments.generation import Call, Generation, merged, prepend
from deployments.metrics import where
from deployments.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    generation_defaults,
    request_constraint,
    to_sampling_params,
    wants_timing,
)
from deployments.responses import Reply, collect
from deployments.server import within
from deployments.vllm_metrics import Exporter
from drafter.registry import method

__all__ = ["Admission", "Router"]

# GET /ready waits this long for a drafter replica's answer, twice this for a verifier's: a pool with no running
# replica does not answer (the call waits in the handle's queue), and a probe must answer within its own timeout
READY_TIMEOUT_S = 1.0


@serve.ingress(app)
class Router:
    """The HTTP ingress and per-request loop. Receives its drafter and verifier as handles
    (or, in tests without a cluster, as anything with the same async methods)."""

    def __init__(self, config: dict, drafter, verifier, metrics_hub=None):
        from transformers import AutoTokenizer

        from core.hub import localize

        # model references as directories on this node; the router reads their metadata only
        self.config = AppConfig.model_validate({**config, "verifier": localize(config["verifier"], weights=False),
                                                "drafter": localize(config["drafter"], weights=False)})
        self.drafter = drafter
        self.verifier = verifier
        vpath = self.config.verifier.model
        self.tokenizer = AutoTokenizer.from_pretrained(vpath)
        self.max_len = context_limit(vpath, self.config.verifier.max_model_len)
        d = self.config.drafter
        if method(d.method).lm:  # a draft model's context bounds the sequence's
            self.max_len = min(self.max_len, context_limit(d.model, d.max_model_len))
        self.eos_ids = eos_token_ids(self.tokenizer, model_dir=vpath)
        from transformers import AutoConfig

        model_config = AutoConfig.from_pretrained(vpath)
        self.vocab_size = model_config.get_text_config().vocab_size
        self.defaults = generation_defaults(vpath)  # sampling defaults for fields a request omits
        configure_edge(self.config)
        self.model_name = self.config.model_name
        # the chat template and vLLM's output parsers (a parser the config names but vLLM lacks fails here)
        self.chat = ChatFormat(self.tokenizer, self.config.verifier, self.model_name, model_config.model_type)
        self.created = int(time.time())
        self.active = 0  # requests running on this router replica
        # vLLM's metric families, summed over the router replicas by the hub (GET /metrics)
        self.exporter = Exporter(self.model_name, d.num_speculative_tokens or 0, metrics_hub,
                                 where().get("replica_id", ""))
        self._grammars = None  # structured outputs' compiled grammars (core.grammar), made at the first such request

    # ---------------------------------------------------------------- HTTP
    @app.get("/health")
    async def health(self):
        """Liveness: this router replica answers (its pools may still be loading: GET /ready says when they serve)."""
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(self):
        """Readiness: 200 once a request can be served end to end (a verifier replica up and, unless
        ``ready_without_drafter`` or the drafter runs in the verifier, a drafter replica it reaches), else 503
        with the reason. Each call asks one replica of each pool, through the handles requests take."""
        try:
            problem = await within(self.verifier.ready.remote(not self.config.ready_without_drafter, READY_TIMEOUT_S),
                                   2 * READY_TIMEOUT_S)
        except TimeoutError:
            problem = f"no verifier replica answered within {2 * READY_TIMEOUT_S:g} s (the pool is starting or down)"
        except Exception as e:  # noqa: BLE001 - a replica that died under the call: not ready, and why
            problem = f"verifier: {type(e).__name__}: {e}"
        if problem:
            return JSONResponse({"status": "not ready", "reason": problem}, status_code=503)
        return {"status": "ready"}

    @app.get("/metrics")
    async def prometheus_metrics(self):
        """vLLM's metric families (Prometheus' text format), the deployment's totals."""
        return Response(await self.exporter.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "splitspec", "max_model_len": self.max_len}]}

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        if isinstance(body.prompt, str) and len(body.prompt) > self.config.max_prompt_chars:
            raise OpenAIError(400, f"prompt has {len(body.prompt)} characters; the limit is "
                              f"{self.config.max_prompt_chars}", param="prompt", code="context_length_exceeded")
        prompt_ids = (list(body.prompt) if isinstance(body.prompt, list)
                      else self.tokenizer(body.prompt)["input_ids"])
        if isinstance(body.prompt, list) and any(not 0 <= t < len(self.tokenizer) for t in prompt_ids):
            raise OpenAIError(400, "prompt token ids out of the vocabulary", param="prompt")
        return await self._serve("completions", body, prompt_ids, request, body.logprobs)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        try:
            chars = sum(len(m.text()) for m in body.messages)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="messages") from None
        if chars > self.config.max_prompt_chars:
            raise OpenAIError(400, f"messages have {chars} characters; the limit is {self.config.max_prompt_chars}",
                              param="messages", code="context_length_exceeded")
        prompt_ids = self.chat.prompt_ids(body)
        top = (body.top_logprobs or 0) if body.logprobs else None
        return await self._serve("chat", body, prompt_ids, request, top, self._prediction_ids(body))

    # ---------------------------------------------------------------- internals
    @property
    def capabilities(self) -> Capabilities:
        """What the verifier backend serves (``core.backends``): what a request may ask for."""
        return capabilities(self.config.verifier)

    def _prediction_ids(self, body: ChatCompletionRequest) -> list[int]:
        """The tokens of a chat request's predicted output ([]: none)."""
        if body.prediction is None:
            return []
        try:
            text = body.prediction.text()
        except ValueError as e:
            raise OpenAIError(400, str(e), param="prediction") from None
        if len(text) > self.config.max_prompt_chars:
            raise OpenAIError(400, f"prediction has {len(text)} characters; the limit is "
                              f"{self.config.max_prompt_chars}", param="prediction")
        if text and not self.capabilities.predicted_outputs:
            raise OpenAIError(400, f"prediction is not supported with {self.capabilities.label}", param="prediction")
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def _params(self, body, prompt_len: int) -> SamplingParams:
        if body.model is not None and body.model != self.model_name:
            raise OpenAIError(404, f"model {body.model!r} does not exist; this server serves {self.model_name!r}",
                              param="model", code="model_not_found")
        return to_sampling_params(body, prompt_len=prompt_len, max_len=self.max_len, vocab_size=self.vocab_size,
                                  max_tokens_limit=self.config.max_tokens_limit, defaults=self.defaults,
                                  verification=self.config.verification, capabilities=self.capabilities)

    async def _constraint(self, body) -> Constraint | None:
        """The request's structured output, compiled here once (off the event loop, within the grammar's time
        bound) so that a constraint that cannot be served is a 400 naming its field before anything runs."""
        # a forced tool choice constrains the output to its calls, over any structured output (as vLLM)
        c = self.chat.constraint(body) if isinstance(body, ChatCompletionRequest) else None
        c = c if c is not None else request_constraint(body)
        if c is None:
            return None
        param = c.param.split(".")[0]
        if not self.capabilities.structured_outputs:
            raise OpenAIError(400, f"{param} is not supported with {self.capabilities.label}", param=param)
        if body.ignore_eos:
            raise OpenAIError(400, "ignore_eos cannot be combined with a structured output, which ends where its "
                              "grammar does", param="ignore_eos")
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)
        try:
            await asyncio.to_thread(self._grammars.compile, c)
        except GrammarError as e:
            raise OpenAIError(400, str(e), param=e.param) from None
        return c

    async def _serve(self, endpoint: str, body, prompt_ids: list[int], request: Request, logprobs: int | None,
                     prediction: list[int] = ()):
        params = self._params(body, len(prompt_ids))
        constraint = await self._constraint(body)
        slot = admit(self, self.config.max_active_requests)
        try:
            reply = await self._reply(endpoint, body, prompt_ids, logprobs, prediction)
            # n choices: each its own speculative sequence; choice i of a seeded request uses seed + i
            choices = [self._choice(reply, params, i, prediction, wants_timing(body, request), constraint).steps()
                       for i in range(body.n)]
            timeout_s = min(body.timeout or self.config.request_timeout_s, self.config.request_timeout_s)
            steps = until_deadline(merged(choices), timeout_s)
            if body.stream:  # the stream's generator gives the admission slot back when it ends
                # The first step runs before the headers go out, so that a request the system cannot
                # start (overloaded, deadline, context) gets a real status code, not an in-band error.
                first = await anext(steps, None)
                return StreamingResponse(self._sse(prepend(first, steps), reply, request, slot),
                                         media_type="text/event-stream")
            try:
                out = await collect(steps, request, body.n)
            finally:
                slot.release()
            return JSONResponse(reply.final_body(out))
        except BaseException:
            slot.release()
            raise

    async def _reply(self, endpoint: str, body, prompt_ids: list[int], logprobs: int | None,
                     prediction: list[int]) -> Reply:
        rid = ("cmpl-" if endpoint == "completions" else "chatcmpl-") + uuid.uuid4().hex
        reply = Reply(rid, endpoint, body, prompt_ids, self.tokenizer, self.model_name, logprobs,
                      # predicted output tokens verified and kept / dropped, every choice's (OpenAI's usage details)
                      predicted={"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}
                      if prediction else None)
        if endpoint == "chat":  # each choice's output read by its own parser (vLLM's parsers keep state)
            reply.parsers = [self.chat.output(body, prompt_ids) for _ in range(body.n)]
        if endpoint == "completions" and body.echo:
            reply.echo = body.prompt if isinstance(body.prompt, str) else self.tokenizer.decode(prompt_ids)
        if reply.echo and logprobs is not None:  # the prompt's own logprobs lead the choice's (the first is None)
            if not self.capabilities.echo_logprobs:
                raise OpenAIError(400, f"echo with logprobs is not supported with {self.capabilities.label}",
                                  param="echo")
            reply.echo_logprobs = await self.verifier.prompt_logprobs.remote(prompt_ids, logprobs)
        return reply

    def _choice(self, reply: Reply, params: SamplingParams, i: int, prediction: list[int],
                timing: bool, constraint: Constraint | None = None) -> Generation:
        """Choice ``i`` of a request: its sequence, and what its verifier replica runs."""
        body, rid = reply.body, reply.rid if reply.body.n == 1 else f"{reply.rid}-{i}"
        if params.seed is not None and i:
            params = params.model_copy(update={"seed": (params.seed + i) % 2**63})
        k = self.config.drafter.num_speculative_tokens
        if body.num_speculative_tokens is not None:
            asked = body.num_speculative_tokens
            k = min(k, asked) if self.config.clamp_speculative_tokens else asked
        # a non-streaming request's tokens are needed only at its end: its replica sends them in fewer,
        # larger chunks (unless the router must find stop strings in them as they come)
        interval_s = None if body.stream or params.stop else self.config.collect_interval_ms / 1000
        seq = Sequence(reply.prompt_ids, params, k, self.tokenizer, self.eos_ids, self.max_len, seq_id=rid,
                       logprobs=reply.logprobs)
        call = Call(reply.prompt_ids, params, k, self.max_len, reply.logprobs, self.config.k_policy,
                    list(prediction), interval_s, constraint, body.cache_salt)
        return Generation((self.drafter, self.verifier), seq, call, self.config.verifier_retry_s, timing,
                          reply.predicted, phases=self._phases(reply, i),
                          meter=self.exporter.choice(len(reply.prompt_ids)),
                          spec_metrics=self.config.per_request_spec_decode_metrics, cached=reply.cached)

    @staticmethod
    def _phases(reply: Reply, i: int):
        """Choice ``i``'s parser where the output has a reasoning part (its acceptance is counted apart)."""
        parser = reply.parsers[i] if reply.parsers else None
        return parser if parser is not None and parser.reasons else None

    async def _sse(self, steps, reply: Reply, request: Request, slot: Admission):
        try:
            async for chunk in reply.sse_chunks(steps):
                yield chunk
        finally:
            slot.release()
