"""The model runtime both engines share: dtypes, loading a local causal LM, its EOS ids.

Everything here reads local files only; nothing fetches from a model hub.
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (empty where there is none: not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU computes bf16 natively (AVX-512 BF16 or AMX): then bf16 halves the bytes a
    memory-bound decode step reads. Elsewhere bf16 is emulated and slower than float32."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def pin_process(cores: list[int] | None) -> None:
    """Run every thread of this process (and the threads and processes it starts later) on
    ``cores``: a replica's engine, its event loop and Ray's threads. Linux only; None leaves the
    OS to schedule. Where drafter and verifier replicas share one machine, disjoint cores keep
    the drafter's pre-drafting from slowing the verifier's forward pass."""
    if not cores:
        return
    import os

    if not hasattr(os, "sched_setaffinity"):
        raise ValueError("cpu_affinity needs Linux (os.sched_setaffinity)")
    machine = set(range(os.cpu_count() or 1))
    if not set(cores) <= machine:
        raise ValueError(f"cpu_affinity {sorted(cores)}: cores {sorted(set(cores) - machine)} are not available "
                         f"(this machine has {sorted(machine)})")
    for tid in (int(t) for t in os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
        except OSError as e:  # e.g. none of them in this container's cpuset
            raise ValueError(f"cpu_affinity {sorted(cores)}: {e}") from None
    log.info("pinned to cores %s", sorted(cores))


def resolve_dtype(name: str, device: str | torch.device = "cpu") -> str:
    """The compute dtype for ``name``; ``auto`` is bf16 on GPUs that support it and on CPUs with
    native bf16, float32 elsewhere."""
    if name != "auto":
        return name
    device = torch.device(device)
    if device.type == "cuda":
        fast = torch.cuda.is_bf16_supported()
    else:
        fast = device.type == "cpu" and cpu_has_fast_bf16()
    chosen = "bfloat16" if fast else "float32"
    log.info("dtype auto on %s: %s", device, chosen)
    return chosen


def resolve_kv_dtype(name: str, compute: str, device: str | torch.device = "cpu") -> str:
    """The KV cache's dtype; ``auto`` is float32 on CPUs (their bf16 attention kernels are slower than
    float32 ones at decode shapes: docs/decisions/0007-dtype-auto.md), the compute dtype elsewhere."""
    if name != "auto":
        return name
    return "float32" if torch.device(device).type == "cpu" else compute


def attention_implementation(config) -> str:
    """SDPA where the model's class supports it, else its eager attention (gpt-oss: SDPA has no attention
    sinks). Both take the masks the engines build over the paged cache (``core.llama.HFRunner``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:  # not a causal LM transformers maps: from_pretrained says why
        return "sdpa"
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def load_causal_lm(path: str, dtype: torch.dtype, device: str | torch.device = "cpu"):
    """A local Hugging Face causal LM in eval mode, with SDPA attention where its class supports it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    impl = attention_implementation(AutoConfig.from_pretrained(path))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=impl)
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
