"""The wire protocol: every type that crosses a process boundary, in one place.

Drafter and verifier replicas are addressed statelessly. A call names the sequence, the
position ``start`` where its ``new_tokens`` begin and a hash of the tokens before them
(``prefix_hash``); a replica that does not hold exactly that prefix answers ``cache_miss``
and the caller resends the full token ids (``full=True``). Any replica can therefore answer
any call, at worst after one resend: the caches are only an optimisation.

The interfaces of the two peers (``Drafter``, ``Verifier``) live here too, so the loop can be
written against them without importing either implementation.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

if TYPE_CHECKING:  # pydantic stays out of engine-level imports
    from configs import SamplingParams
    from core.grammar import Constraint


HASH_BLOCK = 256  # tokens per link of the prefix hash's chain


def _link(state: bytes, block: list[int]) -> bytes:
    return hashlib.blake2b(state + np.asarray(block, dtype=np.int64).tobytes(), digest_size=16).digest()


def salt_root(salt: str | None) -> bytes:
    """The first state of a chain of block hashes shared across requests: a tenant's ``cache_salt``
    changes every link after it (vLLM's semantics), so salted and unsalted prefixes never match."""
    return b"" if salt is None else hashlib.blake2b(b"salt:" + salt.encode(), digest_size=16).digest()


def block_link(state: bytes, block: list[int]) -> bytes:
    """The next link of a chain over token blocks: the hash of the previous link and this block."""
    return _link(state, block)


def prefix_hash(tokens: list[int], n: int | None = None, chain: list[bytes] | None = None,
                stable: int | None = None) -> str:
    """The hash that names tokens[:n] (default: all) in the cache protocol: a chain over blocks of
    256 tokens (each link hashes the previous link and its block), then the tail.

    ``chain`` memoises the links of one growing token list ([b""] to start): hashing a prefix then
    costs one link and the tail, not the whole prefix. Links are stored only for blocks that end
    within ``stable`` tokens (default n), which the owner promises not to change without cutting
    the chain (``cut_chain``)."""
    n = len(tokens) if n is None else n
    q = n // HASH_BLOCK
    links = chain if chain is not None else [b""]
    limit = (n if stable is None else min(n, stable)) // HASH_BLOCK
    state, i = (links[min(q, len(links) - 1)], min(q, len(links) - 1))
    while i < q:
        state = _link(state, tokens[i * HASH_BLOCK:(i + 1) * HASH_BLOCK])
        i += 1
        if i == len(links) and i <= limit:
            links.append(state)
    return hashlib.blake2b(state + np.asarray(tokens[q * HASH_BLOCK:n], dtype=np.int64).tobytes(),
                           digest_size=16).hexdigest()


def cut_chain(chain: list[bytes], n: int) -> None:
    """The token list was cut to n tokens (or changed from position n): drop the links past it."""
    del chain[n // HASH_BLOCK + 1:]


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # compared in C: the common case at any length
        return n
    head = max(0, n - 64)  # sequences diverge near their ends (rejected drafts): skip the head in C
    i = head if a[:head] == b[:head] else 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class CacheAddressed:
    """Mixin for the call dataclasses of the cache protocol (fields seq_id, start, prefix,
    new_tokens, full): how a call names the prefix its replica should hold."""

    def __post_init__(self):
        if self.start == 0:  # no prefix assumed: new_tokens are the whole sequence
            self.full = True

    @classmethod
    def for_tokens(cls, seq_id: str, tokens: list[int], cached: int, chain: list[bytes] | None = None,
                   stable: int | None = None, **kw):
        """The call for a sequence whose replica is believed to hold tokens[:cached]
        (at least one token is always sent, so there is a position to predict from);
        ``chain``/``stable``: the caller's memo of the prefix hash (``prefix_hash``)."""
        cached = min(cached, len(tokens) - 1)
        return cls(seq_id, cached, prefix_hash(tokens, cached, chain, stable), tokens[cached:], **kw)


class CacheMiss(Exception):
    """The replica does not hold the prefix a call assumed; resend the full token ids."""


@dataclass
class DraftProbs:
    """q for k draft positions, as the drafter's (exactly sparse) top-K entries."""

    ids: list[list[int]]  # [k][K] token ids
    probs: list[list[float]]  # [k][K] their probabilities; each row sums to 1

    def head(self, k: int) -> DraftProbs:
        """q of the first k draft positions."""
        return DraftProbs(self.ids[:k], self.probs[:k])

    def dense(self, vocab_size: int) -> torch.Tensor:
        q = torch.zeros(len(self.ids), vocab_size)  # [k, V]
        for row, (ids, probs) in enumerate(zip(self.ids, self.probs)):  # rows may differ in length
            q[row, ids] = torch.tensor(probs, dtype=torch.float32)
        return q


@dataclass
class DraftRequest(CacheAddressed):
    """Propose k tokens after a sequence. Same cache protocol as ``VerifyRequest``: the
    replica should hold tokens[:start] (hash ``prefix``), ``new_tokens`` follow them;
    ``full=True`` means new_tokens are the whole sequence."""

    seq_id: str
    start: int
    prefix: str | None
    new_tokens: list[int]
    k: int
    sampling: SamplingParams
    seed: int
    full: bool = False
    num_prompt: int = 0  # the sequence's first num_prompt tokens are the prompt (for penalties)
    # EAGLE-3 drafters: the target's aux hidden states g_t [len, 3 * hidden] of positions aux_start..
    # (computed by the verifier; the drafter needs those of every token but the last)
    aux: torch.Tensor | None = None
    aux_start: int = 0
    # a pre-draft for a guessed context (the sequence, then a block not verified yet): a drafter that
    # reads the target's states may continue from its own for the guessed tokens, or answer cache_miss
    provisional: bool = False
    # record, at each draft position, the drafter's m most likely tokens (``Proposal.alts``)
    alternatives: int = 0
    # a pre-draft tree: instead of drafting after the context, draft k tokens after each branch
    # (n, c): the context's first n tokens, then token c (``Proposal.branches``, in this order)
    branches: list[tuple[int, int]] = field(default_factory=list)
    # a structured output's constraint (core.grammar): by hash (``Constraint.ref``), whole on a full
    # call; a replica that has not compiled it answers cache_miss. Drafts are drawn under its masks
    grammar: Constraint | None = None
    cache_salt: str | None = None  # the tenant's: only prefixes cached under the same salt are shared
    # the context's first tokens the verifier has kept: a pre-draft's guesses after them may be rolled back,
    # so blocks shared across requests are made of these only
    verified: int = 0


@dataclass
class Proposal:
    seq_id: str
    tokens: list[int]  # the k draft tokens (fewer when the drafter found nothing to propose)
    probs: DraftProbs | None = None  # q at each draft position; None means one-hot
    cached: int = 0  # tokens the drafter replica now holds for the sequence
    cache_miss: bool = False  # resend with full=True
    draft_s: float = 0.0  # time spent drafting the batch this proposal was part of
    batch_size: int = 1  # sequences in that batch
    alts: list[list[int]] | None = None  # per draft position, the drafter's most likely tokens, best first
    branches: list[Proposal] | None = None  # a pre-draft tree's: one proposal per requested branch


@dataclass
class VerifyRequest(CacheAddressed):
    """One sequence's verification step.

    Either (start, prefix, new_tokens): the replica should hold the sequence's first
    ``start`` tokens, whose hash is ``prefix``, and ``new_tokens`` follow them; or
    ``full=True``: new_tokens are all of the sequence's tokens (the resend after a miss).
    """

    seq_id: str
    start: int
    prefix: str | None
    new_tokens: list[int]
    draft_tokens: list[int]
    sampling: SamplingParams
    seed: int  # the request's seed (the caller draws one when the client gave none)
    draft_probs: DraftProbs | None = None  # None: one-hot drafts (n-gram) or greedy
    full: bool = False
    # return the target's log-probabilities of emitted tokens, with this many top alternatives
    logprobs: int | None = None
    num_prompt: int = 0  # the sequence's first num_prompt tokens are the prompt (for penalties)
    capture: tuple[int, ...] = ()  # return the hidden states entering these layers (an EAGLE-3 drafter's aux states)
    # a structured output's constraint, as in ``DraftRequest``: p at each position is masked by the grammar
    # state reached along the drafts
    grammar: Constraint | None = None
    cache_salt: str | None = None  # the tenant's: only prefixes cached under the same salt are shared

    @property
    def k(self) -> int:
        return len(self.draft_tokens)

    def resumed(self, held: list[int] | None) -> list[int] | None:
        """The sequence's tokens before its drafts, for a replica that keeps a sequence's token ids (``held``,
        None: none kept): all of them when resent (``full``), else ``held``'s first ``start`` if they hash
        to ``prefix``, then the new ones; None: a cache miss."""
        if self.full:
            return list(self.new_tokens)
        if held is None or len(held) < self.start or prefix_hash(held[: self.start]) != self.prefix:
            return None
        return held[: self.start] + list(self.new_tokens)


@dataclass
class VerifyResult:
    seq_id: str
    tokens: list[int] = field(default_factory=list)  # accepted drafts + one recovered or bonus token
    num_accepted: int = 0
    cached: int = 0  # tokens the replica now holds for the sequence (the next call's `start`)
    cache_miss: bool = False  # the replica lacked the assumed prefix: resend with full=True
    error: str | None = None  # this sequence could not be verified (the rest of the batch was)
    retryable: bool = False  # the error was the engine's (another replica may succeed), not the request's
    num_drafts: int = 0  # k of this step
    forward_s: float = 0.0  # time in the batched forward pass this step was part of
    # time in the engine's call for that batch: the pass, the decisions, the cache's bookkeeping
    engine_s: float = 0.0
    batch_size: int = 1  # sequences in the batch this step was verified with
    # per emitted token: (its log-probability, [(token, log-probability)] of the top alternatives),
    # from the target's raw distribution (before temperature/top-k/top-p), as OpenAI and vLLM report them
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # with ``capture``: the states of the positions fed and kept (the sequence through the accepted
    # drafts, the emitted last token excluded), [n, len(capture) * hidden], from position aux_start
    aux: torch.Tensor | None = None
    aux_start: int = 0
    prefix_hit: int = 0  # tokens of this call's sequence read from blocks cached by earlier requests

    @property
    def accepted(self) -> list[bool]:
        """Per draft position: was the draft accepted."""
        return [i < self.num_accepted for i in range(self.num_drafts)]


@dataclass
class StepInfo:
    """What one step of ``speculate`` did, for the caller's statistics and metrics."""

    k: int  # drafts verified (0: a plain step)
    accepted: int
    pre_draft: str | None = None  # "hit": the step's drafts were ready when it began; "miss": discarded
    pre_branches: int = 0  # branches of the pre-draft tree the step was checked against (1: a chain)
    pre_outcome: int | None = None  # that tree's block: drafts accepted (its outcome j)
    predicted: int = 0  # drafts taken from the client's predicted output (then none from the drafter)
    forced: int = 0  # drafts the grammar forced (a single legal token each; then none from the drafter)
    degraded: bool = False  # speculation was wanted but no drafter answered (or its breaker is open)
    forward_s: float = 0.0  # the verify forward pass
    draft_s: float = 0.0  # drafting on the critical path (0 on a pre-draft hit)
    draft_engine_s: float = 0.0  # of which inside the drafter engine (the rest: transport, queueing)
    aux_bytes: int = 0  # target hidden states sent to the drafter with this step's draft request
    step_s: float = 0.0  # wall time of the step
    # from the verify call to its result: the engine's call (``engine_s``), plus the hand-offs to its thread and
    # back (and, when the step pre-drafts, sending the pre-draft request, which goes first)
    verify_s: float = 0.0
    engine_s: float = 0.0
    batch_size: int = 1  # sequences in the verify batch
    done: bool = False  # the sequence is complete after this step
    recomputes: dict[str, int] = field(default_factory=dict)  # cache misses this step: {"drafter": n, "verifier": n}
    cached_tokens: int = 0  # the prompt's tokens read from the verifier's prefix cache (the sequence's first step)


class Drafter(Protocol):
    """A drafter pool replica, or an in-process drafter: propose k tokens for many sequences."""

    def propose(self, requests: list[DraftRequest]) -> list[Proposal]: ...

    def release(self, seq_id: str) -> bool: ...

    def num_cached(self) -> int: ...


class Verifier(Protocol):
    """A verifier engine: verify the drafts of many sequences, one batched forward pass."""

    tokenizer: object
    eos_ids: set[int]
    max_len: int

    def verify(self, requests: list[VerifyRequest]) -> list[VerifyResult]: ...

    def release(self, seq_id: str) -> bool: ...

    def num_cached(self) -> int: ...
