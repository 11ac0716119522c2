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
from tests.mtp_models import VOCAB, write_target

FAMILIES = ["glm4_moe", "deepseek_v3"]
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

        final, enorm, hnorm = norm(model.model.norm.weight), norm(extra[base + "enorm.weight"]), norm(extra[base + "hnorm.weight"])
        head_norm = norm(extra[base + "shared_head.norm.weight"])
        ids, pos = list(tokens[1:]), list(range(len(tokens) - 1))
        prev = [final(s) for s in states]  # the target's returned hidden states
        drafts, rows = [], []
        for i in range(k):
            e = model.model.embed_tokens(torch.tensor(ids))
            p = torch.tensor(pos)
            e = torch.where(p.unsqueeze(-1) == 0, 0, e)
            h = F.linear(torch.cat([enorm(e), hnorm(torch.stack(prev))], -1), extra[base + "eh_proj.weight"]).unsqueeze(0)
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
])
def test_refusals_name_the_field(change, field):
    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 4, "num_nextn_predict_layers": 1, "hidden_size": 64,
           "vocab_size": VOCAB}
    MtpSpec.from_config(cfg)
    with pytest.raises(UnsupportedMtp, match=field):
        MtpSpec.from_config({**cfg, **change})
