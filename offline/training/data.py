"""Training data for the trainers that learn from a frozen target (``eagle3``, ``distill``).

Every source becomes one ``TokenData``: a stream of token ids, a loss mask over it (which tokens are
learned) and the positions a training window may start at.

- **Chat** (JSONL, one conversation a line): ShareGPT's ``{"conversations": [{"from", "value"}]}`` or
  OpenAI's ``{"messages": [{"role", "content"}]}``. Each conversation is rendered with the target's chat
  template, as the server renders a chat request; a tokenizer without one gets the server's plain
  template (``role: content`` lines, the generation prompt ``assistant:``: ``PLAIN_CHAT_TEMPLATE``).
  Each assistant turn is learned as it is served: the prompt is the conversation before it, rendered
  with the generation prompt and encoded as the server encodes a chat request, and the learned tokens
  follow it, tokenised on their own as the target writes them after that prompt: the ids the server
  returned (``token_ids`` on the message, which ``regenerate`` writes), else the text the template
  adds for the reply (the reply and its end-of-turn marker), else (no template, or one that rewrites
  earlier turns) the reply's content and EOS. The plain template's ``assistant: {content}`` is never
  learned: its space is the history's rendering, not the target's writing. A later turn whose prompt
  extends the tokens so far continues the example; otherwise it starts one of its own.
- **Plain text** (JSONL ``{"text": ...}`` lines, or ``.txt``/``.py`` files, or the standard library's
  source, the default): documents as ``<bos> text <eos>``, every token learned.
- **Captured traffic** (``verifier.capture`` shards): the tokens of served requests with the target's
  states recorded by the verifier, read by ``offline.training.eagle3`` directly (``captured``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

PLAIN_CHAT_TEMPLATE = "{role}: {content}\n"  # the router's, for a tokenizer without a chat template
PLAIN_GENERATION_PROMPT = "assistant:"
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system", "tool": "tool"}


@dataclass
class TokenData:
    ids: torch.Tensor  # [N] int32: every example, one after another
    mask: torch.Tensor  # [N] bool: the tokens the loss learns
    # [n] int64: the examples' starts (a window lies in one example, or begins one); None: anywhere
    starts: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def window_starts(self, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
        """``batch`` window starts drawn with ``gen`` (the same draws in every process of a distributed run)."""
        last = len(self.ids) - seq_len - 1
        if self.starts is None:
            return torch.randint(0, last, (batch,), generator=gen)
        i = torch.randint(0, len(self.starts), (batch,), generator=gen)
        ends = torch.cat([self.starts[1:], torch.tensor([len(self.ids)])])
        room = (ends - self.starts - seq_len - 1).clamp(min=0)[i]  # an example longer than a window: any part of it
        offset = (torch.rand(batch, generator=gen) * (room + 1)).long()
        return (self.starts[i] + offset).clamp(max=last)

    def eval_starts(self, seq_len: int, windows: int) -> torch.Tensor:
        """Non-overlapping windows, or the examples' starts, deterministically."""
        last = len(self.ids) - seq_len - 1
        if self.starts is None:
            return torch.arange(min(windows, (len(self.ids) - 1) // seq_len)) * seq_len
        return self.starts[:windows].clamp(max=max(last, 0))


def concat(parts: list[tuple[list[int], list[bool]]], starts: bool) -> TokenData:
    ids, mask, first = [], [], []
    for tokens, m in parts:
        first.append(len(ids))
        ids.extend(tokens)
        mask.extend(m)
    return TokenData(torch.tensor(ids, dtype=torch.int32), torch.tensor(mask, dtype=torch.bool),
                     torch.tensor(first, dtype=torch.long) if starts else None)


def _message(role: str, content, token_ids=None) -> dict:
    m = {"role": role, "content": content or ""}
    if token_ids:  # the served ids of a regenerated reply (``regenerate``)
        m["token_ids"] = list(token_ids)
    return m


def normalise(record: dict) -> list[dict] | str:
    """A JSONL record as OpenAI-style messages, or as plain text ({"text": ...})."""
    if "messages" in record:
        return [_message(m["role"], m.get("content"), m.get("token_ids")) for m in record["messages"]]
    if "conversations" in record:
        out = []
        for turn in record["conversations"]:
            who = str(turn.get("from", turn.get("role", ""))).lower()
            if who not in SHAREGPT_ROLES:
                raise ValueError(f"conversations: unknown speaker {who!r} (known: {', '.join(sorted(SHAREGPT_ROLES))})")
            out.append(_message(SHAREGPT_ROLES[who], turn.get("value", turn.get("content")), turn.get("token_ids")))
        return out
    if "text" in record:
        return str(record["text"])
    raise ValueError(f"a record needs 'messages', 'conversations' or 'text'; got keys {sorted(record)}")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The conversation as the server renders a chat request (``deployments.router``)."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    text = "".join(PLAIN_CHAT_TEMPLATE.format(**m) for m in messages)
    return text + (PLAIN_GENERATION_PROMPT if add_generation_prompt else "")


def encode(tokenizer, text: str, offsets: bool = False):
    """Token ids as the server encodes a rendered chat (a template that writes BOS gets no second one)."""
    has_bos = tokenizer.bos_token is not None and text.startswith(tokenizer.bos_token)
    enc = tokenizer(text, add_special_tokens=not has_bos, return_offsets_mapping=offsets)
    return (enc["input_ids"], enc["offset_mapping"]) if offsets else enc["input_ids"]


def reply_ids(tokenizer, messages: list[dict], i: int) -> list[int]:
    """The tokens the target writes for assistant message i after the served prompt (``messages[:i]`` with the
    generation prompt): the ids the server returned, else the template's text for the reply, else its content
    and EOS."""
    m = messages[i]
    if m.get("token_ids"):
        return [int(t) for t in m["token_ids"]]
    if tokenizer.chat_template:
        before = render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = render(tokenizer, messages[: i + 1])
        if upto.startswith(before) and len(upto) > len(before):
            return tokenizer(upto[len(before):], add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return tokenizer(m["content"], add_special_tokens=False)["input_ids"] + eos


def chat_examples(tokenizer, messages: list[dict]) -> list[tuple[list[int], list[bool]]]:
    """(token ids, loss mask) examples of a conversation: each assistant turn after its served prompt, learned
    (``reply_ids``); a turn whose prompt extends the example so far continues it, any other starts a new one."""
    out, ids, mask = [], [], []
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or i == 0:  # a reply needs a request before it
            continue
        prompt = encode(tokenizer, render(tokenizer, messages[:i], add_generation_prompt=True))
        if prompt[: len(ids)] != ids:
            out.append((ids, mask))
            ids, mask = [], []
        mask += [False] * (len(prompt) - len(ids))
        reply = reply_ids(tokenizer, messages, i)
        ids = prompt + reply
        mask += [True] * len(reply)
    return [e for e in out + [(ids, mask)] if any(e[1])]


def text_example(tokenizer, text: str) -> tuple[list[int], list[bool]]:
    ids = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    ids += tokenizer(text, add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return ids, [True] * len(ids)


def _score(i: int, record: dict) -> int:
    digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode() + str(i).encode()).digest()
    return int.from_bytes(digest[:4], "big")


def is_held_out(i: int, record: dict, percent: int) -> bool:
    return _score(i, record) % 100 < percent


def min_held_out(n: int) -> int:
    """The fewest records held out of ``n``: 4, never more than half (2 of 4, 1 of 2 or 3, none of 1)."""
    return min(4, n // 2)


def held_out_flags(keys: list[dict], percent: int) -> list[bool]:
    """Per record (``keys``: what its hash is taken of), whether it is held out: ``percent`` of them by the
    hash, at least ``min_held_out`` (the lowest hashes)."""
    scores = [_score(i, k) for i, k in enumerate(keys)]
    flags = [s % 100 < percent for s in scores]
    need = min_held_out(len(keys)) - sum(flags)
    for i in sorted((i for i, f in enumerate(flags) if not f), key=scores.__getitem__)[: max(0, need)]:
        flags[i] = True
    return flags


def load(paths: list[Path], tokenizer, held_out: list[Path] | None = None,
         held_out_percent: int = 5) -> tuple[TokenData, TokenData, list]:
    """(train, held-out, the held-out records: conversations as messages, texts as strings) from JSONL
    conversations or text, or text files.
    Without ``held_out`` files, ``held_out_percent`` of the records are held out (by a hash; at least
    ``min_held_out``: a small dataset's evaluation is more than one conversation)."""
    def records(ps):
        out = []
        for p in ps:
            p = Path(p)
            out += [normalise(r) for r in read_jsonl(p)] if p.suffix == ".jsonl" else [p.read_text()]
        return out

    train = records(paths)
    if held_out:
        held = records(held_out)
    else:
        flags = held_out_flags([{"r": r} for r in train], held_out_percent)
        held = [r for r, f in zip(train, flags) if f]
        train = [r for r, f in zip(train, flags) if not f]

    def tokens(recs):
        parts = [p for r in recs
                 for p in (chat_examples(tokenizer, r) if isinstance(r, list) else [text_example(tokenizer, r)])]
        return concat(parts, starts=any(isinstance(r, list) for r in recs))

    return tokens(train), tokens(held), held


def prompts(tokenizer, records: list, n: int, prompt_chars: int = 400) -> list[list[int]]:
    """Up to ``n`` prompts from held-out records: a conversation up to its first assistant turn, rendered
    with the generation prompt as a chat request to the server would be; a text's first ``prompt_chars``
    characters, cut at a line end."""
    out = []
    for r in records:
        if isinstance(r, list):
            i = next((j for j, m in enumerate(r) if m["role"] == "assistant"), None)
            if i:
                out.append(encode(tokenizer, render(tokenizer, r[:i], add_generation_prompt=True)))
        elif len(r) > prompt_chars // 4:
            cut = r.rfind("\n", 0, prompt_chars)
            out.append(tokenizer(r[: cut + 1 if cut > 0 else prompt_chars])["input_ids"])
        if len(out) == n:
            break
    return out
