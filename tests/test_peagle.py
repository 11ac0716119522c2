"""P-EAGLE heads against vLLM 0.32: the draft logits of one parallel-drafting pass equal vLLM's.

vLLM's parallel drafting does not run on a CPU (``_copy_and_expand_eagle_inputs`` is a Triton kernel, the
proposer needs an engine), so ``vllm_block`` re-creates it from vLLM's source on fixed random weights, with
vLLM's own pieces where they run outside an engine: the config as vLLM reads it (``SpeculatorsConfig`` and its
``peagle`` updater, or the EAGLE config's attributes; the placeholder token by
``get_parallel_drafting_token_id``), its ``RMSNorm`` (the fused residual add) and ``get_rope``, and
``llama_eagle3``'s forward: ``combine_hidden_states`` (also over ``mask_hidden``, once, as
``load_model`` does), the expanded inputs (the shifted tokens, the bonus token, k - 1 placeholders with the
placeholder state, positions start..), the first layer's cat(embeds, hidden) with
``norm_before_residual``'s two orders, causal attention, the final norm and ``compute_logits``' d2t
scatter at the bonus and placeholder rows."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from core.eagle3 import UnsupportedHead, draft_vocabulary
from core.peagle import PEagleHead, PEagleSpec, check_head, load_head

VOCAB, TARGET_HIDDEN, K = 256, 48, 5
PROMPT = [3, 17, 101, 44, 250, 9, 77, 77, 12, 198, 5, 63, 140]  # x_0..x_{n+1}


def layer(hidden=64, layers=1, model_type="llama", **extra):
    return {"model_type": model_type, "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_attention_heads": hidden // 32, "num_key_value_heads": 1, "head_dim": 32, "num_hidden_layers": layers,
            "rms_norm_eps": 1e-6, "vocab_size": VOCAB, "max_position_embeddings": 256, "hidden_act": "silu",
            "tie_word_embeddings": False, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, **extra}


def speculators(lay: dict, draft_vocab: int, **extra) -> dict:
    return {"architectures": ["PEagleSpeculator"], "speculators_model_type": "peagle",
            "speculators_config": {"algorithm": "peagle", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": K}],
                                   "verifier": {"name_or_path": "verifier", "architectures": ["LlamaForCausalLM"]}},
            "transformer_layer_config": {"architectures": ["LlamaForCausalLM"], **lay}, "draft_vocab_size": draft_vocab,
            "target_hidden_size": TARGET_HIDDEN, "eagle_aux_hidden_state_layer_ids": [1, 3, 5],
            "mask_token_id": VOCAB - 1, **extra}


def eagle(lay: dict, draft_vocab: int, **extra) -> dict:
    """vLLM's own EAGLE-3 layout, as the AWS gpt-oss P-EAGLE heads ship (served with parallel_drafting: true)."""
    return {"architectures": ["LlamaForCausalLMEagle3"], **lay, "draft_vocab_size": draft_vocab,
            "target_hidden_size": TARGET_HIDDEN, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]},
            **extra}


# the old keys, as the published EAGLE-layout heads write them
LLAMA3 = {"rope_parameters": None, "rope_theta": 500000.0,
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8}}
VARIANTS = {
    # Speculators' peagle: one layer, norm_before_residual absent (false for peagle, unlike eagle3), a draft vocabulary
    "speculators": speculators(layer(), draft_vocab=128),
    # the same with two layers and norm_before_residual true
    "speculators_two_layers": speculators(layer(layers=2), draft_vocab=VOCAB, norm_before_residual=True),
    # the AWS style: vLLM's EAGLE layout, several layers, llama3 rope, the placeholder as ptd_token_id, norm_before_fc
    "eagle_layout": eagle(layer(layers=3, **LLAMA3), draft_vocab=128, ptd_token_id=VOCAB - 2,
                          eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 5], "norm_before_fc": True}),
}


def random_state(spec: PEagleSpec, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in PEagleHead(spec).state_dict().items():
        if name in ("d2t", "t2d"):
            continue
        if "norm" in name:
            w = 1 + 0.2 * torch.randn(p.shape, generator=g)
        else:
            scale = 0.5 if "embed" in name or "mask_hidden" in name else p.shape[-1] ** -0.5
            w = torch.randn(p.shape, generator=g) * scale
        state[name] = w.bfloat16().float()
    state["mask_hidden"] = state["mask_hidden"].reshape(-1)  # as published: one row, vLLM views it [1, -1]
    if spec.draft_vocab_size != spec.vocab_size:
        state["d2t"], state["t2d"] = draft_vocabulary(torch.randint(0, 1000, (VOCAB,), generator=g),
                                                      spec.draft_vocab_size)
    return state


def write(tmp, name: str, seed: int = 0):
    from safetensors.torch import save_file

    cfg = VARIANTS[name]
    path = tmp / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    state = random_state(PEagleSpec.from_config(cfg, 8), seed)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    return path, cfg, state


def vllm_config_reading(cfg: dict):
    """(the draft's hf_config, the placeholder token) as vLLM 0.32 builds them from the config."""
    from transformers import LlamaConfig
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig
    from vllm.v1.worker.gpu.spec_decode.utils import get_parallel_drafting_token_id

    if "speculators_model_type" in cfg:
        hf = SpeculatorsConfig(**SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(cfg))))
    else:
        # AutoConfig by model_type (llama): the rope keys normalised into rope_parameters as vLLM sees them
        hf = LlamaConfig(**{k: v for k, v in json.loads(json.dumps(cfg)).items() if k != "rope_parameters"})
    return hf, get_parallel_drafting_token_id(hf)


def vllm_block(cfg: dict, state: dict, aux: torch.Tensor, tokens: list[int], k: int) -> torch.Tensor:
    """vLLM's one parallel-drafting pass for one request (module docstring): target-vocabulary logits [k, V]."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import get_rope

    hf, pard = vllm_config_reading(cfg)
    L, H, D = hf.num_hidden_layers, hf.hidden_size, hf.head_dim
    nh, nkv, eps = hf.num_attention_heads, hf.num_key_value_heads, hf.rms_norm_eps
    eagle_cfg = getattr(hf, "eagle_config", None) or {}
    norm_before_fc = bool(eagle_cfg.get("norm_before_fc", getattr(hf, "norm_before_fc", False)))
    with set_current_vllm_config(VllmConfig()):
        def norm(name, n):
            m = RMSNorm(n, eps=eps)
            m.weight.data.copy_(state[name])
            return m

        def combine(x):  # Eagle3LlamaForCausalLM.combine_hidden_states
            if norm_before_fc:
                x = norm("input_norm.weight", x.shape[-1]).forward_native(x)
            return F.linear(x, state["fc.weight"])

        rope = get_rope(D, max_position=hf.max_position_embeddings, is_neox_style=True,
                        rope_parameters=hf.rope_parameters)
        n1 = len(tokens) - 1
        # _copy_and_expand_eagle_inputs (shift_input_ids): x_1..x_n, the bonus x_{n+1}, k - 1 placeholders
        ids = torch.tensor(tokens[1:] + [pard] * (k - 1))
        T = ids.shape[0]
        pos = torch.arange(T)
        hidden = torch.cat([combine(aux), combine(state["mask_hidden"].view(1, -1)).expand(k - 1, -1)])
        embeds = F.embedding(ids, state["embed_tokens.weight"])
        residual = None
        for i in range(L):
            p = f"layers.{i}."
            if i == 0:
                e = norm(p + "input_layernorm.weight", H).forward_native(embeds)
                hn = norm(p + "hidden_norm.weight", H)
                if getattr(hf, "norm_before_residual", False):
                    hidden = hn.forward_native(hidden)
                    residual = hidden
                else:
                    residual, hidden = hidden, hn.forward_native(hidden)
                x = torch.cat([e, hidden], dim=-1)
            else:
                x, residual = norm(p + "input_layernorm.weight", H).forward_native(hidden, residual)
            q = F.linear(x, state[p + "self_attn.q_proj.weight"])
            kk = F.linear(x, state[p + "self_attn.k_proj.weight"])
            v = F.linear(x, state[p + "self_attn.v_proj.weight"])
            q, kk = rope.forward_native(pos, q.clone(), kk.clone())
            qh = q.view(T, nh, D).transpose(0, 1)
            Kh = kk.view(T, nkv, D).repeat_interleave(nh // nkv, dim=1).transpose(0, 1)
            Vh = v.view(T, nkv, D).repeat_interleave(nh // nkv, dim=1).transpose(0, 1)
            scores = (qh @ Kh.transpose(1, 2)) * D ** -0.5
            causal = torch.ones(T, T, dtype=torch.bool).tril()
            o = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ Vh
            h = F.linear(o.transpose(0, 1).reshape(T, nh * D), state[p + "self_attn.o_proj.weight"])
            h, residual = norm(p + "post_attention_layernorm.weight", H).forward_native(h, residual)
            gate_up = torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]])
            gate, up = F.linear(h, gate_up).chunk(2, -1)
            hidden = F.linear(F.silu(gate) * up, state[p + "mlp.down_proj.weight"])
        out = norm("norm.weight", H).forward_native(hidden, residual)[0]
    rows = out[n1 - 1:]  # token_indices_to_sample: the bonus slot and the placeholders
    logits = F.linear(rows, state["lm_head.weight"])
    if "d2t" not in state:
        return logits
    full = logits.new_full((k, VOCAB), float("-inf"))
    full[:, torch.arange(logits.shape[1]) + state["d2t"]] = logits
    return full


@pytest.fixture(scope="module")
def vllm_available():
    pytest.importorskip("vllm")


@pytest.mark.parametrize("name", list(VARIANTS))
def test_block_logits_equal_vllms(name, tmp_path, vllm_available):
    """One pass of k = 5 drafts: the head's logits at every block position equal vLLM's forward (1e-4)."""
    path, cfg, state = write(tmp_path, name, seed=7)
    head = load_head(path)
    g = torch.Generator().manual_seed(11)
    aux = (torch.randn(len(PROMPT) - 1, 3 * TARGET_HIDDEN, generator=g) * 2).bfloat16().float()
    drafts, logits = head.draft(PROMPT, aux, K, return_logits=True)
    ref = vllm_block(cfg, state, aux, PROMPT, K)
    ours = head.target_logits(logits)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(ref))
    fin = torch.isfinite(ref)
    torch.testing.assert_close(ours[fin], ref[fin], rtol=1e-4, atol=1e-4)
    assert drafts == [int(r.argmax()) for r in ref]


def test_layouts_read_as_vllm_reads_them(tmp_path):
    """The flags vLLM's readers give: peagle's norm_before_residual false when absent (eagle3's is true), the
    placeholder from mask_token_id or the EAGLE layout's ptd_token_id, the trained k."""
    spec = PEagleSpec.from_config(VARIANTS["speculators"], 8)
    assert (spec.norm_before_residual, spec.mask_token_id, spec.layout, spec.speculative_tokens) == (False, VOCAB - 1,
                                                                                                     "speculators", K)
    spec = PEagleSpec.from_config(VARIANTS["eagle_layout"], 8)
    assert (spec.norm_before_residual, spec.norm_before_fc, spec.mask_token_id, spec.layout, spec.num_layers) == (
        False, True, VOCAB - 2, "eagle", 3)
    assert spec.rope_parameters["rope_type"] == "llama3"


def test_positions_do_not_depend_on_earlier_drafts(tmp_path):
    """The block's rows read placeholders, never drafted tokens: q_i is the same whatever was drafted before i
    (the drafter samples each position independently), and longer blocks keep the shorter ones' rows."""
    path, _, _ = write(tmp_path, "speculators", seed=3)
    head = load_head(path)
    aux = torch.randn(len(PROMPT) - 1, 3 * TARGET_HIDDEN, generator=torch.Generator().manual_seed(1))
    _, five = head.draft(PROMPT, aux, 5, return_logits=True)
    _, three = head.draft(PROMPT, aux, 3, return_logits=True)
    torch.testing.assert_close(five[:3], three, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change, field", [
    ({"mask_token_id": None}, "mask_token_id"),
    ({"mask_token_id": VOCAB}, "mask_token_id"),
    ({"fc_norm": True}, "fc_norm"),
    ({"speculators_model_type": "eagle3"}, "speculators_model_type"),
    ({"transformer_layer_config": {**VARIANTS["speculators"]["transformer_layer_config"], "attention_bias": True}},
     "attention_bias"),
])
def test_refusals_name_the_field(change, field):
    with pytest.raises(UnsupportedHead, match=field):
        PEagleSpec.from_config({**VARIANTS["speculators"], **change}, 8)


def test_eagle_layout_refusals_name_the_field():
    with pytest.raises(UnsupportedHead, match="architectures"):
        PEagleSpec.from_config({**VARIANTS["eagle_layout"], "architectures": ["MedusaModel"]}, 8)
    cfg = {k: v for k, v in VARIANTS["eagle_layout"].items() if k != "ptd_token_id"}
    with pytest.raises(UnsupportedHead, match="mask_token_id"):
        PEagleSpec.from_config(cfg, 8)


def test_a_head_without_mask_hidden_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    path, _, _ = write(tmp_path, "speculators")
    state = load_file(str(path / "model.safetensors"))
    state.pop("mask_hidden")
    save_file(state, str(path / "model.safetensors"))
    with pytest.raises(UnsupportedHead, match="mask_hidden"):
        load_head(path)
    with pytest.raises(UnsupportedHead, match="mask_hidden"):
        check_head(path, None)


# ------------------------------------------------------------ the drafter on the pool
def _request(seq_id, tokens, aux, aux_start, k=4, start=None, sampling=None):
    from configs import SamplingParams
    from core.protocol import DraftRequest

    sp = sampling or SamplingParams(temperature=0)
    if start is None:
        return DraftRequest(seq_id, 0, None, list(tokens), k=k, sampling=sp, seed=1, full=True, aux=aux,
                            aux_start=aux_start)
    return DraftRequest.for_tokens(seq_id, list(tokens), start, k=k, sampling=sp, seed=1, aux=aux, aux_start=aux_start)


def tiny_head(vocab=40, seed=0):
    from tests.peagle_heads import from_eagle3_head
    from tests.test_eagle3 import random_head, tiny_spec

    return from_eagle3_head(random_head(tiny_spec(draft_vocab=30, vocab=vocab), seed=seed), mask_token_id=vocab - 1,
                            seed=seed)


def drafter(head, **kw):
    from configs.models import PEagleConfig
    from drafter.peagle_drafter import PEagleDrafter

    return PEagleDrafter(PEagleConfig(model="x", dtype="float32", **kw), head=head, eos_ids=set())


def test_drafter_equals_the_reference_whole_incremental_and_after_misses():
    """The pool's drafter (paged rows, placeholders in the pass, provisional rows dropped) drafts what the reference
    drafts: whole, incrementally with the loop's states, after misses, and batched with other lengths and k."""
    from configs import SamplingParams
    from core.eagle3 import aux_states
    from core.protocol import DraftRequest
    from tests.helpers import tiny_llama

    target = tiny_llama(40, layers=4, hidden=24, seed=3, peak=3.0, eos_token_id=None)
    head = tiny_head()
    dr = drafter(head)
    T = torch.randint(0, 39, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        aux = aux_states(target, torch.tensor([T]), head.spec.aux_layer_ids)[0][0]
    ref = lambda n, k=4: head.draft(T[:n], aux[: n - 1], k)  # noqa: E731 - drafts after T[:n]
    (p,) = dr.propose([_request("a", T[:20], aux[:19], 0)])
    assert p.tokens == ref(20) and p.cached == 20 and not p.cache_miss
    (p,) = dr.propose([_request("a", T[:24], aux[19:23], 19, start=20)])  # the loop sends from cached - 1
    assert p.tokens == ref(24) and p.cached == 24
    (p,) = dr.propose([_request("a", T[:25], aux[23:24], 23, start=24, k=7)])
    assert p.tokens == ref(25, 7)
    (p,) = dr.propose([_request("b", T[:28], aux[:27], 0, start=20)])  # a prefix not held
    assert p.cache_miss
    (p,) = dr.propose([DraftRequest.for_tokens("a", T[:28], 25, k=4, sampling=SamplingParams(temperature=0), seed=1,
                                               provisional=True)])  # a pre-draft: declined
    assert p.cache_miss and not p.tokens
    (p,) = dr.propose([_request("a", T[:28], aux[:27], 0)])
    assert p.tokens == ref(28) and dr.num_cached() == 1
    pc, pd = dr.propose([_request("c", T[:12], aux[:11], 0), _request("d", T[:27], aux[:26], 0, k=2)])
    assert pc.tokens == ref(12) and pd.tokens == ref(27, 2)
    assert dr.stats["passes"] == 5  # one pass per call, whatever k


def test_each_position_samples_its_own_q():
    """Sampled: each draft is drawn from its own row's q (sent with it), the rows the reference's logits."""
    from configs import SamplingParams
    from core.eagle3 import aux_states
    from core.sampling import processed_probs
    from tests.helpers import tiny_llama

    target = tiny_llama(40, layers=4, hidden=24, seed=3, peak=3.0, eos_token_id=None)
    head = tiny_head()
    T = torch.randint(0, 39, (16,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.no_grad():
        aux = aux_states(target, torch.tensor([T]), head.spec.aux_layer_ids)[0][0]
    sp = SamplingParams(temperature=0.8, verification="rejection")
    (p,) = drafter(head, draft_top_k=40).propose([_request("s", T, aux[:15], 0, k=4, sampling=sp)])
    _, logits = head.draft(T, aux[:15], 4, return_logits=True)
    for i, (ids, probs) in enumerate(zip(p.probs.ids, p.probs.probs)):
        q = processed_probs(head.target_logits(logits[i]).unsqueeze(0), sp)[0]
        assert p.tokens[i] in ids
        torch.testing.assert_close(torch.tensor(probs), q[ids].float() / q[ids].sum(), rtol=1e-4, atol=1e-6)


def test_greedy_with_the_shipped_heads_p_eagle_equals_the_target(tmp_path):
    """The shipped EAGLE-3 head made a P-EAGLE head (``tests.peagle_heads``) through the loop with pre-drafting:
    greedy output token for token the target's generate, its first block positions accepted."""
    import asyncio

    from configs import SamplingParams, VerifierConfig
    from configs.models import PEagleConfig
    from core.loop import speculate_local
    from core.policy import FixedK
    from core.sequence import Sequence
    from drafter.peagle_drafter import PEagleDrafter
    from tests.peagle_heads import from_eagle3_dir
    from tests.test_eagle3 import HEAD, TARGET
    from tests.test_eagle3_serving import CODE
    from tests.test_processors import hf_greedy
    from verifier.engine import VerifierEngine

    ver = VerifierEngine(VerifierConfig(model=str(TARGET), dtype="float32", cache_budget_mb=64, num_threads=1))
    path = from_eagle3_dir(HEAD, tmp_path / "peagle", mask_token_id=ver.tokenizer.pad_token_id or 0)
    dr = PEagleDrafter(PEagleConfig(model=str(path), dtype="float32", cache_budget_mb=16, verifier_model=str(TARGET)))
    accepted = drafted = 0
    for i, text in enumerate(CODE[:3]):
        ids = ver.tokenizer(text)["input_ids"]
        seq = Sequence(ids, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), 4, ver.tokenizer,
                       ver.eos_ids, ver.max_len, seq_id=f"p{i}")
        asyncio.run(speculate_local(seq, dr, ver, FixedK(4)))
        assert seq.output_ids == hf_greedy(ver.model, ids, 32), text
        accepted += seq.stats.num_accepted_tokens
        drafted += seq.stats.num_draft_tokens
    assert drafted > 0 and accepted / drafted > 0.2, (accepted, drafted)


# ------------------------------------------------------------ the distribution
def sampling_world():
    """(a target of 8 tokens, its verifier, a random P-EAGLE head's drafter whose q is 0 on three tokens)."""
    from configs import VerifierConfig
    from tests.helpers import tiny_llama, tiny_tokenizer
    from tests.peagle_heads import from_eagle3_head
    from tests.test_eagle3 import random_head, tiny_spec
    from tests.test_eagle3_serving import V
    from verifier.engine import VerifierEngine

    target = tiny_llama(V, layers=2, hidden=24, seed=3, peak=3.0, eos_token_id=None)
    ver = VerifierEngine(VerifierConfig(model="tiny", dtype="float32", cache_budget_mb=64), model=target,
                         tokenizer=tiny_tokenizer())
    spec = tiny_spec(draft_vocab=5, vocab=V)
    spec.aux_layer_ids = [0, 1, 2]
    head = random_head(spec, seed=4)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(torch.randn(V, spec.hidden_size, generator=torch.Generator().manual_seed(4)))
    return target, ver, drafter(from_eagle3_head(head, mask_token_id=V - 1, seed=4), cache_budget_mb=64)


@pytest.mark.heavy  # 2000 sampled sequences through the loop, twice
@pytest.mark.parametrize("control", [False, True], ids=["peagle", "peagle-wrong-q"])
def test_sampled_output_at_t08_is_the_targets_distribution(control):
    """At T = 0.8 the output is the target's exact distribution (chi-square); a control that reports a q other than
    the one each position was drawn from (uniform over the same support) fails it."""
    from tests.test_dflash import _WrongQ
    from tests.test_drafter_contract import sampled_p_value

    target, ver, dr = sampling_world()
    n = 2000
    p, drafted = sampled_p_value(target, ver, _WrongQ(dr) if control else dr, [0, 3], n)
    assert drafted > n
    assert (p < 1e-3) if control else (p > 1e-3), p


def test_the_app_builder_reads_and_checks_the_head(tmp_path):
    """The app builder resolves the verifier and k from the head's config and captures the layers it reads; the vllm
    backend drafts on the pool from its loop's states; a head for another verifier, vLLM's per-step loop and vLLM's
    own engine are refused, each naming what is wrong."""
    from configs import AppConfig
    from configs.models import VllmOptions
    from deployments.app import check_models, local_view, resolve_model_paths
    from tests.peagle_heads import from_eagle3_dir
    from tests.test_eagle3 import HEAD, TARGET

    path = from_eagle3_dir(HEAD, tmp_path / "peagle", mask_token_id=0)

    def built(verifier=None, **drafter):
        args = {"verifier": {"model": verifier}, "drafter": {"method": "peagle", "model": str(path), **drafter}}
        return resolve_model_paths(AppConfig.model_validate(args))

    cfg = built()  # the verifier the head's speculators_config names, k its default proposal's
    assert Path(cfg.verifier.model).resolve() == TARGET.resolve() and cfg.drafter.num_speculative_tokens == 4
    assert check_models(local_view(cfg)) == tuple(json.loads((HEAD / "config.json").read_text())[
        "eagle_aux_hidden_state_layer_ids"])
    on_vllm = cfg.verifier.model_copy(update={"backend": "vllm", "vllm": VllmOptions()})
    vllm = cfg.model_copy(update={"verifier": on_vllm})
    assert check_models(local_view(vllm)) == check_models(local_view(cfg))  # vLLM's loop sends the states to the pool
    per_step = on_vllm.model_copy(update={"vllm": VllmOptions(loop="per_step")})
    for refused in (vllm.model_copy(update={"drafter_placement": "verifier"}),
                    vllm.model_copy(update={"verifier": per_step})):
        with pytest.raises(ValueError, match="vllm.loop engine and drafter_placement pool"):
            check_models(local_view(refused))
    cfg_json = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg_json, "target_hidden_size": 999}))
    with pytest.raises(ValueError, match="999"):
        check_models(local_view(built(verifier=str(TARGET))))


@pytest.mark.long  # a served app, the head in each verifier replica
def test_served_greedy_with_the_head_in_the_verifier_replica_equals_the_target(serve_app, tmp_path):
    """drafter_placement verifier: the verifier replica drafts with the P-EAGLE head from its own captured states;
    greedy over HTTP equals the target's generate, with drafts (the pool's case is the contract's)."""
    import httpx

    from tests.conftest import side_app
    from tests.peagle_heads import served_args
    from tests.test_processors import hf_greedy

    engine = {"dtype": "float32", "cache_budget_mb": 64, "num_threads": 1}
    verifier, drafter_args, tok, target = served_args(tmp_path, engine)
    args = {"model_name": "tiny", "verifier": verifier, "drafter": drafter_args, "k_policy": "fixed",
            "drafter_placement": "verifier"}
    with side_app(serve_app, "peagle-colocated", args) as url:
        body = {"model": "tiny", "temperature": 0, "max_tokens": 24, "ignore_eos": True, "return_token_ids": True}
        for text in ["def add(a, b):", "class Point:"]:
            r = httpx.post(f"{url}/v1/completions", json={**body, "prompt": text}, timeout=120)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["token_ids"] == hf_greedy(target, tok(text)["input_ids"], 24), text
            assert choice["speculation"]["num_draft_tokens"] > 0, choice["speculation"]


@pytest.mark.long  # starts a vLLM engine (tens of seconds on a small CPU)
def test_with_vllms_loop_the_head_on_the_pool_gives_the_targets_greedy(tmp_path):
    """backend vllm, vllm.loop engine: vLLM's runner computes the states, its proposer sends them to a drafter replica
    running the P-EAGLE drafter (in process, over the direct channel); greedy equals the target's own generate and
    drafts are accepted."""
    import asyncio

    pytest.importorskip("vllm")
    from configs import SamplingParams, VerifierConfig
    from core.peagle import check_head
    from deployments.drafter import DrafterServer
    from tests.peagle_heads import from_eagle3_dir
    from tests.test_eagle3 import HEAD, TARGET
    from tests.test_processors import hf_greedy
    from tests.test_vllm_eagle3 import CODE, VERIFIER
    from verifier.vllm_engine import VllmVerifierEngine

    k, n = 4, 32
    path = from_eagle3_dir(HEAD, tmp_path / "peagle", mask_token_id=0)
    layers = tuple(check_head(path, TARGET).aux_layer_ids)

    async def run():
        dr = DrafterServer({"method": "peagle", "model": str(path), "dtype": "float32", "num_speculative_tokens": k,
                            "cache_budget_mb": 16, "num_threads": 1, "verifier_model": str(TARGET)})
        ep = await dr.endpoint()
        eng = VllmVerifierEngine(VerifierConfig.model_validate(VERIFIER), speculative=True, aux_layers=layers,
                                 per_step_metrics=True)
        try:
            await eng.bind({"endpoints": [[ep.host, ep.port, ep.token.hex(), ep.replica]], "timeout_s": 30.0,
                            "tree": 1, "speculate": "always"})
            out = []
            for i, text in enumerate(CODE[:2]):
                ids = eng.tokenizer(text)["input_ids"]
                sp = eng.sampling_params(SamplingParams(temperature=0, ignore_eos=True, verification="rejection"),
                                         k, f"p{i}", 0, len(ids), n, None)
                got, spec = [], None
                async for new, _, s in eng.generate(ids, sp, f"p{i}"):
                    got += new
                    spec = s or spec
                out.append((text, ids, got, spec))
            return out, (await eng.proposer_status())[0]
        finally:
            eng.shutdown()

    out, status = asyncio.run(run())
    assert status["failures"] == 0 and status["aux_bytes"] > 0, status
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(TARGET).float().eval()
    for text, ids, got, _ in out:
        assert got == hf_greedy(target, ids, n), text
    assert sum(sum(s.per_step_accepted) for *_, s in out if s is not None) > 0
