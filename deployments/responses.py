"""OpenAI response bodies: a completion's or chat completion's final body, its stream's chunks
(server-sent events ending in ``data: [DONE]``), usage and logprobs, written from a request's
choices' steps (``generation.StepOutput``)."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field

from deployments.generation import StepOutput
from deployments.metrics import metrics
from deployments.openai_api import OpenAIError

log = logging.getLogger("ray.serve")


@dataclass
class Reply:
    """What a request's response is written from."""

    rid: str
    endpoint: str  # "completions" or "chat"
    body: object  # the request (openai_api's request models)
    prompt_ids: list[int]
    tokenizer: object
    model_name: str
    logprobs: int | None  # None: none; n: the emitted token's and the top n alternatives'
    echo: str = ""  # completions with echo: the prompt's text, first in the first choice text
    echo_logprobs: list | None = None  # and the prompt's logprobs, first in its logprobs
    predicted: dict | None = None  # predicted output tokens kept and dropped (usage details)
    # the prompt's tokens read from the verifier's prefix cache (usage details: OpenAI's field)
    cached: dict = field(default_factory=lambda: {"cached_tokens": 0})
    parsers: list | None = None  # chat: each choice's output parser (``chat.OutputParser``; None: plain answer)
    t0: float = field(default_factory=time.perf_counter)

    def envelope(self) -> dict:
        chat = self.endpoint == "chat"
        obj = ("chat.completion.chunk" if self.body.stream else "chat.completion") if chat else "text_completion"
        return {"id": self.rid, "object": obj, "created": int(time.time()), "model": self.model_name}

    def logprobs_body(self, ids: list[int], lps: list, first: bool = False) -> dict | None:
        if first and self.echo_logprobs is not None:  # completions with echo: the prompt's come first
            ids, lps = self.prompt_ids + list(ids), self.echo_logprobs + list(lps)
        if not lps:
            return None
        decode = self.tokenizer.decode
        if self.endpoint == "chat":
            return {"content": [{"token": decode([t]), "logprob": lp, "bytes": list(decode([t]).encode()),
                                 "top_logprobs": [{"token": decode([a]), "logprob": alp,
                                                   "bytes": list(decode([a]).encode())} for a, alp in top]}
                                for t, (lp, top) in zip(ids, lps)]}
        return {"tokens": [decode([t]) for t in ids],
                "token_logprobs": [lp[0] if lp else None for lp in lps],
                "top_logprobs": [{decode([a]): alp for a, alp in lp[1]} if lp else None for lp in lps],
                "text_offset": None}

    def parser(self, index: int):
        return self.parsers[index] if self.parsers else None

    def hides(self, index: int) -> bool:
        """Whether choice ``index``'s reasoning is left out, and with it (as vLLM) the per-token
        logprobs and token ids that would show it."""
        return self.parser(index) is not None and not self.body.include_reasoning

    def chunk(self, s: StepOutput, first: bool, index: int = 0, per_token: bool = False) -> dict | None:
        """A step's chunk; None: nothing to send (a parser holding text back, with no tokens asked for)."""
        if self.endpoint == "chat":
            parser, finish = self.parser(index), s.finish_reason
            if parser is None:
                delta = {"content": s.text}
            else:  # every step goes through the parser: it keeps the output so far
                delta, finish = parser.delta(s.text, s.token_ids, finish)
                if delta is None and not (first or finish or (per_token and s.token_ids and not self.hides(index))):
                    return None
                delta = delta or {}
            if first:
                delta = {"role": "assistant", **delta}
            lps = [] if self.hides(index) else s.logprobs
            choice = {"index": index, "delta": delta, "finish_reason": finish,
                      "logprobs": self.logprobs_body(s.token_ids, lps)}
        else:
            text = self.echo + s.text if first else s.text
            choice = {"index": index, "text": text, "finish_reason": s.finish_reason,
                      "logprobs": self.logprobs_body(s.token_ids, s.logprobs, first)}
        if self.body.return_token_ids:
            if not self.hides(index):
                choice["token_ids"] = s.token_ids
            if first:
                choice["prompt_token_ids"] = self.prompt_ids
        if s.stats is not None:  # the choice's statistics, on its last chunk
            choice["speculation"] = s.stats
        return {**self.envelope(), "choices": [choice]}

    def usage(self, n_out: int) -> dict:
        """The prompt counts once, the completion tokens of every choice add up (as OpenAI's)."""
        n_in = len(self.prompt_ids)
        usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out,
                 "prompt_tokens_details": dict(self.cached)}
        if self.predicted is not None:  # drafted from the prediction and kept / dropped by verification
            usage["completion_tokens_details"] = dict(self.predicted)
        return {"usage": usage}

    def final_body(self, outs: list[dict]) -> dict:
        """A non-streamed response, from each choice's collected steps (``collect``)."""
        choices = []
        for i, out in enumerate(outs):
            if self.endpoint == "chat":
                choice = self.chat_choice(i, out)
            else:
                choice = {"index": i, "text": self.echo + out["text"], "finish_reason": out["finish_reason"],
                          "logprobs": self.logprobs_body(out["ids"], out["logprobs"], first=True)}
            if self.body.return_token_ids:
                if not self.hides(i):
                    choice["token_ids"] = out["ids"]
                choice["prompt_token_ids"] = self.prompt_ids
            choice["speculation"] = out["stats"]  # each choice is its own speculative sequence
            choices.append(choice)
        self.count("200")
        usage = self.usage(sum(len(out["ids"]) for out in outs))
        body = {**self.envelope(), "choices": choices, **usage}
        if len(outs) == 1 and outs[0]["spec_metrics"] is not None:  # as vLLM: a single sequence's only
            body["metrics"] = {"speculative_decoding": outs[0]["spec_metrics"]}
        return body

    def chat_choice(self, i: int, out: dict) -> dict:
        parser, lps = self.parser(i), out["logprobs"]
        if parser is None:
            message, finish = {"role": "assistant", "content": out["text"]}, out["finish_reason"]
        else:
            message, finish = parser.final(out["text"], out["ids"], out["finish_reason"])
            lps = [] if self.hides(i) else lps
        return {"index": i, "message": message, "finish_reason": finish,
                "logprobs": self.logprobs_body(out["ids"], lps)}

    async def sse_chunks(self, steps):
        """The stream's events: a chunk per step that adds something, then usage when asked, then [DONE]."""
        n_out, status, started, spec = 0, "200", set(), None
        # a step that releases no text (a held-back multi-byte character or stop-string prefix)
        # still carries tokens: sent when the client asked for their ids or logprobs
        per_token = self.body.return_token_ids or self.logprobs is not None
        try:
            async for i, s in steps:
                n_out += len(s.token_ids)
                spec = s.spec_metrics or spec
                first = i not in started
                if self.parser(i) is not None:  # the parser sees every step, and says whether to send one
                    chunk = self.chunk(s, first, i, per_token)
                    if chunk is not None:
                        started.add(i)
                        yield f"data: {json.dumps(chunk)}\n\n"
                elif s.text or s.finish_reason or first or (per_token and s.token_ids):
                    started.add(i)
                    yield f"data: {json.dumps(self.chunk(s, first, i))}\n\n"
        except OpenAIError as e:
            status = str(e.status)
            yield f"data: {json.dumps(e.body())}\n\n"
        except Exception as e:  # noqa: BLE001 - headers are sent: report in-band, as OpenAI does
            status = "500"
            log.exception("stream failed")
            err = OpenAIError(500, f"generation failed: {type(e).__name__}", type_="internal_error")
            yield f"data: {json.dumps(err.body())}\n\n"
        if self.body.stream_options and self.body.stream_options.include_usage:
            usage = {**self.envelope(), "choices": [], **self.usage(n_out)}
            if spec is not None and self.body.n == 1:  # as vLLM: on the usage chunk, a single sequence's only
                usage["metrics"] = {"speculative_decoding": spec}
            yield f"data: {json.dumps(usage)}\n\n"
        yield "data: [DONE]\n\n"
        self.count(status)

    def count(self, status: str):
        metrics()["requests"].inc(tags={"endpoint": self.endpoint, "status": status})
        metrics()["request_latency"].observe(time.perf_counter() - self.t0, tags={"endpoint": self.endpoint})


async def collect(steps, request, n: int) -> list[dict]:
    """A non-streamed request's choices, step by step; a client that left ends it (499)."""
    outs = [{"ids": [], "text": [], "logprobs": [], "finish_reason": None, "stats": None, "spec_metrics": None}
            for _ in range(n)]
    async for i, s in steps:
        out = outs[i]
        out["ids"] += s.token_ids
        out["text"].append(s.text)
        out["logprobs"] += s.logprobs
        out["finish_reason"] = s.finish_reason or out["finish_reason"]
        out["stats"] = s.stats or out["stats"]
        out["spec_metrics"] = s.spec_metrics or out["spec_metrics"]
        if await request.is_disconnected():
            await steps.aclose()
            raise OpenAIError(499, "client disconnected")
    for out in outs:
        out["text"] = "".join(out["text"])
    return outs
