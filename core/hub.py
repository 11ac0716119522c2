"""Model references: a local directory, or a Hugging Face Hub repo id with an optional revision,
``org/name[@revision]`` (a branch, a tag or a commit).

The app builder pins an id to a commit (``pin``), so that every replica, started now or by an
autoscaler hours later, loads the same files; each replica then turns the pinned reference into a
directory on its own node (``local_dir``) through ``huggingface_hub``: the node's cache (``HF_HOME``,
``HF_HUB_CACHE``), downloading what it lacks, or from the cache alone with ``HF_HUB_OFFLINE=1``. A
gated model's token is the node's ``HF_TOKEN``, read by ``huggingface_hub`` from the process's
environment; it is never part of a config or a runtime env.

Only the files a model needs are taken: the JSON, tokenizer and template files at the repo's root,
and the safetensors its index names (or the root's safetensors without an index); never the copies
some repos keep in folders (Meta's ``original/`` consolidated checkpoint, ``onnx/``, ``gguf/``), nor
``*.bin``/``*.pth`` duplicates of the weights.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

# the files every user of a model reads: config, generation config, tokenizer (json, sentencepiece,
# tiktoken, BPE merges and vocab), chat templates, the weights' index; all at the repo's root
METADATA = ["*.json", "*.jinja", "*.model", "*.tiktoken", "*.txt"]
ROOT_ONLY = ["*/*"]  # fnmatch's * crosses '/': this leaves out every file in a folder (original/, onnx/)
INDEX = "model.safetensors.index.json"
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def parse(ref: str) -> tuple[str, str | None] | None:
    """``(repo_id, revision)`` when ``ref`` has the form of a repo id, ``org/name[@revision]``, else None
    (absolute paths, ``./x``, ``a/b/c``). A relative directory such as ``models/x`` has the form too:
    callers look for a local directory first."""
    repo, at, revision = ref.partition("@")
    if not _REPO_ID.fullmatch(repo) or ".." in repo or repo.endswith(".") or (at and not revision):
        return None
    return repo, revision or None


def offline() -> bool:
    """``HF_HUB_OFFLINE``, read now (``huggingface_hub`` reads it once, at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def cache_dir() -> Path:
    """The hub cache as ``huggingface_hub`` finds it (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else
    ``XDG_CACHE_HOME/huggingface/hub``), read now, so that a process's environment decides."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def _existing(ref: str, bases) -> Path | None:
    p = Path(ref).expanduser()
    if p.is_absolute():
        return p
    for base in bases:
        if (Path(base) / p).exists():
            return (Path(base) / p).resolve()
    return None


def _why(e: Exception, repo: str, revision: str | None) -> str:
    from huggingface_hub import errors

    if isinstance(e, errors.GatedRepoError):
        return f"{repo} is gated: accept its terms on the Hub and export HF_TOKEN on this node"
    if isinstance(e, errors.RepositoryNotFoundError):
        return f"no model {repo} on the Hugging Face Hub (or it is private: export HF_TOKEN on this node)"
    if isinstance(e, errors.RevisionNotFoundError):
        return f"{repo} has no revision {revision!r}"
    if isinstance(e, errors.LocalEntryNotFoundError) and offline():
        return f"{repo}@{revision or 'main'} is not in the Hugging Face cache {cache_dir()} (HF_HUB_OFFLINE=1)"
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{repo}: {type(e).__name__}: {first}"


def _snapshot(repo: str, revision: str | None, patterns: list[str], ignore: list[str] = ROOT_ONLY) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(repo, revision=revision, allow_patterns=patterns, ignore_patterns=ignore,
                                  cache_dir=str(cache_dir()), local_files_only=offline()))


def weight_patterns(snapshot: Path) -> tuple[list[str], list[str]]:
    """(allow, ignore) for a model's weights: the shards its index names, else the root's safetensors
    (not ``consolidated*``, the Mistral-format copy some repos carry beside the Hugging Face one)."""
    index = snapshot / INDEX
    if index.exists():
        return sorted(set(json.loads(index.read_text())["weight_map"].values())), ROOT_ONLY
    return ["*.safetensors"], [*ROOT_ONLY, "consolidated*"]


def pin(ref: str, field: str, bases=()) -> str:
    """The reference replicas load, fixed at build time: an existing local directory as an absolute
    path (``ref`` relative to the first of ``bases`` that has it), an id as ``repo_id@commit``, the
    commit its revision (default ``main``) names now: on the Hub, or in the local cache's
    ``refs/<revision>`` offline. A relative path found nowhere that is not an id stays relative to
    the last base (the check of the directory then says what is missing). Raises ``ValueError``, one
    line naming ``field``, for an id that does not resolve. Downloads the id's metadata files
    (``METADATA``) into this node's cache."""
    local = _existing(ref, bases)
    if local is not None:
        return str(local)
    hub = parse(ref)
    if hub is None:
        return str((Path(list(bases)[-1]) / ref).resolve()) if bases else ref
    repo, revision = hub
    try:
        return f"{repo}@{_snapshot(repo, revision, METADATA).name}"
    except Exception as e:  # noqa: BLE001 - every failure becomes the one line naming the field
        raise ValueError(f"{field} {ref!r}: not a local directory, and {_why(e, repo, revision)}") from None


def local_dir(ref: str, weights: bool = True, field: str = "model") -> str:
    """A directory on this node holding ``ref``'s files: an existing path as it is; an id from this
    node's cache, downloading what is missing (metadata only, or with the weights). Anything else is
    returned unchanged (loading it then says what is missing)."""
    if _existing(ref, [os.getcwd()]) is not None:
        return ref
    hub = parse(ref)
    if hub is None:
        return ref
    repo, revision = hub
    try:
        path = _snapshot(repo, revision, METADATA)
        if weights:
            allow, ignore = weight_patterns(path)
            path = _snapshot(repo, revision, allow, ignore)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{field} {ref!r}: {_why(e, repo, revision)}") from None
    if weights and not any(path.glob("*.safetensors")):
        raise ValueError(f"{field} {ref!r}: {path} holds no safetensors weights"
                         + (" (HF_HUB_OFFLINE=1: this node's cache lacks them)" if offline() else ""))
    return str(path)


def head_borrows(head: str | Path) -> bool:
    """Whether an EAGLE-3 head leaves its embedding or its lm_head to the verifier (no
    ``embed_tokens.weight`` or ``lm_head.weight`` of its own): then loading it reads the verifier's
    weights."""
    from safetensors import safe_open

    head = Path(head)
    index = head / INDEX
    files = ([head / f for f in set(json.loads(index.read_text())["weight_map"].values())] if index.exists()
             else sorted(head.glob("*.safetensors")))
    names: set[str] = set()
    for f in files:
        with safe_open(str(f), "pt") as h:
            names.update(h.keys())
    return not {"embed_tokens.weight", "lm_head.weight"} <= names


def localize(section: dict, weights: bool = True) -> dict:
    """A drafter or verifier config (as a dict) with its model references turned into directories on
    this node: ``model`` (with its weights when ``weights``) and an EAGLE-3 head's ``verifier_model``
    (whose weights are fetched only when the head borrows from them)."""
    out = dict(section)
    if out.get("model"):
        out["model"] = local_dir(out["model"], weights, "model")
    if out.get("verifier_model"):
        borrows = weights and head_borrows(out["model"])
        out["verifier_model"] = local_dir(out["verifier_model"], borrows, "verifier_model")
    return out
