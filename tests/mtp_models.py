"""Tiny targets with MTP layers, built from transformers' config classes: the target's checkpoint written by
transformers, then its MTP layer added as the published checkpoints lay it out (``model.layers.{N}.*``).

transformers builds no MTP layer, so the target is built with N + 1 layers: layer N (its attention and
mixture of experts, in the family's own modules) becomes the MTP layer's decoder block, and ``enorm``, ``hnorm``,
``eh_proj`` and ``shared_head`` are added beside it; config.json then says N layers and one MTP layer. The
N + 1-layer model is returned too: its layer N is the block the reference runs."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers as T

VOCAB = 256
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": False,
          "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
MOE = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
       "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}

CLASSES = {"glm4_moe": "Glm4MoeForCausalLM", "glm4_moe_lite": "Glm4MoeLiteForCausalLM",
           "deepseek_v3": "DeepseekV3ForCausalLM"}


def family_config(family: str, layers: int):
    if family == "glm4_moe":
        # GLM-4.5's attention: q/k/v biases, half the head rotated (partial_rotary_factor 0.5, the class default)
        return T.Glm4MoeConfig(**COMMON, **MOE, head_dim=16, num_hidden_layers=layers, attention_bias=True)
    if family == "deepseek_v3":
        return T.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, **MOE, num_hidden_layers=layers,
                                  q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                                  v_head_dim=16)
    if family == "glm4_moe_lite":
        # GLM-4.7-Flash: latent attention with interleaved rotary halves, qk_nope + qk_rope = v_head_dim as published
        return T.Glm4MoeLiteConfig(**{**COMMON, "num_key_value_heads": 4}, **MOE, num_hidden_layers=layers,
                                   q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=24,
                                   v_head_dim=32)
    raise ValueError(family)


def write_target(family: str, path: Path, layers: int = 4, seed: int = 0, peaked: float = 20.0, vocab: int = VOCAB,
                 copying: bool = False):
    """(the checkpoint directory, the N + 1-layer model whose layer N is the MTP block, its extra weights).
    ``copying``: a target whose layers add nothing (a bigram model: its next token a function of the current one)
    and an MTP layer that computes the same function of its token (``_copying``): every draft is the target's."""
    from safetensors.torch import load_file, save_file

    torch.manual_seed(seed)
    config = family_config(family, layers + 1)
    config.vocab_size = vocab
    model = getattr(T, CLASSES[family])(config).float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(peaked)  # greedy picks far from ties
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape))
    model.save_pretrained(path)
    g = torch.Generator().manual_seed(seed + 1)
    H, base = COMMON["hidden_size"], f"model.layers.{layers}."
    extra = {base + "enorm.weight": 1 + 0.2 * torch.randn(H, generator=g),
             base + "hnorm.weight": 1 + 0.2 * torch.randn(H, generator=g),
             base + "eh_proj.weight": torch.randn(H, 2 * H, generator=g) * (2 * H) ** -0.5,
             base + "shared_head.norm.weight": 1 + 0.2 * torch.randn(H, generator=g),
             base + "shared_head.head.weight": model.lm_head.weight.detach().clone()}
    if copying:
        _copying(model, extra, base)
        model.save_pretrained(path)
    state = load_file(str(path / "model.safetensors"))
    state.update(extra)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(num_hidden_layers=layers, num_nextn_predict_layers=1)
    cfg.pop("mlp_layer_types", None)  # the published GLM-4.7-Flash config names first_k_dense_replace only
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path, model, extra


def _copying(model, extra: dict, base: str) -> None:
    """Every decoder layer's output projections zeroed (attention, dense MLP, experts, shared experts), the MTP
    layer's eh_proj passing enorm(embed(x)) through and its norms the target's: the MTP layer's logits for token x
    are the target's, lm_head(norm(embed(x)))."""
    H = model.config.hidden_size
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.zero_()
        extra[base + "enorm.weight"] = torch.ones(H)
        extra[base + "eh_proj.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)
        extra[base + "shared_head.norm.weight"] = model.model.norm.weight.detach().clone()


CONTRACT_FAMILY = "glm4_moe_lite"  # the contract's: the family of the model that fits one GPU (GLM-4.7-Flash)


def contract_world(tok, path: Path | None = None, family: str = CONTRACT_FAMILY):
    """(tokenizer, target, verifier, drafter, texts, pre-drafts taken) for the drafter contract: a copying target
    and its MTP layer (``write_target(copying=True)``), whose pre-drafts continue its chains and are taken."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from configs import VerifierConfig
    from configs.models import MtpConfig
    from drafter.mtp_drafter import MtpDrafter
    from verifier.engine import VerifierEngine

    path = path or Path(tempfile.mkdtemp(prefix="mtp-world-"))
    write_target(family, path, vocab=len(tok), copying=True)
    target = AutoModelForCausalLM.from_pretrained(path).float().eval()
    ver = VerifierEngine(VerifierConfig(model="glm", dtype="float32", cache_budget_mb=64), model=target, tokenizer=tok)
    dr = MtpDrafter(MtpConfig(model=str(path), dtype="float32", cache_budget_mb=16), eos_ids=set())
    return tok, target, ver, dr, ["def add(a, b):", "class Point:", "for i in range(10):"], True


def served_args(tok, tmp_path: Path, engine: dict, family: str = CONTRACT_FAMILY) -> tuple[dict, dict, object, object]:
    """(verifier args, drafter args, tokenizer, reference target) for an app serving a copying target with its own
    MTP layer on the drafter pool (the drafter's model is the verifier's checkpoint)."""
    from transformers import AutoModelForCausalLM

    path, _, _ = write_target(family, tmp_path / f"{family}-mtp", vocab=len(tok), copying=True)
    tok.save_pretrained(path)
    target = AutoModelForCausalLM.from_pretrained(path).float().eval()
    return ({"model": str(path), **engine},
            {"method": "mtp", "num_speculative_tokens": 4, "model": str(path), **engine}, tok, target)
