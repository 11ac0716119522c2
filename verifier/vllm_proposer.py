"""vLLM runs the speculative loop, the drafter pool drafts (``backend: vllm``, ``vllm_loop: engine``).

vLLM 0.32 calls a ``custom_class`` proposer once per engine step, after sampling, with every
running request's token ids; what it returns is verified in the next engine step by vLLM's own
rejection sampler, in the same batched forward as everything else (paged attention, continuous
batching, its kernels, CUDA graphs on GPUs). ``SplitspecProposer`` is that proposer: it lives in
vLLM's worker process and reaches splitspec's drafter pool over the direct channel
(``core.channel``), the same wire protocol and cache protocol as the verifier-side loop.

Glossary:
- row i: the i-th request of vLLM's input batch; ``token_ids_cpu[i, :num_tokens_no_spec[i]]`` is
  its context, the tokens sampled this step included;
- k: drafts asked for a request (``extra_args["splitspec"]["k"]``), at most the engine's
  ``num_speculative_tokens`` (k_max), fewer near the context limit;
- held: the tokens the drafter replica holds for a sequence (its cache protocol: a wrong guess is
  a cache miss and a resend, never a wrong draft);
- pre-draft: as soon as a step's drafts are known, the drafts for the step after it are asked for
  the likely outcomes (``core.loop.tree_branches``), so the drafter works while vLLM verifies; the
  next call answers at once when the outcome is one of the branches (a hit).

What vLLM's hook lacks, and how it is filled in:
- request ids and per-request settings: ``ProposerWorker`` (vLLM's ``worker_extension_cls``) hands
  the proposer the model runner, whose input batch names each row's request and whose request
  states carry its SamplingParams; the replica puts splitspec's settings for the request
  (sequence id, k, the drafter's sampling, seed, prompt length) in ``extra_args["splitspec"]``.
  A request without them is decoded without drafts.
- q: vLLM reads draft probabilities only from its own draft-model proposers; this proposer sets
  the runner's ``_draft_probs`` / ``_draft_prob_req_ids`` after proposing (the runner clears them
  before each ``propose`` and reads them in the next step's rejection sampler), so sampled
  requests are verified against the drafter's q instead of one-hot drafts. With tensor
  parallelism every rank runs the sampler on its own copy of q; only rank 0 calls the drafter
  pool (vLLM schedules rank 0's drafts), so with more than one rank drafts count as one-hot.
- where the drafter pool is: the verifier replica pushes drafter endpoints with
  ``collective_rpc("splitspec_bind", ...)`` and polls ``splitspec_status`` (failed endpoints,
  counters); an endpoint that fails is skipped behind a breaker and its sequences move to
  another one (a cache miss there); with none left, steps go on without drafts.
- the hook is synchronous: a step waits for its drafts, at most ``timeout_s``.
- an EAGLE-3 head's input, the target's aux hidden states: vLLM computes them for its own EAGLE-3
  once the runner's ``use_aux_hidden_state_outputs`` is on and the model's aux layers are set;
  ``load_model`` (vLLM calls it from the runner's ``load_model``, before the runner sets the
  layers up and before anything is compiled) turns them on for the head's layers
  (``additional_config["splitspec"]["aux_layers"]``, from ``core.eagle3``) and wraps the runner's
  ``propose_draft_token_ids``, which receives them, to hand them to ``propose``. Each step the
  proposer keeps the states of the positions vLLM kept (the fed tokens up to the accepted drafts)
  and sends the drafter the ones it lacks (``DraftRequest.aux``), as the verifier-side loop does
  with the transformers verifier's states.

Lossless: vLLM's rejection sampler accepts draft x with probability min(1, p(x) / q(x)) and
otherwise samples max(p - q, 0) (greedy: the argmax), which gives p exactly for any q the drafts
were really drawn from; the drafter draws them from q (greedy drafts: one-hot q).

Structured outputs: vLLM masks p with the request's grammar (its ``structured_outputs``) at every
position, and its scheduler drops the drafts from the first one the grammar forbids, sampling that
position from p instead of the residual max(p - q, 0). That is exact for one-hot q (an n-gram's
drafts, greedy), not for a sampled q that gave the forbidden draft mass; so the drafter is told the
grammar (``extra_args["splitspec"]["grammar"]``, to ``DraftRequest.grammar``) and draws under its
masks: every draft is legal and q is what it was drawn from.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import threading
import time
from concurrent.futures import Future

import torch

from core.channel import ChannelClient, Endpoint
from core.gate import BatchSpeculation
from core.grammar import Constraint
from core.policy import Breaker
from core.proposers import TREE_MAX_DRAFTER_BATCH, PreDraft, tree_branches
from core.protocol import DraftRequest, Proposal, common_prefix_len
from verifier import vllm_compat as compat
from verifier.vllm_compat import fix_cpu_expand_kernel
from verifier.vllm_prefix_states import PrefixStates

log = logging.getLogger(__name__)
KEY = "splitspec"  # the extra_args entry the replica fills in
DOWN_S = 30.0  # an endpoint whose channel failed is skipped at least this long
SLOW_S = 5.0  # one that did not answer within timeout_s


class States:
    """A sequence's aux hidden states, positions 0..n-1, kept on the host as the steps compute them
    (chunks, joined when read: a step appends in O(1)). vLLM computes a position's states once, so
    the proposer keeps them all for as long as the request runs: a drafter replica that lost the
    sequence (a restart, another replica) needs every row again."""

    def __init__(self):
        self.chunks: list[torch.Tensor] = []
        self.n = 0
        self.broken = False  # a step's states were missed: no drafts for this sequence from here on

    def put(self, start: int, rows: torch.Tensor):
        """The states of positions start..start + len(rows) - 1."""
        if self.broken or rows.shape[0] == 0:
            return
        if start > self.n:  # a gap: the positions between were computed without us
            self.lost()
            return
        if start < self.n:  # recomputed (a preempted request): the new rows replace the kept ones
            self.chunks, self.n = [self.all()[:start]], start
        self.chunks.append(rows)
        self.n += rows.shape[0]

    def lost(self):
        self.broken, self.chunks, self.n = True, [], 0

    def all(self) -> torch.Tensor:
        if len(self.chunks) > 1:
            self.chunks = [torch.cat(self.chunks)]
        return self.chunks[0]

    def rows(self, lo: int, hi: int) -> torch.Tensor | None:
        """Positions lo..hi-1 (a copy: a view would pickle the whole buffer), or None when they are
        not all kept."""
        if self.broken or hi > self.n or not self.chunks:
            return None
        return self.all()[lo:hi].clone()


class SplitspecProposer:
    """vLLM ``custom_class`` proposer backed by the drafter pool (see the module docstring)."""

    def __init__(self, vllm_config):
        self.k_max = vllm_config.speculative_config.num_speculative_tokens
        self.max_len = vllm_config.model_config.max_model_len
        self.tp = vllm_config.parallel_config.tensor_parallel_size
        self.runner = None  # set by ProposerWorker.splitspec_bind
        self.rank = 0
        self.endpoints: list[Endpoint] = []
        self.breakers: dict[Endpoint, Breaker] = {}
        self.timeout_s, self.tree = 2.0, 1
        self._pre_draft = True  # this step asks for the next step's pre-drafts
        self._q: dict[int, tuple[list[int], Proposal]] = {}  # row -> (drafts, proposal) of the rows that sample
        self.bound: dict[str, Endpoint] = {}  # seq id -> the drafter replica its calls go to
        # seq id -> what that replica holds of it: (n, tail), the first n accepted tokens then tail
        self.held: dict[str, tuple[int, list[int]]] = {}
        self.pending: dict[str, PreDraft] = {}  # seq id -> the pre-draft in flight
        self.seqs: dict[str, str] = {}  # vLLM request id -> seq id
        # seq id -> its accepted tokens and their prefix-hash links, kept as they grow: rebuilding
        # them for every row every step costs O(context) each, which grows into milliseconds on long contexts
        self.ctx: dict[str, list[int]] = {}
        self.chains: dict[str, list[bytes]] = {}
        self.choice = BatchSpeculation()  # speculate at this batch size or not, measured
        self.stats = {"off_steps": 0, "calls": 0, "rows": 0, "drafted": 0, "hits": 0, "misses": 0, "cache_misses": 0,
                      "failures": 0, "no_drafter": 0, "q_rows": 0, "no_states": 0, "aux_bytes": 0,
                      "propose_s": 0.0, "wait_s": 0.0}
        self.failed: list[str] = []  # endpoints that failed since the last consuming status call
        self._client: ChannelClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # an EAGLE-3 head on the drafter pool: the target layers whose input states it reads (() for other drafters)
        extra = getattr(vllm_config, "additional_config", None) or {}
        self.aux_layers = tuple(extra.get(KEY, {}).get("aux_layers", ()))
        self.states: dict[str, States] = {}  # seq id -> its aux states
        # the states of the prefixes vLLM caches, for its hits (made at bind: vLLM's blocks, as many as its KV cache)
        self._prefix_caching = bool(self.aux_layers) and bool(vllm_config.cache_config.enable_prefix_caching)
        self.prefix: PrefixStates | None = None
        self._deferred: list[tuple] = []  # this step's first states of hits, put once every row's are kept
        self._step = None  # this engine step's (aux states [T, layers * H], spec decode metadata), from the runner

    def load_model(self, *args, **kwargs):
        """vLLM's runners call it from their ``load_model``, with the target model, after the
        proposer is the runner's ``drafter``, before the runner sets up aux outputs and before the
        first forward (so before torch.compile and CUDA graph capture see the model)."""
        if not self.aux_layers:
            return
        runner = compat.calling_runner(self)
        compat.enable_aux_states(runner, self.aux_layers)  # the forward returns (hidden states, [aux per layer])
        compat.on_draft_step(runner, self._on_step)

    def _on_step(self, aux_hidden_states, spec_decode_metadata):
        """The runner's step, before it asks for drafts: its aux states for ``propose`` (which takes them)."""
        self._step = (torch.cat(aux_hidden_states, dim=-1), spec_decode_metadata) if aux_hidden_states else None

    # --- the replica's side (through ProposerWorker) --------------------------------------

    def bind(self, runner, rank: int, config: dict) -> dict:
        """``config``: {"endpoints": [[host, port, token hex, replica], ...], "timeout_s", "tree",
        "speculate": "measured" | "always"}."""
        self.runner, self.rank = runner, rank
        self.timeout_s = float(config.get("timeout_s", self.timeout_s))
        self.tree = int(config.get("tree", self.tree))
        self.choice.always = config.get("speculate", "measured") == "always"
        if self._prefix_caching:
            self._size_prefix_states(runner, config)
        if self.aux_layers:
            # a head pre-drafts only from its own outputs (the block's states do not exist yet), which costs
            # acceptance (docs/eagle3.md); here every step drafts from the target's states
            self.tree = -1
        eps = [Endpoint(h, int(p), bytes.fromhex(t), r) for h, p, t, r in config.get("endpoints", [])]
        gone = set(self.endpoints) - set(eps)
        self.endpoints = eps
        for s in [s for s, ep in self.bound.items() if ep in gone]:
            self._unbind(s)
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, daemon=True, name="splitspec-drafter").start()
            self._client = ChannelClient()
        return self.status()

    def status(self, consume: bool = False) -> dict:
        now = time.monotonic()
        failed = self.failed
        if consume:
            self.failed = []
        return {"rank": self.rank, "endpoints": len(self.endpoints),
                "open": sum(b.open(now) for b in self.breakers.values()), "failed": failed,
                "sequences": len(self.held), "pending": len(self.pending), "by_batch": self.choice.report(),
                **self.stats, **(self.prefix.stats if self.prefix is not None else {})}

    # --- vLLM's side ---------------------------------------------------------------------

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **kwargs):
        t0 = time.perf_counter()
        out: list[list[int]] = [[] for _ in sampled_token_ids]
        self._q = {}
        runner = self.runner
        if runner is None or self.rank != 0:
            return out
        req_ids = compat.request_ids(runner)
        self._forget(compat.requests(runner))
        rows = self._rows_to_draft(sampled_token_ids, num_tokens_no_spec, req_ids, token_ids_cpu)
        if not rows:
            self.choice._last = None  # nothing to measure across steps without drafts
            return out
        # the whole step speculates or not, by what each choice measured at this batch size
        spec = self.choice.use(len(sampled_token_ids), sum(len(s) for s in sampled_token_ids), time.perf_counter())
        if not spec:
            self.stats["off_steps"] += 1
            self._drop_pre_drafts()
            return out
        todo = self._take_pre_drafts(rows, token_ids_cpu, out)
        # pre-drafts double the drafter pool's work; past a few rows per step it cannot keep up with them
        self._pre_draft = len(rows) <= TREE_MAX_DRAFTER_BATCH
        if not self._pre_draft:
            self._drop_pre_drafts()
        if todo:
            self._draft(todo, out)
        if self._q:  # read by the runner's rejection sampler in the next step, by request id
            compat.set_draft_probs(runner, *self._q_tensor(out, req_ids))
            self._q = {}
        self.stats["propose_s"] += time.perf_counter() - t0
        return out

    def _rows_to_draft(self, sampled_token_ids, num_tokens_no_spec, req_ids, token_ids_cpu=None) -> list[tuple]:
        """(row, vLLM request id, settings, context length) of this step's rows that want drafts; an EAGLE-3
        head's rows also keep their target states (``_keep_states``) from the step's aux states."""
        runner = self.runner
        step, self._step = self._step, None
        if step is not None:  # to the host in one copy (on GPUs), the rows of every sequence sliced from it
            step = (step[0][: int(compat.query_start(runner)[len(sampled_token_ids)])].to("cpu"), step[1])
        rows = []
        for i, sampled in enumerate(sampled_token_ids):
            ex = compat.extra_args(runner, req_ids[i], KEY) if i < len(req_ids) else None
            n = int(num_tokens_no_spec[i])
            if ex and ex["k"] > 0 and self.aux_layers:
                self.seqs[req_ids[i]] = ex["seq"]
                self._keep_states(ex["seq"], i, len(sampled), n, step, ex.get("salt"), token_ids_cpu)
            if ex and len(sampled) and ex["k"] > 0 and n + 2 <= self.max_len:  # not a chunked prefill half-way
                rows.append((i, req_ids[i], ex, n))
        self._put_deferred()
        return rows

    def _take_pre_drafts(self, rows: list[tuple], token_ids_cpu, out: list[list[int]]) -> list[tuple]:
        """Fill ``out`` for the rows whose pre-draft holds; return the rows left to draft now, as
        (row, seq id, context, k, settings)."""
        todo = []
        for i, rid, ex, n in rows:
            seq = ex["seq"]
            self.seqs[rid] = seq
            ctx = self._context(seq, token_ids_cpu, i, n)
            k = min(ex["k"], self.k_max, self.max_len - n - 1)
            if self.aux_layers and (seq not in self.states or self.states[seq].n < n - 1):
                self.stats["no_states"] += 1  # a head drafts from the states of every token but the last
                continue
            self.stats["rows"] += 1
            pre = self.pending.pop(seq, None)
            if pre is not None:
                p = self._pre_drafted(pre, ctx)
                if p is not None:
                    self.stats["hits"] += 1
                    out[i] = p.tokens[:k]
                    self._keep(i, seq, ctx, k, p, ex)
                    continue
                self.stats["misses"] += 1
            todo.append((i, seq, ctx, k, ex))
        return todo

    def _draft(self, todo, out):
        """One call per drafter endpoint for the rows without a pre-draft hit; a cache miss is resent
        in full; an endpoint that fails leaves its rows without drafts this step."""
        now = time.monotonic()
        live = [ep for ep in self.endpoints if not (ep in self.breakers and self.breakers[ep].open(now))]
        if not live:
            self.stats["no_drafter"] += len(todo)
            return
        groups: dict[Endpoint, list] = {}
        for t in todo:
            ep = self.bound.get(t[1])
            if ep not in live:
                self._unbind(t[1])
                ep = self.bound[t[1]] = live[hash(t[1]) % len(live)]
            groups.setdefault(ep, []).append(t)
        self.stats["calls"] += 1
        futs = {ep: self._call(ep, "propose", [self._request(t) for t in ts]) for ep, ts in groups.items()}
        for ep, ts in groups.items():
            props = self._result(ep, futs[ep])
            if props is None:
                continue
            missed = [t for t, p in zip(ts, props) if p.cache_miss]
            if missed:
                self.stats["cache_misses"] += len(missed)
                again = self._result(ep, self._call(ep, "propose", [self._request(t, full=True) for t in missed]))
                if again is None:
                    continue
                redo = iter(again)
                props = [next(redo) if p.cache_miss else p for p in props]
            for (i, seq, ctx, k, ex), p in zip(ts, props):
                if not p.cache_miss:
                    out[i] = p.tokens[:k]
                    self._keep(i, seq, ctx, k, p, ex)

    def _draft_kw(self, ex: dict, k: int) -> dict:
        """A drafter call's fields for a request: k drafts, its sampling, seed and prompt length, the
        alternatives a pre-draft tree needs, and a structured output's constraint (by hash)."""
        c = _constraint(ex)
        return dict(k=k, sampling=_params(ex), seed=ex["seed"], num_prompt=ex.get("num_prompt", 0),
                    alternatives=self.tree + 1 if self.tree > 0 else 0, grammar=None if c is None else c.ref())

    def _request(self, t, full: bool = False) -> DraftRequest:
        _, seq, ctx, k, ex = t
        # one more than k with pre-drafting: the guess of the bonus token the tree starts from
        kw = self._draft_kw(ex, k + 1 if self.tree >= 0 else k)
        if full:
            req = DraftRequest(seq, 0, None, list(ctx), full=True, **kw)  # (ctx grows in place next step)
            req.grammar = _constraint(ex)  # whole: the replica may not have compiled it
        else:
            req = DraftRequest.for_tokens(seq, ctx, self._held_prefix(seq, ctx), self.chains.setdefault(seq, [b""]),
                                          len(ctx), **kw)
        if self.aux_layers:  # the rows the drafter lacks: from g_{start - 1} (its row `start`) to g_{n - 2}
            lo = max(0 if req.full else req.start - 1, 0)
            req.aux, req.aux_start = self.states[seq].rows(lo, len(ctx) - 1), lo
            self.stats["aux_bytes"] += req.aux.numel() * req.aux.element_size()
        return req

    def _keep_states(self, seq: str, row: int, num_sampled: int, n: int, step, salt: str | None = None,
                     token_ids_cpu=None):
        """Keep the aux states of the positions this step computed and kept for row ``row``: its fed
        tokens up to the accepted drafts (the rejected drafts' are dropped). ``n``: the row's tokens now,
        the sampled ones included (whose states the next step computes). Without this step's states (vLLM
        skipped drafting for the whole batch) the sequence stops drafting: its states would have a gap. With
        prefix caching, a sequence's first states after a hit follow the hit's kept ones (``_put_states``)."""
        states = self.states.setdefault(seq, States())
        if step is None:
            states.lost()
            return
        aux, meta = step
        qsl = compat.query_start(self.runner)
        lo, fed = int(qsl[row]), int(qsl[row + 1] - qsl[row])
        if num_sampled:  # the fed tokens are the last token, then drafts, of which num_sampled - 1 were accepted
            drafts = meta.num_draft_tokens[row] if meta is not None and row < len(meta.num_draft_tokens) else 0
            kept = fed - drafts + num_sampled - 1
            start = n - 1 - kept
        else:  # a prefill chunk, more to come: all kept, from the first position the step fed
            kept, start = fed, compat.computed_tokens(self.runner, row)
        self._put_states(seq, states, start, aux[lo: lo + kept].clone(), salt,  # (not a view of the step's buffer)
                         None if token_ids_cpu is None else token_ids_cpu[row])

    def _put_states(self, seq: str, states: States, start: int, rows: torch.Tensor, salt: str | None, tokens):
        """Keep a row's states, and the blocks they complete by prefix (``PrefixStates``). A sequence's first
        states starting past 0 follow a hit in vLLM's prefix cache: deferred to the end of the step, when the
        rows that computed the hit's blocks in this same step (vLLM lets a request read them) are kept too."""
        if self.prefix is None or tokens is None:
            states.put(start, rows)
        elif start > 0 and states.n == 0 and not states.broken:
            self._deferred.append((seq, states, start, rows, salt, tokens))
        else:
            states.put(start, rows)
            if not states.broken:
                self.prefix.keep(seq, salt, tokens, start, rows)

    def _put_deferred(self):
        """The first states of this step's hits: after the hit's kept states, or none (no drafts for them)."""
        for seq, states, start, rows, salt, tokens in self._deferred:
            prefix = self.prefix.hit(seq, salt, tokens, start)
            if prefix is None:
                states.lost()
                continue
            states.put(0, prefix)
            self._put_states(seq, states, start, rows, salt, tokens)
        self._deferred = []

    def _size_prefix_states(self, runner, config: dict):
        """Room for as many tokens' states as vLLM's KV cache holds (or ``prefix_states_tokens``), by vLLM's blocks."""
        block, blocks = compat.kv_blocks(runner)
        if self.prefix is None:
            self.prefix = PrefixStates(block, block)
        tokens = config.get("prefix_states_tokens")
        if tokens is None:
            tokens = blocks * block or 1 << 16
        self.prefix.resize(int(tokens))

    def _held_prefix(self, seq: str, ctx: list[int]) -> int:
        """How many of ctx's tokens the bound drafter replica holds. ctx only grows, so its first n
        tokens are still those recorded: only the tail (drafts past them) is compared, O(k)."""
        n, tail = self.held.get(seq, (0, []))
        return n + common_prefix_len(tail, ctx[n: n + len(tail)])

    def _context(self, seq: str, token_ids_cpu, row: int, n: int) -> list[int]:
        """The sequence's n accepted tokens: the kept list, extended by what vLLM accepted since
        (accepted tokens never change: a sequence whose kept tokens no longer match is rebuilt)."""
        ctx = self.ctx.get(seq)
        if ctx is None or len(ctx) > n or (ctx and int(token_ids_cpu[row, len(ctx) - 1]) != ctx[-1]):
            self.chains.pop(seq, None)
            self.held.pop(seq, None)  # (recorded against the old tokens: the next call resends them all)
            ctx = self.ctx[seq] = token_ids_cpu[row, :n].tolist()
        elif len(ctx) < n:
            ctx += token_ids_cpu[row, len(ctx):n].tolist()
        return ctx

    def _keep(self, row: int, seq: str, ctx: list[int], k: int, p: Proposal, ex: dict):
        """Record what the drafter holds, q for the runner, and ask for the next step's pre-draft."""
        drafts = p.tokens[:k]
        self.held[seq] = (min(len(ctx), p.cached), p.tokens[: max(0, p.cached - len(ctx))])
        self.stats["drafted"] += len(drafts)
        if drafts and self.tp == 1 and not _params(ex).greedy:
            self._set_q(row, drafts, p)
        if self.tree < 0 or not self._pre_draft or len(p.tokens) <= len(drafts) or seq not in self.bound:
            return
        branches = tree_branches(drafts, p, self.tree)
        context = ctx + drafts
        req = DraftRequest.for_tokens(seq, context, min(len(context), p.cached), self.chains.setdefault(seq, [b""]),
                                      len(ctx), branches=[(len(ctx) + j, c) for j, c in branches],
                                      **self._draft_kw(ex, k + 1))
        ep = self.bound[seq]
        self.pending[seq] = PreDraft(ctx, drafts, branches, self._call(ep, "propose", [req]))
        self.pending[seq].endpoint = ep

    def _pre_drafted(self, pre: PreDraft, ctx: list[int]) -> Proposal | None:
        b = pre.branch_for(ctx)
        if b is None:
            pre.task.cancel()
            return None
        answer = self._result(pre.endpoint, pre.task)
        p = answer[0].branches[b] if answer and answer[0].branches and b < len(answer[0].branches) else None
        return p if p is not None and p.tokens and not p.cache_miss else None

    def _set_q(self, row: int, drafts: list[int], p: Proposal):
        self._q[row] = (drafts, p)
        self.stats["q_rows"] += 1

    def _q_tensor(self, out: list[list[int]], req_ids) -> tuple[torch.Tensor, list[str]]:
        """q for the runner: one row per request with drafts (the runner drops q for the whole batch
        if one is missing; greedy rows stay zero, their verification never reads q), as long as
        this step's longest drafts. [rows with drafts, max drafts, V], not [batch, k_max, V]: at
        batch 64 and k_max 8 with a 152k vocabulary that is 311 MB a step when any row samples."""
        rows = [i for i, d in enumerate(out) if d]
        V = compat.vocab_size(self.runner)
        q = torch.zeros(len(rows), max(len(out[i]) for i in rows), V, device=self.runner.device)
        for slot, i in enumerate(rows):
            got = self._q.get(i)
            if got is None:
                continue
            drafts, p = got
            if p.probs is not None:  # [k, V], the drafter's sparse q made dense
                q[slot, : len(drafts)] = p.probs.head(len(drafts)).dense(V).to(q.device)
            else:  # drafts without q (an n-gram drafter): drawn deterministically, one-hot
                q[slot, torch.arange(len(drafts)), torch.tensor(drafts)] = 1.0
        return q, [req_ids[i] for i in rows]

    # --- transport ------------------------------------------------------------------------

    def _call(self, ep: Endpoint, method: str, *args) -> Future:
        """A channel call on the proposer's event loop thread (vLLM calls ``propose`` synchronously)."""
        return asyncio.run_coroutine_threadsafe(self._client.call(ep, method, *args), self._loop)

    def _result(self, ep: Endpoint, fut: Future) -> list[Proposal] | None:
        t0 = time.perf_counter()
        try:
            out = fut.result(timeout=self.timeout_s)
        except (OSError, TimeoutError) as e:  # gone, broken or late: this step goes on without it
            fut.cancel()
            self._failed(ep, e, slow=isinstance(e, TimeoutError))
            return None
        except Exception as e:  # noqa: BLE001 - the replica answered with an error: this step only
            if type(e).__name__ == "Overloaded":  # full: leave it alone briefly, as a late one
                self._failed(ep, e, slow=True)
            else:
                log.warning("drafter %s:%d answered with an error: %r", ep.host, ep.port, e)
                self.stats["failures"] += 1
            return None
        finally:
            self.stats["wait_s"] += time.perf_counter() - t0
        if ep in self.breakers:
            self.breakers[ep].succeeded()
        return out

    def _failed(self, ep: Endpoint, e: BaseException, slow: bool):
        log.warning("drafter %s:%d failed (%r): its sequences move to another", ep.host, ep.port, e)
        self.stats["failures"] += 1
        self.breakers.setdefault(ep, Breaker(max_backoff_s=300.0)).failed(time.monotonic(), SLOW_S if slow else DOWN_S)
        self.failed.append(f"{ep.host}:{ep.port}")
        for s in [s for s, b in self.bound.items() if b == ep]:
            self._unbind(s)

    def _drop_pre_drafts(self):
        for seq in list(self.pending):
            self.pending.pop(seq).task.cancel()

    def _unbind(self, seq: str):
        self.bound.pop(seq, None)
        self.held.pop(seq, None)
        pre = self.pending.pop(seq, None)
        if pre is not None:
            pre.task.cancel()

    def _forget(self, requests):
        """Drop the state of requests vLLM no longer runs (finished, aborted), and free their caches on
        the drafter replicas that hold them (Serve's router does not know where: it never placed them)."""
        for rid in [r for r in self.seqs if r not in requests]:
            seq = self.seqs.pop(rid)
            ep = self.bound.get(seq)
            self._unbind(seq)
            self.ctx.pop(seq, None)
            self.chains.pop(seq, None)
            self.states.pop(seq, None)
            if self.prefix is not None:
                self.prefix.forget(seq)
            if ep is not None:
                # best effort: an unreleased cache is evicted
                self._call(ep, "release", [seq]).add_done_callback(lambda f: f.exception())


_PARAMS: dict[bytes, object] = {}


def _params(ex: dict):
    """The request's sampling parameters for the drafter (``configs.SamplingParams``, pickled by
    the replica: this module stays free of pydantic), unpickled once per distinct value."""
    blob = ex["sampling"]
    p = _PARAMS.get(blob)
    if p is None:
        if len(_PARAMS) > 4096:
            _PARAMS.clear()
        p = _PARAMS[blob] = pickle.loads(blob)
    return p


_CONSTRAINTS: dict[tuple[str, str], Constraint] = {}


def _constraint(ex: dict) -> Constraint | None:
    """The request's structured output (see the module docstring), hashed once per distinct value."""
    g = ex.get("grammar")
    if g is None:
        return None
    key = (g[0], g[1])
    c = _CONSTRAINTS.get(key)
    if c is None:
        if len(_CONSTRAINTS) > 1024:
            _CONSTRAINTS.clear()
        c = _CONSTRAINTS[key] = Constraint(*key)
    return c


class ProposerWorker:
    """vLLM ``worker_extension_cls``: methods the replica calls on every worker through
    ``collective_rpc`` (they run in the worker, where the runner and the proposer live)."""

    def splitspec_bind(self, config: dict) -> dict:
        runner = self.model_runner
        prop = getattr(runner, "drafter", None)
        if str(runner.device) == "cpu" and fix_cpu_expand_kernel():
            self.splitspec_fixed = ["expand_kernel"]
        if not isinstance(prop, SplitspecProposer):
            raise RuntimeError("the engine's proposer is not splitspec's (speculative_config.method custom_class)")
        rank = compat.tensor_parallel_rank()
        return {**prop.bind(runner, rank, config), "fixed": getattr(self, "splitspec_fixed", [])}

    def splitspec_status(self, consume: bool = False) -> dict:
        prop = getattr(self.model_runner, "drafter", None)
        return prop.status(consume) if isinstance(prop, SplitspecProposer) else {}
