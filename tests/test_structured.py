"""Structured outputs under speculation: every output matches its constraint, and speculation stays
lossless under the grammar (p and q both masked by the grammar state reached along the drafts).

- seeded sampled outputs (T = 0.8, k = 4) under a nested JSON schema, a regex and a choice all match;
- greedy with a schema is token-for-token masked greedy decoding (computed here directly, with the
  target and a fresh matcher) with speculation off and with each drafter; seeded gumbel outputs do
  not depend on k;
- the distribution of whole outputs under a small grammar equals the masked target's, enumerated
  exactly, for each drafter; a verifier that leaves the mask off the bonus token, and a drafter that sends q
  unmasked while its drafts are masked, fail the same test.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from scipy.stats import chisquare

from configs import DraftModelConfig, Eagle3Config, NgramConfig, ParallelHeadConfig, SamplingParams, VerifierConfig
from core.grammar import (
    Constraint,
    GrammarError,
    Grammars,
    SequenceMasks,
    apply_bitmask,
    choice_constraint,
    json_schema_constraint,
)
from core.loop import generate
from core.sampling import processed_probs
from drafter.base import BatchedDrafter
from drafter.dflash_drafter import ParallelDrafter
from drafter.eagle3_drafter import Eagle3Drafter
from drafter.model_drafter import ModelDrafter
from drafter.ngram import NgramDrafter
from tests.helpers import noisy_copy, tiny_llama, tiny_tokenizer
from verifier.engine import VerifierEngine

EOS = 1
SCHEMA = {
    "type": "object",
    "properties": {
        # (xgrammar lets free strings hold raw control characters)
        "name": {"type": "string", "pattern": "^[a-z ]{1,6}$"},
        "kind": {"enum": ["cat", "dog", "owl"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                   "vip": {"type": "boolean"}},
                  "required": ["id", "vip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "kind", "age", "owner", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"
CHOICES = ["yes", "no", "maybe", "def add"]


def _engines(target, tok, drafter):
    ver = VerifierEngine(VerifierConfig(model="tiny", dtype="float32", cache_budget_mb=64), model=target, tokenizer=tok)
    ver.eos_ids = {EOS}  # (the tiny models leave EOS unset; the grammar ends with it)
    if hasattr(drafter, "eos_ids"):
        drafter.eos_ids = {EOS}
    if isinstance(drafter, BatchedDrafter):
        drafter.grammar_tokenizer = tok
    return ver


def _heads(V: int):
    """(EAGLE-3 head, DFlash head, DSpark head) for a tiny target of V tokens (layers 0-2 read)."""
    from tests.test_dflash import random_head as parallel_head
    from tests.test_dflash import tiny_spec as parallel_spec
    from tests.test_eagle3 import random_head, tiny_spec

    # half the vocabulary: q is 0 on the rest (and masked rows may be empty)
    spec = tiny_spec(draft_vocab=V // 2, vocab=V)
    spec.aux_layer_ids = [0, 1, 2]
    head = random_head(spec, seed=4)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(torch.randn(V, spec.hidden_size))
    return (head, parallel_head(parallel_spec("dflash", vocab=V, draft_vocab=V // 2, aux=(0, 1, 2)), seed=4),
            parallel_head(parallel_spec("dspark", vocab=V, draft_vocab=V // 2, aux=(0, 1, 2)), seed=4))


def drafters(tok, target, names=("draft_model", "ngram", "eagle3", "dflash", "dspark")):
    V = target.config.vocab_size
    eagle, dflash, dspark = _heads(V) if set(names) & {"eagle3", "dflash", "dspark"} else (None,) * 3
    make = {
        "draft_model": lambda: ModelDrafter(DraftModelConfig(model="tiny", cache_budget_mb=64),
                                            model=noisy_copy(target, 0.15)),
        "ngram": lambda: NgramDrafter(NgramConfig(max_n=3)),
        "eagle3": lambda: Eagle3Drafter(Eagle3Config(model="tiny", dtype="float32", cache_budget_mb=64),
                                        head=eagle, eos_ids={EOS}),
        "dflash": lambda: ParallelDrafter(ParallelHeadConfig(method="dflash", model="x", dtype="float32"),
                                          head=dflash, eos_ids={EOS}),
        "dspark": lambda: ParallelDrafter(ParallelHeadConfig(method="dspark", model="x", dtype="float32"),
                                          head=dspark, eos_ids={EOS}),
    }
    out = {}
    for name in names:
        d = make[name]()
        if isinstance(d, BatchedDrafter):
            d.grammar_tokenizer = tok
        out[name] = d
    return out


@pytest.fixture(scope="module")
def peaked():
    """The tiny tokenizer, a peaked target (greedy is far from ties) whose heads read layers 0-2."""
    tok = tiny_tokenizer()
    return tok, tiny_llama(len(tok), layers=3, hidden=24, seed=3, peak=20.0, eos_token_id=None)


def _text(tok, seq) -> str:
    return tok.decode([t for t in seq.output_ids if t != EOS])


# ------------------------------------------------------------ every output matches
@pytest.mark.parametrize("kind", ["json", "regex", "choice"])
def test_thirty_seeded_sampled_outputs_all_match(peaked, kind):
    tok, target = peaked
    dr = drafters(tok, target, ["draft_model"])["draft_model"]
    ver = _engines(target, tok, dr)
    c = {"json": json_schema_constraint(SCHEMA), "regex": Constraint("regex", REGEX),
         "choice": choice_constraint(CHOICES)}[kind]
    prompt = tok("def add(a, b):")["input_ids"]
    params = [SamplingParams(temperature=0.8, max_tokens=160, seed=s) for s in range(30)]
    seqs = generate([prompt] * 30, params, 4, dr, ver, constraint=c)
    assert sum(s.stats.num_draft_tokens for s in seqs) > 30  # it speculated
    for s in seqs:
        assert s.finish_reason == "stop" and s.output_ids[-1] == EOS, (s.finish_reason, _text(tok, s))
        text = _text(tok, s)
        if kind == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "regex":
            assert re.fullmatch(REGEX, text), text
        else:
            assert text in CHOICES, text


# ------------------------------------------------------------ greedy: masked decoding, with or without drafts
def masked_greedy(target, tok, prompt, c: Constraint, n: int) -> list[int]:
    """Masked greedy decoding computed directly: the target's argmax under a fresh matcher's mask."""
    masks = SequenceMasks(Grammars(tok, target.config.vocab_size, {EOS}))
    out = []
    for _ in range(n):
        with torch.no_grad():
            logits = target(torch.tensor([prompt + out])).logits[0, -1:].float()
        out.append(int(apply_bitmask(logits, masks.masks("ref", c, out, 1)).argmax()))
        if out[-1] == EOS:
            break
    return out


@pytest.mark.parametrize("name", ["draft_model", "ngram", "eagle3", "dflash", "dspark"])
def test_greedy_with_a_schema_is_masked_greedy_with_every_drafter(peaked, name):
    tok, target = peaked
    dr = drafters(tok, target, [name])[name]
    ver = _engines(target, tok, dr)
    c = json_schema_constraint(SCHEMA)
    prompts = [tok(p)["input_ids"] for p in ("def add(a, b):", "class Point:\n", "for i in range(10):")]
    want = [masked_greedy(target, tok, p, c, 120) for p in prompts]
    off = generate(prompts, SamplingParams(temperature=0, max_tokens=120), 0, None, ver, constraint=c)
    on = generate(prompts, SamplingParams(temperature=0, max_tokens=120), 4, dr, ver, constraint=c)
    assert [s.output_ids for s in off] == want
    assert [s.output_ids for s in on] == want
    assert sum(s.stats.num_draft_tokens for s in on) > 0
    for w in want:
        jsonschema.validate(json.loads(tok.decode(w[:-1])), SCHEMA)


def test_seeded_gumbel_output_does_not_depend_on_k(peaked):
    tok, target = peaked
    dr = drafters(tok, target, ["draft_model"])["draft_model"]
    ver = _engines(target, tok, dr)
    c = json_schema_constraint(SCHEMA)
    prompt = tok("def add(a, b):")["input_ids"]
    params = [SamplingParams(temperature=0.8, max_tokens=160, seed=s, verification="gumbel") for s in range(8)]
    outs = [[s.output_ids for s in generate([prompt] * 8, params, k, dr if k else None, ver, constraint=c)]
            for k in (0, 1, 4)]
    assert outs[0] == outs[1] == outs[2]


def test_drafts_are_always_legal(peaked):
    """The model drafter's drafts under a grammar: every block it proposes is a legal continuation."""
    from core.protocol import DraftRequest

    tok, target = peaked
    dr = drafters(tok, target, ["draft_model"])["draft_model"]
    c = json_schema_constraint(SCHEMA)
    masks = SequenceMasks(Grammars(tok, target.config.vocab_size, {EOS}))
    prompt = tok("def add(a, b):")["input_ids"]
    for seed in range(10):
        r = DraftRequest(f"s{seed}", 0, None, list(prompt), k=8, sampling=SamplingParams(temperature=1.0, seed=seed),
                         seed=seed, num_prompt=len(prompt), grammar=c)
        (p,) = dr.propose([r])
        assert len(p.tokens) == 8
        assert masks._tracked("check", c).sync(p.tokens), tok.decode(p.tokens)
        dr.release(r.seq_id)


# ------------------------------------------------------------ refusals
def test_bad_too_large_and_slow_constraints_are_grammar_errors_naming_the_field(peaked):
    tok, target = peaked
    g = Grammars(tok, target.config.vocab_size, {EOS}, timeout_s=0.02)
    for c in [Constraint("regex", "a(b", param="structured_outputs.regex"),
              Constraint("grammar", "root ::= undefined_rule", param="structured_outputs.grammar"),
              json_schema_constraint({"type": "nonsense"}, param="response_format.json_schema.schema")]:
        with pytest.raises(GrammarError) as e:
            g.compile(c)
        assert e.value.param == c.param
    with pytest.raises(GrammarError, match="characters"):
        Constraint("regex", "a" * 70_000, param="structured_outputs.regex")
    # a schema that takes several times the (test's) bound of 0.02 s to compile: a 400, not a wait
    slow = json_schema_constraint({"type": "object", "properties": {
        f"p{i}": {"type": "string", "pattern": "^[a-z]{1,30}@[a-z]{2,20}$"} for i in range(200)}},
        param="structured_outputs.json")
    with pytest.raises(GrammarError, match="within") as e:
        g.compile(slow)
    assert e.value.param == "structured_outputs.json"
    assert g.compile(choice_constraint(["x"])) is not None  # the compiler still serves others


def test_json_is_generated_in_the_schemas_key_order(peaked):
    """Properties come in the order the schema lists them (as vLLM's and OpenAI's), not sorted."""
    tok, target = peaked
    masks = SequenceMasks(Grammars(tok, target.config.vocab_size, {EOS}))
    schema = {"type": "object", "properties": {"zeta": {"type": "boolean"}, "alpha": {"type": "boolean"}},
              "required": ["zeta", "alpha"], "additionalProperties": False}
    c = json_schema_constraint(schema)
    for text, legal in (('{"zeta":true,"alpha":false}', True), ('{"alpha":false,"zeta":true}', False)):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert (masks.legal(text, c, [], ids) == len(ids)) == legal, text


def test_compiled_grammars_are_cached_by_content_within_a_byte_budget(peaked):
    tok, target = peaked
    g = Grammars(tok, target.config.vocab_size, {EOS})
    a = g.compile(Constraint("regex", "[a-c]{3}"))
    assert g.compile(Constraint("regex", "[a-c]{3}")) is a  # same content, same key: compiled once
    assert g.compile(Constraint("regex", "[a-c]{3}").ref()) is a  # by hash alone
    small = Grammars(tok, target.config.vocab_size, {EOS}, budget_bytes=a.memory_size_bytes + 1)
    small.compile(Constraint("regex", "[a-c]{3}"))
    small.compile(Constraint("regex", "[d-f]{3}"))
    assert small.get(Constraint("regex", "[a-c]{3}").key) is None and len(small._compiled) == 1  # (the newest stays)
    with pytest.raises(KeyError):
        small.compile(Constraint("regex", "[a-c]{3}").ref())


# ------------------------------------------------------------ the distribution under a grammar
DIST_CHOICES = ["yes", "no", "maybe", "def", "de"]
N = 3000
T = 0.8


def exact_outcomes(target, tok, prompt, c: Constraint, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """The masked target's exact distribution of whole outputs (through EOS), enumerated over every history."""
    masks = SequenceMasks(Grammars(tok, target.config.vocab_size, {EOS}))
    done, frontier = {}, {(): 1.0}
    while frontier:
        hists = list(frontier)
        with torch.no_grad():
            logits = target(torch.tensor([prompt + list(h) for h in hists])).logits[:, -1].float()
        nxt = {}
        for h, row in zip(hists, logits):
            p = processed_probs(apply_bitmask(row[None], masks.masks(str(h), c, list(h), 1)), params)[0].double()
            for t in p.nonzero()[:, 0].tolist():
                (done if t == EOS else nxt)[h + (t,)] = frontier[h] * float(p[t])
        frontier = nxt
    return done


def outcome_p_value(outputs: list[tuple[int, ...]], exact: dict) -> float:
    bins = sorted(exact, key=exact.get, reverse=True)
    big = [b for b in bins if exact[b] * len(outputs) >= 5]
    rest = 1.0 - sum(exact[b] for b in big)
    counts = {b: 0 for b in big}
    other = 0
    for o in outputs:
        if o in counts:
            counts[o] += 1
        else:
            other += 1
    f_obs = [counts[b] for b in big] + ([other] if rest * len(outputs) >= 1 else [])
    f_exp = [exact[b] * len(outputs) for b in big] + ([rest * len(outputs)] if rest * len(outputs) >= 1 else [])
    if other and rest * len(outputs) < 1:
        return 0.0  # an outcome the masked target never produces
    return float(chisquare(f_obs, [e * sum(f_obs) / sum(f_exp) for e in f_exp]).pvalue)


class BonusUnmasked(VerifierEngine):
    """A control: the grammar's mask left off the bonus position (all drafts accepted)."""

    def masked(self, r, logits, tokens):
        out = super().masked(r, logits, tokens)
        if r.grammar is not None and r.k > 0:
            out = out.clone()
            out[-1] = logits[-1].float()
        return out


@pytest.fixture(scope="module")
def flat():
    """A target far from peaked (the distribution is not one outcome), heads reading layers 0-2."""
    tok = tiny_tokenizer()
    return tok, tiny_llama(len(tok), layers=3, hidden=24, seed=5, peak=3.0, eos_token_id=None)


def _sampled_outcomes(tok, target, drafter, ver, c, verification="rejection", k=4):
    prompt = tok("def add(a, b):")["input_ids"]
    params = [SamplingParams(temperature=T, max_tokens=12, seed=s, verification=verification) for s in range(N)]
    seqs = generate([prompt] * N, params, k, drafter, ver, constraint=c)
    assert sum(s.stats.num_draft_tokens for s in seqs) > N // 2
    return prompt, [tuple(s.output_ids) for s in seqs], params[0]


@pytest.mark.heavy  # 3000 sampled sequences per drafter through the loop
@pytest.mark.parametrize("name,verification", [("draft_model", "gumbel"), ("ngram", "rejection"),
                                               ("eagle3", "rejection"), ("dflash", "rejection"),
                                               ("dspark", "rejection")])
def test_outputs_under_a_grammar_follow_the_masked_target(flat, name, verification):
    """(The draft model with rejection sampling: the next test, beside its control.)"""
    tok, target = flat
    dr = drafters(tok, target, [name])[name]
    ver = _engines(target, tok, dr)
    c = choice_constraint(DIST_CHOICES)
    prompt, outs, params = _sampled_outcomes(tok, target, dr, ver, c, verification)
    assert outcome_p_value(outs, exact_outcomes(target, tok, prompt, c, params)) > 1e-3


@pytest.mark.heavy
def test_the_control_without_the_bonus_mask_fails(flat):
    tok, target = flat
    dr = drafters(tok, target, ["draft_model"])["draft_model"]
    ver = BonusUnmasked(VerifierConfig(model="tiny", dtype="float32", cache_budget_mb=64), model=target, tokenizer=tok)
    ver.eos_ids = {EOS}
    dr.eos_ids = {EOS}
    c = choice_constraint(DIST_CHOICES)
    prompt, outs, params = _sampled_outcomes(tok, target, dr, ver, c)
    assert outcome_p_value(outs, exact_outcomes(target, tok, prompt, c, params)) < 1e-6


@pytest.mark.heavy
@pytest.mark.parametrize("q_masked", [True, False])
def test_q_unmasked_while_the_drafts_are_masked_fails(flat, q_masked):
    """The draft model with rejection sampling, and the same with its one switch off (``q_masked``): the
    drafts are still drawn under the grammar but q goes out unmasked, so p / q overstates every draft's
    acceptance, and the output drifts to the drafter's own distribution. The same code path, seeds and test:
    the correct one passes, the control fails. (A drafter far from the target, so that the drift shows in N
    outputs: the usual one, noise 0.15, is within a chi-square of 10 of the target here.)"""
    tok, target = flat
    dr = ModelDrafter(DraftModelConfig(model="tiny", cache_budget_mb=64), model=noisy_copy(target, 1.0))
    ver = _engines(target, tok, dr)
    dr.q_masked = q_masked
    c = choice_constraint(DIST_CHOICES)
    prompt, outs, params = _sampled_outcomes(tok, target, dr, ver, c)
    p = outcome_p_value(outs, exact_outcomes(target, tok, prompt, c, params))
    assert p > 1e-3 if q_masked else p < 1e-6, p


# ------------------------------------------------------------ forced tokens as free drafts (the served loop)
def _speculated(tok, target, dr, ver, prompt, params, c, forced, k=4):
    import asyncio

    from core.loop import speculate_local
    from core.policy import FixedK
    from core.sequence import Sequence

    seq = Sequence(prompt, params, k, None, ver.eos_ids, 256, constraint=c)
    return asyncio.run(speculate_local(seq, dr, ver, FixedK(k), forced=forced))


@pytest.fixture
def forced_count(monkeypatch):
    """The forced tokens the loop drafted itself (a list, one entry per lookup)."""
    got, inner = [], SequenceMasks.forced

    def counted(self, *args):
        tokens = inner(self, *args)
        got.append(len(tokens))
        return tokens

    monkeypatch.setattr(SequenceMasks, "forced", counted)
    return got


@pytest.fixture
def cut_count(monkeypatch):
    """Drafts the loop cut from proposals (forbidden by the grammar), one entry per proposal."""
    got, inner = [], SequenceMasks.legal

    def counted(self, seq_id, c, out, drafts):
        n = inner(self, seq_id, c, out, drafts)
        got.append(len(drafts) - n)
        return n

    monkeypatch.setattr(SequenceMasks, "legal", counted)
    return got


def test_legal_counts_the_allowed_drafts_from_the_first(peaked):
    tok, target = peaked
    masks = SequenceMasks(Grammars(tok, target.config.vocab_size, {EOS}))
    c = choice_constraint(["yes", "no"])
    y, e, s_, n = (tok.convert_tokens_to_ids(x) for x in ("y", "e", "s", "n"))
    assert masks.legal("a", c, [], [y, e, s_, EOS]) == 4
    assert masks.legal("a", c, [y], [e, n, s_]) == 1  # rolled back from the call before, cut at "n"
    assert masks.legal("a", c, [n], [e]) == 0


@pytest.mark.parametrize("name", ["draft_model", "ngram"])
def test_forced_tokens_drafted_for_free_keep_greedy_and_seeded_outputs(peaked, forced_count, cut_count, name):
    tok, target = peaked
    dr = drafters(tok, target, [name])[name]
    ver = _engines(target, tok, dr)
    c = json_schema_constraint(SCHEMA)
    prompts = [tok(p)["input_ids"] for p in ("def add(a, b):", "class Point:\n")]
    greedy = SamplingParams(temperature=0, max_tokens=120)
    for forced in (False, True):
        outs = [_speculated(tok, target, dr, ver, p, greedy, c, forced).output_ids for p in prompts]
        assert outs == [masked_greedy(target, tok, p, c, 120) for p in prompts]
    assert sum(forced_count) > 10  # (a schema's keys and punctuation)
    if name == "ngram":  # the loop cut its lookups at their first forbidden draft
        assert cut_count and sum(cut_count) > 0
    for seed in range(6):  # gumbel: the output is the seed's, whatever drafted it
        params = SamplingParams(temperature=0.8, max_tokens=120, seed=seed, verification="gumbel")
        plain = generate([prompts[0]], params, 0, None, ver, constraint=c)[0].output_ids
        assert _speculated(tok, target, dr, ver, prompts[0], params, c, True).output_ids == plain


@pytest.mark.heavy  # 1500 sequences through the served loop, one at a time
def test_forced_blocks_follow_the_masked_target(flat, forced_count):
    tok, target = flat
    dr = drafters(tok, target, ["draft_model"])["draft_model"]
    ver = _engines(target, tok, dr)
    c = choice_constraint(["yes please", "no thank you", "maybe so", "def", "de"])  # long forced tails
    prompt = tok("def add(a, b):")["input_ids"]
    params = [SamplingParams(temperature=T, max_tokens=16, seed=s) for s in range(1500)]
    outs = [tuple(_speculated(tok, target, dr, ver, prompt, p, c, True).output_ids) for p in params]
    assert sum(forced_count) > 1500  # forced blocks happened (the tail of a choice once it is the only one left)
    assert outcome_p_value(outs, exact_outcomes(target, tok, prompt, c, params[0])) > 1e-3
