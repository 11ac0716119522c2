"""Router deployment and HTTP ingress: the request's edge.

The router keeps the request: HTTP, admission, deadlines, detokenisation and stop strings,
failover and resume, streaming, statistics. Its speculative loop runs on a verifier replica
(one streaming call per request, ``VerifierServer.speculate``), which drafts on the drafter
pool and verifies beside its engine, so no step crosses back to the router. The replicas
hold only caches, named by the stateless protocol: a request whose replica dies resumes on
another one from its tokens.
"""

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from configs import AppConfig, SamplingParams
from core.loop import own_cancel
from core.models import context_limit, eos_token_ids
from core.protocol import StepInfo, VerifyResult
from core.sequence import Sequence
from core.stats import RequestStats, exposed_s
from deployments.batcher import Overloaded
from deployments.edge import EdgeMiddleware, configure_edge, count_status
from deployments.metrics import Tally, metrics
from deployments.openai_api import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    generation_defaults,
    to_sampling_params,
    validation_error,
    wants_timing,
)

log = logging.getLogger("ray.serve")


@dataclass
class StepOutput:
    """What one stream item from the verifier (one or more steps) adds to a response."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list = field(default_factory=list)
    stats: dict | None = None  # the request's speculation statistics, on the last step


app = FastAPI(title="splitspec", description="Speculative decoding with separately scaled drafter and verifier pools.")
app.add_middleware(EdgeMiddleware)  # API keys and the body limit, before a body is parsed

PLAIN_CHAT_TEMPLATE = "{role}: {content}\n"  # used when the tokenizer has no chat template


@app.exception_handler(OpenAIError)
async def _openai_error(request: Request, e: OpenAIError):
    count_status(request.url.path, e.status)
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


@app.exception_handler(Exception)
async def _internal_error(request: Request, e: Exception):
    log.exception("internal error")
    count_status(request.url.path, 500)
    return JSONResponse(OpenAIError(500, f"internal error: {type(e).__name__}", type_="internal_error").body(),
                        status_code=500)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, e: RequestValidationError):
    count_status(request.url.path, 400)
    return JSONResponse(validation_error(e.errors()).body(), status_code=400)


def _tally(seq: Sequence, info: StepInfo, wall_s: float, tally: Tally):
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


def _overloaded(e: Exception) -> OpenAIError:
    return OpenAIError(503, f"verifier pool overloaded: {e}", type_="server_error", code="overloaded",
                       headers={"Retry-After": "1"})


async def _merged(gens):
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


async def _prepend(first, steps):
    if first is not None:
        yield first
    async for s in steps:
        yield s


class Admission:
    """A request's place among the router replica's ``max_active_requests``, given back
    exactly once: when the request ends, or, for a stream whose body never started (the
    client left between the headers and the first chunk), when its generator is collected."""

    def __init__(self, router):
        self.router = router
        router.active += 1
        self.held = True
        metrics()["active_requests"].set(router.active)

    def release(self):
        if self.held:
            self.held = False
            self.router.active -= 1
            metrics()["active_requests"].set(self.router.active)

    __del__ = release


@serve.ingress(app)
class Router:
    """The HTTP ingress and per-request loop. Receives its drafter and verifier as handles
    (or, in tests without a cluster, as anything with the same async methods)."""

    def __init__(self, config: dict, drafter, verifier):
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
        if d.method == "draft_model":
            self.max_len = min(self.max_len, context_limit(d.model, d.max_model_len))
        self.eos_ids = eos_token_ids(self.tokenizer, model_dir=vpath)
        from transformers import AutoConfig

        self.vocab_size = AutoConfig.from_pretrained(vpath).get_text_config().vocab_size
        self.defaults = generation_defaults(vpath)  # sampling defaults for fields a request omits
        configure_edge(self.config)
        self.model_name = self.config.model_name
        self.created = int(time.time())
        self.active = 0  # requests running on this router replica

    # ---------------------------------------------------------------- HTTP
    @app.get("/health")
    async def health(self):
        return {"status": "ok"}

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
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        except ValueError as e:
            raise OpenAIError(400, str(e), param="messages") from None
        chars = sum(len(m["content"]) for m in messages)
        if chars > self.config.max_prompt_chars:
            raise OpenAIError(400, f"messages have {chars} characters; the limit is {self.config.max_prompt_chars}",
                              param="messages", code="context_length_exceeded")
        prompt_ids = self._chat_prompt(messages, body.add_generation_prompt)
        top = (body.top_logprobs or 0) if body.logprobs else None
        return await self._serve("chat", body, prompt_ids, request, top, self._prediction_ids(body))

    # ---------------------------------------------------------------- internals
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
        if text and self.config.verifier.backend == "vllm":
            raise OpenAIError(400, "prediction is not supported with the vllm verifier backend", param="prediction")
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def _chat_prompt(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        tok = self.tokenizer
        if tok.chat_template:
            try:
                text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            except Exception as e:  # noqa: BLE001 - the template refused these messages (e.g. roles must alternate)
                raise OpenAIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        else:
            text = "".join(PLAIN_CHAT_TEMPLATE.format(**m) for m in messages)
            if add_generation_prompt:
                text += "assistant:"
        # a template that writes BOS itself must not get a second one from the tokenizer
        has_bos = tok.bos_token is not None and text.startswith(tok.bos_token)
        return tok(text, add_special_tokens=not has_bos)["input_ids"]

    def _params(self, body, prompt_len: int) -> SamplingParams:
        if body.model is not None and body.model != self.model_name:
            raise OpenAIError(404, f"model {body.model!r} does not exist; this server serves {self.model_name!r}",
                              param="model", code="model_not_found")
        return to_sampling_params(body, prompt_len=prompt_len, max_len=self.max_len, vocab_size=self.vocab_size,
                                  max_tokens_limit=self.config.max_tokens_limit, defaults=self.defaults,
                                  verification=self.config.verification, backend=self.config.verifier.backend,
                                  vllm_loop=self.config.verifier.vllm_loop)

    async def _serve(self, endpoint: str, body, prompt_ids: list[int], request: Request, logprobs: int | None,
                     prediction: list[int] = ()):
        params = self._params(body, len(prompt_ids))
        if self.active >= self.config.max_active_requests:
            raise OpenAIError(429, f"server busy: {self.active} requests running; retry shortly",
                              type_="rate_limit_error", code="overloaded", headers={"Retry-After": "1"})
        slot = Admission(self)
        try:
            return await self._serve_admitted(endpoint, body, prompt_ids, request, logprobs, params, slot, prediction)
        except BaseException:
            slot.release()
            raise

    async def _serve_admitted(self, endpoint, body, prompt_ids, request, logprobs, params, slot: "Admission",
                              prediction: list[int] = ()):
        k = self.config.drafter.num_speculative_tokens
        if body.num_speculative_tokens is not None:
            k = min(k, body.num_speculative_tokens) if self.config.clamp_speculative_tokens else body.num_speculative_tokens
        rid = ("cmpl-" if endpoint == "completions" else "chatcmpl-") + uuid.uuid4().hex
        timeout_s = min(body.timeout or self.config.request_timeout_s, self.config.request_timeout_s)
        # predicted output tokens verified and kept / verified and dropped, every choice's (OpenAI's usage details)
        predicted = {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0} if prediction else None
        # a non-streaming request's tokens are needed only at its end: its replica sends them in fewer,
        # larger chunks (unless the router must find stop strings in them as they come)
        interval_s = None if body.stream or params.stop else self.config.collect_interval_ms / 1000
        # n choices: each its own speculative sequence; choice i of a seeded request uses seed + i
        choices = [self._generate(rid if body.n == 1 else f"{rid}-{i}", prompt_ids,
                                  params if params.seed is None or i == 0
                                  else params.model_copy(update={"seed": (params.seed + i) % 2**63}), k, logprobs,
                                  prediction, predicted, interval_s, wants_timing(body, request))
                   for i in range(body.n)]
        steps = self._until_deadline(_merged(choices), timeout_s)
        echo = ""
        if endpoint == "completions" and body.echo:
            echo = body.prompt if isinstance(body.prompt, str) else self.tokenizer.decode(prompt_ids)
        meta = dict(rid=rid, endpoint=endpoint, prompt_ids=prompt_ids, t0=time.perf_counter(), body=body, echo=echo,
                    logprobs=logprobs, echo_logprobs=None, predicted=predicted)
        if echo and logprobs is not None:  # the prompt's own logprobs lead the choice's (the first is None)
            if self.config.verifier.backend == "vllm":
                raise OpenAIError(400, "echo with logprobs is not supported with the vllm verifier backend",
                                  param="echo")
            meta["echo_logprobs"] = await self.verifier.prompt_logprobs.remote(prompt_ids, logprobs)
        if body.stream:  # the stream's generator gives the admission slot back when it ends
            # The first step runs before the headers go out, so that a request the system cannot
            # start (overloaded, deadline, context) gets a real status code, not an in-band error.
            try:
                first = await anext(steps)
            except StopAsyncIteration:
                first = None
            return StreamingResponse(self._sse(_prepend(first, steps), meta, request, slot),
                                     media_type="text/event-stream")
        try:
            out = await self._collect(steps, request, body.n)
        finally:
            slot.release()
        return JSONResponse(self._final_body(meta, out))

    @staticmethod
    async def _until_deadline(steps, timeout_s: float):
        """The request's steps until its deadline; past it the generation is cancelled (its
        finally blocks release the caches on both pools) and the client gets a 504."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            while True:
                try:
                    # in this task, not a helper task (as wait_for would): a cancellation then
                    # reaches the generator itself, which stops and releases its caches
                    async with asyncio.timeout_at(deadline):
                        s = await anext(steps)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    metrics()["deadline_exceeded"].inc()
                    raise OpenAIError(504, f"the request exceeded its deadline of {timeout_s:g} s",
                                      type_="timeout_error", code="deadline_exceeded") from None
                yield s
        except (GeneratorExit, asyncio.CancelledError):  # the client went away
            metrics()["cancelled"].inc()
            raise
        finally:
            await steps.aclose()

    async def _generate(self, rid: str, prompt_ids, params: SamplingParams, k: int, logprobs: int | None,
                        prediction: list[int] = (), predicted: dict | None = None, interval_s: float | None = None,
                        timing: bool = False):
        """The request's steps. Its loop runs on a verifier replica (``VerifierServer.speculate``:
        draft, verify, accept beside the engine, no router round trip per step), which streams
        each step's tokens; the router keeps the text (detokenisation, stop strings), the
        statistics and the failover: if the stream breaks (the replica died), the sequence
        resumes on another replica from its tokens, no token lost or repeated. ``interval_s``: how
        often the replica sends the steps (None: its ``stream_interval_ms``)."""
        seq = Sequence(prompt_ids, params, k, self.tokenizer, self.eos_ids, self.max_len, seq_id=rid,
                       logprobs=logprobs)
        stats = RequestStats(k)
        deadline = time.monotonic() + self.config.verifier_retry_s
        attempt = 0
        try:
            while not seq.done:
                stream = self.verifier.options(stream=True).speculate.remote(
                    prompt_ids, params, rid, k, self.max_len, logprobs, seq.output_ids, self.config.k_policy,
                    list(prediction), interval_s)
                ended = False  # the replica's loop finished by itself: nothing to cancel
                try:
                    t_prev = time.perf_counter()
                    while not seq.done:
                        try:  # only the stream's failures mean a lost replica; the router's own are bugs
                            group = await anext(stream)  # the steps since the last item (VerifierServer.speculate)
                        except StopAsyncIteration:
                            ended = True
                            break
                        t_got = time.perf_counter()
                        # progress: a later failure gets the whole retry window again
                        deadline, attempt = time.monotonic() + self.config.verifier_retry_s, 0
                        n_lp, out_ids, text = len(seq.logprobs), [], ""
                        # the group's wall time as the router saw it, split by the replica's own step times,
                        # so per-step statistics add up to the client's time: the group's last speculative
                        # step takes the rest (a plain step's time is not in the speculative steps' figures,
                        # so the rest given to one would drop the transit time it absorbed from them)
                        wall = t_got - t_prev
                        rest_j = max((j for j, (_, _, info) in enumerate(group) if info.k), default=len(group) - 1)
                        walls, left = [0.0] * len(group), wall
                        for j, (_, _, info) in enumerate(group):
                            if j != rest_j:
                                walls[j] = min(info.step_s, left)
                                left -= walls[j]
                        walls[rest_j] = left
                        tally = Tally()  # the group's counters, one call each
                        for j, (ids, lps, info) in enumerate(group):
                            if seq.done:  # a stop string ended it: the rest was decoded past the end
                                break
                            new, delta = seq.apply(VerifyResult(rid, tokens=ids, num_accepted=info.accepted,
                                                                num_drafts=info.k,
                                                                logprobs=lps if logprobs is not None else None))
                            stats.record(info, walls[j], len(seq.output_ids))
                            _tally(seq, info, walls[j], tally)
                            if predicted is not None and info.predicted:
                                predicted["accepted_prediction_tokens"] += info.accepted
                                predicted["rejected_prediction_tokens"] += info.predicted - info.accepted
                            out_ids += new
                            text += delta
                        tally.flush()
                        report = stats.report(seq, timing) if seq.done else None
                        yield StepOutput(out_ids, text, seq.finish_reason, seq.logprobs[n_lp:], report)
                        t_prev = time.perf_counter()
                        stats.emitted(t_prev - t_got)
                    if not ended and seq.detok.stopped_at is None:
                        # done for the same reason as the replica's loop (EOS, length): let it end by
                        # itself rather than cancel it (Serve cancels a request's related calls too)
                        with contextlib.suppress(StopAsyncIteration):
                            await anext(stream)
                        ended = True
                except (GeneratorExit, OpenAIError):
                    raise
                except asyncio.CancelledError as e:
                    if own_cancel():  # the client went away, or the deadline passed
                        raise
                    failure = e  # the stream was cancelled under us: resume it
                except Exception as e:  # noqa: BLE001 - replica died (or was full): resume elsewhere
                    failure = e
                else:
                    failure = None
                finally:
                    if not ended:  # abandoned mid-way (stop string, failure): stop the replica's loop
                        stream.cancel()
                if failure is not None and seq.done:  # the replica failed while ending: nothing is lost
                    log.warning("verifier stream failed after the request completed: %r", failure)
                elif failure is not None:
                    e = failure
                    attempt += 1
                    if isinstance(e, Overloaded) and not seq.output_ids:
                        raise _overloaded(e) from None
                    if isinstance(e, ValueError):  # the engine refused the sequence: no replica will take it
                        raise OpenAIError(400, str(e), code="context_length_exceeded") from None
                    if time.monotonic() >= deadline:
                        raise e
                    seq.cache_misses["verifier"] += 1
                    log.warning("verifier stream failed (attempt %d), resuming on another replica: %r", attempt, e)
                    await asyncio.sleep(min(2.0, 0.1 * 2 ** attempt))
        finally:
            self._release(rid)

    def _release(self, rid: str):
        # fire and forget: the request is done, its caches on both pools can go
        for handle in (self.drafter, self.verifier):
            if handle is None:  # drafter_placement verifier: no drafter pool
                continue
            try:
                handle.release.remote([rid])
            except Exception:  # noqa: BLE001
                pass

    async def _collect(self, steps, request: Request, n: int) -> list[dict]:
        outs = [{"ids": [], "text": [], "logprobs": [], "finish_reason": None, "stats": None} for _ in range(n)]
        async for i, s in steps:
            out = outs[i]
            out["ids"] += s.token_ids
            out["text"].append(s.text)
            out["logprobs"] += s.logprobs
            out["finish_reason"] = s.finish_reason or out["finish_reason"]
            out["stats"] = s.stats or out["stats"]
            if await request.is_disconnected():
                await steps.aclose()
                raise OpenAIError(499, "client disconnected")
        for out in outs:
            out["text"] = "".join(out["text"])
        return outs

    async def _sse(self, steps, meta: dict, request: Request, slot: "Admission"):
        try:
            async for chunk in self._sse_chunks(steps, meta, meta["body"]):
                yield chunk
        finally:
            slot.release()

    async def _sse_chunks(self, steps, meta: dict, body):
        n_out, status, started = 0, "200", set()
        # a step that releases no text (a held-back multi-byte character or stop-string prefix)
        # still carries tokens: sent when the client asked for their ids or logprobs
        per_token = body.return_token_ids or meta["logprobs"] is not None
        try:
            async for i, s in steps:
                n_out += len(s.token_ids)
                first = i not in started
                if s.text or s.finish_reason or first or (per_token and s.token_ids):
                    started.add(i)
                    yield f"data: {json.dumps(self._chunk(meta, s, first, i))}\n\n"
        except OpenAIError as e:
            status = str(e.status)
            yield f"data: {json.dumps(e.body())}\n\n"
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, as OpenAI does
            status = "500"
            log.exception("stream failed")
            yield f"data: {json.dumps(OpenAIError(500, f'generation failed: {type(e).__name__}', type_='internal_error').body())}\n\n"
        if body.stream_options and body.stream_options.include_usage:
            usage = self._usage(meta, n_out)
            yield f"data: {json.dumps({**self._envelope(meta), 'choices': [], **usage})}\n\n"
        yield "data: [DONE]\n\n"
        metrics()["requests"].inc(tags={"endpoint": meta["endpoint"], "status": status})
        metrics()["request_latency"].observe(time.perf_counter() - meta["t0"], tags={"endpoint": meta["endpoint"]})

    def _envelope(self, meta: dict) -> dict:
        chat = meta["endpoint"] == "chat"
        obj = ("chat.completion.chunk" if meta["body"].stream else "chat.completion") if chat else "text_completion"
        return {"id": meta["rid"], "object": obj, "created": int(time.time()), "model": self.model_name}

    def _logprobs_body(self, meta: dict, ids: list[int], lps: list, first: bool = False) -> dict | None:
        if first and meta["echo_logprobs"] is not None:  # completions with echo: the prompt's come first
            ids, lps = meta["prompt_ids"] + list(ids), meta["echo_logprobs"] + list(lps)
        if not lps:
            return None
        if meta["endpoint"] == "chat":
            return {"content": [{"token": self.tokenizer.decode([t]), "logprob": lp,
                                 "bytes": list(self.tokenizer.decode([t]).encode()),
                                 "top_logprobs": [{"token": self.tokenizer.decode([a]), "logprob": alp,
                                                   "bytes": list(self.tokenizer.decode([a]).encode())} for a, alp in top]}
                                for t, (lp, top) in zip(ids, lps)]}
        return {"tokens": [self.tokenizer.decode([t]) for t in ids],
                "token_logprobs": [lp[0] if lp else None for lp in lps],
                "top_logprobs": [{self.tokenizer.decode([a]): alp for a, alp in lp[1]} if lp else None for lp in lps],
                "text_offset": None}

    def _chunk(self, meta: dict, s: StepOutput, first: bool, index: int = 0) -> dict:
        body = meta["body"]
        if meta["endpoint"] == "chat":
            delta = {"content": s.text}
            if first:
                delta["role"] = "assistant"
            choice = {"index": index, "delta": delta, "finish_reason": s.finish_reason,
                      "logprobs": self._logprobs_body(meta, s.token_ids, s.logprobs)}
        else:
            text = meta["echo"] + s.text if first else s.text
            choice = {"index": index, "text": text, "finish_reason": s.finish_reason,
                      "logprobs": self._logprobs_body(meta, s.token_ids, s.logprobs, first)}
        if body.return_token_ids:
            choice["token_ids"] = s.token_ids
            if first:
                choice["prompt_token_ids"] = meta["prompt_ids"]
        out = {**self._envelope(meta), "choices": [choice]}
        if s.stats is not None:
            out["speculation"] = s.stats
        return out

    def _usage(self, meta: dict, n_out: int) -> dict:
        """The prompt counts once, the completion tokens of every choice add up (as OpenAI's)."""
        n_in = len(meta["prompt_ids"])
        usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out}
        if meta.get("predicted") is not None:  # drafted from the prediction and kept / dropped by verification
            usage["completion_tokens_details"] = dict(meta["predicted"])
        return {"usage": usage}

    def _final_body(self, meta: dict, outs: list[dict]) -> dict:
        body = meta["body"]
        choices = []
        for i, out in enumerate(outs):
            lp = self._logprobs_body(meta, out["ids"], out["logprobs"])
            if meta["endpoint"] == "chat":
                choice = {"index": i, "message": {"role": "assistant", "content": out["text"]},
                          "finish_reason": out["finish_reason"], "logprobs": lp}
            else:
                choice = {"index": i, "text": meta["echo"] + out["text"], "finish_reason": out["finish_reason"],
                          "logprobs": self._logprobs_body(meta, out["ids"], out["logprobs"], first=True)}
            if body.return_token_ids:
                choice["token_ids"] = out["ids"]
                choice["prompt_token_ids"] = meta["prompt_ids"]
            choices.append(choice)
        metrics()["requests"].inc(tags={"endpoint": meta["endpoint"], "status": "200"})
        metrics()["request_latency"].observe(time.perf_counter() - meta["t0"], tags={"endpoint": meta["endpoint"]})
        usage = self._usage(meta, sum(len(out["ids"]) for out in outs))
        stats = outs[0]["stats"] if len(outs) == 1 else [out["stats"] for out in outs]
        return {**self._envelope(meta), "choices": choices, **usage, "speculation": stats}
