"""OpenAI-compatible request schemas and error bodies.

Unknown parameters are rejected with a 400 naming them, rather than silently ignored:
a client that sets e.g. ``logit_bias`` would otherwise get output it did not ask for.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from configs.models import MAX_SPECULATIVE_TOKENS


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="Model name; must be the served one when given.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Alias of max_tokens (chat).")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="vLLM extension; 0 or -1 disables.")
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1, description="Only one choice per request is supported.")
    logprobs: bool | int | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    return_token_ids: bool = Field(False, description="vLLM extension: include prompt and completion token ids.")
    ignore_eos: bool = Field(False, description="vLLM extension: keep generating after EOS.")
    num_speculative_tokens: int | None = Field(
        None, ge=0, le=MAX_SPECULATIVE_TOKENS,
        description="splitspec extension: the most draft tokens per step for this request; 0 turns speculation off.")
    verification: Literal["rejection", "gumbel"] | None = Field(
        None, description="splitspec extension: rejection (default: highest acceptance) or gumbel (seeded output "
        "identical whatever the drafter, k or replica did). Both sample exactly from the target's distribution.")
    timeout: float | None = Field(
        None, gt=0, le=3600, description="splitspec extension: seconds this request may run; beyond it the request "
        "ends with a 504 (or an in-band error event when streaming). The server's request_timeout_s caps it.")
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="Not supported; only 0 is accepted.")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="Not supported; only 0 is accepted.")

    @field_validator("top_k", mode="before")
    @classmethod
    def _minus_one_disables(cls, v):
        return 0 if v == -1 else v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] = Field(..., description="Text, or token ids, or a list with one text.")
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = Field(False, le=False, description="Not supported.")
    best_of: int | None = Field(None, ge=1, le=1)
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            v = v[0]
        if (isinstance(v, str) and not v) or (isinstance(v, list) and not v):
            raise ValueError("prompt must not be empty")
        return v


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            parts = []
            for p in self.content:
                if p.get("type") != "text":
                    raise ValueError(f"content part type {p.get('type')!r} is not supported")
                parts.append(str(p.get("text", "")))
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool = False
    add_generation_prompt: bool = True

    def max_new(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
