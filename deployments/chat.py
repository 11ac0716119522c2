"""Chat at the edge: the prompt a chat request's template renders, and the model's output read back
into reasoning, answer and tool calls, whole or as a stream.

The template is the tokenizer's (or the app's ``verifier.chat_template``), given the request's
messages, tools, documents and template variables as vLLM gives them. The output is read by
vLLM's own parsers (``vllm/parser``: a ``verifier.reasoning_parser`` and a
``verifier.tool_call_parser``, named as vLLM names them), one per choice, so what a client gets
is what vLLM's server would give it for the same text. This module is the only one that imports
vLLM's parsers, and only when a parser is configured: importing them costs seconds (decision
0040). Parsing reads only the router's text and token ids, so it is the same whichever verifier
backend runs the model.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from core.grammar import Constraint, GrammarError, json_schema_constraint
from deployments.openai_api import ChatCompletionRequest, OpenAIError

PLAIN_CHAT_TEMPLATE = "{role}: {content}\n"  # used when the tokenizer has no chat template


def load_template(value: str | None) -> str | None:
    """A configured chat template: its text, or the file a path names (as vLLM's --chat-template)."""
    if value is None:
        return None
    if "{" not in value and "\n" not in value:  # a path: a template has Jinja markup
        path = Path(value)
        if not path.is_file():
            raise ValueError(f"verifier.chat_template: {value!r} is neither a Jinja template nor a file")
        return path.read_text()
    return value


class ChatFormat:
    """A router's chat: its template and, when configured, vLLM's parser class for the output."""

    def __init__(self, tokenizer, verifier_config, model_name: str = "", model_type: str = ""):
        self.tokenizer = tokenizer
        cfg = verifier_config
        self.template = load_template(cfg.chat_template)
        self.trust_request_template = cfg.trust_request_chat_template
        self.reasoning_parser, self.tool_call_parser = cfg.reasoning_parser, cfg.tool_call_parser
        self.auto_tools = cfg.enable_auto_tool_choice
        self.parser_cls = None
        self.harmony = model_type == "gpt_oss"
        if self.reasoning_parser or (self.tool_call_parser and self.auto_tools):
            # a gpt-oss model speaks harmony: vLLM reads it with its harmony parser whatever the names
            self.parser_cls = _parser_class(tokenizer, self.reasoning_parser, self.tool_call_parser, self.auto_tools,
                                            model_name, harmony=self.harmony)

    # ------------------------------------------------------------ the prompt
    def check(self, body: ChatCompletionRequest):
        """What the app cannot serve for this request: a 400 naming the field (or the config field to set)."""
        if body.chat_template is not None and not self.trust_request_template:
            raise OpenAIError(400, "a request's own chat_template needs the app's verifier.trust_request_chat_template "
                              "(as vLLM's --trust-request-chat-template)", param="chat_template")
        choice = body.tool_choice
        if not body.tools or choice == "none":
            return
        if choice in (None, "auto") and not self.auto_tools:
            raise OpenAIError(400, "tools with tool_choice auto need the app's verifier.tool_call_parser and "
                              "verifier.enable_auto_tool_choice (as vLLM's --tool-call-parser and "
                              "--enable-auto-tool-choice)", param="tools")

    def constraint(self, body: ChatCompletionRequest) -> Constraint | None:
        """The grammar a forced tool choice puts on the output: vLLM's JSON schema for it (the named
        function's parameters, or an array of calls to any of the tools), None where no tool is forced.
        The same whatever tool parser is configured: the arguments always match their tool's schema
        (decision 0041)."""
        if not forces_tool(body):
            return None
        from vllm.tool_parsers.utils import get_json_schema_from_tools

        request = vllm_request(body)
        try:
            schema = get_json_schema_from_tools(request.tool_choice, request.tools, body.parallel_tool_calls)
            return json_schema_constraint(schema, param="tools")
        except (GrammarError, ValueError) as e:  # (vLLM's validation error is a ValueError) e.g. clashing $defs
            raise OpenAIError(400, f"tools: {e}", param="tools") from None

    def prompt_ids(self, body: ChatCompletionRequest) -> list[int]:
        """The request's prompt tokens, as vLLM renders and tokenizes a chat."""
        self.check(body)
        messages = [conversation_message(m) for m in body.messages]
        tok = self.tokenizer
        template = body.chat_template or self.template or tok.chat_template
        if template:
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            try:
                text = tok.apply_chat_template(
                    messages, chat_template=template, tools=tools, documents=body.documents, tokenize=False,
                    add_generation_prompt=body.add_generation_prompt,
                    continue_final_message=body.continue_final_message, **body.template_kwargs())
            except Exception as e:  # noqa: BLE001 - the template refused these messages (e.g. roles must alternate)
                raise OpenAIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        else:
            text = "".join(PLAIN_CHAT_TEMPLATE.format(role=m["role"], content=m["content"]) for m in messages)
            if body.add_generation_prompt:
                text += "assistant:"
        # a template that writes BOS itself must not get a second one from the tokenizer
        has_bos = tok.bos_token is not None and text.startswith(tok.bos_token)
        return tok(text, add_special_tokens=not has_bos)["input_ids"]

    # ------------------------------------------------------------ the output
    def output(self, body: ChatCompletionRequest, prompt_ids: list[int]) -> OutputParser | None:
        """A choice's output parser (None: the output is the answer as it is)."""
        if forces_tool(body):
            if self.parser_cls is not None and OutputParser(self, body, prompt_ids).in_reasoning():
                # the grammar holds from the first token, so the model could not think first
                raise OpenAIError(400, "tool_choice 'required' or a named function is served when the output opens "
                                  "with its answer: turn thinking off (chat_template_kwargs {\"enable_thinking\": "
                                  "false} or reasoning_effort none) or use 'auto'", param="tool_choice")
            return ForcedToolCalls(body)
        if self.parser_cls is None:
            return None
        return OutputParser(self, body, prompt_ids)


def forces_tool(body: ChatCompletionRequest) -> bool:
    """Whether the request makes the model call a tool (tool_choice required, or a named function)."""
    return bool(body.tools) and body.tool_choice not in (None, "auto", "none")


def conversation_message(m) -> dict:
    """A request message as vLLM hands it to a template: text content, tool call arguments as
    objects, a tool message's content joined, the reasoning under both of its names."""
    try:
        text = m.text() if m.role != "tool" or not isinstance(m.content, list) else "\n".join(
            str(p.get("text", "")) for p in m.content if p.get("type") == "text")
    except ValueError as e:
        raise OpenAIError(400, str(e), param="messages") from None
    out = {"role": m.role, "content": text}
    if m.name is not None:
        out["name"] = m.name
    if m.role == "assistant" and m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                             for c in m.tool_calls]
    reasoning = m.reasoning if m.reasoning is not None else m.reasoning_content
    if m.role == "assistant" and reasoning is not None:
        out["reasoning"] = out["reasoning_content"] = reasoning
    if m.role == "tool" and m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _arguments(arguments: str | dict) -> dict:
    """Templates take a call's arguments as an object; text that is not one becomes {} (as vLLM:
    a malformed call in the history must not fail every later turn)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _parser_class(tokenizer, reasoning: str | None, tools: str | None, auto_tools: bool, model_name: str,
                  harmony: bool):
    """vLLM's composed parser class for these names; a name vLLM does not know is a config error naming its field."""
    from vllm.parser.parser_manager import ParserManager
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    if reasoning and reasoning not in ReasoningParserManager.list_registered():
        raise ValueError(f"verifier.reasoning_parser: vLLM has no reasoning parser {reasoning!r}; "
                         f"it has {sorted(ReasoningParserManager.list_registered())}")
    if tools and tools not in ToolParserManager.list_registered():
        raise ValueError(f"verifier.tool_call_parser: vLLM has no tool call parser {tools!r}; "
                         f"it has {sorted(ToolParserManager.list_registered())}")
    try:
        return ParserManager.get_parser(tool_parser_name=tools, reasoning_parser_name=reasoning,
                                        enable_auto_tools=auto_tools, model_name=model_name, tokenizer=tokenizer,
                                        is_harmony=harmony)
    except TypeError as e:
        field = "verifier.reasoning_parser" if reasoning and reasoning in str(e) else "verifier.tool_call_parser"
        raise ValueError(f"{field}: {e}") from None


class OutputParser:
    """One choice's output read by vLLM's parser: reasoning, content and tool calls, whole
    (``final``) or as stream deltas (``delta``), with finish_reason ``tool_calls`` where vLLM
    gives it. Also tells which part of the output a step's tokens went to (``in_reasoning``)."""

    def __init__(self, fmt: ChatFormat, body: ChatCompletionRequest, prompt_ids: list[int]):
        self.fmt, self.body = fmt, body
        self.request = vllm_request(body)
        # as vLLM makes it: the request's tools and the variables its template was given (a parser
        # reads, e.g., enable_thinking false: no reasoning in the output)
        kwargs = {"add_generation_prompt": body.add_generation_prompt,
                  "continue_final_message": body.continue_final_message, **body.template_kwargs()}
        self.parser = fmt.parser_cls(fmt.tokenizer, self.request.tools, chat_template_kwargs=kwargs)
        self.parser.set_prompt_token_ids(prompt_ids)
        self.prompt_ids = prompt_ids
        self.auto_tools = bool(fmt.auto_tools and body.tools and body.tool_choice in (None, "auto"))
        reasoning = self.parser.reasoning_parser
        self.reasons = reasoning is not None  # the output has a reasoning part to tell apart
        # harmony's reasoning is a channel, which vLLM's harmony parser reads token by token
        self.channels = HarmonyChannels() if fmt.harmony and self.reasons else None
        self.reasoning_open = self.reasons and (self.channels is not None or not reasoning.is_reasoning_end(prompt_ids))
        self.ids: list[int] = []
        self.tools_streamed = False
        self.blank = ""  # streamed content that is only whitespace so far: held back (see ``delta``)

    # ------------------------------------------------------------ phases
    def in_reasoning(self) -> bool:
        """Whether the output is still in its reasoning (the next tokens are thinking)."""
        return self.reasoning_open

    def advance(self, ids: list[int]):
        """The output grew by ``ids``: note where the reasoning ends."""
        if self.channels is not None:
            self.reasoning_open = self.channels.advance(ids)
        elif self.reasoning_open and ids:
            self.ids += ids
            self.reasoning_open = not self.parser.reasoning_parser.is_reasoning_end_streaming(self.ids, ids)

    # ------------------------------------------------------------ whole and streamed
    def final(self, text: str, ids: list[int], finish_reason: str | None) -> tuple[dict, str | None]:
        """The response's message and finish_reason for the whole output."""
        reasoning, content, calls = self.parser.parse(text, self.request, enable_auto_tools=self.auto_tools,
                                                      model_output_token_ids=ids)
        message = {"role": "assistant", "content": content}
        if reasoning is not None and self.body.include_reasoning:
            message["reasoning"] = reasoning
        calls = list(calls or []) if self.auto_tools else []
        if self.body.parallel_tool_calls is False:
            calls = calls[:1]
        if calls:
            message["tool_calls"] = [{"id": c.id or _call_id(), "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        return message, finish_reason

    def delta(self, text: str, ids: list[int], finish_reason: str | None) -> tuple[dict | None, str | None]:
        """A stream step's delta (None: nothing to send yet) and its finish_reason."""
        d = self.parser.parse_delta(text, list(ids), self.request, prompt_token_ids=self.prompt_ids,
                                    finished=finish_reason is not None)
        out = None
        if d is not None:
            out = d.model_dump(exclude_unset=True, exclude_none=True)
            if not self.body.include_reasoning:
                out.pop("reasoning", None)
            calls = out.get("tool_calls")
            if calls is not None and not self.auto_tools:
                out.pop("tool_calls")
            elif calls is not None:
                if self.body.parallel_tool_calls is False:
                    out["tool_calls"] = calls = [c for c in calls if c.get("index", 0) == 0]
                self.tools_streamed = self.tools_streamed or bool(calls)
                if not calls:
                    out.pop("tool_calls")
        out = self._hold_blank(out or {}, finish_reason is not None) or None
        if finish_reason == "stop" and self.tools_streamed:
            finish_reason = "tool_calls"
        return out, finish_reason

    def _hold_blank(self, out: dict, finished: bool) -> dict:
        """Whitespace alone before a tool call is no content in vLLM's whole response, but its
        stream sends it: held back until text or the end follows, so the stream adds up to the
        whole response."""
        content = self.blank + out.pop("content", "")
        if out.get("tool_calls") and not content.strip():
            content = ""
        elif not content.strip() and not (finished and not self.tools_streamed):
            self.blank, content = content, ""
        self.blank = self.blank if not content else ""
        if content:
            out["content"] = content
        return out


class ForcedToolCalls:
    """One choice's output under a forced tool choice, read as vLLM reads it: under ``required`` a JSON
    array of ``{"name", "parameters"}`` objects, each a call; under a named function the arguments
    object itself. Its grammar (``ChatFormat.constraint``) keeps the output to that form. finish_reason
    is ``tool_calls`` for required and stays ``stop`` for a named function, as vLLM's. A call's
    arguments are its text as generated, whole and streamed alike (vLLM streams that text but
    re-serializes it in a whole response), so that a stream adds up to the whole response."""

    reasons = False  # the output is the calls: no reasoning part (``ChatFormat.output`` sees to it)

    def __init__(self, body: ChatCompletionRequest):
        self.name = body.tool_choice.function.name if body.tool_choice != "required" else None
        self.text = ""
        self.ids: list[str] = []  # each started call's id, streamed in its first delta

    def in_reasoning(self) -> bool:
        return False

    def advance(self, ids: list[int]):
        pass

    def calls(self, text: str) -> list[tuple[str, str]]:
        """(name, arguments) of each call whose name is out so far: the arguments as far as they go."""
        if self.name is not None:
            return [(self.name, text)] if text.strip() else []
        from verifier.vllm_compat import scan_required_tool_calls

        return [(s.name, text[s.args_start:len(text) if s.args_end is None else s.args_end])
                for s in scan_required_tool_calls(text) if s.ready]

    def finish(self, finish_reason: str | None) -> str | None:
        return "tool_calls" if finish_reason == "stop" and self.name is None else finish_reason

    def final(self, text: str, ids: list[int], finish_reason: str | None) -> tuple[dict, str | None]:
        calls = self.calls(text)
        message = {"role": "assistant", "content": "",
                   "tool_calls": [{"id": self._id(i), "type": "function", "function": {"name": n, "arguments": a}}
                                  for i, (n, a) in enumerate(calls)]}
        return message, self.finish(finish_reason)

    def delta(self, text: str, ids: list[int], finish_reason: str | None) -> tuple[dict | None, str | None]:
        sent = self.calls(self.text)
        self.text += text
        out = []
        for i, (name, arguments) in enumerate(self.calls(self.text)):
            if i >= len(sent):
                out.append({"index": i, "id": self._id(i), "type": "function",
                            "function": {"name": name, "arguments": arguments}})
            elif len(arguments) > len(sent[i][1]):
                out.append({"index": i, "function": {"arguments": arguments[len(sent[i][1]):]}})
        return ({"tool_calls": out} if out else None), self.finish(finish_reason)

    def _id(self, i: int) -> str:
        while len(self.ids) <= i:
            self.ids.append(_call_id())
        return self.ids[i]


class HarmonyChannels:
    """Which harmony channel a gpt-oss output is in, read by openai-harmony's parser as vLLM's harmony
    parser reads it: analysis is the reasoning; commentary (tool calls) and final are not."""

    def __init__(self):
        from vllm.parser.harmony import get_streamable_parser_for_assistant

        self.parser = get_streamable_parser_for_assistant()
        self.reasoning = True  # gpt-oss opens with its analysis

    def advance(self, ids: list[int]) -> bool:
        from openai_harmony import HarmonyError

        for t in ids:
            try:
                self.parser.process(t)
            except HarmonyError:  # as vLLM's parser: a token harmony refuses is skipped
                continue
            if self.parser.current_channel is not None:
                self.reasoning = self.parser.current_channel == "analysis"
        return self.reasoning


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"


def vllm_request(body: ChatCompletionRequest):
    """The request as vLLM's parsers read it: tools, tool_choice, include_reasoning."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmRequest

    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    choice = body.tool_choice
    if not isinstance(choice, (str, type(None))):
        choice = choice.model_dump()
    fields = {"model": "m", "messages": [{"role": "user", "content": ""}], "include_reasoning": body.include_reasoning,
              "chat_template_kwargs": body.chat_template_kwargs}
    if tools:
        fields.update(tools=tools, tool_choice=choice or "auto")
    try:
        return VllmRequest(**fields)
    except ValueError as e:  # (pydantic's ValidationError is one) what vLLM's own request model refuses
        raise OpenAIError(400, f"tools: {e}", param="tools") from None
