"""P-EAGLE heads for the drafter tests, made from EAGLE-3 heads.

A P-EAGLE pass's first block position (the bonus token's row, after the real rows, before any placeholder) is
computed exactly as an EAGLE-3 head's first draft step, so an EAGLE-3 head plus a ``mask_hidden`` is a P-EAGLE
head whose first draft is the EAGLE-3 head's: the shipped head, trained for the shipped target, makes a P-EAGLE
head whose first drafts are accepted about as often as EAGLE-3's (its later positions read placeholders it was
never trained on: rarely accepted, still lossless)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from core.peagle import PEagleHead, PEagleSpec


def from_eagle3_dir(src: Path, out: Path, mask_token_id: int, seed: int = 0) -> Path:
    """A Speculators peagle checkpoint at ``out`` from the eagle3 one at ``src`` (norm_before_residual written as the
    eagle3 head reads it: peagle's default differs), ``mask_hidden`` random."""
    from safetensors.torch import load_file, save_file

    from core.eagle3 import Eagle3Spec

    cfg = json.loads((src / "config.json").read_text())
    spec = Eagle3Spec.from_config(cfg, None if cfg.get("eagle_aux_hidden_state_layer_ids") else 8)
    peagle = {**cfg, "speculators_model_type": "peagle", "architectures": ["PEagleSpeculator"],
              "norm_before_residual": spec.norm_before_residual, "mask_token_id": mask_token_id}
    state = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    width = len(spec.aux_layer_ids) * spec.target_hidden_size
    state["mask_hidden"] = torch.randn(width, generator=g).to(state["fc.weight"].dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(peagle, indent=2))
    return out


def from_eagle3_head(head, mask_token_id: int, seed: int = 0) -> PEagleHead:
    """The same in memory, for an ``EagleHead`` built in a test."""
    spec = PEagleSpec(**vars(head.spec), mask_token_id=mask_token_id)
    out = PEagleHead(spec)
    state = dict(head.state_dict())
    state["mask_hidden"] = torch.randn(out.mask_hidden.shape, generator=torch.Generator().manual_seed(seed))
    out.load_state_dict(state)
    return out.eval()


def contract_world():
    """(tokenizer, target, verifier, drafter, texts, pre-drafts taken) for the drafter contract: the shipped target
    and the P-EAGLE head made from its EAGLE-3 head (in memory). Pre-drafts are declined."""
    from configs import VerifierConfig
    from configs.models import PEagleConfig
    from core.eagle3 import load_head
    from drafter.peagle_drafter import PEagleDrafter
    from tests.test_eagle3 import HEAD, TARGET
    from tests.test_eagle3_serving import CODE
    from verifier.engine import VerifierEngine

    ver = VerifierEngine(VerifierConfig(model=str(TARGET), dtype="float32", cache_budget_mb=64, num_threads=1))
    head = from_eagle3_head(load_head(HEAD, verifier=TARGET), mask_token_id=ver.tokenizer.pad_token_id or 0)
    dr = PEagleDrafter(PEagleConfig(model=str(HEAD), dtype="float32", cache_budget_mb=16, verifier_model=str(TARGET)),
                       head=head)
    return ver.tokenizer, ver.model, ver, dr, CODE[:3], False


def served_args(tmp_path: Path, engine: dict) -> tuple[dict, dict, object, object]:
    """(verifier args, drafter args, tokenizer, reference target) for an app serving the P-EAGLE head made from the
    shipped EAGLE-3 head, written as a Speculators peagle checkpoint."""
    from configs import VerifierConfig
    from tests.test_eagle3 import HEAD, TARGET
    from verifier.engine import VerifierEngine

    ver = VerifierEngine(VerifierConfig(model=str(TARGET), dtype="float32", cache_budget_mb=64, num_threads=1))
    path = from_eagle3_dir(HEAD, tmp_path / "peagle", mask_token_id=ver.tokenizer.pad_token_id or 0)
    return ({"model": str(TARGET), **engine},
            {"method": "peagle", "num_speculative_tokens": 4, "model": str(path), **engine}, ver.tokenizer, ver.model)
