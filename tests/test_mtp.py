"""Native MTP layers against vLLM 0.32: k draft logits equal vLLM's MTP drafting on fixed random weights.

vLLM's MTP models need an engine (its decoder layers take tensor-parallel groups, a KV cache and a forward
context), so ``vllm_drafts`` re-creates vLLM's drafting from its source: the target config rewritten as vLLM
does (``SpeculativeConfig.hf_config_override``: the MTP architecture), what its proposer feeds back chosen by
vLLM's own ``model_returns_tuple``, vLLM's ``RMSNorm`` for the target's final norm (vLLM's target returns the
normed state), ``enorm``, ``hnorm`` and ``shared_head.norm``, and ``DeepSeekMultiTokenPredictorLayer.forward`` /
``Glm4MoeMultiTokenPredictorLayer.forward``: the embedding zeroed at position 0, eh_proj(cat), the decoder
layer, ``shared_head``. The decoder layer is the family's transformers module, from a model built with one
layer more whose last layer holds the MTP block (``tests/mtp_models.py``): loaded by transformers' own
loader, not by ``core.mtp``'s. Each step recomputes every row without a cache (causal), where vLLM and
``core.mtp`` keep keys and values: the same attention, computed another way."""

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from core.mtp import MtpSpec, UnsupportedMtp, check_model, load_head, mtp_weight_names
from tests.mtp_models import CONTRACT_FAMILY, VOCAB, write_target

FAMILIES = ["glm4_moe", "glm4_moe_lite", "deepseek_v3"]
PROMPT = [3, 17, 101, 44, 250, 9, 77, 77, 12, 198, 5, 63, 140]
K = 4


@pytest.fixture(scope="module", params=FAMILIES)
def target(request, tmp_path_factory):
    path, model, extra = write_target(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, path, model, extra


def feeds_back_normed(cfg: dict) -> bool:
    """What vLLM's proposer feeds back: the second of a tuple-returning MTP model's outputs (the normed one)."""
    from transformers import AutoConfig
    from vllm.config.speculative import SpeculativeConfig
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    hf = SpeculativeConfig.hf_config_override(AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "auto_map"}))
    ns = SimpleNamespace(method="mtp", draft_model_config=SimpleNamespace(hf_config=hf))
    return SpecDecodeBaseProposer.model_returns_tuple(ns)


def vllm_drafts(path, model, extra, states: torch.Tensor, tokens: list[int], k: int):
    """vLLM's k MTP drafts for one request (module docstring): (drafts, logits [k, V])."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    cfg = json.loads((path / "config.json").read_text())
    N, H, eps = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["rms_norm_eps"]
    base = f"model.layers.{N}."
    tuple_model = feeds_back_normed(cfg)
    block, rotary = model.model.layers[N], model.model.rotary_emb
    with set_current_vllm_config(VllmConfig()), torch.no_grad():
        def norm(w):
            m = RMSNorm(H, eps=eps)
            m.weight.data.copy_(w)
            return m.forward_native

        final = norm(model.model.norm.weight)
        enorm, hnorm = norm(extra[base + "enorm.weight"]), norm(extra[base + "hnorm.weight"])
        head_norm = norm(extra[base + "shared_head.norm.weight"])
        ids, pos = list(tokens[1:]), list(range(len(tokens) - 1))
        prev = [final(s) for s in states]  # the target's returned hidden states
        drafts, rows = [], []
        for _ in range(k):
            e = model.model.embed_tokens(torch.tensor(ids))
            p = torch.tensor(pos)
            e = torch.where(p.unsqueeze(-1) == 0, 0, e)
            h = F.linear(torch.cat([enorm(e), hnorm(torch.stack(prev))], -1),
                         extra[base + "eh_proj.weight"]).unsqueeze(0)
            T = h.shape[1]
            causal = torch.zeros(T, T).masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
            out = block(h, attention_mask=causal.view(1, 1, T, T), position_ids=p.unsqueeze(0),
                        position_embeddings=rotary(h, p.unsqueeze(0)))[0]
            normed = head_norm(out)
            logits = F.linear(normed[-1], extra[base + "shared_head.head.weight"])
            rows.append(logits)
            drafts.append(int(logits.argmax()))
            ids.append(drafts[-1])
            pos.append(pos[-1] + 1)
            prev.append(normed[-1] if tuple_model else out[-1])
    return drafts, torch.stack(rows)


def test_draft_logits_equal_vllms(target):
    """k = 4 MTP drafts (one layer applied four times): every step's logits equal vLLM's (1e-4), and the feedback
    is the family's (DeepSeek: the normed output; GLM-4.5: the output)."""
    pytest.importorskip("vllm")
    family, path, model, extra = target
    head = load_head(path)
    assert head.spec.feeds_normed == feeds_back_normed(json.loads((path / "config.json").read_text()))
    g = torch.Generator().manual_seed(5)
    states = torch.randn(len(PROMPT) - 1, 64, generator=g) * 2
    drafts, logits = head.draft(PROMPT, states, K, return_logits=True)
    ref_drafts, ref = vllm_drafts(path, model, extra, states, PROMPT, K)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    assert drafts == ref_drafts


def test_only_the_mtp_weights_are_read(target):
    """The head's tensors are the first MTP layer's, the embedding, the final norm and the head: none of the
    target's decoder layers 0..N-1. Its decoder block equals transformers' own layer N (the experts packed alike)."""
    family, path, model, _ = target
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as h:
        names = list(h.keys())
    spec = check_model(path)
    read = set(mtp_weight_names(spec, names).values())
    assert not any(n.startswith(f"model.layers.{i}.") for n in read for i in range(spec.num_hidden_layers))
    assert "model.norm.weight" in read and "model.embed_tokens.weight" in read
    head = load_head(path)
    ours, theirs = head.layer.mtp_block.state_dict(), model.model.layers[spec.num_hidden_layers].state_dict()
    assert set(ours) == set(theirs)
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0)


def test_the_target_state_is_the_normed_last_layer(target):
    """h_t is the target's output after its final norm: the head's ``target_hidden`` of the stream entering
    layer N equals transformers' last hidden state."""
    family, path, model, _ = target
    from transformers import AutoModelForCausalLM

    from core.llama import capture_states

    tgt = AutoModelForCausalLM.from_pretrained(path).float().eval()
    head = load_head(path)
    ids = torch.tensor([PROMPT])
    N = head.spec.num_hidden_layers
    with torch.no_grad(), capture_states(tgt, (N,)) as states:
        out = tgt(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(head.target_hidden(states[N][0]), out.hidden_states[-1][0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change, field", [
    ({"model_type": "qwen3_next"}, "model_type"),
    ({"model_type": "mimo"}, "model_type"),
    ({"num_nextn_predict_layers": 0}, "num_nextn_predict_layers"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"index_topk": 2048}, "index_topk"),
    ({"speculators_model_type": "fastmtp"}, "speculators_model_type"),
])
def test_refusals_name_the_field(change, field):
    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 4, "num_nextn_predict_layers": 1, "hidden_size": 64,
           "vocab_size": VOCAB}
    MtpSpec.from_config(cfg)
    with pytest.raises(UnsupportedMtp, match=field):
        MtpSpec.from_config({**cfg, **change})


# ------------------------------------------------------------ the drafter on the pool
def _request(seq_id, tokens, aux, aux_start, k=4, start=None, sampling=None):
    from configs import SamplingParams
    from core.protocol import DraftRequest

    sp = sampling or SamplingParams(temperature=0)
    if start is None:
        return DraftRequest(seq_id, 0, None, list(tokens), k=k, sampling=sp, seed=1, full=True, aux=aux,
                            aux_start=aux_start)
    return DraftRequest.for_tokens(seq_id, list(tokens), start, k=k, sampling=sp, seed=1, aux=aux, aux_start=aux_start)


def drafter(path, **kw):
    from configs.models import MtpConfig
    from drafter.mtp_drafter import MtpDrafter

    return MtpDrafter(MtpConfig(model=str(path), dtype="float32", **kw), eos_ids=set())


def target_states(path, tokens):
    """The stream entering layer N at each position, as the verifier captures it."""
    from transformers import AutoModelForCausalLM

    from core.llama import capture_states

    tgt = AutoModelForCausalLM.from_pretrained(path).float().eval()
    N = tgt.config.num_hidden_layers
    with torch.no_grad(), capture_states(tgt, (N,)) as states:
        tgt(input_ids=torch.tensor([tokens]))
    return states[N][0]


def test_drafter_equals_the_reference_whole_incremental_and_after_misses(target):
    """The pool's drafter (rows kept per sequence, draft rows dropped at the next call) drafts what the reference
    drafts: whole, incrementally with the loop's states, after misses, and two sequences in one call."""
    from configs import SamplingParams
    from core.protocol import DraftRequest

    family, path, _, _ = target
    head = load_head(path)
    dr = drafter(path)
    T = torch.randint(3, VOCAB, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    g = target_states(path, T)
    ref = lambda n, k=4: head.draft(T[:n], g[: n - 1], k)  # noqa: E731 - drafts after T[:n]
    (p,) = dr.propose([_request("a", T[:20], g[:19], 0)])
    assert p.tokens == ref(20) and p.cached == 20 and not p.cache_miss
    (p,) = dr.propose([_request("a", T[:24], g[19:23], 19, start=20)])  # the loop sends from cached - 1
    assert p.tokens == ref(24) and p.cached == 24
    (p,) = dr.propose([_request("a", T[:25], g[21:24], 21, start=22, k=6)])  # the tokens after 22 resent
    assert p.tokens == ref(25, 6)
    (p,) = dr.propose([_request("a", T[:28], g[26:27], 26, start=25)])  # states that do not reach the held rows
    assert p.cache_miss
    (p,) = dr.propose([_request("b", T[:28], g[:27], 0, start=20)])  # a prefix not held
    assert p.cache_miss
    (p,) = dr.propose([DraftRequest.for_tokens("c", T[:28], 25, k=4, sampling=SamplingParams(temperature=0), seed=1,
                                               provisional=True)])  # a pre-draft: declined
    assert p.cache_miss and not p.tokens
    pc, pd = dr.propose([_request("c", T[:12], g[:11], 0), _request("d", T[:27], g[:26], 0, k=2)])
    assert pc.tokens == ref(12) and pd.tokens == ref(27, 2)
    assert dr.release("c") and dr.num_cached() == 1


def test_a_pre_draft_continues_the_chain(target):
    """A pre-draft (the block being verified guessed accepted, its states not computed) continues from the layer's
    own rows: its drafts are the ones a longer chain drafts in one call; a guess that is not the chain is declined,
    and the next ordinary call drafts from the target's states again."""
    from configs import SamplingParams
    from core.protocol import DraftRequest

    family, path, _, _ = target
    dr = drafter(path)
    T = torch.randint(3, VOCAB, (24,), generator=torch.Generator().manual_seed(6)).tolist()
    g = target_states(path, T)
    (long,) = dr.propose([_request("z", T[:20], g[:19], 0, k=7)])
    (p,) = dr.propose([_request("a", T[:20], g[:19], 0, k=4)])  # the loop asks k + 1: the last guesses the bonus
    assert p.tokens == long.tokens[:4]

    def pre(guess, k=3):
        return DraftRequest.for_tokens("a", T[:20] + guess, 20, k=k, sampling=SamplingParams(temperature=0), seed=1,
                                       provisional=True)

    (q,) = dr.propose([pre(long.tokens[:4])])
    assert q.tokens == long.tokens[4:7] and not q.cache_miss
    (q,) = dr.propose([pre([(long.tokens[0] + 1) % VOCAB] + long.tokens[1:4])])  # another chain: declined
    assert q.cache_miss and not q.tokens
    (p,) = dr.propose([_request("a", T[:22], g[19:21], 19, start=20)])
    assert p.tokens == load_head(path).draft(T[:22], g[:21], 4)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_with_a_copying_mtp_layer_equals_the_target(tmp_path, family):
    """A target whose next token is a function of the current one, and its MTP layer computing the same function
    (``tests.mtp_models``): through the loop with pre-drafting, greedy equals the target's generate and every draft
    of the k-step chain is accepted. The verifier runs each family over its paged cache (GLM-4.7-Flash's and
    DeepSeek-V3's latent attention: the compressed latents)."""
    import asyncio

    from transformers import AutoModelForCausalLM

    from configs import SamplingParams, VerifierConfig
    from core.loop import speculate_local
    from core.policy import FixedK
    from core.sequence import Sequence
    from tests.helpers import tiny_tokenizer
    from tests.mtp_models import write_target
    from tests.test_processors import hf_greedy
    from verifier.engine import VerifierEngine

    tok = tiny_tokenizer()
    path, _, _ = write_target(family, tmp_path / family, vocab=len(tok), copying=True)
    tgt = AutoModelForCausalLM.from_pretrained(path).float().eval()
    ver = VerifierEngine(VerifierConfig(model="glm", dtype="float32", cache_budget_mb=64), model=tgt, tokenizer=tok)
    dr = drafter(path, cache_budget_mb=16)
    accepted = drafted = 0
    for i, text in enumerate(["def add(a, b):", "class Point:", "for i in range(10):"]):
        ids = tok(text)["input_ids"]
        seq = Sequence(ids, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), 4, tok, ver.eos_ids,
                       ver.max_len, seq_id=f"m{i}")
        asyncio.run(speculate_local(seq, dr, ver, FixedK(4)))
        assert seq.output_ids == hf_greedy(tgt, ids, 24), text
        accepted += seq.stats.num_accepted_tokens
        drafted += seq.stats.num_draft_tokens
        assert dr.num_cached() == 0
    assert drafted > 0 and accepted / drafted > 0.95, (accepted, drafted)


# ------------------------------------------------------------ the distribution
def sampling_world(tmp_path=None, family: str = CONTRACT_FAMILY):
    """(a target of 8 tokens, its verifier, the drafter of its random MTP layer)."""
    import tempfile
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from configs import VerifierConfig
    from tests.helpers import tiny_tokenizer
    from tests.mtp_models import write_target
    from tests.test_eagle3_serving import V
    from verifier.engine import VerifierEngine

    tmp_path = tmp_path or Path(tempfile.mkdtemp(prefix="mtp-sampling-"))
    path, _, _ = write_target(family, tmp_path / f"{family}8", vocab=V, peaked=3.0, seed=3)
    target = AutoModelForCausalLM.from_pretrained(path).float().eval()
    ver = VerifierEngine(VerifierConfig(model="tiny", dtype="float32", cache_budget_mb=64), model=target,
                         tokenizer=tiny_tokenizer())
    return target, ver, drafter(path, cache_budget_mb=64)


@pytest.mark.heavy  # 2000 sampled sequences through the loop, twice
@pytest.mark.parametrize("control", [False, True], ids=["mtp", "mtp-wrong-q"])
def test_sampled_output_at_t08_is_the_targets_distribution(control, tmp_path):
    """At T = 0.8 the output is the target's exact distribution (chi-square); a control that reports a q other than
    the one each draft was drawn from (uniform over the same support) fails it."""
    from tests.test_dflash import _WrongQ
    from tests.test_drafter_contract import sampled_p_value

    target, ver, dr = sampling_world(tmp_path, "glm4_moe")  # (the contract's run holds GLM-4.7-Flash's)
    n = 2000
    p, drafted = sampled_p_value(target, ver, _WrongQ(dr) if control else dr, [0, 3], n)
    assert drafted > n
    assert (p < 1e-3) if control else (p > 1e-3), p


def test_the_app_builder_reads_and_checks_the_layer(tmp_path):
    """The app builder captures layer N for the MTP layer (DeepSeek-V3's too: the verifier's cache holds its latents);
    a checkpoint that is not the verifier's and the vllm backend are refused by name."""
    from configs import AppConfig
    from deployments.app import check_models, local_view, resolve_model_paths
    from tests.helpers import tiny_tokenizer
    from tests.mtp_models import write_target

    tok = tiny_tokenizer()
    glm, _, _ = write_target("glm4_moe", tmp_path / "glm", vocab=len(tok), copying=True)
    other, _, _ = write_target("glm4_moe", tmp_path / "glm6", layers=6, vocab=len(tok))
    ds, _, _ = write_target("deepseek_v3", tmp_path / "ds", vocab=len(tok))
    for p in (glm, other, ds):
        tok.save_pretrained(p)

    def built(verifier, model, **kw):
        args = {"verifier": {"model": str(verifier), **kw}, "drafter": {"method": "mtp", "model": str(model)}}
        return local_view(resolve_model_paths(AppConfig.model_validate(args)))

    assert check_models(built(glm, glm)) == (4,)
    with pytest.raises(ValueError, match="is not for verifier.model"):
        check_models(built(glm, other))
    assert check_models(built(ds, ds)) == (4,)
    with pytest.raises(ValueError, match="verifier.backend transformers"):
        check_models(built(glm, glm, backend="vllm"))
    cfg = json.loads((glm / "config.json").read_text())
    (glm / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        check_models(built(glm, glm))


@pytest.mark.long  # a served app, the MTP layer in each verifier replica
def test_served_greedy_with_the_layer_in_the_verifier_replica_equals_the_target(serve_app, tmp_path):
    """drafter_placement verifier: the verifier replica drafts with the checkpoint's MTP layer from its own captured
    states; greedy over HTTP equals the target's generate, drafts accepted (the pool's case is the contract's)."""
    import httpx

    from tests.conftest import side_app
    from tests.helpers import tiny_tokenizer
    from tests.mtp_models import served_args
    from tests.test_processors import hf_greedy

    engine = {"dtype": "float32", "cache_budget_mb": 64, "num_threads": 1}
    verifier, drafter_args, tok, target = served_args(tiny_tokenizer(), tmp_path, engine)
    args = {"model_name": "tiny", "verifier": verifier, "drafter": drafter_args, "k_policy": "fixed",
            "drafter_placement": "verifier"}
    with side_app(serve_app, "mtp-colocated", args) as url:
        body = {"model": "tiny", "temperature": 0, "max_tokens": 24, "ignore_eos": True, "return_token_ids": True}
        for text in ["def add(a, b):", "class Point:"]:
            r = httpx.post(f"{url}/v1/completions", json={**body, "prompt": text}, timeout=120)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["token_ids"] == hf_greedy(target, tok(text)["input_ids"], 24), text
            assert choice["speculation"]["mean_acceptance_length"] > 3, choice["speculation"]


def test_the_glm47_flash_config_builds_with_a_stand_in_under_its_id(tmp_path, monkeypatch):
    """configs/serve_gpu_glm47_flash_mtp.yaml validates as a Serve config and an ``AppConfig``; with a tiny
    GLM-4.7-Flash stand-in (its MTP layer as the published checkpoint lays it out) under the config's id in an offline
    hub cache, its ids resolve and the app builder's checks pass, reading layer N; only the engine's CPU settings
    differ from the file."""
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    from configs import AppConfig
    from deployments.app import check_models, local_view, resolve_model_paths
    from tests.helpers import tiny_tokenizer
    from tests.hub_cache import lay_out, model_files, offline_home

    root = Path(__file__).resolve().parent.parent
    config = yaml.safe_load((root / "configs" / "serve_gpu_glm47_flash_mtp.yaml").read_text())
    ServeDeploySchema.model_validate(config)
    (app,) = config["applications"]
    args = json.loads(json.dumps(app["args"]))
    assert args["verifier"]["model"] == args["drafter"]["model"] == "zai-org/GLM-4.7-Flash"
    assert args["drafter"]["method"] == "mtp" and args["drafter_placement"] == "verifier"
    tok = tiny_tokenizer()
    path, _, _ = write_target("glm4_moe_lite", tmp_path / "stand-in", vocab=len(tok))
    tok.save_pretrained(path)
    lay_out(offline_home(tmp_path, monkeypatch), args["verifier"]["model"], model_files(path))
    for role in ("verifier", "drafter"):
        args[role].update(device="cpu", dtype="float32", cache_budget_mb=32, max_model_len=128)
    cfg = resolve_model_paths(AppConfig.model_validate(args))
    assert cfg.verifier.model == cfg.drafter.model and cfg.verifier.model.startswith("zai-org/GLM-4.7-Flash@")
    assert check_models(local_view(cfg)) == (4,)
