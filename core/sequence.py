"""One request's state: ``Sequence`` and its speculation counters ``SpecStats``.

``Sequence`` is one request's state machine (tokens, what each engine is believed to
cache, detokenisation, stop conditions, speculation statistics). The in-process loop
(``core.loop``) and the Ray router drive the same state machine, the router over RPC.
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from core.detok import IncrementalDetokenizer
from core.grammar import Constraint
from core.protocol import DraftProbs, DraftRequest, Proposal, VerifyRequest, VerifyResult, common_prefix_len, cut_chain

if TYPE_CHECKING:  # pydantic stays out of engine-level imports
    from configs import SamplingParams


@dataclass
class SpecStats:
    """Speculation counters, named as vLLM's spec_decode metrics."""

    num_drafts: int = 0  # steps that proposed at least one token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    steps: int = 0  # verifier steps, speculative or not

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens per speculative step, bonus token included."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def record(self, k: int, num_accepted: int):
        self.steps += 1
        if k == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < k:
            self.accepted_per_pos += [0] * (k - len(self.accepted_per_pos))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def merge(self, other: SpecStats):
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "steps"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        if len(self.accepted_per_pos) < len(other.accepted_per_pos):
            self.accepted_per_pos += [0] * (len(other.accepted_per_pos) - len(self.accepted_per_pos))
        for i, a in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[i] += a

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "accepted_per_pos": self.accepted_per_pos,
                "acceptance_rate": round(self.acceptance_rate, 4),
                "mean_acceptance_length": round(self.mean_acceptance_length, 4), "steps": self.steps}


class Sequence:
    """One request: prompt, sampling, and everything needed to take its next step."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, k: int, tokenizer,
                 eos_ids: set[int], max_len: int, seq_id: str | None = None, logprobs: int | None = None,
                 output_ids: list[int] = (), constraint: Constraint | None = None, cache_salt: str | None = None):
        """``tokenizer`` None: no text is kept (stop strings then belong to the caller);
        ``output_ids``: resume a sequence that already generated these tokens; ``constraint``: a structured
        output's (``core.grammar``), which both engines apply to every draft and verified position; ``cache_salt``:
        the tenant's, which the verifier's prefix cache is keyed by."""
        if not prompt_ids:
            raise ValueError("the prompt must contain at least one token")
        if len(prompt_ids) >= max_len:
            raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in the context of {max_len}")
        self.seq_id = seq_id or uuid.uuid4().hex
        self.params = params
        self.k = k
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self.tokens = list(prompt_ids) + list(output_ids)
        self.num_prompt = len(prompt_ids)
        # ids that end generation: EOS (unless ignored) and the request's stop_token_ids
        self.eos_ids = (set() if params.ignore_eos else set(eos_ids)) | set(params.stop_token_ids)
        self.max_len = max_len
        self.detok = IncrementalDetokenizer(tokenizer, params.stop, params.min_tokens)
        self.stats = SpecStats()
        self.finish_reason: str | None = None
        # what each pool's replica is believed to hold for this sequence; a wrong belief costs a
        # cache miss and a resend, never a wrong token
        self.drafter_held: list[int] = []
        self.drafter_asked = False  # a draft request was made: the drafter pool may hold a slot to release
        self.verifier_cached = 0  # the verifier replica holds tokens[:verifier_cached]
        self.hash_chain: list[bytes] = [b""]  # memo of the prefix hash of self.tokens (core.protocol)
        self._verifying: list[int] = []  # drafts of the step in flight
        # calls resent in full (recomputes); states: an EAGLE-3 drafter's states recomputed by the verifier
        self.cache_misses = {"drafter": 0, "verifier": 0, "states": 0}
        self.text = ""
        # an EAGLE-3 drafter's inputs: the verifier captures the states entering these layers, and they
        # are kept (positions aux_start..) until the drafter holds their rows; None: none yet
        self.capture: tuple[int, ...] = ()
        self._aux: list[torch.Tensor] | None = None  # chunks, joined when used: a step appends in O(1)
        self._aux_rows = 0
        self.aux_start = 0
        self.aux_bytes_sent = 0
        self.want_logprobs = logprobs  # None: none; n: the emitted token's and the top n alternatives'
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []  # per output token, when asked
        self.constraint = constraint
        self.cache_salt = cache_salt
        # the loop's own matcher (``core.grammar.SequenceMasks``), when forced tokens are drafted for free
        self.forced_masks = None

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.num_prompt:]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def step_k(self, k: int | None = None) -> int:
        """Draft tokens for the next step: no more than could be emitted or fit the context."""
        k = self.k if k is None else min(k, self.k)
        left = self.params.max_tokens - self.num_output
        return max(0, min(k, left - 1, self.max_len - len(self.tokens) - 1))

    def draft_request(self, k: int, full: bool = False, context: list[int] | None = None,
                      provisional: bool = False, alternatives: int = 0,
                      branches: list[tuple[int, int]] = ()) -> DraftRequest:
        """Ask for k drafts after ``context`` (default: the sequence so far); ``provisional``: a
        pre-draft an EAGLE-3 drafter continues from its own rows (it reads no states);
        ``alternatives``, ``branches``: see ``DraftRequest``."""
        ctx = self.tokens if context is None else context
        self.drafter_asked = True
        kw = dict(k=k, sampling=self.params, seed=self.seed, num_prompt=self.num_prompt, provisional=provisional,
                  alternatives=alternatives, branches=list(branches), cache_salt=self.cache_salt,
                  verified=len(ctx) if context is None else common_prefix_len(self.tokens, ctx))
        if self.capture and self.aux is not None and not provisional:
            kw.update(aux=self.aux, aux_start=self.aux_start)
            self.aux_bytes_sent += self.aux.numel() * self.aux.element_size()
        if full:
            return self._constrained(DraftRequest(self.seq_id, 0, None, list(ctx), full=True, **kw))
        # a pre-draft context (the tokens, then a guess) reads the memo but never adds guessed blocks to it
        return self._constrained(DraftRequest.for_tokens(self.seq_id, ctx, common_prefix_len(self.drafter_held, ctx),
                                                         self.hash_chain, None if context is None else 0, **kw))

    def forced(self, limit: int) -> list[int]:
        """The tokens the constraint forces next (each the single legal one), at most ``limit``; [] without
        ``forced_masks``."""
        if self.forced_masks is None or self.constraint is None or limit <= 0:
            return []
        return self.forced_masks.forced(self.seq_id, self.constraint, self.output_ids, limit)

    def legal_drafts(self, drafts: list[int]) -> int:
        """How many of ``drafts`` the constraint allows, from the first (all without ``forced_masks``)."""
        if self.forced_masks is None or self.constraint is None or not drafts:
            return len(drafts)
        return self.forced_masks.legal(self.seq_id, self.constraint, self.output_ids, list(drafts))

    def _constrained(self, req):
        """The call with the sequence's constraint: whole on a full call, by hash otherwise (a replica
        without it answers a cache miss, and the resend is full)."""
        if self.constraint is not None:
            req.grammar = self.constraint if req.full else self.constraint.ref()
        return req

    def note_proposal(self, proposal: Proposal, context: list[int] | None = None):
        """Record what the drafter now holds: the context and the drafts it fed back in."""
        ctx = self.tokens if context is None else context
        self.drafter_held = (list(ctx) + proposal.tokens)[: proposal.cached]
        if self.aux is not None and proposal.cached:  # it holds rows 0..cached-1: it next needs g_{cached-1}..
            drop = min(proposal.cached - 1 - self.aux_start, self.aux.shape[0])
            if drop > 0:  # a copy: a view would pickle the whole storage
                self.aux, self.aux_start = self.aux[drop:].clone(), self.aux_start + drop

    # kept states beyond this (a long plain stretch) are cut back to half of it, so the cut is amortised;
    # a drafter miss recomputes what was dropped
    MAX_AUX_ROWS = 2048

    @property
    def aux(self) -> torch.Tensor | None:
        """The kept states, positions aux_start.. (None: none yet)."""
        if self._aux is not None and len(self._aux) > 1:
            self._aux = [torch.cat(self._aux)]
        return None if self._aux is None else self._aux[0]

    @aux.setter
    def aux(self, value: torch.Tensor | None):
        self._aux = None if value is None else [value]
        self._aux_rows = 0 if value is None else value.shape[0]

    @property
    def has_aux(self) -> bool:
        """Whether any states came yet (without joining the kept chunks)."""
        return self._aux is not None

    @property
    def needs_all_aux(self) -> bool:
        """A full resend to the drafter needs every state and the kept ones start later: the
        verifier must recompute them (``restart_aux``)."""
        return bool(self.capture) and self.aux_start > 0

    def restart_aux(self, states: torch.Tensor):
        """Every state from position 0, recomputed by the verifier after a drafter lost its rows."""
        self.aux, self.aux_start = states, 0
        self.cache_misses["states"] += 1

    def take_aux(self, result: VerifyResult):
        """Keep the states a verification returned (positions result.aux_start..) after those kept."""
        if result.aux is None:
            return
        end = self.aux_start + self._aux_rows
        if self._aux is None or not self.aux_start <= result.aux_start <= end:  # a gap: start again from these
            self.aux, self.aux_start = result.aux, result.aux_start
            return
        if result.aux_start < end:  # recomputed positions (a verifier resend) replace the kept ones
            self.aux = self.aux[: result.aux_start - self.aux_start].clone()
        self._aux.append(result.aux)
        self._aux_rows += result.aux.shape[0]
        if self._aux_rows > self.MAX_AUX_ROWS:
            drop = self._aux_rows - self.MAX_AUX_ROWS // 2
            self.aux, self.aux_start = self.aux[drop:].clone(), self.aux_start + drop

    def verify_request(self, drafts: list[int] = (), probs: DraftProbs | None = None,
                       full: bool = False, capture: bool = True) -> VerifyRequest:
        """``capture`` False: no states for a head this step (it will not draft soon: see ``core.loop``)."""
        self._verifying = list(drafts)
        kw = dict(draft_tokens=list(drafts), sampling=self.params, seed=self.seed, logprobs=self.want_logprobs,
                  draft_probs=probs if drafts else None, num_prompt=self.num_prompt,
                  capture=self.capture if capture else (), cache_salt=self.cache_salt)
        if full:
            return self._constrained(VerifyRequest(self.seq_id, 0, None, list(self.tokens), full=True, **kw))
        cached = min(self.verifier_cached, len(self.tokens))
        return self._constrained(VerifyRequest.for_tokens(self.seq_id, self.tokens, cached, self.hash_chain, **kw))

    def apply(self, result: VerifyResult) -> tuple[list[int], str]:
        """Emit a verified step. Returns (new token ids, newly final text): only the tokens kept,
        so a stop string, EOS or max_tokens inside an accepted block drops the ones after it."""
        self.stats.record(result.num_drafts, result.num_accepted)
        # the verifier holds the sequence and the drafts it accepted, which the emitted tokens start
        # with: a prefix of the tokens from here on (a length, not a copy: O(1) per step)
        self.verifier_cached = result.cached
        new = list(result.tokens)
        left = self.params.max_tokens - self.num_output
        new = new[:left]
        for i, t in enumerate(new):
            if t in self.eos_ids:
                new = new[: i + 1]
                self.finish_reason = "stop"
                break
        self.tokens.extend(new)
        if result.logprobs is not None:
            self.logprobs.extend(result.logprobs[: len(new)])
        delta = self.detok.add([t for t in new if t not in self.eos_ids])
        if self.detok.stopped_at is not None:
            self.finish_reason = "stop"
            keep = self.detok.tokens_through_stop()
            dropped = self.num_output - keep
            del self.tokens[self.num_prompt + keep:]
            cut_chain(self.hash_chain, len(self.tokens))
            del self.logprobs[keep:]
            new = new[: len(new) - dropped]
        elif self.finish_reason is None and (self.num_output >= self.params.max_tokens
                                             or len(self.tokens) >= self.max_len):
            self.finish_reason = "length"
        if self.finish_reason is not None:
            delta += self.detok.finish()
        self.text += delta
        return new, delta
