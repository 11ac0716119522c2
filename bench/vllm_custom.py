"""Spike for issue #18: vLLM as the verifier, drafting through its ``custom_class`` proposer.

vLLM 0.32 calls ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, ...)`` on the
proposer once per engine step, after sampling, and verifies what it returns in the next step.
The call carries each running request's token ids (``token_ids_cpu[i, :num_tokens_no_spec[i]]``,
the newly sampled tokens included) but no request id, sampling parameters or k per request, and
its drafts count as one-hot. ``SplitspecProposer`` answers it with splitspec's drafter through
the wire protocol (``core.protocol``), three ways:

- ``local``: a ``ModelDrafter`` in vLLM's own process (the interface's ceiling: no transport);
- ``channel``: a ``ModelDrafter`` in another process behind splitspec's direct channel
  (``core.channel``), as a drafter pool replica is reached from a verifier replica;
- ``channel`` with ``tree`` = m (``--trees``): as soon as a step's drafts are known, the pre-draft tree for
  the step after it (``core.loop.tree_branches``) is requested, so it is drafted on the other
  process while vLLM verifies; the next call answers at once when the outcome is a branch.

Requests are told apart by a hash of their first 32 tokens (vLLM gives no ids): the drafter's
cache protocol (prefix hashes) makes a collision a cache miss, never a wrong draft.

``python -m bench.vllm_custom`` measures, greedy, one stream, the same prompts through the same
subprocess client (``bench.vllm_peer``): vLLM plain, vLLM's in-engine ``draft_model`` k, and the
proposer's three ways at k, interleaved by prompt; per (prompt, repeat) the ratio to vLLM's
``draft_model``, then the median.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

from bench.common import (
    BENCH_DTYPE,
    DEFAULT_OUT,
    DRAFTER,
    ROOT,
    environment,
    load_prompts,
    log,
    median,
    paired_ratio,
    rnd,
    write_json,
)

ENV = "SPLITSPEC_PROPOSER"  # JSON: {"mode": "local"|"channel", "tree": m (-1: no pre-draft), endpoint...}


class SplitspecProposer:
    """vLLM ``custom_class`` proposer backed by splitspec's drafter (see the module docstring)."""

    def __init__(self, vllm_config):
        from configs import SamplingParams

        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.max_len = vllm_config.model_config.max_model_len
        cfg = json.loads(os.environ.get(ENV, '{"mode": "local"}'))
        self.tree = int(cfg.get("tree", -1))
        self.params = SamplingParams(temperature=0)
        self.held: dict[str, list[int]] = {}  # what the drafter holds of each request
        self.pending: dict[str, object] = {}  # request key -> core.loop.PreDraft in flight
        self.stats = {"calls": 0, "hits": 0, "misses": 0}
        if cfg.get("stats_path"):  # the engine's process is not ours to ask: leave the counts on exit
            import atexit

            atexit.register(lambda: Path(cfg["stats_path"]).write_text(json.dumps(self.stats)))
        if cfg["mode"] == "local":
            from configs import DraftModelConfig
            from drafter.model_drafter import ModelDrafter

            d = ModelDrafter(DraftModelConfig(model=cfg.get("drafter", DRAFTER), num_threads=1,
                                              dtype=cfg.get("dtype", BENCH_DTYPE), cache_budget_mb=64,
                                              max_model_len=self.max_len))
            self._call = d.propose
            self._submit = None
        else:
            from core.channel import ChannelClient, Endpoint

            ep = Endpoint(cfg["host"], cfg["port"], bytes.fromhex(cfg["token"]))
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, daemon=True, name="splitspec-channel").start()
            client = ChannelClient()

            def submit(reqs):
                return asyncio.run_coroutine_threadsafe(client.call(ep, "propose", reqs), loop)

            self._submit = submit
            self._call = lambda reqs: submit(reqs).result(timeout=10)

    def load_model(self, *args, **kwargs):  # vLLM's CPU runner calls it on every proposer
        pass

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **kwargs):
        from core.protocol import DraftRequest, common_prefix_len

        out: list[list[int]] = [[] for _ in sampled_token_ids]
        todo = []
        for i, sampled in enumerate(sampled_token_ids):
            n = int(num_tokens_no_spec[i])
            if not len(sampled) or n + self.k + 1 >= self.max_len:
                continue
            ctx = token_ids_cpu[i, :n].tolist()
            key = hashlib.blake2b(np.asarray(ctx[:32], dtype=np.int64).tobytes(), digest_size=8).hexdigest()
            pre = self.pending.pop(key, None)
            if pre is not None:
                branch = pre.branch_for(ctx)
                if branch is not None:
                    answer = pre.task.result(timeout=10)
                    p = answer.branches[branch] if answer.branches and branch < len(answer.branches) else None
                    if p is not None and p.tokens:
                        self.stats["hits"] += 1
                        self.held[key] = ctx[: p.cached]
                        out[i] = p.tokens[: self.k]
                        self._pre_draft(key, ctx, p)
                        continue
                self.stats["misses"] += 1
                pre.task.cancel()
            todo.append((i, key, ctx))
        if not todo:
            return out
        k = self.k + 1 if self.tree >= 0 else self.k  # one more: the guess of the bonus token
        alts = self.tree + 1 if self.tree > 0 else 0

        def request(key, ctx, full=False):
            if full:
                return DraftRequest(key, 0, None, ctx, k, self.params, 0, full=True, alternatives=alts)
            return DraftRequest.for_tokens(key, ctx, common_prefix_len(self.held.get(key, []), ctx), None, None, k=k,
                                           sampling=self.params, seed=0, alternatives=alts)

        self.stats["calls"] += 1
        props = self._call([request(key, ctx) for _, key, ctx in todo])
        missed = [(t, p) for t, p in zip(todo, props) if p.cache_miss]
        if missed:
            again = self._call([request(key, ctx, full=True) for (_, key, ctx), _ in missed])
            props = [p for p in props if not p.cache_miss] + again
            todo = [t for t, p in zip(todo, props) if not p.cache_miss] + [t for t, _ in missed]
        for (i, key, ctx), p in zip(todo, props):
            self.held[key] = (ctx + p.tokens)[: p.cached]
            out[i] = p.tokens[: self.k]
            self._pre_draft(key, ctx, p)
        return out

    def _pre_draft(self, key: str, ctx: list[int], p) -> None:
        """Request the tree for the step after the one these drafts go to, to run while vLLM verifies."""
        from core.loop import PreDraft, tree_branches
        from core.protocol import DraftRequest

        drafts = p.tokens[: self.k]
        if self._submit is None or self.tree < 0 or len(p.tokens) <= len(drafts):
            return
        branches = tree_branches(drafts, p, self.tree)
        context = ctx + drafts
        req = DraftRequest.for_tokens(key, context, min(len(context), p.cached), None, None, k=self.k + 1,
                                      sampling=self.params, seed=0, alternatives=self.tree + 1 if self.tree > 0 else 0,
                                      branches=[(len(ctx) + j, c) for j, c in branches])
        self.held[key] = context[: p.cached]
        self.pending[key] = PreDraft(ctx, drafts, branches, self._submit([req]))
        self.pending[key].task = _first(self.pending[key].task)


class _first:
    """A concurrent future of a one-element list, answering its element."""

    def __init__(self, fut):
        self.fut = fut

    def result(self, timeout=None):
        return self.fut.result(timeout)[0]

    def cancel(self):
        self.fut.cancel()


# ------------------------------------------------------------ the drafter process
def serve_drafter(argv=None):
    """A ModelDrafter behind a ChannelServer; prints its endpoint as one JSON line."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default=BENCH_DTYPE)
    ap.add_argument("--max-model-len", type=int, default=512)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    from concurrent.futures import ThreadPoolExecutor

    from configs import DraftModelConfig
    from core.channel import ChannelServer
    from drafter.model_drafter import ModelDrafter

    d = ModelDrafter(DraftModelConfig(model=DRAFTER, num_threads=1, dtype=args.dtype, cache_budget_mb=64,
                                      max_model_len=args.max_model_len))
    pool = ThreadPoolExecutor(1)  # one engine thread, calls in order (as a replica's batcher runs them)

    async def main():
        loop = asyncio.get_running_loop()

        async def propose(reqs):
            return await loop.run_in_executor(pool, d.propose, reqs)

        server = ChannelServer({"propose": propose})
        ep = await server.start("127.0.0.1")
        print(json.dumps({"host": ep.host, "port": ep.port, "token": ep.token.hex()}), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


# ------------------------------------------------------------ the measurement
def main(argv=None):
    from bench.common import vllm_python
    from bench.vllm_peer import VllmPeer

    ap = argparse.ArgumentParser(description="vLLM verifier with splitspec's drafter as a custom_class proposer.")
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--trees", default="1,2", help="m of the pre-draft trees of the channel+tree runs")
    ap.add_argument("--dtype", default=BENCH_DTYPE)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    py = vllm_python()
    if py is None:
        raise SystemExit("no interpreter here imports vllm")
    drafter = subprocess.Popen([py, "-m", "bench.vllm_custom", "serve-drafter", "--dtype", args.dtype], cwd=ROOT,
                               stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    try:
        endpoint = json.loads(drafter.stdout.readline())
        channel = {"mode": "channel", **endpoint}
        systems = {  # name: (k, method, proposer config)
            "vllm_plain": (0, "draft_model", None),
            "vllm_draft_model": (args.k, "draft_model", None),
            "custom_local": (args.k, "custom_class", {"mode": "local", "dtype": args.dtype}),
            "custom_channel": (args.k, "custom_class", {**channel, "tree": -1}),
        } | {f"custom_channel_tree_m{m}": (args.k, "custom_class", {**channel, "tree": m})
             for m in (int(x) for x in args.trees.split(","))}
        from transformers import AutoTokenizer

        from bench.common import TARGET

        prompts = load_prompts(args.prompts, AutoTokenizer.from_pretrained(TARGET))
        rows = {name: [] for name in systems}
        proposer_stats = {}  # the proposer's calls, pre-draft hits and misses, per system
        for name, (k, method, cfg) in systems.items():  # one engine at a time: they would share the two cores
            log(f"{name}: starting")
            stats_path = f"/tmp/splitspec-proposer-{os.getpid()}-{name}.json"
            env = {ENV: json.dumps({**cfg, "stats_path": stats_path})} if cfg else {}
            peer = VllmPeer(py, k, 1, dtype=args.dtype, method=method,
                            drafter="bench.vllm_custom.SplitspecProposer" if method == "custom_class" else DRAFTER,
                            env=env)
            try:
                peer.wait_ready()
                peer.run(prompts[0][1], 16, 0.0, 0)  # warm-up
                for rep in range(args.repeats):
                    for i, (_, ids) in enumerate(prompts):
                        r = peer.run(ids, args.max_tokens, 0.0, 0)
                        rows[name].append({"prompt": i, "repeat": rep, "ms_per_token": 1000 * r["wall_s"] / r["tokens"],
                                           "output_ids": r["output_ids"], "spec": r.get("spec")})
            finally:
                peer.close()
            if cfg and os.path.exists(stats_path):
                proposer_stats[name] = json.loads(Path(stats_path).read_text())
                os.remove(stats_path)
    finally:
        drafter.kill()
    base = rows["vllm_draft_model"]
    plain = rows["vllm_plain"]
    result = {"scenario": "vllm_custom_proposer", "config": vars(args), "systems": {}}
    for name, rs in rows.items():
        spec = rs[-1]["spec"] or {}
        result["systems"][name] = {
            "ms_per_token": rnd(median([r["ms_per_token"] for r in rs])),
            "vs_vllm_draft_model": paired_ratio(rs, base),
            "speedup_vs_vllm_plain": paired_ratio(plain, rs),
            "same_tokens_as_vllm_plain": rnd(sum(r["output_ids"] == p["output_ids"] for r, p in zip(rs, plain)) / len(rs)),
            "spec_counters_last_run": spec,
            "proposer": proposer_stats.get(name),
        }
    result["environment"] = environment(1)
    write_json(Path(args.out), "vllm_custom", result)
    for name, s in result["systems"].items():
        print(name, {k: v for k, v in s.items() if k != "spec_counters_last_run"})


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "serve-drafter":
        serve_drafter(sys.argv[2:])
    else:
        main()
