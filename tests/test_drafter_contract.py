"""The drafter contract: every method the registry names (drafter/registry.py) passes the same tests.

- its record's parts load, and its config class selects it;
- greedy speculative decoding equals the target's own greedy generate, in the loop that serves (pre-drafting on)
  and in the lockstep batched loop;
- a call for a sequence the drafter does not hold is a cache miss, and the whole-sequence resend drafts;
- a batched pass that fails is retried for each sequence alone, and a sequence that fails alone decodes
  without drafts while the others still draft;
- pre-drafts are of the kind the method declares (trees or chains), answered without error, and change no token;
- sampled at T = 0.8, the output is the target's exact distribution (chi-square, ``heavy``);
- served over HTTP with the official client, greedy equals the target (the heads' apps are ``long``).

A method added to the registry without a world here fails ``test_every_method_has_a_contract_world``.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

import pytest
import torch

from configs import DraftModelConfig, Eagle3Config, NgramConfig, SamplingParams, VerifierConfig
from core.loop import generate, speculate, speculate_local, step
from core.policy import Breaker, FixedK
from core.registry import load
from core.sequence import Sequence
from drafter.base import BatchedDrafter
from drafter.registry import METHODS, method
from tests.helpers import TINY_TEXT
from tests.test_processors import hf_greedy

NAMES = list(METHODS)
MAX_NEW = 32


class World(NamedTuple):
    """A target, its verifier engine and one method's drafter, built so that drafts are often accepted."""

    tok: object
    target: object  # the transformers model whose greedy generate is the reference
    ver: object
    drafter: object
    texts: list[str | list[int]]  # the prompts: texts, or token ids
    pre_draft_hits: bool  # whether its pre-drafts can be taken (a method that declines them: False)


def _draft_model_world(tiny_pair, name: str) -> World:
    """The tiny peaked target and a noisy copy of it."""
    from drafter.model_drafter import ModelDrafter
    from verifier.engine import VerifierEngine

    tok, target, draft = tiny_pair
    ver = VerifierEngine(VerifierConfig(model="tiny", cache_budget_mb=64), model=target, tokenizer=tok)
    dr = ModelDrafter(DraftModelConfig(model="tiny", cache_budget_mb=64), model=draft)
    return World(tok, target, ver, dr, [TINY_TEXT[a:a + 30] for a in (0, 200, 400)], True)


def _bigram_world(tiny_pair, drafter) -> World:
    """A target whose next token depends on the current one alone (``tests.test_dflash.bigram_target``), and prompts
    that repeat themselves, as code does: the target's own chain from a token x, then x again (so its output
    is the chain once more, which a drafter that looks the sequence up can follow)."""
    from tests.test_dflash import bigram_target
    from verifier.engine import VerifierEngine

    tok = tiny_pair[0]
    target = bigram_target(tok)
    ver = VerifierEngine(VerifierConfig(model="tiny", dtype="float32", cache_budget_mb=64), model=target, tokenizer=tok)
    prompts = [[x, *hf_greedy(target, [x], 12), x] for x in (tok("def")["input_ids"][0], 40, 77)]
    return World(tok, target, ver, drafter, prompts, True)


def _ngram_world(tiny_pair, name: str) -> World:
    from drafter.ngram import NgramDrafter

    return _bigram_world(tiny_pair, NgramDrafter(NgramConfig(max_n=3)))


def _eagle3_world(tiny_pair, name: str) -> World:
    """The shipped tiny-code target and the EAGLE-3 head trained for it."""
    from drafter.eagle3_drafter import Eagle3Drafter
    from tests.test_eagle3 import HEAD, TARGET
    from tests.test_eagle3_serving import CODE
    from verifier.engine import VerifierEngine

    ver = VerifierEngine(VerifierConfig(model=str(TARGET), dtype="float32", cache_budget_mb=64, num_threads=1))
    dr = Eagle3Drafter(Eagle3Config(model=str(HEAD), dtype="float32", cache_budget_mb=16, verifier_model=str(TARGET)))
    return World(ver.tokenizer, ver.model, ver, dr, CODE[:3], True)


def _parallel_world(tiny_pair, name: str) -> World:
    """A target whose next token depends on the current one alone, and a head built to copy it (``tests.test_dflash``).
    The head declines chain pre-drafts (no states exist for the guessed block)."""
    from tests.test_dflash import bigram_target, copying_head, drafter
    from verifier.engine import VerifierEngine

    tok = tiny_pair[0]
    target = bigram_target(tok)
    ver = VerifierEngine(VerifierConfig(model="tiny", dtype="float32", cache_budget_mb=64), model=target, tokenizer=tok)
    dr = drafter(name, copying_head(target, name, tok.pad_token_id))
    return World(tok, target, ver, dr, ["def add(a, b):", "class Point:", "for i in range(10):"], False)


def _peagle_world(tiny_pair, name: str) -> World:
    """The shipped target and a P-EAGLE head made from its EAGLE-3 head (``tests.peagle_heads``); pre-drafts
    declined."""
    from tests.peagle_heads import contract_world

    return World(*contract_world())


def _mtp_world(tiny_pair, name: str) -> World:
    """A GLM-4.5 target and its own MTP layer, built to copy it (``tests.mtp_models``); its pre-drafts are taken."""
    from tests.mtp_models import contract_world

    return World(*contract_world(tiny_pair[0]))


WORLDS = {"draft_model": _draft_model_world, "ngram": _ngram_world, "eagle3": _eagle3_world, "dflash": _parallel_world,
          "dspark": _parallel_world, "peagle": _peagle_world, "mtp": _mtp_world}


@pytest.fixture(scope="module")
def world(tiny_pair):
    """world(name) -> that method's World, built once per module."""
    built = {}

    def get(name: str) -> World:
        if name not in built:
            built[name] = WORLDS[name](tiny_pair, name)
        return built[name]

    return get


def _greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def _prompts(w: World) -> list[list[int]]:
    return [list(t) if isinstance(t, list) else w.tok(t)["input_ids"] for t in w.texts]


_REFS: dict[tuple, list[int]] = {}


def _refs(w: World) -> list[list[int]]:
    """The target's own greedy outputs for the world's prompts (computed once)."""
    keys = [(id(w.target), tuple(p)) for p in _prompts(w)]
    for key in keys:
        if key not in _REFS:
            _REFS[key] = hf_greedy(w.target, list(key[1]), MAX_NEW)
    return [_REFS[key] for key in keys]


class Recorder:
    """A drafter whose calls are recorded (request, proposal), with ``before(requests)`` run before each call."""

    def __init__(self, inner, before=None):
        self.inner, self.before, self.calls = inner, before, []

    def propose(self, requests):
        if self.before is not None:
            self.before(requests)
        props = self.inner.propose(requests)
        self.calls.extend(zip(requests, props))
        return props

    def __getattr__(self, name):
        return getattr(self.inner, name)


# ------------------------------------------------------------ the registry
def test_every_method_has_a_contract_world():
    assert set(WORLDS) == set(METHODS), "a registered method needs a world here (and so runs the whole contract)"
    with pytest.raises(ValueError, match="unknown drafter method 'nope': one of draft_model, ngram"):
        method("nope")


@pytest.mark.parametrize("name", NAMES)
def test_the_methods_record_loads_and_its_config_selects_it(name):
    m = method(name)
    config = load(m.config)
    assert name in config.model_fields["method"].annotation.__args__  # (Literal[...] of the method names)
    assert callable(load(m.drafter))
    for path in (m.check, m.max_k):
        assert path is None or callable(load(path))
    assert m.pre_draft in ("tree", "chain") and not (m.lm and m.head)
    assert ("verifier_model" in config.model_fields) == m.head  # a head's config may name its verifier


# ------------------------------------------------------------ greedy
@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_the_targets_generate_in_both_loops(world, name):
    check_greedy(world(name), name)


def check_greedy(w: World, name: str) -> None:
    refs = _refs(w)
    drafted = 0
    for i, (p, ref) in enumerate(zip(_prompts(w), refs)):  # the loop that serves: policy, pre-drafting
        seq = Sequence(p, _greedy(), 4, w.tok, w.ver.eos_ids, w.ver.max_len, seq_id=f"{name}-g{i}")
        asyncio.run(speculate_local(seq, w.drafter, w.ver, FixedK(4)))
        assert seq.output_ids == ref, (name, w.texts[i])
        drafted += seq.stats.num_draft_tokens
        assert w.ver.num_cached() == 0 and w.drafter.num_cached() == 0
    seqs = generate(_prompts(w), _greedy(), 3, w.drafter, w.ver)  # lockstep, every sequence in each batched call
    assert [s.output_ids for s in seqs] == refs
    drafted += sum(s.stats.num_draft_tokens for s in seqs)
    accepted = sum(s.stats.num_accepted_tokens for s in seqs)
    assert drafted > 0 and accepted > 0, (drafted, accepted)  # speculation really happened


# ------------------------------------------------------------ cache misses
@pytest.mark.parametrize("name", NAMES)
def test_a_sequence_the_drafter_does_not_hold_is_a_miss_and_the_resend_drafts(world, name):
    check_misses(world(name))


def check_misses(w: World) -> None:
    calls = []

    def forget_every_other_call(requests):  # (as a replica that evicted them, or another replica)
        calls.append(len(calls))
        if len(calls) % 2 == 0:
            for r in requests:
                w.drafter.release(r.seq_id)

    rec = Recorder(w.drafter, forget_every_other_call)
    seqs = generate(_prompts(w), _greedy(), 3, rec, w.ver)
    assert [s.output_ids for s in seqs] == _refs(w)
    assert all(s.cache_misses["drafter"] > 0 for s in seqs), [s.cache_misses for s in seqs]
    answered = [(r, p) for r, p in rec.calls if not r.full]
    assert answered and any(p.cache_miss for _, p in answered)
    resent = [p for r, p in rec.calls if r.full]
    assert resent and not any(p.cache_miss for p in resent)  # the whole sequence is never a miss
    assert sum(len(p.tokens) for p in resent) > 0  # and it drafts


# ------------------------------------------------------------ per-sequence fallback
@pytest.mark.parametrize("name", NAMES)
def test_a_failed_batch_is_retried_alone_and_a_failing_sequence_decodes_without_drafts(world, name, monkeypatch):
    w = world(name)
    if not isinstance(w.drafter, BatchedDrafter):
        pytest.skip(f"{type(w.drafter).__name__} drafts each sequence alone: no batched pass to fall back from")
    poisoned: set[str] = set()
    passes = {"batched": 0, "alone": 0}
    batched = w.drafter._batched

    def flaky(entries, run, out):
        def failing(es):
            if len(es) > 1:
                passes["batched"] += 1
                raise RuntimeError("a batched pass failed")
            passes["alone"] += 1
            if es[0].request.seq_id in poisoned:
                raise RuntimeError("this sequence fails alone")
            return run(es)

        return batched(entries, failing, out)

    monkeypatch.setattr(w.drafter, "_batched", flaky)
    prompts = _prompts(w)
    seqs = [Sequence(p, _greedy(), 3, w.tok, w.ver.eos_ids, w.ver.max_len, seq_id=f"{name}-f{i}")
            for i, p in enumerate(prompts)]
    poisoned.add(seqs[0].seq_id)
    for s in seqs:
        s.capture = getattr(w.drafter, "aux_layers", ())
    while any(not s.done for s in seqs):
        step(seqs, w.drafter, w.ver)
    for s in seqs:
        w.ver.release(s.seq_id)
        w.drafter.release(s.seq_id)
    assert [s.output_ids for s in seqs] == _refs(w)
    assert passes["batched"] > 0 and passes["alone"] > passes["batched"]
    assert seqs[0].stats.num_draft_tokens == 0
    assert all(s.stats.num_draft_tokens > 0 for s in seqs[1:])


# ------------------------------------------------------------ pre-drafts
async def _speculate(seq: Sequence, drafter, ver, pre_draft: str) -> list:
    """``speculate`` with the engines called in turn, pre-drafting as the method declares: its steps' infos."""
    async def propose(requests):
        return drafter.propose(requests)

    async def verify(requests):
        return ver.verify(requests)

    async def recompute_aux(tokens):
        return ver.aux_states(tokens, seq.capture)

    seq.capture = getattr(drafter, "aux_layers", ())
    try:
        return [info async for _, _, info in speculate(seq, propose, verify, FixedK(seq.k), Breaker(), True,
                                                       recompute_aux=recompute_aux,
                                                       narrow=getattr(drafter, "narrow", None), pre_draft=pre_draft)]
    finally:
        ver.release(seq.seq_id)
        drafter.release(seq.seq_id)


@pytest.mark.parametrize("name", NAMES)
def test_pre_drafts_are_the_declared_kind_and_change_no_token(world, name):
    check_pre_drafts(world(name), name)


def check_pre_drafts(w: World, name: str) -> None:
    kind = method(name).pre_draft
    rec = Recorder(w.drafter)
    hits = 0
    for i, (p, ref) in enumerate(zip(_prompts(w), _refs(w))):
        # k = 3: with the next block's guess a pre-drafting step asks k + 1 drafts, within a parallel head's block
        seq = Sequence(p, _greedy(), 3, w.tok, w.ver.eos_ids, w.ver.max_len, seq_id=f"{name}-p{i}")
        infos = asyncio.run(_speculate(seq, rec, w.ver, kind))
        assert seq.output_ids == ref
        hits += sum(info.pre_draft == "hit" for info in infos)
    trees = [(r, p) for r, p in rec.calls if r.branches]
    chains = [(r, p) for r, p in rec.calls if r.provisional]
    wanted, unwanted = (trees, chains) if kind == "tree" else (chains, trees)
    assert wanted and not unwanted, (len(trees), len(chains))
    for r, p in trees:  # one answer per branch asked for
        assert p.branches is not None and len(p.branches) == len(r.branches)
    for _, p in chains:  # continued, or declined (a cache miss): never an error
        assert p.cache_miss or p.tokens
    if w.pre_draft_hits:
        assert hits > 0
    else:
        assert hits == 0 and all(p.cache_miss for _, p in chains)


# ------------------------------------------------------------ the distribution
def _sampling_world(name: str):
    """(target with 8 tokens, its verifier, the method's drafter) for the exact distribution (``_exact``)."""
    from tests.helpers import noisy_copy

    if name == "eagle3":
        from tests.test_eagle3_serving import _tiny

        return _tiny()
    if name == "peagle":  # (tests/test_peagle.py and tests/test_mtp.py add a wrong-q control)
        from tests.test_peagle import sampling_world

        return sampling_world()
    if name == "mtp":
        from tests.test_mtp import sampling_world

        return sampling_world()
    if name in ("dflash", "dspark"):
        from tests.test_dflash import _tiny, drafter

        target, ver, head = _tiny(name)
        return target, ver, drafter(name, head, cache_budget_mb=64)
    from tests.test_eagle3_serving import _tiny

    target, ver, _ = _tiny()
    if name == "ngram":
        from drafter.ngram import NgramDrafter

        return target, ver, NgramDrafter(NgramConfig(max_n=2))
    from drafter.model_drafter import ModelDrafter

    return target, ver, ModelDrafter(DraftModelConfig(model="tiny", dtype="float32", cache_budget_mb=64),
                                     model=noisy_copy(target, 0.5))


def sampled_p_value(target, ver, dr, prompt: list[int], n: int = 2000) -> tuple[float, int]:
    """n seeded T = 0.8 sequences of 4 tokens after ``prompt`` through the loop at k = 3, verified by rejection
    sampling: (the chi-square p-value of their tokens against the target's exact distribution, drafts made)."""
    from tests.test_eagle3_serving import _exact
    from tests.test_rejection import min_p_value_of

    params = [SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, seed=s, verification="rejection")
              for s in range(n)]
    seqs = generate([prompt] * n, params, 3, dr, ver)
    drafted = sum(s.stats.num_draft_tokens for s in seqs)
    return min_p_value_of(torch.tensor([s.output_ids for s in seqs]), _exact(target, params[0], prompt, 4)), drafted


@pytest.mark.heavy  # 2000 sampled sequences through the loop per method
@pytest.mark.parametrize("name", NAMES)
def test_sampled_output_at_t08_is_the_targets_distribution(name):
    n = 2000
    p, drafted = sampled_p_value(*_sampling_world(name), [0, 3, 5, 0, 3], n)  # (a repeat: the n-gram drafter finds it)
    assert drafted > n // 2, drafted
    assert p > 1e-3, p


# ------------------------------------------------------------ served
CHEAP_TO_SERVE = {"draft_model", "ngram"}  # the shared app's drafter, and one without a model


def _served_args(name: str, tiny_model_dirs, tmp_path, tiny_pair) -> tuple[dict, object, object]:
    """(app args, tokenizer, reference target) for an app serving the method's drafter."""
    target_dir = tiny_model_dirs[0]
    tok, target, _ = tiny_pair
    engine = {"dtype": "float32", "cache_budget_mb": 64, "num_threads": 1}
    verifier, drafter = {"model": str(target_dir), **engine}, {"method": name, "num_speculative_tokens": 4}
    if name == "eagle3":
        from tests.test_eagle3 import HEAD, TARGET
        from verifier.engine import VerifierEngine

        verifier["model"], drafter = str(TARGET), {**drafter, "model": str(HEAD), **engine}
        ver = VerifierEngine(VerifierConfig(model=str(TARGET), dtype="float32", cache_budget_mb=64, num_threads=1))
        tok, target = ver.tokenizer, ver.model  # (the target as the app runs it: float32)
    elif name == "peagle":
        from tests.peagle_heads import served_args

        verifier, drafter, tok, target = served_args(tmp_path, engine)
    elif name == "mtp":
        from tests.mtp_models import served_args

        verifier, drafter, tok, target = served_args(tok, tmp_path, engine)
    elif method(name).head:
        from core.dflash import save_head
        from tests.test_dflash import bigram_target, copying_head

        target = bigram_target(tok)
        target.save_pretrained(tmp_path / "target")
        tok.save_pretrained(tmp_path / "target")
        head = copying_head(target, name, tok.pad_token_id)
        save_head(head, tmp_path / name, head.spec.to_config(str(tmp_path / "target"), ["LlamaForCausalLM"]),
                  dtype=torch.float32)
        verifier["model"], drafter = str(tmp_path / "target"), {**drafter, "model": str(tmp_path / name), **engine}
    args = {"model_name": "tiny", "verifier": verifier, "drafter": drafter, "k_policy": "fixed"}
    return args, tok, target


@pytest.mark.parametrize("name", [n if n in CHEAP_TO_SERVE else pytest.param(n, marks=pytest.mark.long) for n in NAMES])
def test_served_greedy_equals_the_target(serve_app, tiny_model_dirs, tiny_pair, tmp_path, name):
    import contextlib

    from openai import OpenAI

    from tests.conftest import side_app

    args, tok, target = _served_args(name, tiny_model_dirs, tmp_path, tiny_pair)
    # the shared app serves the draft model: the others get an app of their own beside it
    served = (contextlib.nullcontext(serve_app[0]) if name == "draft_model"
              else side_app(serve_app, f"contract-{name}", args))
    drafted = 0
    with served as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        for text in ["def add(a, b):", "class Point:", "for i in range(10):"]:
            out = client.completions.create(model="tiny", prompt=text, max_tokens=24, temperature=0,
                                            extra_body={"ignore_eos": True, "return_token_ids": True})
            choice = out.choices[0].model_dump()
            assert choice["token_ids"] == hf_greedy(target, tok(text)["input_ids"], 24), (name, text)
            drafted += choice["speculation"]["num_draft_tokens"]
    assert drafted > 0  # the drafter pool answered


# ------------------------------------------------------------ the worked example of docs/adding-a-drafter.md
def test_the_worked_example_of_adding_a_drafter_passes_the_contract(tiny_pair, monkeypatch):
    """The doc's three blocks as written (config class, engine, registry line) make a method that passes the
    in-process contract."""
    import re
    from pathlib import Path

    import configs.models
    from drafter.registry import Method

    doc = (Path(__file__).resolve().parent.parent / "docs" / "adding-a-drafter.md").read_text()
    config_src, engine_src, registry_src = re.findall(r"```python\n(.*?)```", doc, re.S)
    space = dict(vars(configs.models))  # the config class is written inside configs/models.py
    exec(config_src, space)
    engine = {"__name__": "drafter.bigram"}
    exec(engine_src, engine)
    records = []
    exec(registry_src, {"register": records.append, "Method": Method})
    (m,) = records
    assert (m.name, m.config, m.drafter) == ("bigram", "configs.models:BigramConfig", "drafter.bigram:BigramDrafter")
    monkeypatch.setitem(METHODS, "bigram", m)
    w = _bigram_world(tiny_pair, engine["BigramDrafter"](space["BigramConfig"](max_sequences=2)))
    check_greedy(w, "bigram")
    check_misses(w)
    check_pre_drafts(w, "bigram")


# ------------------------------------------------------------ the heads' vocabulary
def _heads_with_a_draft_vocabulary():
    """(EAGLE-3 head, DSpark head), each drafting over 16 of the target's 40 tokens."""
    from tests.test_dflash import random_head as parallel_head
    from tests.test_dflash import tiny_spec as parallel_spec
    from tests.test_eagle3 import random_head, tiny_spec

    return (random_head(tiny_spec(draft_vocab=16, vocab=40), seed=1),
            parallel_head(parallel_spec("dspark", 40, 16), seed=2))


@pytest.mark.parametrize("which", ["eagle3", "dspark"])
def test_target_logits_follow_the_draft_vocabulary_as_loaded(which):
    """Draft id i is target id i + d2t[i], -inf elsewhere; a vocabulary loaded into d2t after the first call (a
    checkpoint loaded into a built head, weights swapped) or after ``fuse`` is the one used."""
    from core.eagle3 import draft_vocabulary

    head = dict(zip(["eagle3", "dspark"], _heads_with_a_draft_vocabulary()))[which]
    x = torch.randn(3, 16)

    def expected():
        out = torch.full((3, 40), float("-inf"))
        for i in range(16):
            out[:, i + int(head.d2t[i])] = x[:, i]
        return out

    assert torch.equal(head.target_logits(x), expected())
    for seed in (7, 8):
        d2t, t2d = draft_vocabulary(torch.randint(0, 100, (40,), generator=torch.Generator().manual_seed(seed)), 16)
        with torch.no_grad():
            head.d2t.copy_(d2t)
            head.t2d.copy_(t2d)
        assert torch.equal(head.target_logits(x), expected())
        if hasattr(head, "fuse"):
            head.fuse(64)  # the serving tables
    assert torch.equal(head.target_logits(x[0]), expected()[0])  # any leading shape
