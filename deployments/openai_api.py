"""OpenAI-compatible request schemas and error bodies.

Unknown parameters are rejected with a 400 naming them, rather than silently ignored:
a client that sets e.g. ``guided_json`` (which vLLM 0.32 no longer reads) would otherwise get output it did
not ask for; the 400 names its replacement. What
vLLM's OpenAI protocol rejects (its request validators and ``SamplingParams``), these models
reject too, with the same kind of 400 naming the parameter (docs/serving.md has the comparison).
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from configs.models import MAX_SPECULATIVE_TOKENS
from core.backends import Capabilities
from core.grammar import Constraint, GrammarError, choice_constraint, json_schema_constraint

MAX_STOP_CHARS = 1024  # per stop string: each one is searched in the output at every step


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str, message: str) -> PydanticCustomError:
    """A request error raised by a validator that names its parameter (the 400's ``param``; a
    combination of fields has no location of its own), as vLLM's ``VLLMValidationError``."""
    return PydanticCustomError("invalid_request", "{message}", {"message": message, "param": param})


# vLLM request fields this server does not serve, and why: a 400 that says so, never a silent ignore
UNSUPPORTED = {
    # the guided decoding fields vLLM 0.32 removed: each names its replacement
    **{f"guided_{kind}": f"removed in vLLM 0.32: use structured_outputs.{kind}"
       for kind in ("json", "regex", "choice", "grammar")},
    "guided_decoding_backend": "removed in vLLM 0.32: the grammar engine is xgrammar",
    "guided_whitespace_pattern": "removed in vLLM 0.32: JSON is generated compact",
    "structural_tag": "use structured_outputs.structural_tag",
    "prompt_logprobs": "no prompt logprobs; on completions, echo with logprobs returns the prompt's",
    "max_completion_tokens": "completions take max_tokens",
    "top_logprobs": "completions take logprobs: the number of alternatives",
    "logprob_token_ids": "logprobs are the emitted token's and the top_logprobs alternatives'",
    **dict.fromkeys(("use_beam_search", "length_penalty", "best_of"), "no beam search or best-of sampling"),
    **dict.fromkeys(("bad_words", "allowed_token_ids"), "no banned or allowed token lists (logit_bias is served)"),
    **dict.fromkeys(("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"),
                    "detokenisation is fixed: stop strings left out, special tokens skipped"),
    **dict.fromkeys(("truncate_prompt_tokens", "truncation_side"),
                    "prompts are never truncated: one beyond the context is a 400"),
    **dict.fromkeys(("echo", "add_special_tokens"), "the chat template's prompt, tokenized as it is"),
    "thinking_token_budget": "a reasoning budget is not honoured: ending the reasoning early would change what the "
                             "model writes; reasoning_effort and chat_template_kwargs reach the chat template",
    "priority": "no priority scheduling",
    "kv_transfer_params": "no disaggregated prefill: each verifier replica prefills its own requests",
    **dict.fromkeys(("prompt_embeds", "mm_processor_kwargs", "media_io_kwargs"), "text prompts only"),
}


def validation_error(errors: list[dict]) -> OpenAIError:
    """The 400 for a body the request models refused: the first error, its parameter named."""
    first = errors[0] if errors else {}
    loc = [str(x) for x in first.get("loc", []) if x != "body"]
    named = (first.get("ctx") or {}).get("param")  # a validator's error (``invalid``): its message says it all
    param = named or ".".join(loc) or None
    if named:
        msg = first.get("msg", "invalid request")
    elif first.get("type") == "json_invalid":
        msg, param = "the request body is not valid JSON", None
    elif first.get("type") == "extra_forbidden":
        reason = UNSUPPORTED.get(loc[-1]) if loc else None
        msg = f"unsupported parameter: {param}" + (f" ({reason})" if reason else "")
    else:
        msg = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request")
    return OpenAIError(400, msg, param=param, code=first.get("type"))


class ResponseFormatSchema(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(..., max_length=64)
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or a JSON schema (``strict`` or not, the output
    matches the schema: it is generated under the schema's grammar)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: ResponseFormatSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise invalid("response_format", "response_format of type json_schema needs json_schema")
        return self


class StructuredOutputs(BaseModel):
    """vLLM 0.32's structured_outputs: one kind of constraint."""

    model_config = ConfigDict(extra="forbid")
    json_: dict | bool | str | None = Field(None, alias="json", description="A JSON schema.")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, description="An EBNF (GBNF) or Lark grammar.")
    json_object: bool | None = None
    structural_tag: str | None = Field(None, description="An xgrammar structural tag, as JSON.")
    disable_fallback: bool = Field(False, description="Accepted: there is no fallback engine.")
    disable_any_whitespace: bool = Field(False, description="Accepted: JSON is always generated compact.")

    @model_validator(mode="after")
    def _one_kind(self):
        kinds = [k for k in ("json_", "regex", "choice", "grammar", "structural_tag") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise invalid("structured_outputs", "structured_outputs takes exactly one of json, regex, choice, grammar, "
                          f"json_object, structural_tag (got {len(kinds)})")
        return self

    def constraint(self) -> Constraint:
        if self.json_ is not None:
            return json_schema_constraint(self.json_, param="structured_outputs.json")
        if self.regex is not None:
            return Constraint("regex", self.regex, param="structured_outputs.regex")
        if self.choice is not None:
            return choice_constraint(self.choice)
        if self.grammar is not None:
            return Constraint("grammar", self.grammar, param="structured_outputs.grammar")
        if self.structural_tag is not None:
            return Constraint("structural_tag", self.structural_tag, param="structured_outputs.structural_tag")
        return json_schema_constraint(None, param="structured_outputs.json_object")


def request_constraint(body: _Common) -> Constraint | None:
    """The request's structured output (response_format or structured_outputs), None for free text;
    a malformed one is a 400 naming its field. (Whether it compiles is checked by the caller.)"""
    rf, so = body.response_format, body.structured_outputs
    if rf is not None and rf.type != "text" and so is not None:
        raise OpenAIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
    try:
        if so is not None:
            return so.constraint()
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_object":
            return json_schema_constraint(None, param="response_format")
        if rf.json_schema.schema_ is None:
            return json_schema_constraint(None, param="response_format.json_schema")
        return json_schema_constraint(rf.json_schema.schema_, param="response_format.json_schema.schema")
    except GrammarError as e:
        raise OpenAIError(400, str(e), param=e.param) from None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="Model name; must be the served one when given.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1_000_000, description="vLLM extension; 0 or -1 disables; at most the vocabulary.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description=(
        "vLLM extension: drop tokens below min_p x the top token's probability."))
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="vLLM extension; 1 is off.")
    logit_bias: dict[str, float] | None = Field(None, max_length=1024, description=(
        "Token id (as a string) -> bias in [-100, 100]."))
    min_tokens: int = Field(0, ge=0, le=1_000_000, description="vLLM extension: generate at least this many tokens.")
    stop_token_ids: list[int] | None = Field(None, max_length=256, description=(
        "vLLM extension: token ids that end generation."))
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=16, description=(
        "Choices per request, each its own speculative sequence (choice i seeded seed + i)."))
    logprobs: bool | int | None = None
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
    return_timing: bool = Field(
        False, description="splitspec extension: add the per-step time breakdown to the response's speculation block "
        "(as does the header x-splitspec-timing: 1).")
    user: str | None = None
    cache_salt: str | None = Field(
        None, description="vLLM extension: the prefix cache is salted with it, so only requests with the same salt "
        "share cached prefixes (requests without one share theirs). Random and long enough to be unguessable; at "
        "most 128 characters, none of @ / \\ or NUL.")
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object or json_schema: the output is generated under the schema's grammar.")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="vLLM extension: json, regex, choice, grammar, json_object or structural_tag.")

    @field_validator("top_k", mode="before")
    @classmethod
    def _minus_one_disables(cls, v):
        return 0 if v == -1 else v

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _salt(cls, v):  # vLLM's rules (validate_cache_salt), its messages
        if v is None:
            return v
        if not isinstance(v, str) or not v:
            raise invalid("cache_salt", "Parameter 'cache_salt' must be a non-empty string if provided.")
        if len(v) > 128 or any(c in "@/\\\0" for c in v):
            raise invalid("cache_salt", "Parameter 'cache_salt' must be at most 128 characters and must not contain "
                          "'@', '/', '\\\\', or NUL.")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        # as vLLM: options given (even all false) on a request that does not stream
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise invalid("stream_options", "stream_options can only be given when stream is true")
        return self

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if not v:
            return None
        out = {}
        for key, bias in v.items():
            try:
                out[int(key)] = bias
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for {key}")
        return out


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] = Field(..., description="Text, or token ids, or a list with one text.")
    # an integer, not a string of one (vLLM refuses "2" here, where pydantic would read it as 2)
    logprobs: int | None = Field(None, ge=0, le=20, strict=True)
    echo: bool = Field(False, description="Return the prompt before the completion (with its logprobs when asked).")
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


def content_text(content: str | list[dict] | None) -> str:
    """A message's (or a prediction's) content as text: a string, or text parts joined."""
    if isinstance(content, list):
        parts = []
        for p in content:
            if p.get("type") != "text":
                raise ValueError(f"content part type {p.get('type')!r} is not supported")
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    return content or ""


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., min_length=1, max_length=256)
    arguments: str | dict = Field("", description="JSON text (OpenAI's), or an object.")


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str | None = Field(None, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = Field(None, max_length=128, description=(
        "An assistant's calls, rendered by the template."))
    tool_call_id: str | None = Field(None, max_length=256, description="A tool message's answer to this call.")
    reasoning: str | None = Field(None, description="An assistant's reasoning, for templates that render it.")
    reasoning_content: str | None = Field(None, description="Deprecated name of reasoning (vLLM's).")

    def text(self) -> str:
        return content_text(self.content)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.:-]{1,64}$", description=(
        "OpenAI's function names (and vLLM's dots and colons)."))
    description: str | None = Field(None, max_length=100_000)
    parameters: dict | None = Field(None, description="The arguments' JSON Schema.")
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(..., min_length=1, max_length=64)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


TemplateValue = str | int | float | bool | None | list | dict
# what the chat template is always given by the server: a request sets these through their own fields
TEMPLATE_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                               "chat_template", "tokenize", "return_dict", "tokenizer", "conversation"})
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # vLLM 0.32's


class PredictionContent(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["content"]
    content: str | list[dict]

    def text(self) -> str:
        return content_text(self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="Takes precedence over max_tokens, as vLLM's.")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20, strict=True, description="Needs logprobs true, as vLLM's.")
    add_generation_prompt: bool = Field(True, description="End the prompt with the assistant's turn opening (vLLM's).")
    continue_final_message: bool = Field(False, description=(
        "The final (assistant) message is left open for the model to continue (vLLM's); not with "
        "add_generation_prompt."))
    documents: list[dict[str, str]] | None = Field(None, max_length=1024, description=(
        "Documents for templates that render them (RAG)."))
    chat_template: str | None = Field(None, min_length=1, max_length=200_000, description=(
        "A template for this request only: served where the app sets verifier.trust_request_chat_template."))
    chat_template_kwargs: dict[str, TemplateValue] | None = Field(None, max_length=64, description=(
        "Variables for the chat template, e.g. {\"enable_thinking\": false} (Qwen3): a JSON object of plain values."))
    reasoning_effort: Literal[REASONING_EFFORTS] | None = Field(None, description=(
        "Given to the chat template (gpt-oss reads it); any value but none also sets enable_thinking, unless "
        "chat_template_kwargs does (as vLLM)."))
    include_reasoning: bool = Field(True, description="false: the reasoning is left out of the response (as vLLM).")
    # OpenAI chat fields clients send with neutral values (SDKs and agent frameworks fill them in):
    # accepted where they ask for nothing this server would not do, a 400 naming them otherwise
    tools: list[Tool] | None = Field(None, max_length=512, description=(
        "Functions the model may call; needs a tool_call_parser on the app (verifier.tool_call_parser). Empty: none."))
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(None, description=(
        "auto (the default with tools), none, required, or a named function (these two constrain the output to "
        "calls matching the tools' schemas)."))
    parallel_tool_calls: bool | None = Field(None, description=(
        "false: at most one tool call in a response (the first)."))
    functions: list[dict] | None = Field(None, description="Deprecated form of tools; must be empty.")
    function_call: str | dict | None = Field(None, description="Deprecated form of tool_choice: none or auto.")
    modalities: list[Literal["text", "audio"]] | None = Field(None, max_length=2, description="Only [\"text\"].")
    store: bool | None = Field(None, description=(
        "Only false: this server stores no completions; false also keeps the request out of the verifier's traffic "
        "capture "
        "(VerifierConfig.capture, docs/training.md)."))
    metadata: dict[str, str] | None = Field(None, max_length=16, description=(
        "Accepted and ignored (OpenAI keeps it with stored completions)."))
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = Field(
        None, description="Accepted; every request is served alike.")
    prompt_cache_key: str | None = Field(None, max_length=1024, description=(
        "Accepted; prefix caching here is per sequence, automatic."))
    safety_identifier: str | None = Field(None, max_length=1024, description="Accepted and ignored, as user.")
    prediction: PredictionContent | None = Field(
        None, description="Predicted Outputs: text the answer is expected to mostly repeat; where it continues the "
        "output, its tokens are the drafts (verified, so the output is the model's whatever it says).")

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, v):
        if v:
            raise ValueError("the deprecated functions field is not served: send tools")
        return v

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v):
        for key, value in (v or {}).items():
            if not key.isidentifier():
                raise ValueError(f"keys must be template variable names, got {key!r}")
            if key in TEMPLATE_RESERVED:
                raise ValueError(f"{key!r} is set by the server (or by its own request field), not here")
            if len(json.dumps(value)) > 100_000:
                raise ValueError(f"the value of {key!r} is over 100000 characters of JSON")
        return v

    @model_validator(mode="after")
    def _tool_choice_needs_tools(self):
        choice = self.tool_choice
        if choice is None or choice == "none":
            return self
        if not self.tools:  # as vLLM
            raise invalid("tool_choice", "when using tool_choice, tools must be set")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise invalid("tool_choice", f"tool_choice names {choice.function.name!r}, which is not one of the tools")
        return self

    @model_validator(mode="after")
    def _one_prompt_ending(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise invalid("continue_final_message",
                          "continue_final_message needs add_generation_prompt false (as vLLM)")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise invalid("continue_final_message", "continue_final_message needs an assistant message last")
        return self

    def template_kwargs(self) -> dict:
        """What the chat template is given beyond the messages, tools and documents (as vLLM's)."""
        kwargs = {k: v for k, v in (self.chat_template_kwargs or {}).items()}
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
        return kwargs

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, v):
        if v is not None and v not in ("none", "auto"):  # the deprecated field: 'auto' with no functions is none
            raise ValueError("function calling is not supported: only 'none', or 'auto' without functions")
        return v

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:  # as vLLM: 0 is no alternatives, allowed either way
            raise invalid("top_logprobs", "top_logprobs needs logprobs true")
        return self

    @field_validator("modalities")
    @classmethod
    def _text_out(cls, v):
        if v and set(v) != {"text"}:
            raise ValueError("only ['text'] output is supported")
        return v

    @field_validator("store")
    @classmethod
    def _no_store(cls, v):
        if v:
            raise ValueError("this server does not store completions: leave it out or false")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v):
        for key, value in (v or {}).items():
            if len(key) > 64 or len(value) > 512:
                raise ValueError("keys at most 64 characters and values at most 512")
        return v

    def max_new(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


TIMING_HEADER = "x-splitspec-timing"


def wants_timing(body: _Common, request) -> bool:
    """Whether a response's speculation block carries the time breakdown: the request field
    ``return_timing`` or the header ``x-splitspec-timing`` (1 or true)."""
    return body.return_timing or request.headers.get(TIMING_HEADER, "").strip().lower() in ("1", "true")


# Sampling fields a model's generation_config.json may default (as vLLM's `--generation-config auto`):
# they apply when a request omits them.
GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def generation_defaults(model_dir: str) -> dict:
    """The sampling defaults a model directory's generation_config.json declares (empty without one)."""
    import json
    from pathlib import Path

    path = Path(model_dir) / "generation_config.json"
    if not path.exists():
        return {}
    raw = json.loads(path.read_text())
    out = {k: raw[k] for k in GENERATION_DEFAULTS if raw.get(k) is not None}
    if raw.get("do_sample") is False and "temperature" not in out:
        out["temperature"] = 0.0  # transformers' greedy default, stated explicitly
    return out


def to_sampling_params(body: _Common, *, prompt_len: int, max_len: int, vocab_size: int, max_tokens_limit: int,
                       defaults: dict, verification: str, capabilities: Capabilities):
    """The request's ``SamplingParams``, every bound checked here: a bad value is a 400 naming
    its parameter, never an error inside the engine, nor one the verifier backend cannot serve
    (its ``capabilities``)."""
    from pydantic import ValidationError

    from configs import SamplingParams

    max_new = _max_new(body, prompt_len, max_len, max_tokens_limit)
    given = body.model_fields_set
    fields = {name: (getattr(body, name) if name in given or name not in defaults else defaults[name])
              for name in GENERATION_DEFAULTS}
    if fields["top_k"] == -1:
        fields["top_k"] = 0
    _in_vocabulary(body, fields["top_k"], vocab_size)
    if body.min_tokens > max_new:
        raise OpenAIError(400, f"min_tokens {body.min_tokens} exceeds max_tokens {max_new}", param="min_tokens")
    verification = _backend_limits(body, fields, capabilities, verification)
    try:
        return SamplingParams(
            **fields, seed=body.seed, max_tokens=max_new, stop=tuple(body.stop or ()), ignore_eos=body.ignore_eos,
            verification=body.verification or verification, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, logit_bias=body.logit_bias or {}, min_tokens=body.min_tokens,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            capture=getattr(body, "store", None) is not False)  # store: false keeps a chat out of the traffic capture
    except ValidationError as e:  # a generation_config default out of bounds, or a combination
        err = e.errors()[0]
        param = ".".join(str(x) for x in err.get("loc", ())) or None
        msg = f"{param + ': ' if param else ''}{err.get('msg', 'invalid value')}"
        raise OpenAIError(400, msg, param=param) from None


def _max_new(body: _Common, prompt_len: int, max_len: int, max_tokens_limit: int) -> int:
    """Tokens to generate at most: the request's (chat: max_completion_tokens first), within the
    server's limit and the context left (clamped to it, as vLLM's)."""
    chat = isinstance(body, ChatCompletionRequest)
    if prompt_len >= max_len:
        raise OpenAIError(400, f"prompt has {prompt_len} tokens; the context limit is {max_len}",
                          param="messages" if chat else "prompt", code="context_length_exceeded")
    max_new = body.max_new() if chat else body.max_tokens
    if max_new is not None and max_new > max_tokens_limit:
        raise OpenAIError(400, f"max_tokens {max_new} exceeds the server limit {max_tokens_limit}", param="max_tokens")
    if max_new is None:
        max_new = max_tokens_limit if chat else 16
    return min(max_new, max_len - prompt_len)


def _in_vocabulary(body: _Common, top_k: int, vocab_size: int):
    """Token ids and top_k within the vocabulary."""
    if top_k > vocab_size:
        raise OpenAIError(400, f"top_k {top_k} exceeds the vocabulary of {vocab_size} tokens", param="top_k")
    for tid in (body.logit_bias or {}):
        if not 0 <= tid < vocab_size:
            raise OpenAIError(400, f"logit_bias names token {tid}, outside the vocabulary of {vocab_size}",
                              param="logit_bias")
    for tid in (body.stop_token_ids or ()):
        if not 0 <= tid < vocab_size:
            raise OpenAIError(400, f"stop_token_ids has {tid}, outside the vocabulary of {vocab_size}",
                              param="stop_token_ids")


def _backend_limits(body: _Common, fields: dict, caps: Capabilities, verification: str) -> str:
    """What the verifier backend cannot do (its ``caps``): a model default dropped, a request's own value a
    400 naming it (``fields`` adjusted in place). Returns the verification to use."""
    given = body.model_fields_set
    if not caps.gumbel:  # rejection sampling is the only verification there
        if body.verification == "gumbel":
            raise OpenAIError(400, f"verification 'gumbel' is not supported with {caps.label}; use 'rejection'",
                              param="verification")
        verification = "rejection"
    # a sampling parameter the backend cannot apply: a model default is not imposed, a request's own value is a
    # 400 naming it
    for name, off, served in (("min_p", 0.0, caps.min_p), ("repetition_penalty", 1.0, caps.repetition_penalty)):
        if not served and name not in given:
            fields[name] = off
        if not served and fields[name] != off:
            raise OpenAIError(400, f"{name} is not supported with {caps.label}", param=name)
    if body.logit_bias and not caps.logit_bias:
        raise OpenAIError(400, f"logit_bias is not supported with {caps.label}", param="logit_bias")
    return verification
