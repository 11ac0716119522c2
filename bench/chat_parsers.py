"""What vLLM's output parsers cost the router: the import (once, when a replica starts) and the time per
output token, streamed (``OutputParser.delta`` per step) and whole (``OutputParser.final``), on a Qwen3
turn that thinks, answers and calls a tool (the qwen3 reasoning parser and the hermes tool parser, as the
shipped Qwen3-8B configs set them), beside the router's own detokenisation of the same tokens.

    python -m bench.chat_parsers [--tokens 2000] [--step 1]

Prints one JSON line. The tokenizer is the tests' tiny Qwen3 one (tests/helpers.py: the published chat
template, byte-level BPE of 320 tokens): its tokens are short, so a turn of a given length has more steps
than a real model's, which makes the per-token figures an upper bound.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def import_s() -> dict:
    """Seconds to import the router's chat module and vLLM's parsers, each in a fresh interpreter."""
    def timed(code: str) -> float:
        script = f"import time; t = time.perf_counter(); {code}; print(time.perf_counter() - t)"
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
        return float(out.stdout.strip().splitlines()[-1])

    return {"chat_module_s": round(timed("import deployments.chat"), 2),
            "vllm_parsers_s": round(timed("from vllm.parser.parser_manager import ParserManager; "
                                          "import vllm.entrypoints.openai.chat_completion.protocol"), 2)}


def turn(tok, n: int) -> list[int]:
    """A Qwen3 turn of about ``n`` tokens: reasoning, an answer, a tool call, EOS."""
    words = "the user asks for the weather so I look at the city and call the tool with it ".split()
    body, i = [], 0
    while len(tok(" ".join(body), add_special_tokens=False)["input_ids"]) < n // 2:
        body.append(words[i % len(words)])
        i += 1
    text = (f"<think>\n{' '.join(body)}\n</think>\n\n{' '.join(body)}\n<tool_call>\n"
            "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>")
    return tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def per_token(n: int, step: int) -> dict:
    from configs import VerifierConfig
    from core.detok import IncrementalDetokenizer
    from deployments.chat import ChatFormat
    from deployments.openai_api import ChatCompletionRequest
    from tests.helpers import chat_tokenizer

    tok = chat_tokenizer("qwen3")
    fmt = ChatFormat(tok, VerifierConfig(model="tiny", reasoning_parser="qwen3", tool_call_parser="hermes",
                                         enable_auto_tool_choice=True))
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools)
    prompt, ids = fmt.prompt_ids(body), turn(tok, n)
    steps = [ids[i:i + step] for i in range(0, len(ids), step)]
    detok = IncrementalDetokenizer(tok)
    t0 = time.perf_counter()
    texts = [detok.add(s) for s in steps]
    t_detok = time.perf_counter() - t0
    parser = fmt.output(body, prompt)
    t0 = time.perf_counter()
    for i, (s, text) in enumerate(zip(steps, texts)):
        parser.in_reasoning()
        parser.advance(s)
        parser.delta(text, s, "stop" if i == len(steps) - 1 else None)
    t_stream = time.perf_counter() - t0
    t0 = time.perf_counter()
    message, _ = fmt.output(body, prompt).final("".join(texts), ids, "stop")
    t_whole = time.perf_counter() - t0
    assert message["tool_calls"] and message["reasoning"]
    us = 1e6 / len(ids)
    return {"tokens": len(ids), "step": step, "detok_us_per_token": round(t_detok * us, 1),
            "stream_parse_us_per_token": round(t_stream * us, 1), "whole_parse_us_per_token": round(t_whole * us, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--step", type=int, default=1, help="tokens a stream step carries (1: token by token)")
    args = ap.parse_args()
    print(json.dumps({**import_s(), **per_token(args.tokens, args.step)}))


if __name__ == "__main__":
    main()
