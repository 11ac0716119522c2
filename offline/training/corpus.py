"""The training corpus: the Python source of the CPython standard library.

Every Python installation carries it, so the default model pair can be rebuilt on
any machine with no download. Third-party code (site-packages, dist-packages) is
left out. The split into train and held-out sets is by module and
deterministic: a module is held out when a hash of its name falls in the held-out
bucket, so the same installation always gives the same split.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

THIRD_PARTY_DIRS = {"site-packages", "dist-packages"}
HELD_OUT_PERCENT = 3


@dataclass(frozen=True)
class SourceFile:
    module: str  # dotted module name ("json.decoder"), the unit of the split
    path: Path
    text: str


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_held_out(module: str) -> bool:
    digest = hashlib.sha256(module.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELD_OUT_PERCENT


def iter_stdlib_sources(root: Path | None = None):
    """Yield every decodable ``.py`` file of the standard library, sorted by path."""
    root = root or stdlib_dir()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if THIRD_PARTY_DIRS & set(rel.parts):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few test files are deliberately mis-encoded
        if text.strip():
            yield SourceFile(module_name(rel), path, text)


def load_split(root: Path | None = None) -> tuple[list[SourceFile], list[SourceFile]]:
    """(train, held_out) source files."""
    train, held_out = [], []
    for src in iter_stdlib_sources(root):
        (held_out if is_held_out(src.module) else train).append(src)
    return train, held_out


def held_out_modules(root: Path | None = None) -> list[str]:
    return sorted({s.module for s in load_split(root)[1]})


def held_out_prompts(n: int, prompt_chars: int = 400, root: Path | None = None) -> list[str]:
    """``n`` code prompts cut from held-out modules, deterministically.

    Each prompt is the first ``prompt_chars`` characters of a held-out file, cut at a
    line end, taken from files spread evenly over the held-out set.
    """
    files = [s for s in load_split(root)[1] if len(s.text) >= 2 * prompt_chars]
    step = max(1, len(files) // n)
    prompts = []
    for src in files[::step][:n]:
        cut = src.text.rfind("\n", 0, prompt_chars)
        prompts.append(src.text[: cut + 1 if cut > 0 else prompt_chars])
    return prompts
