"""A Hugging Face hub cache laid out on disk, as ``huggingface_hub`` writes one, for tests that resolve
model ids with ``HF_HUB_OFFLINE=1`` (no network):

    <HF_HOME>/hub/models--org--name/
        refs/<revision>                      the commit the revision names
        snapshots/<commit>/<file>            links to the blobs
        blobs/<sha256 of the file>
        trees/<commit>.json                  the repo's whole listing (the tree cache): with it, an offline
                                             snapshot_download refuses a snapshot missing a file its
                                             patterns ask for
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent.parent / "models"


def commit_of(*parts: str) -> str:
    """A stable 40-hex commit id for a test repo."""
    return hashlib.sha1("/".join(parts).encode()).hexdigest()


def lay_out(hf_home: str | Path, repo_id: str, files: dict[str, Path | bytes], revisions=("main",),
            commit: str | None = None, listed: dict[str, int] | None = None) -> str:
    """Put ``files`` ({path in repo: source file or content}) in the cache at ``hf_home`` as the snapshot
    of ``commit`` (default: derived from the repo id and the revisions), with ``refs/<r>`` naming it for
    each of ``revisions``. ``listed``: more files ({path: size}) the repo has on the Hub but the cache
    does not (``original/`` copies): they go into the tree listing only. Returns the commit."""
    commit = commit or commit_of(repo_id, *revisions)
    storage = Path(hf_home) / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    entries = {}
    for name, src in files.items():
        data = src if isinstance(src, bytes) else Path(src).read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        blob = storage / "blobs" / sha
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(os.path.relpath(blob, link.parent))
        entries[name] = {"size": len(data), "blob_id": hashlib.sha1(data).hexdigest()}
    for name, size in (listed or {}).items():
        entries[name] = {"size": size, "blob_id": hashlib.sha1(name.encode()).hexdigest()}
    for r in revisions:
        ref = storage / "refs" / r
        ref.parent.mkdir(parents=True, exist_ok=True)
        ref.write_text(commit)
    (storage / "trees").mkdir(parents=True, exist_ok=True)
    (storage / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": entries}))
    return commit


def model_files(directory: str | Path) -> dict[str, Path]:
    """Every file of a model directory, by name (README and measurements left out)."""
    return {p.name: p for p in sorted(Path(directory).iterdir())
            if p.is_file() and p.suffix in (".json", ".safetensors", ".model", ".jinja")
            and p.name != "acceptance.json"}


def head_files(head: str | Path, verifier: str) -> dict[str, Path | bytes]:
    """A head directory's files with its config's ``speculators_config.verifier.name_or_path`` set to
    ``verifier`` (a Hub id, as published heads name theirs)."""
    files: dict[str, Path | bytes] = dict(model_files(head))
    cfg = json.loads((Path(head) / "config.json").read_text())
    cfg["speculators_config"]["verifier"]["name_or_path"] = verifier
    files["config.json"] = (json.dumps(cfg, indent=2) + "\n").encode()
    return files


def offline_home(tmp_path: Path, monkeypatch) -> Path:
    """An empty hub cache under ``tmp_path``, offline, as this process's ``HF_HOME`` (a test's fixture)."""
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return home
