"""The verifier (target-model) engine: batched verification of draft tokens.

One call to ``VerifierEngine.verify`` takes the steps of many sequences and runs one
forward pass (split only when padding would waste too much) over each sequence's new
tokens followed by its k draft tokens, then decides per sequence which drafts to keep.
The protocol (``VerifyRequest``) is stateless from the caller's side: any replica can
answer any call, at worst after a cache miss and a resend of the full token ids.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from core.backends import backend
from core.grammar import Grammars, SequenceMasks, apply_bitmask
from core.kv_cache import CacheFull, batched_forward
from core.llama import EngineModel, capture_states
from core.models import eos_token_ids, pin_process
from core.protocol import CacheMiss, VerifyRequest, VerifyResult
from core.rejection import decide

if TYPE_CHECKING:
    from configs import VerifierConfig

log = logging.getLogger(__name__)


def build(config: VerifierConfig, *, drafting: bool = False, aux_layers: tuple[int, ...] = (),
          head: tuple[str, int] | None = None) -> VerifierEngine:
    """The transformers backend's engine (``core.backends``). It verifies what the replica's loop sends and
    captures the states each request asks for, so it needs none of the loop's settings."""
    return VerifierEngine(config)


class VerifierEngine:
    """This package's engine (``backend: transformers``); its verify runs on the replica's batcher thread."""

    def __init__(self, config: VerifierConfig, model=None, tokenizer=None):
        from transformers import AutoTokenizer

        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        pin_process(config.cpu_affinity)
        self.config = config
        self.capabilities = backend("transformers").capabilities
        self.tokenizer = AutoTokenizer.from_pretrained(config.model) if tokenizer is None else tokenizer
        em = EngineModel(config, model)
        self.model, self.runner, self.cache, self.dtype, self.device, self.max_len = (
            em.model, em.runner, em.cache, em.dtype, em.device, em.max_len)
        self.vocab_size = self.model.config.get_text_config().vocab_size
        self.on_progress = None  # called after each forward pass (the serving layer's stall watchdog)
        self.eos_ids = eos_token_ids(self.tokenizer, model=self.model)
        self._masks = None  # structured outputs' grammar masks (core.grammar), made at the first such request
        self.capture = None  # served traffic recorded for training a head (verifier/capture.py), when configured
        if getattr(config, "capture", None) is not None:
            from verifier.capture import TrafficCapture

            tc = self.model.config.get_text_config()
            self.capture = TrafficCapture(config.capture, tc.num_hidden_layers, tc.hidden_size, str(config.model))

    @property
    def masks(self) -> SequenceMasks:
        if self._masks is None:
            self._masks = SequenceMasks(Grammars(self.tokenizer, self.vocab_size, self.eos_ids))
        return self._masks

    def masked(self, r: VerifyRequest, logits: torch.Tensor, tokens: list[int]) -> torch.Tensor:
        """logits [k+1, V] masked by the grammar state reached along the drafts (``tokens``: the sequence
        through them), the stage before ``decide``: p is the masked target's processed distribution."""
        if r.grammar is None:
            return logits
        return apply_bitmask(logits, self.masks.masks(r.seq_id, r.grammar, tokens[r.num_prompt:], r.k + 1))

    def release(self, seq_id: str) -> bool:
        if self._masks is not None:
            self._masks.release(seq_id)
        if self.capture is not None:
            self.capture.finish(seq_id)
        return self.cache.release(seq_id)

    @torch.inference_mode()
    def prompt_logprobs(self, tokens: list[int], top: int) -> list[tuple[float, list[tuple[int, float]]] | None]:
        """The target's log-probability of each prompt token given the ones before it, with the top
        ``top`` alternatives (``echo`` with logprobs); None for the first token, which has no context.
        One forward pass outside the KV slots: an echo request's prompt is seen once."""
        ids = torch.tensor([tokens], device=self.device)
        lp = self.model(input_ids=ids).logits[0, :-1].float().log_softmax(-1).cpu()  # [n-1, V]
        best = lp.topk(top, -1) if top > 0 else None
        return [None] + [(float(lp[i, t]), list(zip(best.indices[i].tolist(), best.values[i].tolist())) if best else [])
                         for i, t in enumerate(tokens[1:])]

    @torch.inference_mode()
    def aux_states(self, tokens: list[int], layers: tuple[int, ...]) -> torch.Tensor:
        """The states of ``layers`` at every token (``core.llama``: the residual stream entering each),
        [len(tokens), len(layers) * hidden]: one forward pass over the sequence outside the KV cache, for an
        EAGLE-3 drafter that lost a sequence's states (a replaced replica); it costs a prefill of the sequence."""
        with capture_states(self.model, layers) as states:
            self.model(input_ids=torch.tensor([tokens], device=self.device), logits_to_keep=1)
        return torch.cat([states[L][0] for L in layers], dim=-1).cpu()

    def num_cached(self) -> int:
        return len(self.cache)

    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]:
        """Verify the drafts of many sequences in (normally) one batched forward pass."""
        t0 = time.perf_counter()
        results: dict[str, VerifyResult] = {}
        live: list[tuple[VerifyRequest, object]] = []
        pinned = {r.seq_id for r in requests}
        if len(pinned) != len(requests):
            raise ValueError("a sequence appears twice in one batch")
        for r in requests:
            room = self.max_len - (0 if r.full else r.start) - len(r.new_tokens)
            if room < 0:  # the router never sends this; fail this sequence only, not the batch
                error = f"{self.max_len - room} tokens exceed the context limit {self.max_len}"
                results[r.seq_id] = VerifyResult(r.seq_id, error=error)
                continue
            if r.grammar is not None and not self.masks.has(r.grammar):  # resent with the constraint's spec
                results[r.seq_id] = VerifyResult(r.seq_id, cache_miss=True, num_drafts=r.k)
                continue
            if r.k > room:  # verifying fewer drafts is still lossless
                r.draft_tokens = r.draft_tokens[:room]
                if r.draft_probs is not None:
                    r.draft_probs = r.draft_probs.head(room)
            try:
                slot = self.cache.claim(r.seq_id, r.start, r.prefix, r.new_tokens if r.full else None, pinned,
                                        r.cache_salt, self._shares(r), tuple(r.capture))
                # the sequence through its drafts: blocks for them now, so a full pool fails this sequence only
                self.cache.reserve(r.seq_id, (0 if r.full else r.start) + len(r.new_tokens) + r.k, pinned)
            except CacheMiss:
                results[r.seq_id] = VerifyResult(r.seq_id, cache_miss=True, num_drafts=r.k)
                continue
            except CacheFull as e:  # the batch holds the whole pool: another replica, or a later step, may succeed
                results[r.seq_id] = VerifyResult(r.seq_id, error=str(e), retryable=True)
                continue
            live.append((r, slot))

        for group in self._groups(live):
            self._verify_group(group, results)
        out = [results[r.seq_id] for r in requests]
        dt = time.perf_counter() - t0
        for res in out:
            res.engine_s = dt
        return out

    def _shares(self, r: VerifyRequest) -> bool:
        """Whether a sequence may start from blocks cached by other requests: not one whose traffic is recorded
        (from its first position). A head's states are kept beside the blocks (``_head_states``)."""
        return not (self.capture is not None and self.capture.wants(r))

    def _head_states(self, r: VerifyRequest, slot, res: VerifyResult, start: int) -> None:
        """The slot's states for a head (``Slot.kept``), for its blocks' later hits; after a hit, the
        result's states start with the cached prefix's, kept beside its blocks."""
        if not r.capture:
            slot.kept = None  # a gap: no block is made from it
            return
        if slot.kept is not None and slot.kept_from <= start <= slot.kept_from + slot.kept.shape[0]:
            slot.kept = torch.cat([slot.kept[: start - slot.kept_from], res.aux])
        else:
            slot.kept, slot.kept_from = res.aux, start
        if slot.prefix_hit and start == slot.prefix_hit:
            res.aux = torch.cat([self.cache.states_of(slot.blocks[: start // self.cache.block_size]), res.aux])
            res.aux_start = 0

    def _verify_group(self, group, results: dict) -> None:
        """One forward pass for the group, then each sequence's decision. A sequence that makes either
        raise fails alone: a failed pass is rerun sequence by sequence."""
        feeds = [(r.new_tokens[len(slot.tokens):] if r.full else r.new_tokens) + r.draft_tokens for r, slot in group]
        starts = [len(slot.tokens) for _, slot in group]
        capture = tuple(sorted({L for r, _ in group for L in r.capture}))  # an EAGLE-3 drafter's layers
        if self.capture is not None and any([self.capture.wants(r) for r, _ in group]):
            capture = tuple(sorted(set(capture) | set(self.capture.layers)))
        t0 = time.perf_counter()
        try:
            logits = batched_forward(self.runner, self.cache, [s for _, s in group], feeds,
                                     [r.k + 1 for r, _ in group], capture)  # each [k+1, V]
            states = None
            if capture:
                logits, states = logits
        except Exception as e:  # noqa: BLE001 - isolate the sequence that caused it
            if len(group) > 1:
                for item in group:
                    self._verify_group([item], results)
            else:
                self._fail(group[0][0], e, results)
            return
        dt = time.perf_counter() - t0
        if self.on_progress:
            self.on_progress()
        for i, ((r, slot), lg) in enumerate(zip(group, logits)):
            try:
                # the slot holds the sequence through its drafts
                res = decide(r, self.masked(r, lg, slot.tokens), slot.tokens, self.eos_ids)
                if r.grammar is not None and res.logprobs:
                    res.logprobs = _finite(res.logprobs)
            except Exception as e:  # noqa: BLE001
                self._fail(r, e, results)
                continue
            res.forward_s = dt
            if r.capture:  # the states of the positions kept: the fed tokens through the accepted drafts
                kept = len(feeds[i]) - r.k + res.num_accepted
                res.aux = torch.cat([states[i][L][:kept] for L in r.capture], dim=-1)
                res.aux_start = starts[i]
            # keep the accepted drafts' K/V; the recovered/bonus token was never fed
            slot.cut(len(slot.tokens) - r.k + res.num_accepted)
            if self.cache.prefix_caching:
                self._head_states(r, slot, res, starts[i])
            self.cache.commit(slot, layers=tuple(r.capture))  # its full blocks, now final, for later requests
            res.cached, res.prefix_hit = len(slot.tokens), slot.prefix_hit
            if states is not None and self.capture is not None and self.capture.wants(r):
                self.capture.record(r, slot.tokens, starts[i], states[i])
            results[r.seq_id] = res

    def _fail(self, r: VerifyRequest, e: Exception, results: dict) -> None:
        log.warning("sequence %s failed verification alone: %r", r.seq_id, e)
        self.cache.release(r.seq_id)  # its rows may be half written
        results[r.seq_id] = VerifyResult(r.seq_id, error=f"verification of this sequence failed: {e!r}")

    def _groups(self, live):
        """Split a batch so that left-padding never more than doubles the tokens computed,
        and no forward pass exceeds max_batch_tokens (a long prefill goes on its own)."""
        def n_feed(item):
            r, slot = item
            return (len(r.new_tokens) - len(slot.tokens) if r.full else len(r.new_tokens)) + r.k
        group = []
        for item in sorted(live, key=n_feed):
            n = n_feed(item)
            real = sum(map(n_feed, group)) + n
            if group and (n * (len(group) + 1) > max(2 * real, real + 16)
                          or n * (len(group) + 1) > self.config.max_batch_tokens):
                yield group
                group = []
            group.append(item)
        if group:
            yield group


def _finite(logprobs: list) -> list:
    """Masked tokens' log-probabilities (-inf) as -9999.0, as vLLM reports them: JSON has no infinity."""
    return [(max(lp, -9999.0), [(t, max(v, -9999.0)) for t, v in top]) for lp, top in logprobs]
