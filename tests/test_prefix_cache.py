"""Prefix caching across requests: the block bookkeeping (reference counts, eviction, the budget), and
outputs identical with the cache on and off (a hit inside a block, after eviction, across salts)."""

import pytest
import torch

from configs import DraftModelConfig, SamplingParams, VerifierConfig
from core.kv_cache import PagedKVCache
from core.loop import step
from core.protocol import CacheMiss, prefix_hash
from core.sequence import Sequence
from drafter.model_drafter import ModelDrafter
from tests.helpers import tiny_llama
from tests.test_greedy_equivalence import TINY_TEXT
from verifier.engine import VerifierEngine

BS = 16


def pool(blocks: int, prefix_caching: bool = True) -> PagedKVCache:
    cfg = tiny_llama(64).config
    probe = PagedKVCache(cfg, 32, 2**20, torch.float32)
    return PagedKVCache(cfg, 64, blocks * probe.block_bytes, torch.float32, prefix_caching=prefix_caching)


def hold(cache: PagedKVCache, seq: str, tokens: list[int], salt=None):
    """A sequence's prefill as the engine does it, without the forward pass: claim, reserve, the rows
    written (the tokens), committed. -> the tokens it found cached."""
    slot = cache.claim(seq, 0, None, tokens, {seq}, salt)
    hit = slot.prefix_hit
    cache.reserve(seq, len(tokens), {seq})
    slot.tokens.extend(tokens[len(slot.tokens):])
    cache.commit(slot)
    return hit


def accounted(cache: PagedKVCache) -> bool:
    """Every block but block 0 is in exactly one place (``memory``): free, a table's own, cached, or set aside for
    states; a block in two tables is cached and counts them; the budget holds the K/V and the states."""
    held = [b for s in cache.slots.values() for b in s.blocks]
    shared = {b for b in held if held.count(b) > 1}
    m = cache.memory()
    return (m["leaked"] == m["double"] == 0 and m["free"] + m["own"] + m["cached"] + len(cache._ballast) == m["blocks"]
            and all(cache.refs(b) == held.count(b) for b in shared)
            and m["kv_bytes"] + m["ballast_bytes"] - len(cache._ballast) * cache.block_bytes <= m["budget_bytes"]
            and m["state_bytes"] <= m["ballast_bytes"])


def test_a_random_mix_of_prefixes_salts_states_and_evictions_keeps_every_block_accounted():
    """Many sequences sharing prefixes of a few system prompts, under two salts, with and without a head's
    states, in a pool too small for them: evicted, released, resent. Every block stays in one place."""
    import random

    rng = random.Random(5)
    cache = pool(24)
    D = cache.token_bytes // 4 // 4
    systems = [list(range(1000 * i, 1000 * i + 40)) for i in range(1, 4)]
    kept = 0
    for i in range(400):
        seq = f"s{rng.randrange(12)}"
        if rng.random() < 0.3 and seq in cache:
            cache.release(seq)
        else:
            tokens = rng.choice(systems) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 25))]
            layers = (1, 2) if rng.random() < 0.5 else ()
            try:
                slot = cache.claim(seq, 0, None, tokens, {seq}, rng.choice((None, "t")), layers=layers)
                cache.reserve(seq, len(tokens), {seq})
            except Exception as e:  # (a pool full of the current batch: the sequence is released)
                assert type(e).__name__ == "CacheFull", e
                continue
            slot.tokens.extend(tokens[len(slot.tokens):])
            if layers:
                slot.kept, slot.kept_from = torch.zeros(len(tokens), D), 0
            cache.commit(slot, layers=layers)
        assert accounted(cache), (i, cache.memory())
        kept = max(kept, len(cache._states))
    assert kept > 0
    assert cache.stats["prefix_evictions"] > 0 and cache.stats["evictions"] > 0 and cache.stats["prefix_hits"] > 0


def test_full_blocks_are_shared_and_counted():
    cache = pool(20)
    a = list(range(3, 43))  # 40 tokens: two full blocks
    assert hold(cache, "a", a) == 0
    first_two = cache.slots["a"].blocks[:2]
    assert [cache.refs(b) for b in first_two] == [1, 1]
    # b begins with a's 40 tokens then differs: it holds a's two full blocks, its own after them
    assert hold(cache, "b", a + [50, 51]) == 32
    assert cache.slots["b"].blocks[:2] == first_two and [cache.refs(b) for b in first_two] == [2, 2]
    assert cache.slots["b"].blocks[2] != cache.slots["a"].blocks[2]  # a's partial block is never shared
    assert accounted(cache)
    cache.release("a")
    assert [cache.refs(b) for b in first_two] == [1, 1] and cache.idle_blocks == 0
    cache.release("b")  # nobody holds them: cached, not freed
    assert [cache.refs(b) for b in first_two] == [0, 0] and cache.idle_blocks == 2 and accounted(cache)
    assert hold(cache, "c", a) == 32 and cache.idle_blocks == 0
    assert cache.stats["prefix_hits"] == 64 and cache.stats["prefix_queries"] == 40 + 42 + 40


def test_a_hit_leaves_one_token_to_feed_and_a_cached_block_is_never_written():
    cache = pool(20)
    a = list(range(3, 35))  # exactly two blocks
    hold(cache, "a", a)
    cache.release("a")
    # the same 32 tokens again: only the first block is taken (the last token is fed, its block recomputed)
    assert hold(cache, "b", a) == 16
    # a sequence cut back inside a cached block: a call from there is a miss; resent, it keeps the blocks before
    cache.release("b")
    hold(cache, "c", a + [60, 61])
    slot = cache.slots["c"]
    cached = slot.blocks[:2]
    with pytest.raises(CacheMiss):
        cache.claim("c", 20, prefix_hash(slot.tokens, 20), None, {"c"})
    slot = cache.claim("c", 0, None, a[:20] + [70, 71], {"c"})
    assert len(slot.tokens) == 16 and slot.blocks[0] == cached[0] and cached[1] not in slot.blocks
    assert accounted(cache)


def test_salts_share_nothing():
    cache = pool(20)
    a = list(range(3, 60))
    hold(cache, "a", a, salt="tenant-1")
    assert hold(cache, "b", a, salt="tenant-2") == 0
    assert hold(cache, "c", a) == 0  # no salt is a salt of its own
    assert hold(cache, "d", a, salt="tenant-1") == 48


def test_idle_blocks_go_first_least_recently_used_tail_first_within_the_budget():
    cache = pool(9)  # 8 blocks to hand out (block 0 is reserved)
    old, new = list(range(3, 35)), list(range(100, 132))
    hold(cache, "old", old + [1])
    cache.release("old")  # two idle blocks (and its partial third freed)
    hold(cache, "new", new + [1])
    cache.release("new")
    assert cache.idle_blocks == 4 and cache.free_blocks == 4 and accounted(cache)
    hold(cache, "live", list(range(200, 264)))  # the 4 free blocks
    assert cache.idle_blocks == 4 and cache.stats["prefix_evictions"] == 0
    hold(cache, "live2", list(range(300, 316)))  # one block more: the least recently used idle one, old's tail
    assert cache.stats["prefix_evictions"] == 1 and cache.stats["evictions"] == 0 and accounted(cache)
    assert cache.claim("probe", 0, None, old + [2], set()).prefix_hit == 16  # old's head is still cached
    cache.release("probe")
    assert cache.claim("probe", 0, None, new + [2], set()).prefix_hit == 32
    # a sequence needing more than the idle blocks takes them all, then evicts the least recently used
    # sequence, whose blocks stay cached but the one it needed
    cache.release("probe")
    hold(cache, "big", list(range(400, 464)))
    assert cache.stats["prefix_evictions"] == 5 and cache.stats["evictions"] == 1 and "live" not in cache.slots
    assert cache.idle_blocks == 3 and len(cache.slots["big"].blocks) == 4 and accounted(cache)


def test_a_heads_states_beside_cached_blocks_come_out_of_the_budget():
    cache = pool(9)  # 8 blocks to hand out
    D = cache.token_bytes // 4 // 2  # float32 states of half a block's bytes per block

    def hold_with_states(seq, tokens):
        slot = cache.claim(seq, 0, None, tokens, {seq}, layers=(1, 2))
        hit = slot.prefix_hit
        cache.reserve(seq, len(tokens), {seq})
        slot.tokens.extend(tokens[len(slot.tokens):])
        slot.kept, slot.kept_from = torch.arange(len(tokens) * D, dtype=torch.float32).view(-1, D), 0
        cache.commit(slot, layers=(1, 2))
        return hit

    def fill(seq, n):  # blocks of a sequence's own, not shared
        cache.claim(seq, 0, None, list(range(900, 900 + n)), {seq}, share=False)
        cache.reserve(seq, n, {seq})

    a = list(range(3, 67))  # four full blocks: two blocks' worth of states
    hold_with_states("a", a)
    assert len(cache._ballast) == 2 and cache.free_blocks == 2 and accounted(cache)
    assert torch.equal(cache.states_of(cache.slots["a"].blocks[:4]),
                       torch.arange(64 * D, dtype=torch.float32).view(-1, D))
    assert hold_with_states("b", a) == 48  # a hit with states for the same layers
    assert cache.claim("c", 0, None, a, set(), layers=(7,)).prefix_hit == 0  # not for other layers
    for seq in ("a", "b", "c"):
        cache.release(seq)
    fill("f1", 64)
    fill("f2", 48)  # the pool: idle blocks taken back, and the blocks their states had set aside with them
    assert cache.idle_blocks == 0 and not cache._states and not cache._ballast and cache.free_blocks == 1
    assert accounted(cache)
    # no room for states: the block is shared without them
    full = list(range(300, 316))
    hold_with_states("full", full)
    assert not cache._states and not cache._ballast and accounted(cache)
    assert cache.claim("d", 0, None, full + [1], set(), layers=(1, 2)).prefix_hit == 0
    assert cache.claim("e", 0, None, full + [1], set()).prefix_hit == 16


def test_without_prefix_caching_nothing_is_shared():
    cache = pool(20, prefix_caching=False)
    a = list(range(3, 60))
    hold(cache, "a", a)
    cache.release("a")
    assert hold(cache, "b", a) == 0 and cache.idle_blocks == 0 and accounted(cache)


# outputs with the cache on and off, on the engines


def engines(tiny_pair, prefix_caching: bool, budget_mb: float = 64, max_len: int | None = None):
    tok, t, d = tiny_pair
    ver = VerifierEngine(VerifierConfig(model="tiny", cache_budget_mb=budget_mb, prefix_caching=prefix_caching,
                                        max_model_len=max_len), model=t, tokenizer=tok)
    return ver, ModelDrafter(DraftModelConfig(model="tiny", cache_budget_mb=64, prefix_caching=prefix_caching), model=d)


def run(ver, dr, prompt: list[int], params: SamplingParams, k: int = 3, salt: str | None = None):
    """One request to the end, released. -> (output ids, prompt tokens its first verify found cached)."""
    s = Sequence(prompt, params, k, ver.tokenizer, ver.eos_ids, ver.max_len, cache_salt=salt)
    hits = []
    real = ver.verify

    def verify(reqs):
        out = real(reqs)
        hits.extend(r.prefix_hit for r in out if not r.cache_miss)
        return out

    ver.verify = verify  # the engine's own verify, its results read on the way
    try:
        while not s.done:
            step([s], dr if k else None, ver)
    finally:
        del ver.verify
        ver.release(s.seq_id)
        dr.release(s.seq_id)
    return s.output_ids, hits[0]


GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=20, ignore_eos=True)


def conversation(tok, n_turns=3):
    system = tok(TINY_TEXT[:300])["input_ids"][:70]
    return system, [tok(TINY_TEXT[300 + 40 * i:340 + 40 * i])["input_ids"][:9] for i in range(n_turns)]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [0, 3])
def test_multi_turn_outputs_are_the_same_with_the_cache_on_and_off(tiny_pair, params, k):
    tok = tiny_pair[0]
    on, off = engines(tiny_pair, True), engines(tiny_pair, False)
    system, turns = conversation(tok)
    history = list(system)
    for i, turn in enumerate(turns):
        history += turn
        got, hit = run(*on, history, params, k)
        want, none = run(*off, history, params, k)
        assert got == want and none == 0
        # the turn before held the history but its last token (never fed): its full blocks are hit, the
        # partial one recomputed
        assert hit == (0 if i == 0 else (len(history) - len(turn) - 1) // BS * BS)
        history += got
    # a prompt that leaves the conversation inside a block: the blocks before it
    branch = system[:37] + [9, 9, 9]
    assert run(*on, branch, params, k) == (run(*off, branch, params, k)[0], 32)
    if k:  # the draft model's blocks were shared too, with no more recomputes than without
        assert on[1].cache.stats["prefix_hits"] > 0 and off[1].cache.stats["prefix_hits"] == 0
        assert on[1].cache.stats["misses"] == off[1].cache.stats["misses"]


def test_a_hit_after_eviction_gives_the_same_output(tiny_pair):
    tok = tiny_pair[0]
    probe, _ = engines(tiny_pair, True)
    small = 5 * probe.cache.block_bytes / 2**20  # 4 blocks to hand out: one sequence of 64 tokens
    on = engines(tiny_pair, True, small, max_len=64)
    off = engines(tiny_pair, False)
    p = conversation(tok, 1)[0][:40]
    want = run(*off, p, SEEDED.model_copy(update={"max_tokens": 8}), 3)[0]
    assert run(*on, p, SEEDED.model_copy(update={"max_tokens": 8}), 3) == (want, 0)
    assert run(*on, p, SEEDED.model_copy(update={"max_tokens": 8}), 3) == (want, 32)  # cached
    other = tok(TINY_TEXT[400:])["input_ids"][:60]
    run(*on, other, GREEDY.model_copy(update={"max_tokens": 3}), 0)  # needs every block: p's are taken back
    assert on[0].cache.stats["prefix_evictions"] == 2
    assert run(*on, p, SEEDED.model_copy(update={"max_tokens": 8}), 3) == (want, 0)


def test_requests_with_different_salts_share_nothing(tiny_pair):
    tok = tiny_pair[0]
    on, off = engines(tiny_pair, True), engines(tiny_pair, False)
    p = conversation(tok)[0]
    want = run(*off, p, GREEDY)[0]
    assert run(*on, p, GREEDY, salt="a") == (want, 0)
    assert run(*on, p, GREEDY, salt="b") == (want, 0)
    assert run(*on, p, GREEDY) == (want, 0)
    assert run(*on, p, GREEDY, salt="a") == (want, len(p) // BS * BS)


def test_a_new_request_goes_to_the_replica_holding_its_prefix_unless_its_queue_is_long():
    from types import SimpleNamespace

    from deployments.affinity import CacheAffinityRouter, prompt_blocks

    def speculate(prompt, seq, salt=None):
        return SimpleNamespace(args=[prompt, None, seq], kwargs={"cache_salt": salt},
                               metadata=SimpleNamespace(call_method="speculate"))

    router = object.__new__(CacheAffinityRouter)
    router.initialize_state()
    r0, r1 = SimpleNamespace(replica_id="r0"), SimpleNamespace(replica_id="r1")
    system, other = list(range(3, 103)), list(range(200, 300))
    router.on_request_routed(speculate(system + [1, 2], "a"), "r0", None)
    router.on_request_routed(speculate(other + [1, 2], "b"), "r1", None)
    router.on_request_routed(speculate(system + [5], "c", salt="t"), "r1", None)

    def home(prompt, salt=None):
        return router._prefix_home(prompt_blocks(speculate(prompt, "new", salt)), [r0, r1])

    assert home(system + [7, 8, 9]) == "r0" and home(other + [7]) == "r1"
    assert home(system[:40] + other) == "r0"  # two of its twelve blocks: more than 10%
    assert home(system[:16] + other * 2) is None  # one block of thirteen: too little to prefer a replica
    assert home(system, salt="t") == "r1" and home(system, salt="u") is None  # prefixes are salted
    assert home(list(range(500, 600))) is None
    router._replica_queue_len_cache = {"r0": 5, "r1": 1}  # (Serve's cache of probed queue lengths)
    assert home(system) is None  # balanced against load
    router._replica_queue_len_cache = {"r0": 4, "r1": 1}
    assert home(system) == "r0"
    router._replicas, router._replica_id_set, router._queue_len_gauge_last_update = {}, set(), {}
    router.on_replica_actor_died("r0")  # its prefixes go with it, the others stay
    assert home(system) is None and home(other) == "r1" and home(system, salt="t") == "r1"


def test_prefix_cache_metrics_count_prompt_tokens_and_hits_once_per_choice():
    from core.protocol import StepInfo
    from deployments.vllm_metrics import Exporter

    x = Exporter("m", 2)  # no hub: the router keeps its own totals
    first, second = x.choice(40), x.choice(45)
    first.step(StepInfo(k=0, accepted=0), 1, 0.0)
    second.step(StepInfo(k=0, accepted=0, cached_tokens=32), 1, 0.0)
    second.step(StepInfo(k=2, accepted=1, cached_tokens=16), 2, 0.01)  # (a resend's hit: not the prompt's)
    first.end()
    second.end()
    text = x.local.exposition().decode()
    got = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
           if line.startswith("vllm:prefix_cache")}
    assert got['vllm:prefix_cache_queries_total{engine="0",model_name="m"}'] == 85
    assert got['vllm:prefix_cache_hits_total{engine="0",model_name="m"}'] == 32


def test_the_multi_turn_workload_shares_a_system_prompt_and_fits_the_pairs_context():
    from transformers import AutoTokenizer

    from bench.common import TARGET
    from bench.load import parse
    from bench.workloads import conversations

    tok = AutoTokenizer.from_pretrained(TARGET)
    args = parse(["--multi-turn", "--max-tokens", "8"])
    system, convs = conversations(tok, system_tokens=args.system_tokens, turn_tokens=args.turn_tokens)
    assert len(system) == 850 and len(convs) == 8 and all(len(c) == 5 for c in convs)
    turns = [t for c in convs for t in c]
    assert len({tuple(t) for t in turns}) == 40 and all(0 < len(t) <= 24 for t in turns)  # HumanEval tasks, no repeat
    assert len(system) + 5 * (24 + 8) + 8 + 1 <= 1024
    assert conversations(tok, system_tokens=850, turn_tokens=24) == (system, convs)  # the same tasks every run
    with pytest.raises(SystemExit):
        parse(["--multi-turn", "--max-tokens", "64"])


def test_a_drafter_pools_full_call_is_routed_by_its_context():
    from types import SimpleNamespace

    from deployments.affinity import CacheAffinityRouter, prompt_blocks

    def propose(tokens, seq, full=True, salt=None):
        r = SimpleNamespace(seq_id=seq, new_tokens=tokens, full=full, cache_salt=salt)
        return SimpleNamespace(args=[[r]], kwargs={}, metadata=SimpleNamespace(call_method="propose_bound"))

    router = object.__new__(CacheAffinityRouter)
    router.initialize_state()
    context = list(range(3, 70))
    router.on_request_routed(propose(context, "a"), "d1", None)
    assert router._prefix_home(prompt_blocks(propose(context + [1], "b")), []) == "d1"
    assert prompt_blocks(propose(context, "c", full=False)) == []  # a step: its sequence's home decides
    assert router._prefix_home(prompt_blocks(propose(context, "d", salt="t")), []) is None


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_head_drafts_from_a_hit_with_the_states_kept_beside_the_blocks(params):
    """The shipped target and its EAGLE-3 head, served by the loop in process: a conversation's turns hit the
    verifier's cache, the head gets the cached prefix's states from beside the blocks, and every turn's output
    is the one with the cache off."""
    import asyncio

    from bench.common import EAGLE3, TARGET
    from configs import Eagle3Config
    from core.loop import speculate_local
    from core.policy import FixedK
    from drafter.eagle3_drafter import Eagle3Drafter

    def pair(on: bool):
        ver = VerifierEngine(VerifierConfig(model=TARGET, dtype="float32", cache_budget_mb=64, max_model_len=512,
                                            prefix_caching=on, num_threads=1))
        return ver, Eagle3Drafter(Eagle3Config(model=EAGLE3, dtype="float32", cache_budget_mb=8, max_model_len=512,
                                               verifier_model=TARGET, num_threads=1))

    (on, dr_on), (off, dr_off) = pair(True), pair(False)
    tok = on.tokenizer
    history = tok("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n" * 3)["input_ids"][:70]
    for turn in range(3):
        history = history + tok(f"\n# turn {turn}: now the same for n = {turn}\n")["input_ids"]
        outs = []
        for ver, dr in ((on, dr_on), (off, dr_off)):
            s = Sequence(history, params.model_copy(update={"max_tokens": 12}), 4, ver.tokenizer, ver.eos_ids,
                         ver.max_len, seq_id=f"t{turn}-{id(ver)}")
            asyncio.run(speculate_local(s, dr, ver, FixedK(4)))
            outs.append(s)
        assert outs[0].output_ids == outs[1].output_ids
        assert outs[0].stats.as_dict()["num_draft_tokens"] > 0  # the head drafted
        # ... from the states it was given: none recomputed (a drafter miss's count depends on pre-drafts' timing)
        assert outs[0].cache_misses["states"] == outs[1].cache_misses["states"] == 0
        history += outs[0].output_ids
    assert on.cache.stats["prefix_hits"] >= 2 * 64 and off.cache.stats["prefix_hits"] == 0
    assert on.cache._states  # the states of cached blocks, kept for the head
