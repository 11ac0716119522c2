"""Verifiers of the published families, built tiny from transformers' own config classes: Llama 3.x
(``llama3`` and ``yarn`` rope), Mistral (sliding window), Qwen3 dense and MoE, Gemma 4 text (sliding and
global layers with their own shapes and rope, per-layer inputs, shared K/V, ``attention_k_eq_v``) and
gpt-oss (MoE, attention sinks, sliding windows, eager attention). Each has at least 6 layers and a window
shorter than the prompts. Per family: the paged, batched pass (rows padded, rolled back as after
rejected drafts) equals one full transformers forward at every position, past the window included;
greedy through the speculative loop at k in {0, 4}, with the target as its own draft model, equals the
target's own ``generate`` in float32; the captured states are the residual stream entering each layer.

A near-tie is reported, never hidden: the target's top-two logits within 1e-5 at the first differing
token, or, in a mixture-of-experts model, a router whose k-th and (k+1)-th expert scores are within 1e-5
on the way there (float noise then picks another expert)."""

import pytest
import torch
import transformers

from configs import DraftModelConfig, SamplingParams, VerifierConfig
from core.kv_cache import PagedKVCache, batched_forward, kv_layout
from core.llama import HFRunner, capture_states, compact_unsupported, decoder_layers, layer_windows, make_runner
from core.loop import generate
from core.models import attention_implementation, load_causal_lm
from drafter.model_drafter import ModelDrafter
from tests.helpers import tiny_tokenizer
from verifier.engine import VerifierEngine

VOCAB = 320
WINDOW = 16
NEAR_TIE = 1e-5
MAX_LEN = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=MAX_LEN, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)


def build(family: str):
    """A random model of the family, float32, peaked (the output layer scaled) so greedy picks are far from ties."""
    torch.manual_seed(0)
    T = transformers
    if family == "llama3":
        cfg = T.LlamaConfig(**COMMON, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})
        model = T.LlamaForCausalLM(cfg)
    elif family == "llama_yarn":
        cfg = T.LlamaConfig(**COMMON, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32})
        model = T.LlamaForCausalLM(cfg)
    elif family == "mistral":
        model = T.MistralForCausalLM(T.MistralConfig(**COMMON, sliding_window=WINDOW))
    elif family == "qwen3":
        model = T.Qwen3ForCausalLM(T.Qwen3Config(**COMMON))
    elif family == "qwen3_moe":
        model = T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**COMMON, num_experts=8, num_experts_per_tok=2,
                                                        moe_intermediate_size=32, norm_topk_prob=True))
    elif family == "gemma4":
        cfg = T.Gemma4TextConfig(
            **{**COMMON, "num_hidden_layers": 8}, sliding_window=WINDOW, global_head_dim=32, num_global_key_value_heads=1,
            attention_k_eq_v=True, num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
            final_logit_softcapping=30.0,
            layer_types=["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3 + ["full_attention"])
        model = T.Gemma4ForCausalLM(cfg)
    elif family == "gpt_oss":
        cfg = T.GptOssConfig(**{**COMMON, "intermediate_size": 64}, sliding_window=WINDOW, num_local_experts=4,
                             num_experts_per_tok=2, rope_parameters={
                                 "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                 "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 32})
        model = T.GptOssForCausalLM(cfg)
    else:
        raise ValueError(family)
    model = model.float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


FAMILIES = ["llama3", "llama_yarn", "mistral", "qwen3", "qwen3_moe", "gemma4", "gpt_oss"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    return request.param, build(request.param)


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def full_forward(model, toks):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([toks])).logits[0].float()


def test_each_family_takes_the_path_its_config_says(family):
    """Llama-shaped models keep the compact forward (the native one where built); the rest the model's own
    modules, with eager attention where the class has no SDPA (gpt-oss: sinks)."""
    name, model = family
    runner = make_runner(model, MAX_LEN)
    want = "transformers" if name in ("mistral", "qwen3_moe", "gemma4", "gpt_oss") else ("native", "compact")
    assert runner.kind in want, (name, runner.kind, compact_unsupported(model, MAX_LEN))
    assert attention_implementation(model.config) == ("eager" if name == "gpt_oss" else "sdpa")
    if name == "gemma4":  # global layers: their own head size and KV heads; the last two read earlier layers' K/V
        assert kv_layout(model.config) == [(2, 16)] * 3 + [(1, 32)] + [(2, 16)] * 2 + [None, None]
    if name in ("mistral", "gemma4", "gpt_oss"):
        assert WINDOW in layer_windows(model.config)


def test_paged_batched_pass_equals_the_full_forward_past_the_window(family):
    """Three sequences of 41, 29 and 37 tokens (windows of 16): a batched prefill of different lengths, a
    verification of 2 true tokens and 3 wrong drafts each, a rollback of the drafts, the rest of each
    sequence batched, then one-token steps of a lone stream (the cache read as a view). Every position's
    logits equal one uncached transformers forward over the whole sequence."""
    name, model = family
    runner = make_runner(model, MAX_LEN)
    cache = PagedKVCache(model.config, MAX_LEN, 8 * 2**20, torch.float32)
    seqs = [tokens(41, 1), tokens(29, 2), tokens(37, 3)]
    cut = [(20, 27), (3, 10), (30, 31)]  # prefill, then verify to the second point (plus 3 wrong drafts)
    got = [[] for _ in seqs]
    slots = [cache.claim(f"s{i}", 0, None, s[:a] + [0], set()) for i, (s, (a, _)) in enumerate(zip(seqs, cut))]

    def step(feeds, ids):
        for i, f in zip(ids, feeds):
            cache.reserve(f"s{i}", len(slots[i].tokens) + len(f), set())
        return batched_forward(runner, cache, [slots[i] for i in ids], feeds, [len(f) for f in feeds])

    for i, lg in enumerate(step([s[:a] for s, (a, _) in zip(seqs, cut)], [0, 1, 2])):
        got[i].append(lg)
    wrong = [[(t + 7) % (VOCAB - 3) + 3 for t in s[b:b + 3]] for s, (_, b) in zip(seqs, cut)]
    for i, lg in enumerate(step([s[a:b] + w for s, (a, b), w in zip(seqs, cut, wrong)], [0, 1, 2])):
        got[i].append(lg[:cut[i][1] - cut[i][0]])
        slots[i].cut(cut[i][1])  # the drafts rejected: their rows are stale
    for i, lg in enumerate(step([s[b:-4] for s, (_, b) in zip(seqs, cut)], [0, 1, 2])):
        got[i].append(lg)
    for i in range(3):  # one token at a time, one sequence at a time
        for t in seqs[i][-4:]:
            got[i].append(step([[t]], [i])[0])
    for i, s in enumerate(seqs):
        paged = torch.cat(got[i])
        assert paged.shape[0] == len(s)
        torch.testing.assert_close(paged, full_forward(model, s), atol=5e-4, rtol=1e-4, msg=f"{name}, sequence {i}")
