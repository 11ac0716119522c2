"""The model runtime both engines share: dtypes, loading a local causal LM, its EOS ids.

Everything here reads local files only; nothing fetches from a model hub.
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_causal_lm(path: str, dtype: torch.dtype, device: str | torch.device = "cpu"):
    """A local Hugging Face causal LM in eval mode, with SDPA attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return model.to(device=device, dtype=dtype).eval()


def context_limit(path: str, configured: int | None = None) -> int:
    """The context limit a model directory serves: the configured one, else its position embeddings."""
    from transformers import AutoConfig

    return configured or AutoConfig.from_pretrained(path).get_text_config().max_position_embeddings


def eos_token_ids(tokenizer, model=None, model_dir: str | None = None) -> set[int]:
    """Every end-of-sequence id the model's generation config, its config and the tokenizer declare.

    Give ``model`` (a loaded module: its own configs are read) or ``model_dir`` (the files are
    read, for callers that never load the weights: the router, the vLLM backend)."""
    if model is not None:
        sources = [getattr(model, "generation_config", None), model.config]
    else:
        from transformers import AutoConfig, GenerationConfig

        try:
            gen = GenerationConfig.from_pretrained(model_dir)
        except OSError:  # no generation_config.json
            gen = None
        sources = [gen, AutoConfig.from_pretrained(model_dir)]
    ids: set[int] = set()
    for src in (*sources, tokenizer):
        eos = getattr(src, "eos_token_id", None)
        if eos is None:
            continue
        ids.update(eos if isinstance(eos, (list, tuple, set)) else [eos])
    return ids
