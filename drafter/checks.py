"""Build-time checks of the heads on the target (``drafter.registry``'s ``Method.check``): each takes the app's
config (``.drafter`` and ``.verifier``, their references local directories on the building node) and returns
the head's spec (its ``aux_layer_ids``: the verifier layers captured for it), or raises ``ValueError`` naming
the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from core.backends import capabilities

if TYPE_CHECKING:  # pydantic stays out of engine-level imports
    from configs import AppConfig
    from core.dflash import ParallelSpec
    from core.eagle3 import Eagle3Spec


def head_problems(spec, path: Path, verifier_model: str) -> list[str]:
    """What keeps a head (EAGLE-3, DFlash, DSpark) from fitting a verifier: the hidden size it reads, the
    vocabulary, layer ids outside the verifier, and the verifier architecture the head records, if any."""
    from transformers import AutoConfig

    verifier = AutoConfig.from_pretrained(verifier_model)
    target = verifier.get_text_config()
    problems = []
    if spec.target_hidden_size != target.hidden_size:
        problems.append(f"it reads hidden states of size {spec.target_hidden_size}, "
                        f"the verifier's are {target.hidden_size}")
    if spec.vocab_size != target.vocab_size:
        problems.append(f"its vocab_size {spec.vocab_size} is not the verifier's {target.vocab_size}")
    bad = [L for L in spec.aux_layer_ids if not 0 <= L <= target.num_hidden_layers]
    if bad:
        problems.append(f"layer ids {bad} are outside the verifier's 0..{target.num_hidden_layers}")
    raw = json.loads((path / "config.json").read_text())
    arch = (raw.get("speculators_config", {}).get("verifier", {}) or {}).get("architectures")
    if arch and getattr(target, "architectures", None) and set(arch) != set(verifier.architectures or []):
        problems.append(f"it was trained for {arch}, the verifier is {verifier.architectures}")
    return problems


def check_eagle3(config: AppConfig) -> Eagle3Spec:
    """An EAGLE-3 head must be one for this verifier: a Speculators eagle3 config, the verifier's
    hidden size and vocabulary size, layer ids inside the verifier, a backend that returns the states
    (transformers, or vllm with vLLM running the loop), and the verifier's architecture when the head
    records it."""
    from core.eagle3 import check_head

    path = Path(config.drafter.model)
    try:
        spec = check_head(path, config.verifier.model)
    except (KeyError, TypeError, ValueError, OSError) as e:
        raise ValueError(f"eagle3 drafter {str(path)!r}: not a usable Speculators eagle3 head: {e}") from None
    caps = capabilities(config.verifier)
    if not caps.aux_states:
        raise ValueError(f"an eagle3 drafter needs the verifier's hidden states, which {caps.label} does not return: "
                         "use verifier.backend transformers, or vllm with verifier.vllm.loop engine")
    problems = head_problems(spec, path, config.verifier.model)
    if problems:
        raise ValueError(f"eagle3 drafter {str(path)!r} does not fit verifier {config.verifier.model!r}: "
                         + "; ".join(problems))
    return spec


def check_parallel(config: AppConfig) -> ParallelSpec:
    """A DFlash or DSpark head must be one for this verifier (``check_eagle3``'s checks), and the verifier must
    return its states: this package's engine (the vLLM backend's loop feeds vLLM's own drafters)."""
    from core.dflash import check_head

    d, path = config.drafter, Path(config.drafter.model)
    try:
        spec = check_head(path, config.verifier.model)
    except (KeyError, TypeError, ValueError, OSError) as e:
        raise ValueError(f"{d.method} drafter {str(path)!r}: not a usable Speculators {d.method} head: {e}") from None
    caps = capabilities(config.verifier)
    if not caps.step_states:
        raise ValueError(f"a {d.method} drafter needs the verifier's hidden states on every step, which {caps.label} "
                         "does not return: use verifier.backend transformers")
    problems = head_problems(spec, path, config.verifier.model)
    if d.num_speculative_tokens and d.num_speculative_tokens > spec.max_k:
        problems.append(f"drafter.num_speculative_tokens {d.num_speculative_tokens} exceeds the head's block "
                        f"({spec.max_k} drafts)")
    if problems:
        raise ValueError(f"{d.method} drafter {str(path)!r} does not fit verifier {config.verifier.model!r}: "
                         + "; ".join(problems))
    return spec
