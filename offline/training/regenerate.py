"""Regenerate a chat dataset's assistant turns with the target, through any OpenAI-compatible endpoint.

    python -m offline.training.regenerate --url http://localhost:8000/v1 --model tiny-code \\
        --data chats.jsonl --out chats.regenerated.jsonl

A head learns the target's distribution; replies written by another model (or by people) are text the
target would not have written, so the head spends capacity on them and drafts worse for the target.
Each conversation's assistant turns are replaced, in order, by the target's reply to the conversation
so far (``/v1/chat/completions``; greedy by default), every other turn kept. Each reply keeps the token
ids the server returned (``token_ids``, asked with ``return_token_ids``, which this project's server and
vLLM's answer; ``--no-token-ids`` for an endpoint that refuses it): training learns exactly those tokens
after the served prompt (``offline.training.data``). The output is JSONL in the input's shape
(``messages``, or ShareGPT ``conversations``), one line per input line, in order.

Resumable: the output is appended line by line; a rerun keeps the complete lines already written (a
torn last line is cut off) and continues with the next conversation.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from offline.training.data import normalise

SHAREGPT_SPEAKER = {"user": "human", "assistant": "gpt", "system": "system", "tool": "tool"}


def completed_lines(out: Path) -> int:
    """Complete lines already in ``out``, after cutting off a torn last line."""
    if not out.exists():
        return 0
    data = out.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with out.open("r+b") as f:
            f.truncate(end)
    return data[:end].count(b"\n")


def regenerate(record: dict, chat, max_tokens: int) -> dict:
    """The record with each assistant turn replaced by ``chat(messages so far, max_tokens)``: (text, token ids
    or None)."""
    messages = normalise(record)
    if isinstance(messages, str):
        return record
    out: list[dict] = []
    for m in messages:
        if m["role"] == "assistant" and out:
            text, ids = chat([{"role": x["role"], "content": x["content"]} for x in out], max_tokens)
            out.append({"role": "assistant", "content": text, **({"token_ids": ids} if ids else {})})
        else:
            out.append(m)
    if "conversations" in record and "messages" not in record:
        return {**record, "conversations": [{"from": SHAREGPT_SPEAKER.get(m["role"], m["role"]), "value": m["content"],
                                             **({"token_ids": m["token_ids"]} if "token_ids" in m else {})}
                                            for m in out]}
    return {**record, "messages": out}


def openai_chat(url: str, model: str | None, temperature: float, seed: int | None, api_key: str, timeout: float,
                token_ids: bool = True):
    """chat(messages, max_tokens) -> (the reply's text, its token ids or None), from an OpenAI-compatible
    ``/chat/completions``."""
    import httpx

    client = httpx.Client(base_url=url.rstrip("/"), timeout=timeout, headers={"Authorization": f"Bearer {api_key}"})

    def chat(messages: list[dict], max_tokens: int) -> tuple[str, list[int] | None]:
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                "store": False}  # the regeneration itself is not traffic to capture
        if token_ids:
            body["return_token_ids"] = True
        if model:
            body["model"] = model
        if seed is not None:
            body["seed"] = seed
        r = client.post("/chat/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"{url}/chat/completions answered {r.status_code}: {r.text[:500]}")
        choice = r.json()["choices"][0]
        return choice["message"]["content"] or "", choice.get("token_ids")

    return chat


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True, help="the endpoint's base URL, e.g. http://localhost:8000/v1")
    ap.add_argument("--model", default=None, help="the model name the endpoint serves (default: none sent)")
    ap.add_argument("--data", type=Path, required=True, help="JSONL conversations (ShareGPT or OpenAI messages)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: the target's greedy reply")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--limit", type=int, default=None, help="regenerate only the first N conversations")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--no-token-ids", action="store_true",
                    help="do not ask for the replies' token ids (an endpoint that refuses return_token_ids)")
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args(argv)

    from tqdm import tqdm

    lines = [line for line in args.data.read_text().splitlines() if line.strip()][: args.limit]
    done = completed_lines(args.out)
    if done:
        print(f"resuming after {done} conversations")
    chat = openai_chat(args.url, args.model, args.temperature, args.seed, args.api_key, args.timeout,
                       token_ids=not args.no_token_ids)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        for line in tqdm(lines[done:], initial=done, total=len(lines), desc="regenerate"):
            f.write(json.dumps(regenerate(json.loads(line), chat, args.max_tokens)) + "\n")
            f.flush()


if __name__ == "__main__":
    main()
