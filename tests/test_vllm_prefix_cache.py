"""vLLM's prefix caching with an EAGLE-3 head on the drafter pool (``backend: vllm``, ``vllm_loop: engine``).

A prompt block vLLM reads from its prefix cache is never computed, so its states come out of no pass:
the proposer keeps the states of the blocks it saw computed, by the chained hash of their tokens and
the request's cache_salt (``verifier.vllm_prefix_states``), and puts them before a hit's first
computed states. Here: the store's bookkeeping and the proposer's, without an engine; then, on vLLM
with the shipped pair's head, greedy the target's on hits (a repeat, a conversation's next turn
ending inside a block, another salt, a hit whose kept states were evicted) with the same accepted
drafts as the miss that computed them.
"""

import asyncio
import uuid

import numpy as np
import pytest
import torch

from configs import SamplingParams
from tests.test_eagle3 import HEAD, TARGET
from tests.test_vllm_eagle3 import CODE, HEAD_CFG, VERIFIER, K, _step
from tests.test_vllm_eagle3 import _proposer as eagle3_proposer
from verifier.vllm_prefix_states import PrefixStates

B = 4  # tokens per block in the bookkeeping tests


def _rows(lo: int, hi: int) -> torch.Tensor:
    """States whose row for position t holds t, in each of 3 layers."""
    return torch.arange(lo, hi, dtype=torch.float32).unsqueeze(1).repeat(1, 3)


def test_blocks_are_kept_once_whole_and_read_back_by_prefix_and_salt():
    tokens = np.arange(100, 130)
    store = PrefixStates(B, max_tokens=64)
    store.keep("a", "t1", tokens, 0, _rows(0, 6))  # a prefill of 6: one whole block, 2 positions in the tail
    store.keep("a", "t1", tokens, 6, _rows(6, 7))
    assert len(store.blocks) == 1
    store.keep("a", "t1", tokens, 7, _rows(7, 10))  # the second block completes
    assert len(store.blocks) == 2
    got = store.hit("b", "t1", tokens, 8)  # another request with the same 8 tokens first, same salt
    assert got is not None and got[:, 0].tolist() == list(range(8))
    assert store.hit("c", "t2", tokens, 8) is None  # another tenant: nothing
    assert store.hit("c2", None, tokens, 8) is None  # no salt is a salt of its own
    other = tokens.copy()
    other[5] = 0
    assert store.hit("d", "t1", other, 8) is None  # a different second block
    assert store.hit("d2", "t1", other, 4)[:, 0].tolist() == list(range(4))  # its first block is the same
    assert store.hit("e", "t1", tokens, 6) is None  # not whole blocks
    # b goes on from its hit: its next block is named after the hit's chain
    store.keep("b", "t1", tokens, 8, _rows(8, 12))
    assert store.hit("f", "t1", tokens, 12)[:, 0].tolist() == list(range(12))
    assert store.stats["prefix_states_missed"] == 4 and store.stats["prefix_states_hits"] == 3


def test_least_recently_used_blocks_go_first_and_gaps_stop_the_keeping():
    tokens = np.arange(40)
    store = PrefixStates(B, max_tokens=3 * B)
    store.keep("a", None, tokens, 0, _rows(0, 8))  # blocks 0, 1
    assert store.hit("b", None, tokens, 4) is not None  # block 0 read: now the most recent
    store.keep("c", None, tokens + 1000, 0, _rows(0, 8))  # two more blocks: one goes, block 1 (read longest ago)
    assert store.stats["prefix_states_evicted"] == 1
    assert store.hit("d", None, tokens, 4) is not None and store.hit("e", None, tokens, 8) is None
    # a recomputation from a block's start (a preempted request) replaces its chain from there
    store.keep("g", "s", tokens, 0, _rows(0, 6))
    store.keep("g", "s", tokens, 4, _rows(4, 8))
    assert store.hit("h", "s", tokens, 8)[:, 0].tolist() == list(range(8))
    store.keep("g", "s", tokens, 12, _rows(12, 16))  # a gap: nothing more kept for g
    store.keep("g", "s", tokens, 16, _rows(16, 20))
    assert store.hit("i", "s", tokens, 12) is None


def _proposer(rows: int, block: int = B):
    return eagle3_proposer(rows, PrefixStates(block, 1 << 10))


def test_a_hit_in_the_step_that_computes_its_blocks_gets_their_states():
    """vLLM lets a request read the blocks another computes in the same step: row 0 (a hit of 8 tokens)
    comes before row 1, whose prefill computes them; its states are put at the end of the step. A hit
    whose blocks are not kept loses its states (it decodes without drafts)."""
    prop = _proposer(2)
    tokens = np.tile(np.arange(100, 112), (2, 1))  # the same 11 prompt tokens, then the sampled one
    step = _step(prop, [list(range(8, 11)), list(range(11))], [0, 0])
    prop._keep_states("hit", 0, 1, 12, step, "s", tokens)
    prop._keep_states("first", 1, 1, 12, step, "s", tokens)
    prop._put_deferred()
    assert prop.states["hit"].rows(0, 11)[:, 0].tolist() == list(range(11)) == \
        prop.states["first"].rows(0, 11)[:, 0].tolist()
    # a chunked prefill after a hit starts where vLLM's cache left off
    step = _step(prop, [list(range(4, 6))], [0])
    prop._keep_states("chunked", 0, 0, 11, step, "s", tokens)
    prop._put_deferred()
    assert prop.states["chunked"].rows(0, 6)[:, 0].tolist() == list(range(6))
    step = _step(prop, [list(range(8, 11))], [0])  # under another salt nothing is kept: no states
    prop._keep_states("other", 0, 1, 12, step, "t", tokens)
    prop._put_deferred()
    assert prop.states["other"].broken


# ------------------------------------------------------------------ on vLLM, the shipped pair
SYSTEM = "\n".join(CODE) * 3
N = 24


@pytest.mark.long
def test_the_head_on_the_pool_drafts_from_vllms_prefix_cache_hits():
    """vLLM's prefix caching on with the head on the pool: a repeated prompt, a conversation's next turn
    (ending inside a block) and another tenant's request are the target's greedy, and a hit drafts: the
    repeat accepts the same drafts at every step as the miss that computed its states. A hit whose
    blocks' states were evicted decodes without drafts, still the target's."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from configs import VerifierConfig
    from core.eagle3 import check_head
    from deployments.drafter import DrafterServer
    from tests.test_processors import hf_greedy
    from verifier.vllm_engine import VllmVerifierEngine

    layers = tuple(check_head(HEAD, TARGET).aux_layer_ids)
    salt, other = uuid.uuid4().hex, uuid.uuid4().hex

    async def run(eng, ids, seq, salt):
        sp = eng.sampling_params(SamplingParams(temperature=0, ignore_eos=True, verification="rejection"),
                                 K, seq, 0, len(ids), N, None)
        got, spec, cached = [], None, {"tokens": 0}
        async for new, _, s in eng.generate(ids, sp, seq, salt, cached):
            got += new
            spec = s or spec
        return got, spec, cached["tokens"]

    async def vllm_path():
        dr = DrafterServer({**HEAD_CFG, "verifier_model": str(TARGET)})
        ep = await dr.endpoint()
        eng = VllmVerifierEngine(VerifierConfig.model_validate(VERIFIER), speculative=True, aux_layers=layers,
                                 per_step_metrics=True)
        bind = {"endpoints": [[ep.host, ep.port, ep.token.hex(), ep.replica]], "timeout_s": 30.0, "tree": 1,
                "speculate": "always"}
        try:
            await eng.bind(bind)
            tok = eng.tokenizer
            p1 = tok(SYSTEM + CODE[0])["input_ids"]
            out = {"miss": await run(eng, p1, "m", salt), "repeat": await run(eng, p1, "r", salt)}
            p2 = p1 + out["miss"][0] + tok("\n" + CODE[1])["input_ids"][1:]  # the next turn, with the history
            out["turn"] = await run(eng, p2, "t", salt)
            out["other"] = await run(eng, p1, "o", other)
            status = (await eng.proposer_status())[0]
            await eng.bind({**bind, "prefix_states_tokens": 32})  # room for one block: the others' go
            p3 = tok(CODE[2] + SYSTEM)["input_ids"]
            out["evicted"] = (await run(eng, p3, "e1", salt), await run(eng, p3, "e2", salt))
            return tok, (p1, p2, p3), out, status, (await eng.proposer_status())[0]
        finally:
            eng.shutdown()

    tok, (p1, p2, p3), out, status, after = asyncio.run(vllm_path())
    model = AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()
    blocks = lambda n: (n - 1) // 32 * 32  # noqa: E731 - vLLM's hit: whole blocks, the last token computed
    want1, want2, want3 = (hf_greedy(model, p, N) for p in (p1, p2, p3))
    assert out["miss"][0] == out["repeat"][0] == out["other"][0] == want1
    assert out["turn"][0] == want2
    assert (out["miss"][2], out["repeat"][2], out["other"][2]) == (0, blocks(len(p1)), 0)
    assert out["turn"][2] >= blocks(len(p1)) and len(p2) % 32, (out["turn"][2], len(p2))  # ends inside a block
    assert out["repeat"][1].per_step_accepted == out["miss"][1].per_step_accepted  # same states: same drafts
    assert out["turn"][1].num_draft_tokens > 0 and out["other"][1].num_draft_tokens > 0
    assert status["no_states"] == 0 and status["failures"] == 0, status
    assert status["prefix_states_hits"] == 2 and status["prefix_states_tokens"] >= 2 * blocks(len(p1)), status
    (first, first_spec, _), (again, again_spec, cached) = out["evicted"]
    assert first == again == want3 and first_spec.num_draft_tokens > 0
    assert cached == blocks(len(p3))  # vLLM's hit, its states gone: no drafts
    assert again_spec is None or again_spec.num_draft_tokens == 0, again_spec
    assert after["prefix_states_missed"] == status["prefix_states_missed"] + 1, after


# ------------------------------------------------------------------ kept or recomputed: the measurement
def measure(rounds: int = 5, n: int = 8) -> dict:
    """A conversation's first turn (the multi-turn workload's system prompt and a HumanEval turn) on vLLM with
    the head on the pool, then per round, alternating: its hit with the states kept (vLLM's prefix cache and
    the proposer's), the same request recomputing its prompt (``skip_reading_prefix_cache``: the pass a
    recomputation of the hit's states costs) and its uncached suffix alone; -> time to first token medians."""
    import statistics
    import time

    from transformers import AutoTokenizer

    from bench.common import TARGET as BENCH_TARGET
    from bench.workloads import conversations
    from configs import VerifierConfig
    from core.eagle3 import check_head
    from deployments.drafter import DrafterServer
    from verifier.vllm_engine import VllmVerifierEngine

    system, convs = conversations(AutoTokenizer.from_pretrained(BENCH_TARGET), system_tokens=850, turn_tokens=24)
    prompt, salt = system + convs[0][0], uuid.uuid4().hex

    async def ttft(eng, ids, seq, salt, recompute=False):
        sp = eng.sampling_params(SamplingParams(temperature=0, ignore_eos=True, verification="rejection"),
                                 K, seq, 0, len(ids), n, None)
        sp.skip_reading_prefix_cache = recompute
        t0, first, cached = time.perf_counter(), None, {"tokens": 0}
        async for new, _, _ in eng.generate(ids, sp, seq, salt, cached):
            first = first or (time.perf_counter() - t0 if new else None)
        return first, cached["tokens"]

    async def run():
        dr = DrafterServer({**HEAD_CFG, "verifier_model": str(TARGET)})
        ep = await dr.endpoint()
        eng = VllmVerifierEngine(VerifierConfig.model_validate({**VERIFIER, "max_model_len": 1024}),
                                 speculative=True, aux_layers=tuple(check_head(HEAD, TARGET).aux_layer_ids))
        try:
            await eng.bind({"endpoints": [[ep.host, ep.port, ep.token.hex(), ep.replica]], "timeout_s": 30.0,
                            "speculate": "always"})
            await ttft(eng, convs[1][0] * 4, "warm", None)
            times = {"miss": [(await ttft(eng, prompt, "miss", salt))[0]], "kept": [], "recomputed": [], "suffix": []}
            for r in range(rounds):
                t, hit = await ttft(eng, prompt, f"k{r}", salt)
                times["kept"].append(t)
                times["recomputed"].append((await ttft(eng, prompt, f"r{r}", salt, recompute=True))[0])
                times["suffix"].append((await ttft(eng, prompt[hit:], f"s{r}", uuid.uuid4().hex))[0])
            status = (await eng.proposer_status())[0]
        finally:
            eng.shutdown()
        return times, hit, status

    times, hit, status = asyncio.run(run())
    out = {f"ttft_ms_{name}": round(1000 * statistics.median(ts), 1) for name, ts in times.items()}
    return {**out, "prompt_tokens": len(prompt), "cached_tokens": hit, "no_states": status["no_states"],
            "prefix_states_hits": status["prefix_states_hits"]}


if __name__ == "__main__":
    print(measure())
