"""Capture of served traffic for training a draft head (``VerifierConfig.capture``; docs/training.md).

The verification pass already computes, at every token it keeps, the states an EAGLE-3 head learns
from: the residual stream entering the head's aux layers, and the last layer's output, from which the
target's distribution is the final norm and the output projection away. With capture on, the engine
asks its forward for those layers too (for the requests it records) and hands each kept position's
token and states here; when the sequence is released its record joins a buffer, and the buffer is
written as one shard (safetensors: ``tokens``, ``states``, ``offsets``, ``num_prompt``) once it holds
``shard_bytes`` or its oldest request is ``flush_interval_s`` old. ``offline.training.eagle3 --captured``
reads the shards directly: the trainer never runs the target.

This is user data on disk: the prompts and outputs of the requests recorded, as token ids, and states
from which much of them can be read back. It is off unless configured; a request opts out with
``store: false`` (``SamplingParams.capture``); ``sample_rate`` records a share of the rest; the shards
stay within ``max_bytes`` (the oldest deleted first), ``max_shards`` and ``max_age_s``.

Requests are recorded from their first token: a request whose verifier replica did not see its start
(a replica replaced mid-sequence that kept its prefix) is not recorded. A replica that dies loses what
it had not yet written.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections import OrderedDict
from pathlib import Path

import torch

from core.eagle3 import default_aux_layers

log = logging.getLogger(__name__)

FORMAT = "splitspec-capture-1"
TRACKED = 100_000  # sequences whose decision (record or not) a replica remembers


class TrafficCapture:
    def __init__(self, config, num_layers: int, hidden_size: int, model: str = ""):
        self.config = config
        aux = sorted(set(config.layers)) if config.layers else default_aux_layers(num_layers)
        if any(not 0 <= L < num_layers for L in aux):
            raise ValueError(f"capture.layers {aux}: the verifier has layers 0..{num_layers - 1}")
        self.aux_layers = tuple(aux)
        self.layers = (*self.aux_layers, num_layers)  # the aux states, then the last layer's output
        self.hidden_size, self.model = hidden_size, model
        self.dtype = getattr(torch, config.dtype)
        self.dir = Path(config.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._decided: OrderedDict[str, dict | None] = OrderedDict()  # seq_id -> its record, or None: not recorded
        self._buffer: list[dict] = []
        self._buffered_bytes = 0
        self._oldest = 0.0
        self.stats = {"requests": 0, "opted_out": 0, "shards": 0, "bytes_written": 0, "dropped_requests": 0,
                      "deleted_shards": 0}

    def wants(self, r) -> bool:
        """Whether this step's sequence is recorded (decided at its first step: its opt-out, then the sample rate)."""
        if r.seq_id in self._decided:
            return self._decided[r.seq_id] is not None
        rec = None
        if not getattr(r.sampling, "capture", True):
            self.stats["opted_out"] += 1
        elif _draw(r.seq_id) < self.config.sample_rate:
            rec = {"tokens": [], "states": [], "num_prompt": r.num_prompt}
        self._decided[r.seq_id] = rec
        while len(self._decided) > TRACKED:
            seq_id, _ = self._decided.popitem(last=False)
            self._close(seq_id, None)
        return rec is not None

    def record(self, r, tokens: list[int], start: int, states: dict[int, torch.Tensor]) -> None:
        """The positions ``start..len(tokens)`` the verification kept: their tokens and states."""
        rec = self._decided.get(r.seq_id)
        if rec is None:
            return
        n = len(tokens) - start
        have = len(rec["tokens"])
        if start > have:  # positions before start were verified elsewhere: not recorded
            self._decided[r.seq_id] = None
            self.stats["dropped_requests"] += 1
            return
        if start < have:  # a resend or a rollback: the positions from start are replaced
            rec["states"] = [torch.cat(rec["states"])[:start]] if start else []
            del rec["tokens"][start:]
        rec["tokens"] += tokens[start:]
        rec["states"].append(torch.cat([states[L][:n] for L in self.layers], dim=-1).to(self.dtype))
        rec["num_prompt"] = max(rec["num_prompt"], r.num_prompt)

    def finish(self, seq_id: str) -> None:
        """The sequence ended (released): its record joins the buffer, written when due."""
        self._close(seq_id, self._decided.pop(seq_id, None))

    def _close(self, seq_id: str, rec: dict | None) -> None:
        if rec is None or len(rec["tokens"]) < 2:
            return
        rec["states"] = torch.cat(rec["states"])
        self.stats["requests"] += 1
        if not self._buffer:
            self._oldest = time.monotonic()
        self._buffer.append(rec)
        self._buffered_bytes += rec["states"].numel() * rec["states"].element_size() + 4 * len(rec["tokens"])
        if (self._buffered_bytes >= self.config.shard_bytes
                or time.monotonic() - self._oldest >= self.config.flush_interval_s):
            self.flush()

    def flush(self) -> Path | None:
        """Write the buffered requests as one shard, within the retention limits; the shard's path, or None."""
        from safetensors.torch import save

        if not self._buffer:
            return None
        recs, self._buffer, self._buffered_bytes = self._buffer, [], 0
        lengths = [len(r["tokens"]) for r in recs]
        blob = save({"tokens": torch.tensor([t for r in recs for t in r["tokens"]], dtype=torch.int32),
                     "states": torch.cat([r["states"] for r in recs]).contiguous(),
                     "offsets": torch.tensor([0] + lengths, dtype=torch.int64).cumsum(0),
                     "num_prompt": torch.tensor([r["num_prompt"] for r in recs], dtype=torch.int64)},
                    metadata={"format": FORMAT, "layers": json.dumps(list(self.layers)), "model": self.model,
                              "hidden_size": str(self.hidden_size)})
        if not self._make_room(len(blob)):
            self.stats["dropped_requests"] += len(recs)
            log.warning("capture: a shard of %d bytes exceeds capture.max_bytes %d; %d requests dropped",
                        len(blob), self.config.max_bytes, len(recs))
            return None
        path = self.dir / f"{time.time_ns():020d}-{os.getpid()}.safetensors"
        tmp = path.with_suffix(".tmp")  # written then renamed: a reader never sees a torn shard
        tmp.write_bytes(blob)
        tmp.replace(path)
        self.stats["shards"] += 1
        self.stats["bytes_written"] += len(blob)
        return path

    def _make_room(self, size: int) -> bool:
        """Delete shards past their age, then the oldest ones, until a shard of ``size`` bytes fits the limits."""
        c = self.config
        if size > c.max_bytes:
            return False
        now = time.time()
        shards = []
        for p in sorted(self.dir.glob("*.safetensors")):
            try:
                st = p.stat()
            except FileNotFoundError:  # another replica's retention got there first
                continue
            if c.max_age_s is not None and now - st.st_mtime > c.max_age_s:
                self._delete(p)
            else:
                shards.append((p, st.st_size))
        total = sum(s for _, s in shards)
        while shards and (total + size > c.max_bytes or (c.max_shards is not None and len(shards) >= c.max_shards)):
            p, s = shards.pop(0)
            self._delete(p)
            total -= s
        return True

    def _delete(self, p: Path) -> None:
        try:
            p.unlink()
            self.stats["deleted_shards"] += 1
        except FileNotFoundError:
            pass


def _draw(seq_id: str) -> float:
    """A uniform draw in [0, 1) fixed by the sequence id, so every replica decides alike."""
    return int.from_bytes(hashlib.blake2b(seq_id.encode(), digest_size=8).digest(), "big") / 2**64


def read_shards(path: str | Path) -> tuple[list[dict], list[int]]:
    """(records {"tokens": [int], "states": [n, C], "num_prompt": int}, the recorded layer ids: the aux
    layers, then the last layer's output) from every shard in ``path``, oldest first."""
    from safetensors import safe_open

    records, layers = [], None
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            meta = h.metadata() or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"{f}: not a capture shard (format {meta.get('format')!r})")
            shard_layers = json.loads(meta["layers"])
            if layers is not None and shard_layers != layers:
                raise ValueError(f"{f}: layers {shard_layers}, other shards in {path} hold {layers}")
            layers = shard_layers
            tokens, states = h.get_tensor("tokens"), h.get_tensor("states")
            offsets, num_prompt = h.get_tensor("offsets").tolist(), h.get_tensor("num_prompt").tolist()
        for i, n_prompt in enumerate(num_prompt):
            a, b = offsets[i], offsets[i + 1]
            records.append({"tokens": tokens[a:b].tolist(), "states": states[a:b], "num_prompt": n_prompt})
    return records, layers or []
