"""One contract every verifier backend passes (``core.backends``), parametrized over the backends: this package's
engine; a fake one (tests/fake_backend.py: a bigram table behind the same interface), synchronous, as an engine that
batches itself and as one that runs each stream's loop itself; and vLLM where it is installed (one engine for the
module, whose start takes a minute or more on a small CPU: ``long``). Each is checked against its own model's
reference: greedy verification keeps exactly the target's continuation, the cache protocol answers misses, sampled
tokens follow p (chi-square), the replica (``VerifierServer``) decodes through it whatever loop it runs, and it
serves what its capabilities declare and refuses the rest by name."""

import asyncio
from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare

from configs import SamplingParams
from core.backends import BACKENDS, BatchingEngine, Capabilities, Engine, LoopEngine, backend, capabilities
from core.protocol import VerifyRequest, prefix_hash
from core.sampling import processed_probs
from tests.fake_backend import AsyncFakeEngine, FakeEngine, FakeLoopEngine

PROMPT = [5, 9, 14, 3, 7]


class Loop:
    """One event loop for a backend's whole module: an engine that batches itself (vLLM's AsyncLLM) keeps tasks
    on the loop it started on."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def verify(self, engine, requests):
        if getattr(engine, "is_async", False):
            return self.run(engine.verify(requests))
        return engine.verify(requests)


def _hf(model, tok_len: int):
    """A transformers model's reference: its last-position logits and its own greedy generate."""
    from tests.test_greedy_equivalence import reference

    def logits(tokens):
        with torch.no_grad():
            return model(torch.tensor([tokens])).logits[0, -1].float()

    return logits, lambda tokens, n: reference(model, list(tokens), n)


def _transformers(tiny_pair, loop):
    from configs import VerifierConfig
    from verifier.engine import VerifierEngine

    tok, target, _ = tiny_pair
    eng = VerifierEngine(VerifierConfig(model="tiny", dtype="float32", cache_budget_mb=64), model=target,
                         tokenizer=tok)
    logits, greedy = _hf(target, len(tok))
    return SimpleNamespace(engine=eng, logits=logits, greedy=greedy, vocab=eng.vocab_size, close=lambda: None)


def _fake(engine):
    return SimpleNamespace(engine=engine, logits=engine.logits, greedy=engine.greedy, vocab=engine.vocab_size,
                           close=lambda: None)


def _vllm(tmp_path_factory, loop):
    pytest.importorskip("vllm")
    from configs import VerifierConfig
    from tests.helpers import tiny_tokenizer
    from tests.test_vllm_backend import vllm_llama

    tok = tiny_tokenizer()
    target = vllm_llama(len(tok))
    path = tmp_path_factory.mktemp("contract_vllm")
    target.save_pretrained(path)
    tok.save_pretrained(path)
    cfg = VerifierConfig(model=str(path), dtype="float32", backend="vllm", max_model_len=512,
                         vllm={"kv_cache_gib": 0.25, "max_num_seqs": 64})

    async def start():  # (on the module's loop: AsyncLLM keeps its output task there)
        from core.backends import build
        return build(cfg)

    eng = loop.run(start())
    logits, greedy = _hf(target, len(tok))
    return SimpleNamespace(engine=eng, logits=logits, greedy=greedy, vocab=len(tok), close=eng.shutdown)


@pytest.fixture(scope="module")
def loop():
    lp = Loop()
    yield lp
    lp.loop.close()


@pytest.fixture(scope="module", params=["transformers", "fake", "fake_async", "fake_loop",
                                        pytest.param("vllm", marks=pytest.mark.long)])
def bk(request, loop, tiny_pair, tmp_path_factory):
    if request.param == "transformers":
        b = _transformers(tiny_pair, loop)
    elif request.param == "fake":
        b = _fake(FakeEngine())
    elif request.param == "fake_async":
        b = _fake(AsyncFakeEngine())
    elif request.param == "fake_loop":
        b = _fake(FakeLoopEngine())
    else:
        b = _vllm(tmp_path_factory, loop)
    b.name, b.loop = request.param, loop
    yield b
    b.close()


def _req(seq_id, tokens, drafts, sampling, seed=0, start=0, held=None, **kw):
    """A verify call: the whole sequence (``start`` 0), or its tokens past ``start`` with the hash of ``held``'s
    first ``start`` tokens."""
    if start == 0:
        return VerifyRequest(seq_id, 0, None, list(tokens), list(drafts), sampling, seed, full=True, **kw)
    return VerifyRequest(seq_id, start, prefix_hash(held[:start]), list(tokens[start:]), list(drafts), sampling,
                         seed, **kw)


GREEDY = SamplingParams(temperature=0.0)


def test_the_engine_has_the_members_its_kind_and_capabilities_need(bk):
    eng, caps = bk.engine, bk.engine.capabilities
    assert isinstance(eng, Engine) and isinstance(caps, Capabilities)
    if getattr(eng, "is_async", False):
        assert isinstance(eng, BatchingEngine)
    else:  # (the replica's batcher hears of each forward pass through it)
        assert hasattr(eng, "on_progress")
    if caps.engine_loop:
        assert isinstance(eng, LoopEngine)
    for member, needed in (("prompt_logprobs", caps.echo_logprobs), ("aux_states", caps.aux_states and
                                                                     not caps.engine_loop)):
        if needed:
            assert callable(getattr(eng, member, None)), member


def test_greedy_verification_keeps_exactly_the_targets_continuation(bk):
    ref = bk.greedy(PROMPT, 8)
    (res,) = bk.loop.verify(bk.engine, [_req("g", PROMPT, ref[:4], GREEDY)])
    assert (res.num_accepted, res.tokens, res.cached) == (4, ref[:5], len(PROMPT) + 4), res
    # the next step names what the engine holds by its hash: a wrong second draft stops there, the target's token
    held = PROMPT + ref[:4]
    wrong = (ref[6] + 1) % bk.vocab
    (res,) = bk.loop.verify(bk.engine, [_req("g", held + ref[4:5], [ref[5], wrong], GREEDY, start=len(held),
                                             held=held)])
    assert not res.cache_miss and (res.num_accepted, res.tokens) == (1, ref[5:7]), res
    (res,) = bk.loop.verify(bk.engine, [_req("h", PROMPT, [(ref[0] + 1) % bk.vocab], GREEDY)])
    assert (res.num_accepted, res.tokens) == (0, ref[:1]), res


def test_the_cache_protocol_answers_a_miss_and_takes_the_resend(bk):
    eng = bk.engine
    held = list(PROMPT)
    (res,) = bk.loop.verify(eng, [_req("c", held + [1], [], GREEDY, start=len(held), held=held)])
    assert res.cache_miss  # never seen
    bk.loop.verify(eng, [_req("c", held, [], GREEDY)])
    assert eng.num_cached() >= 1
    wrong = [(t + 1) % bk.vocab for t in held]
    (res,) = bk.loop.verify(eng, [_req("c", held + [1], [], GREEDY, start=len(held), held=wrong)])
    assert res.cache_miss  # another prefix than the one held
    assert eng.release("c") and not eng.release("c")
    (res,) = bk.loop.verify(eng, [_req("c", held + [1], [], GREEDY, start=len(held), held=held)])
    assert res.cache_miss  # released
    (res,) = bk.loop.verify(eng, [_req("c", held + [1], [], GREEDY)])  # the resend, whole
    assert not res.cache_miss and res.tokens == bk.greedy(held + [1], 1)
    assert eng.release("c")
    with pytest.raises(ValueError):  # one sequence twice in one call
        bk.loop.verify(eng, [_req("d", held, [], GREEDY), _req("d", held, [], GREEDY)])


@pytest.mark.parametrize("verification", ["rejection", "gumbel"])
def test_sampled_tokens_follow_p(bk, verification):
    """The first emitted token over many seeds, its drafts one-hot guesses (the likeliest, then another): each
    emitted token is distributed as p (chi-square at T = 0.8)."""
    if verification == "gumbel" and not bk.engine.capabilities.gumbel:
        pytest.skip(f"{bk.engine.capabilities.label} verifies by rejection only")
    params = SamplingParams(temperature=0.8, verification=verification)
    p = processed_probs(bk.logits(PROMPT).view(1, -1), params)[0]
    guess = [int(p.argmax()), int(p.argsort()[-2])]
    n = 600 if bk.name == "vllm" else 2000
    out = bk.loop.verify(bk.engine, [_req(f"s{i}", PROMPT, guess, params, seed=i) for i in range(n)])
    first = torch.tensor([r.tokens[0] for r in out])
    for i in range(n):
        bk.engine.release(f"s{i}")
    observed = torch.bincount(first, minlength=p.numel()).double()
    expected = p.double() * n
    assert observed[expected == 0].sum() == 0
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    assert chisquare(obs.numpy(), (exp * obs.sum() / exp.sum()).numpy()).pvalue > 1e-3


def test_the_replica_decodes_through_it_whatever_loop_it_runs(bk):
    """``VerifierServer`` on the engine (no drafter: plain decoding): greedy equals the target's own, its
    stats and health answer, and echo with logprobs is served or refused as the capabilities say."""
    from deployments.verifier import VerifierServer

    server = VerifierServer({}, engine=bk.engine)
    caps = bk.engine.capabilities
    assert (server.engine_loop is not None) == caps.engine_loop

    async def decode():
        got = []
        async for group in server.speculate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                                            "r0", k=0):
            got += [t for ids, _, _ in group for t in ids]
        return got

    assert bk.loop.run(decode()) == bk.greedy(PROMPT, 12)
    server.check_health()
    stats = bk.loop.run(server.stats())
    assert "drafter_calls" in stats and "cached_sequences" in stats
    if caps.echo_logprobs:
        lps = bk.loop.run(server.prompt_logprobs(PROMPT, 2))
        want = bk.logits(PROMPT[:2]).log_softmax(-1)[PROMPT[2]]
        assert lps[0] is None and len(lps) == len(PROMPT) and abs(lps[2][0] - float(want)) < 1e-3
    else:
        with pytest.raises(ValueError, match="echo with logprobs"):
            bk.loop.run(server.prompt_logprobs(PROMPT, 2))


# ------------------------------------------------------------------ the registry and the edge (no engine)


def test_every_backend_declares_its_builder_and_capabilities():
    import importlib

    from configs import VerifierConfig

    for name, b in BACKENDS.items():
        module, _, attr = b.build.partition(":")
        assert callable(getattr(importlib.import_module(module), attr)), name  # imports without the backend's package
        assert all(isinstance(c, Capabilities) for c in (b.capabilities, *b.modes.values()))
    assert capabilities(VerifierConfig(model="m")) == backend("transformers").capabilities
    engine = capabilities(VerifierConfig(model="m", backend="vllm"))
    per_step = capabilities(VerifierConfig(model="m", backend="vllm", vllm={"loop": "per_step"}))
    assert engine.engine_loop and not engine.gumbel and not per_step.engine_loop and not per_step.structured_outputs
    with pytest.raises(ValueError, match="unknown verifier backend 'sglang'"):
        backend("sglang")


CAPS = [backend("transformers").capabilities, *backend("vllm").modes.values(), FakeEngine.capabilities]


@pytest.mark.parametrize("caps", CAPS, ids=lambda c: c.label)
def test_the_edge_refuses_by_name_what_a_backend_cannot_serve(caps):
    """A sampling parameter the backend lacks is a 400 naming it; one it has is taken as given."""
    from deployments.openai_api import CompletionRequest, OpenAIError, to_sampling_params

    kw = dict(prompt_len=3, max_len=64, vocab_size=100, max_tokens_limit=32, defaults={}, verification="rejection",
              capabilities=caps)
    asks = [("min_p", {"min_p": 0.1}, caps.min_p), ("logit_bias", {"logit_bias": {"5": 2.0}}, caps.logit_bias),
            ("repetition_penalty", {"repetition_penalty": 1.3}, caps.repetition_penalty),
            ("verification", {"verification": "gumbel"}, caps.gumbel)]
    for param, body, served in asks:
        req = CompletionRequest(prompt="x", temperature=0.8, **body)
        if served:
            to_sampling_params(req, **kw)
        else:
            with pytest.raises(OpenAIError) as e:
                to_sampling_params(req, **kw)
            assert e.value.status == 400 and e.value.param == param and caps.label in str(e.value)
