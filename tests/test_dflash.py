"""DFlash and DSpark heads on the drafter pool (core/dflash.py, drafter/dflash_drafter.py): the Speculators
format and its refusals, the drafter against the reference drafting (whole, incremental, misses), greedy
with heads built to copy a tiny target's argmax equal to the target's own generate (in process and over
HTTP, with drafts accepted), and the sampled distribution (chi-square at T = 0.8 against the exact
distribution, and a control whose reported q is not the one drafted from, which fails it)."""

import asyncio
import json

import httpx
import pytest
import torch

from configs import ParallelHeadConfig, SamplingParams, VerifierConfig
from core.dflash import ParallelHead, ParallelSpec, UnsupportedHead, load_head, save_head
from core.eagle3 import aux_states, draft_vocabulary
from core.protocol import DraftRequest

METHODS = ["dflash", "dspark"]


def tiny_spec(method: str, vocab=40, draft_vocab=30, aux=(0, 1, 2), target_hidden=24) -> ParallelSpec:
    return ParallelSpec(method=method, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        intermediate_size=64, rms_norm_eps=1e-6, max_position_embeddings=128, vocab_size=vocab,
                        draft_vocab_size=draft_vocab, target_hidden_size=target_hidden, aux_layer_ids=list(aux),
                        block_size=5, mask_token_id=vocab - 1, num_layers=2,
                        layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                        markov_rank=6 if method == "dspark" else 0, confidence_head=method == "dspark",
                        confidence_with_markov=method == "dspark")


def random_head(spec: ParallelSpec, seed=0) -> ParallelHead:
    torch.manual_seed(seed)
    head = ParallelHead(spec)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
        d2t, t2d = draft_vocabulary(torch.randint(0, 100, (spec.vocab_size,)), spec.draft_vocab_size)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    return head.eval()


def drafter(method, head, **kw):
    from drafter.dflash_drafter import ParallelDrafter

    return ParallelDrafter(ParallelHeadConfig(method=method, model="x", dtype="float32", **kw), head=head,
                           eos_ids=set())


# ------------------------------------------------------------ format
@pytest.mark.parametrize("method", METHODS)
def test_speculators_config_round_trips_and_refusals_name_the_field(method, tmp_path):
    spec = tiny_spec(method)
    cfg = spec.to_config("models/x", ["LlamaForCausalLM"])
    assert cfg["speculators_model_type"] == method and cfg["block_size"] == 5
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert ParallelSpec.from_config(json.loads(json.dumps(cfg))) == spec
    bad = {"transformer_layer_config": {**cfg["transformer_layer_config"], "model_type": "gemma4"}}
    for change, field in [(bad, "transformer_layer_config.model_type"), ({"mask_token_id": None}, "mask_token_id"),
                          ({"aux_hidden_state_layer_ids": []}, "aux_hidden_state_layer_ids"),
                          ({"block_size": 1}, "block_size"), ({"projector_type": "domino"}, "projector_type"),
                          ({"shift_label": True}, "shift_label")]:
        with pytest.raises(UnsupportedHead, match=field.replace(".", r"\.")):
            ParallelSpec.from_config({**cfg, **change})
    if method == "dflash":
        with pytest.raises(UnsupportedHead, match="sample_from_anchor"):
            ParallelSpec.from_config({**cfg, "sample_from_anchor": True})
    else:
        for change, field in [({"markov_rank": 0}, "markov_rank"), ({"markov_head_type": "rnn"}, "markov_head_type")]:
            with pytest.raises(UnsupportedHead, match=field):
                ParallelSpec.from_config({**cfg, **change})
        assert ParallelSpec.from_config({**cfg, "sample_from_anchor": True}).max_k == 5
    head = random_head(spec)
    save_head(head, tmp_path, cfg, dtype=torch.float32)
    back = load_head(tmp_path)
    for (n, a), (_, b) in zip(head.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), n


# ------------------------------------------------------------ the drafter against the reference
def _request(seq_id, tokens, aux, aux_start, k=4, start=None, sampling=None):
    sp = sampling or SamplingParams(temperature=0)
    if start is None:
        return DraftRequest(seq_id, 0, None, list(tokens), k=k, sampling=sp, seed=1, full=True, aux=aux,
                            aux_start=aux_start)
    return DraftRequest.for_tokens(seq_id, list(tokens), start, k=k, sampling=sp, seed=1, aux=aux, aux_start=aux_start)


@pytest.mark.parametrize("method", METHODS)
def test_drafts_equal_the_reference_whole_incremental_and_after_misses(method):
    from tests.helpers import tiny_llama

    target = tiny_llama(40, layers=3, hidden=24, seed=3, peak=3.0, eos_token_id=None)
    head = random_head(tiny_spec(method))
    dr = drafter(method, head)
    T = torch.randint(0, 40, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        aux = aux_states(target, torch.tensor([T]), head.spec.aux_layer_ids)[0][0]
    ref = lambda n, k=4: head.draft(T[:n], aux[: n - 1], k)  # noqa: E731 - drafts after T[:n]
    (p,) = dr.propose([_request("a", T[:20], aux[:19], 0)])
    assert p.tokens == ref(20) and p.cached == 19 and not p.cache_miss
    # the sequence's kept states start at cached - 1 (the loop drops those before): the overlap is skipped
    (p,) = dr.propose([_request("a", T[:24], aux[18:23], 18, start=19)])
    assert p.tokens == ref(24) and p.cached == 23
    # k beyond the block: one block's drafts
    (p,) = dr.propose([_request("a", T[:25], aux[23:24], 23, start=23, k=9)])
    assert p.tokens == ref(25) and len(p.tokens) == 4
    # states that do not reach back to the held rows, a prefix not held, a pre-draft: misses
    (p,) = dr.propose([_request("a", T[:28], aux[26:27], 26, start=24)])
    assert p.cache_miss
    (p,) = dr.propose([_request("b", T[:28], aux[:27], 0, start=20)])
    assert p.cache_miss
    (p,) = dr.propose([DraftRequest.for_tokens("a", T[:28], 24, k=4, sampling=SamplingParams(temperature=0), seed=1,
                                               provisional=True)])
    assert p.cache_miss and not p.tokens
    (p,) = dr.propose([_request("a", T[:28], aux[:27], 0)])
    assert p.tokens == ref(28) and dr.num_cached() == 1
    assert dr.release("a") and dr.num_cached() == 0
    # sequences of different lengths in one call: one padded pass, each its own drafts
    pc, pd = dr.propose([_request("c", T[:12], aux[:11], 0), _request("d", T[:27], aux[:26], 0, k=2)])
    assert pc.tokens == ref(12) and pd.tokens == ref(27, 2)


# ------------------------------------------------------------ heads built to copy the target: drafts accepted
def bigram_target(tok):
    """A peaked tiny target whose layers add nothing (o_proj and down_proj zero): its next token is a function f of
    the current one, argmax lm_head(norm(embed(x)))."""
    from tests.helpers import tiny_llama

    target = tiny_llama(len(tok), peak=30.0, eos_token_id=None)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return target


def copying_head(target, method: str, mask: int) -> ParallelHead:
    """A head whose mask queries read the anchor alone and give the target's logits for it: the mask token
    embeds to 0 (its key, value and query vanish) and the context states project to 0 (fc), so attention
    averages the anchor's value with zeros; values and o_proj are the identity, the MLP adds nothing, and
    the final norm and lm_head are the target's, whose layers add nothing either: position 1 drafts f(anchor),
    the target's own token. DSpark's Markov head adds a bias whose argmax is f(previous draft) (unit rows of
    markov_w2, markov_w1[t] a large multiple of row f(t)), so its whole block is the target's greedy chain."""
    tc = target.config
    V, H = tc.vocab_size, tc.hidden_size
    spec = ParallelSpec(method=method, hidden_size=H, num_attention_heads=4, num_key_value_heads=4, head_dim=H // 4,
                        intermediate_size=2 * H, rms_norm_eps=tc.rms_norm_eps, max_position_embeddings=256,
                        vocab_size=V, draft_vocab_size=V, target_hidden_size=H, aux_layer_ids=[0, 1], block_size=5,
                        mask_token_id=mask, markov_rank=32 if method == "dspark" else 0)
    torch.manual_seed(0)
    head = ParallelHead(spec)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.1)
        head.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        head.embed_tokens.weight[mask] = 0
        head.fc.weight.zero_()
        a = head.layers[0].self_attn
        a.v_proj.weight.copy_(torch.eye(H))
        a.o_proj.weight.copy_(torch.eye(H))
        head.layers[0].mlp.down_proj.weight.zero_()
        for n in (head.layers[0].input_layernorm, head.layers[0].post_attention_layernorm, head.hidden_norm):
            n.weight.fill_(1.0)
        head.norm.weight.copy_(target.model.norm.weight)
        head.lm_head.weight.copy_(target.lm_head.weight)
        if method == "dspark":
            f = target(input_ids=torch.arange(V).view(V, 1)).logits[:, 0].argmax(-1)  # [V]: the target's next token
            w2 = torch.nn.functional.normalize(torch.randn(V, spec.markov_rank), dim=-1)
            head.markov_head.markov_w2.weight.copy_(w2)
            head.markov_head.markov_w1.weight.copy_(1e4 * w2[f])
    return head.eval()


@pytest.fixture(scope="module")
def copying(tiny_pair):
    """(bigram target, {method: its copying head})."""
    tok = tiny_pair[0]
    target = bigram_target(tok)
    return target, {m: copying_head(target, m, tok.pad_token_id) for m in METHODS}


@pytest.mark.parametrize("method", METHODS)
def test_greedy_with_the_head_equals_the_target(copying, tiny_pair, method):
    from core.loop import speculate_local
    from core.policy import FixedK
    from core.sequence import Sequence
    from tests.test_processors import hf_greedy
    from verifier.engine import VerifierEngine

    tok, _, _ = tiny_pair
    target, heads = copying
    ver = VerifierEngine(VerifierConfig(model="tiny", dtype="float32", cache_budget_mb=64), model=target, tokenizer=tok)
    dr = drafter(method, heads[method])
    accepted = drafted = 0
    for i, text in enumerate(["def add(a, b):", "class Point:", "for i in range(10):"]):
        ids = tok(text)["input_ids"]
        seq = Sequence(ids, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), 4, tok, ver.eos_ids,
                       ver.max_len, seq_id=f"g{i}")
        asyncio.run(speculate_local(seq, dr, ver, FixedK(4)))
        assert seq.output_ids == hf_greedy(target, ids, 40), text
        stats = seq.stats.as_dict()
        accepted, drafted = accepted + stats["num_accepted_tokens"], drafted + stats["num_draft_tokens"]
        assert ver.num_cached() == 0 and dr.num_cached() == 0
    # DFlash's block reads the anchor alone here: its first draft is the target's; DSpark chains all of them
    assert drafted > 0 and accepted / drafted > (0.95 if method == "dspark" else 0.2), (accepted, drafted)
    assert dr.stats["passes"] > 0 and dr.stats["drafts"] <= 4 * dr.stats["passes"]  # one pass per block


# ------------------------------------------------------------ distribution (tiny target, exact)
def _tiny(method: str):
    from tests.helpers import tiny_llama, tiny_tokenizer
    from tests.test_eagle3_serving import V
    from verifier.engine import VerifierEngine

    target = tiny_llama(V, layers=2, hidden=24, seed=3, peak=3.0, eos_token_id=None)
    ver = VerifierEngine(VerifierConfig(model="tiny", dtype="float32", cache_budget_mb=64), model=target,
                         tokenizer=tiny_tokenizer())
    head = random_head(tiny_spec(method, vocab=V, draft_vocab=5, aux=(0, 1, 2)), seed=4)  # q is 0 on 3 tokens
    return target, ver, head


class _WrongQ:
    """A control: drafts as the drafter does, but reports a q that is not the one drafted from (uniform over
    the same support), so rejection sampling is not lossless."""

    def __init__(self, inner):
        self.inner, self.aux_layers = inner, inner.aux_layers

    def propose(self, requests):
        props = self.inner.propose(requests)
        for p in props:
            if p.probs is not None:
                p.probs.probs = [[1.0 / len(row)] * len(row) for row in p.probs.probs]
        return props

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.heavy  # 3000 sampled sequences through the loop
@pytest.mark.parametrize("method,control,verification", [("dflash", False, "rejection"), ("dspark", False, "rejection"),
                                                         ("dspark", False, "gumbel"), ("dspark", True, "rejection")],
                         ids=["dflash", "dspark", "dspark-gumbel", "dspark-wrong-q"])
def test_sampled_output_is_the_targets_distribution(method, control, verification):
    from core.loop import generate
    from tests.test_eagle3_serving import _exact
    from tests.test_rejection import min_p_value_of

    target, ver, head = _tiny(method)
    dr = drafter(method, head, cache_budget_mb=64)
    N = 3000
    params = [SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, seed=s, verification=verification)
              for s in range(N)]
    prompt = [0, 3]
    seqs = generate([prompt] * N, params, 3, _WrongQ(dr) if control else dr, ver)
    tokens = torch.tensor([s.output_ids for s in seqs])
    drafted = sum(s.stats.as_dict()["num_draft_tokens"] for s in seqs)
    assert drafted > N, drafted  # the steps after the first speculated
    p = min_p_value_of(tokens, _exact(target, params[0], prompt, 4))
    assert (p < 1e-3) if control else (p > 1e-3), p


# ------------------------------------------------------------ served, over HTTP
@pytest.fixture(scope="module")
def head_dirs(copying, tiny_pair, tmp_path_factory):
    """The bigram target (with the tiny tokenizer) and its copying heads as directories."""
    root = tmp_path_factory.mktemp("parallel-heads")
    target, heads = copying
    target_dir = root / "target"
    target.save_pretrained(target_dir)
    tiny_pair[0].save_pretrained(target_dir)
    for method, head in heads.items():
        save_head(head, root / method, head.spec.to_config(str(target_dir), ["LlamaForCausalLM"]), dtype=torch.float32)
    return root


@pytest.mark.long  # a served app per head type
@pytest.mark.parametrize("method", METHODS)
def test_served_greedy_with_the_head_on_the_drafter_pool_equals_the_target(serve_app, head_dirs, copying, tiny_pair,
                                                                            method):
    from tests.conftest import side_app
    from tests.test_processors import hf_greedy

    tok, (target, _) = tiny_pair[0], copying
    args = {"model_name": "tiny",
            "verifier": {"model": None, "dtype": "float32", "cache_budget_mb": 64, "num_threads": 1},
            "drafter": {"method": method, "model": str(head_dirs / method), "dtype": "float32", "num_threads": 1},
            "k_policy": "fixed"}
    with side_app(serve_app, method, args) as url:  # the verifier: the one the head's config names
        body = {"model": "tiny", "temperature": 0, "max_tokens": 40, "ignore_eos": True, "return_token_ids": True,
                "return_timing": True}
        for text in ["def add(a, b):", "class Point:"]:
            r = httpx.post(f"{url}/v1/completions", json={**body, "prompt": text}, timeout=120)
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["choices"][0]["token_ids"] == hf_greedy(target, tok(text)["input_ids"], 40)
            spec = out["choices"][0]["speculation"]
            assert spec["num_drafts"] > 3, spec
            assert spec["mean_acceptance_length"] > (4.5 if method == "dspark" else 1.8), spec
            assert spec["degraded_steps"] == 0, spec
            assert spec["aux_bytes_per_token"] > 0, spec


@pytest.mark.parametrize("method", METHODS)
def test_the_in_process_cli_runs_an_exported_head(head_dirs, method, capsys):
    """``python -m offline.generate --drafter <exported head>``: the head's config picks its drafter."""
    import ast

    from offline.generate import main

    main(["--target", str(head_dirs / "target"), "--drafter", str(head_dirs / method), "--prompt", "def add(a, b):",
          "--max-tokens", "24", "-k", "4"])
    stats = ast.literal_eval(capsys.readouterr().out.rsplit("--- k=4: ", 1)[1].strip())
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] > 0, stats


def test_the_app_builder_reads_and_checks_the_head(head_dirs):
    from configs import AppConfig
    from deployments.app import check_models, local_view, resolve_model_paths

    def built(**drafter):
        args = {"verifier": {"model": None},
                "drafter": {"method": "dspark", "model": str(head_dirs / "dspark"), **drafter}}
        return resolve_model_paths(AppConfig.model_validate(args))

    cfg = built()  # the verifier the head's config names, k its block
    assert cfg.verifier.model == str(head_dirs / "target") and cfg.drafter.num_speculative_tokens == 4
    assert check_models(local_view(cfg)) == (0, 1)  # the states the verifier captures for it
    with pytest.raises(ValueError, match="num_speculative_tokens 6 exceeds the head's block"):
        check_models(local_view(built(num_speculative_tokens=6)))
    vllm = cfg.model_copy(update={"verifier": cfg.verifier.model_copy(update={"backend": "vllm"})})
    with pytest.raises(ValueError, match="verifier.backend transformers"):
        check_models(local_view(vllm))
