"""Structured outputs: constraints, their compiled grammars, and token masks along a sequence.

The one place that owns the grammar engine (xgrammar): compiling a constraint (off the caller's
thread, with a time bound; compiled grammars cached by content hash, bounded in bytes), the
matchers that follow a sequence, the token bitmasks, advancing and rolling back. The verifier
and every drafter use it alike.

A ``Constraint`` is the request's shape (a JSON schema, a regex, a choice, an EBNF/Lark grammar,
a structural tag). It travels by content hash (``Constraint.ref``); a replica that has not
compiled it answers a cache miss and the caller resends it whole, so replicas stay stateless.

``SequenceMasks`` gives, for a sequence's tokens and its next n positions, the masks of the
grammar state reached along them: the matcher per sequence is only a cache, synced to whatever
tokens a call names (rolled back to their common prefix, advanced over the rest), rebuilt from
the tokens when lost. A position after a token the grammar forbids (a draft the grammar rejects
is never accepted: its p is 0) or after the end of the grammar gets an all-allowed row: nothing
drawn there is ever emitted.

Masking is a stage of its own: ``apply_bitmask`` sets forbidden tokens' logits to -inf before the
processors, temperature, top-k and top-p, as masked decoding does (vLLM applies the grammar's
bitmask to the logits before its sampler too).
"""

from __future__ import annotations

import functools
import hashlib
import json
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field

import torch

from core.protocol import Proposal

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_SPEC_CHARS = 64 * 1024  # a constraint's text: larger ones are refused before compiling
COMPILE_TIMEOUT_S = 10.0
ALL_ALLOWED = -1  # a bitmask word with every bit set


class GrammarError(ValueError):
    """A constraint that cannot be served (bad, too large, or too slow to compile). ``param``: the
    request field it came from, for the 400 that names it."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Constraint:
    """What a structured request's output must match. ``spec`` None: a reference (the hash alone)."""

    kind: str
    spec: str | None
    key: str = ""
    param: str = field(default="structured_outputs", compare=False)  # the request field it came from

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"unknown constraint kind {self.kind!r}", self.param)
        if not self.key:
            if self.spec is None:
                raise GrammarError("a constraint needs its spec or its key", self.param)
            if len(self.spec) > MAX_SPEC_CHARS:
                raise GrammarError(f"the {self.kind} constraint has {len(self.spec)} characters; the limit is "
                                   f"{MAX_SPEC_CHARS}", self.param)
            digest = hashlib.sha256(f"{self.kind}\0{self.spec}".encode()).hexdigest()
            object.__setattr__(self, "key", digest)

    def ref(self) -> Constraint:
        """The constraint by hash only (what a call carries once its replica has compiled it)."""
        return Constraint(self.kind, None, self.key, self.param)


def json_schema_constraint(schema: dict | str | None, param: str = "response_format") -> Constraint:
    """A constraint from a JSON schema (None: any JSON object). The function other features
    (tool calls: a function's parameters, ``tool_choice: required``) build theirs with."""
    if schema is None:
        return Constraint("json_object", "", param=param)
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}", param) from None
    if not isinstance(schema, (dict, bool)):
        raise GrammarError("a JSON schema must be an object", param)
    # keys in the schema's order, not sorted: xgrammar (as vLLM, as OpenAI) generates properties in the order the
    # schema lists them, and a schema that puts "reasoning" before "answer" means it
    return Constraint("json", json.dumps(schema, separators=(",", ":")), param=param)


def choice_constraint(choices: list[str], param: str = "structured_outputs.choice") -> Constraint:
    """Exactly one of ``choices``."""
    if not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarError("choice must be a non-empty list of strings", param)
    return Constraint("choice", json.dumps(list(choices), ensure_ascii=False), param=param)


def _ebnf_string(s: str) -> str:
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
    return '"' + "".join(escapes.get(ch, ch if ord(ch) >= 0x20 and ord(ch) != 0x7F else f"\\u{ord(ch):04x}")
                         for ch in s) + '"'


def _compile(compiler, c: Constraint):
    """The xgrammar CompiledGrammar of c. JSON is compact (no whitespace between tokens): a model
    cannot then spend its tokens on whitespace the schema does not need."""
    if c.kind == "json":
        return compiler.compile_json_schema(c.spec, any_whitespace=False, separators=(",", ":"))
    if c.kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=(",", ":"))
    if c.kind == "regex":
        return compiler.compile_regex(c.spec)
    if c.kind == "choice":
        return compiler.compile_grammar("root ::= " + " | ".join(_ebnf_string(s) for s in json.loads(c.spec)))
    if c.kind == "grammar":
        return compiler.compile_grammar(c.spec) if "::=" in c.spec else compiler.compile_lark(c.spec)
    tag = json.loads(c.spec)
    if isinstance(tag, dict) and "structures" in tag:  # the legacy form vLLM also accepts
        import xgrammar as xgr

        items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                 for s in tag["structures"]]
        return compiler.compile_structural_tag(items, tag["triggers"])
    return compiler.compile_structural_tag(c.spec)


class Grammars:
    """Compiled grammars for one tokenizer and vocabulary, by content hash; the least recently used
    dropped past ``budget_bytes``. Compiling runs on a pool of its own and is bounded by
    ``timeout_s``: the caller gets a ``GrammarError`` then, and a compile that never ends holds
    one pool thread, never the caller."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: set[int] | frozenset[int],
                 budget_bytes: int = 64 * 2**20, timeout_s: float = COMPILE_TIMEOUT_S, threads: int = 4):
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=sorted(stop_ids) or None)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.vocab_size, self.budget_bytes, self.timeout_s = vocab_size, budget_bytes, timeout_s
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._bytes = 0
        self._inflight: dict[str, object] = {}
        self._lock = threading.RLock()  # (a compile done at once runs its callback, which takes it, where it is held)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")

    def get(self, key: str):
        """The compiled grammar of a key, or None when this replica has not compiled it."""
        with self._lock:
            g = self._compiled.get(key)
            if g is not None:
                self._compiled.move_to_end(key)
            return g

    def compile(self, c: Constraint):
        """c's compiled grammar (cached; c a reference that is not cached: ``KeyError``)."""
        g = self.get(c.key)
        if g is not None:
            return g
        if c.spec is None:
            raise KeyError(c.key)
        with self._lock:
            fut = self._inflight.get(c.key)
            if fut is None:  # (a second request for the same constraint waits on the same compile)
                fut = self._inflight[c.key] = self._pool.submit(_compile, self.compiler, c)
                fut.add_done_callback(lambda f, key=c.key: self._done(key, f))
        try:
            return self._keep(c.key, fut.result(timeout=self.timeout_s))
        except FutureTimeout:
            raise GrammarError(f"the {c.kind} constraint did not compile within {self.timeout_s:g} s",
                               c.param) from None
        except Exception as e:  # noqa: BLE001 - xgrammar's errors for a bad spec are of several types
            raise GrammarError(f"the {c.kind} constraint does not compile: {str(e).strip().splitlines()[-1]}",
                               c.param) from None

    def _done(self, key: str, fut) -> None:
        with self._lock:
            self._inflight.pop(key, None)
        if fut.exception() is None:
            self._keep(key, fut.result())

    def _keep(self, key: str, g):
        """Cache g under key (once: the kept one is returned)."""
        with self._lock:
            if key in self._compiled:
                return self._compiled[key]
            self._compiled[key] = g
            self._bytes += g.memory_size_bytes
            while self._bytes > self.budget_bytes and len(self._compiled) > 1:
                _, old = self._compiled.popitem(last=False)
                self._bytes -= old.memory_size_bytes
        return g

    def bitmask(self, n: int) -> torch.Tensor:
        """An all-allowed bitmask [n, ceil(V / 32)] (int32, a bit per token)."""
        return torch.full((n, (self.vocab_size + 31) // 32), ALL_ALLOWED, dtype=torch.int32)


class _Tracked:
    """One sequence's matcher and the output tokens it has accepted (every one legal)."""

    def __init__(self, key: str, compiled):
        import xgrammar as xgr

        self.key = key
        self.matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)
        self.accepted: list[int] = []

    def sync(self, out: list[int]) -> bool:
        """Move the matcher to the state after ``out``; False when a token of it is forbidden (or comes
        after the end): the matcher then stands at the longest legal prefix."""
        n = _common_prefix(self.accepted, out)
        if n < len(self.accepted):
            self.matcher.rollback(len(self.accepted) - n)
            del self.accepted[n:]
        for t in out[n:]:
            if self.matcher.is_terminated() or not self.matcher.accept_token(t):
                return False
            self.accepted.append(t)
        return True


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


class SequenceMasks:
    """The grammar masks of sequences' next positions, for an engine (the verifier, a drafter): a
    matcher per sequence (at most ``max_seqs``, the least recently used dropped), each only a
    cache of the state its tokens reach."""

    def __init__(self, grammars: Grammars, max_seqs: int = 4096):
        self.grammars = grammars
        self.max_seqs = max_seqs
        self._seqs: OrderedDict[str, _Tracked] = OrderedDict()
        self._lock = threading.Lock()

    def has(self, c: Constraint) -> bool:
        """Whether a call carrying c can be served here (its spec, or its grammar compiled)."""
        return c.spec is not None or self.grammars.get(c.key) is not None

    def _tracked(self, seq_id: str, c: Constraint) -> _Tracked:
        with self._lock:
            t = self._seqs.pop(seq_id, None)
        if t is None or t.key != c.key:
            t = _Tracked(c.key, self.grammars.compile(c))
        with self._lock:
            self._seqs[seq_id] = t
            while len(self._seqs) > self.max_seqs:
                self._seqs.popitem(last=False)
        return t

    def masks(self, seq_id: str, c: Constraint, out: list[int], n: int) -> torch.Tensor:
        """Bitmasks [n, W] of the positions after out[:len(out) - n + 1 + i], i < n: ``out`` the
        sequence's output tokens through its drafts (n - 1 of them). Raises ``KeyError`` for a
        reference this replica has not compiled (the caller answers a cache miss)."""
        t = self._tracked(seq_id, c)
        bm = self.grammars.bitmask(n)
        base = len(out) - n + 1
        legal = t.sync(out[:base])
        for i in range(n):
            if i > 0:
                legal = legal and t.sync(out[: base + i])
            if not legal or t.matcher.is_terminated():
                break  # the rest stays all-allowed: nothing drawn there is emitted
            t.matcher.fill_next_token_bitmask(bm, i)
        return bm

    def forced(self, seq_id: str, c: Constraint, out: list[int], limit: int) -> list[int]:
        """The tokens the grammar forces after ``out``, at most ``limit``: while a position allows a single
        token, that token (a fixed key, a closing quote, the punctuation between fields)."""
        t = self._tracked(seq_id, c)
        if not t.sync(out):
            return []
        bm, got = self.grammars.bitmask(1), []
        while len(got) < limit and not t.matcher.is_terminated():
            t.matcher.fill_next_token_bitmask(bm, 0)
            allowed = unpack(bm, self.grammars.vocab_size)[0].nonzero()
            if allowed.numel() != 1 or not t.matcher.accept_token(int(allowed[0, 0])):
                break
            got.append(int(allowed[0, 0]))
            t.accepted.append(got[-1])
        return got

    def legal(self, seq_id: str, c: Constraint, out: list[int], drafts: list[int]) -> int:
        """How many of ``drafts`` (after the output ``out``) the grammar allows, from the first."""
        t = self._tracked(seq_id, c)
        if not t.sync(out):
            return 0
        t.sync(out + drafts)
        return len(t.accepted) - len(out)

    def release(self, seq_id: str) -> None:
        with self._lock:
            self._seqs.pop(seq_id, None)


_BITS = torch.arange(32, dtype=torch.int32)  # (moved to the mask's device when it is elsewhere)


def unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bitmask [n, W] -> bool [n, V]: True where the token is allowed."""
    bits = (bitmask.unsqueeze(-1) >> _BITS.to(bitmask.device)) & 1  # [n, W, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor | None, uniform_fallback: bool = False) -> torch.Tensor:
    """logits [n, V] with forbidden tokens at -inf (float32, a copy); unchanged without a mask.

    ``uniform_fallback``: a row where no allowed token has a finite logit (a draft head whose vocabulary
    misses every legal token) becomes uniform over the allowed tokens: a drafter's q only has to be the
    distribution its draft was drawn from."""
    if bitmask is None:
        return logits
    # (torch ops, within the engine's thread count: xgrammar's CPU kernel measured no faster on a quiet core and
    # far slower on a loaded one, docs/decisions/0034-grammar-masks.md)
    allowed = unpack(bitmask.to(logits.device), logits.shape[-1])
    out = logits.float().masked_fill(~allowed, float("-inf"))
    if uniform_fallback and float(out.max(-1).values.min()) == float("-inf"):  # (one reduction: the common case)
        empty = out.max(-1).values == float("-inf")  # [n]
        out[empty] = torch.zeros_like(out[empty]).masked_fill(~allowed[empty], float("-inf"))
    return out


def screened(propose):
    """A drafter's ``propose`` that answers a cache miss to each call whose constraint comes by hash
    only and is not compiled on this replica (its ``_gmasks``): the resend carries the spec."""

    @functools.wraps(propose)
    def wrapper(self, requests):
        masks = getattr(self, "_gmasks", None)
        missed = {r.seq_id for r in requests if r.grammar is not None and r.grammar.spec is None
                  and (masks is None or not masks.has(r.grammar))}
        if not missed:
            return propose(self, requests)
        kept = [r for r in requests if r.seq_id not in missed]
        rest = iter(propose(self, kept) if len(missed) < len(requests) else [])
        return [Proposal(r.seq_id, [], cache_miss=True) if r.seq_id in missed else next(rest) for r in requests]

    return wrapper
