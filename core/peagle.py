"""P-EAGLE heads: an EAGLE-3 head that drafts the whole block in one forward pass (parallel drafting).

Glossary (P-EAGLE, arXiv 2602.01469; names as in vLLM 0.32, which serves these heads as ``method: eagle3``
with ``parallel_drafting: true``, and in ``speculators``' ``peagle`` format):
- the head is an EAGLE-3 head (``core.eagle3``: ``fc`` over the target's aux states g_t, one or several
  decoder layers whose first reads cat(input_layernorm(embed(x)), hidden_norm(h)), the final norm, a draft
  vocabulary) plus ``mask_hidden``: one learned row of aux states [n_aux * target_hidden] standing for the
  state of a position whose token is still a placeholder;
- the mask token: ``mask_token_id`` (Speculators) or, in vLLM's own EAGLE layout, the first of
  ``dflash_config.mask_token_id``, ``mask_token_id``, ``dspark_noise_token_id``, ``pard_token``,
  ``ptd_token_id`` (``LLMBaseProposer._init_parallel_drafting_params``'s order).

The block (vLLM's ``_copy_and_expand_eagle_inputs`` with ``shift_input_ids``, one pass). After the verifier
has states g_0..g_n for x_0..x_n and chose x_{n+1}, the head runs the EAGLE-3 pairs (x_{t+1}, fc(g_t)) at
rotary positions t = 0..n (the last one the bonus pair (x_{n+1}, fc(g_n))), then k - 1 placeholder pairs
(mask token, fc(mask_hidden)) at positions n+1..n+k-1, all under one causal mask. The draft at block
position i (0..k-1) is read from position n + i and predicts x_{n+2+i}.

How positions depend on each other: a placeholder's inputs are constants, so what makes the rows differ is
their rotary position and the keys they attend to: every real pair up to n and the placeholders before
them. The draft at i therefore depends on the context x_0..x_{n+1} and g_0..g_n only, never on the tokens
drafted at 0..i-1: q_i(. | context) for each i, computed in the one pass; the block's drafts are
independent samples, each of its own q_i, which is what the verifier's rejection sampling needs.
Nothing of the head's own output is fed back (unlike EAGLE-3's later draft steps), so k is bounded only
by the positions the head was trained for (``num_speculative_tokens`` of its proposal, when given).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from core.eagle3 import (
    Eagle3Spec,
    EagleHead,
    UnsupportedHead,
    _borrowed,
    _complete,
    _names,
    _safetensors_files,
    _verifier_shape,
    check_reads,
    checkpoint_dir,
    default_proposal,
    read_state,
    unsupported,
    verifier_layers,
    verifier_tensor,
)

# vLLM's architectures that run an EAGLE-3 head (Eagle3LlamaForCausalLM / Eagle3Qwen3ForCausalLM) with parallel drafting
EAGLE_ARCHITECTURES = {"LlamaForCausalLMEagle3": "llama", "Eagle3LlamaForCausalLM": "llama",
                       "PEagleDraftModel": "llama", "PeagleLlamaForCausalLM": "llama",
                       "Eagle3Qwen3ForCausalLM": "qwen3", "PeagleQwen3ForCausalLM": "qwen3"}
MASK_FIELDS = ("mask_token_id", "dspark_noise_token_id", "pard_token", "ptd_token_id")  # after dflash_config's


@dataclass
class PEagleSpec(Eagle3Spec):
    """An EAGLE-3 head's spec plus the placeholder token; ``layout``: "speculators" (``peagle``) or "eagle"
    (vLLM's own EAGLE-3 config with a mask token, served with ``parallel_drafting: true``)."""

    mask_token_id: int = 0
    layout: str = "speculators"
    speculative_tokens: int | None = None  # the k the head was trained for, when its config names one

    @classmethod
    def from_config(cls, cfg: dict, target_num_layers: int | None = None) -> PEagleSpec:
        """The spec of a P-EAGLE config.json in either layout, read as vLLM 0.32 reads it. Raises
        ``UnsupportedHead`` (one line naming the field and value) for a config this project cannot run."""
        if cfg.get("speculators_model_type") is not None:
            as_eagle3, mask, layout = _speculators(cfg), cfg.get("mask_token_id"), "speculators"
            k = default_proposal(cfg).get("speculative_tokens")
        else:
            as_eagle3, mask, layout, k = _eagle_layout(cfg), _mask_token(cfg), "eagle", None
        base = Eagle3Spec.from_config(as_eagle3, target_num_layers)
        if not isinstance(mask, int) or isinstance(mask, bool) or not 0 <= mask < base.vocab_size:
            unsupported("mask_token_id", mask,
                        f"parallel drafting needs a placeholder token id below vocab_size {base.vocab_size}")
        return cls(**vars(base), mask_token_id=mask, layout=layout,
                   speculative_tokens=k if isinstance(k, int) and k >= 1 else None)


def _speculators(cfg: dict) -> dict:
    """A Speculators ``peagle`` config as the eagle3 config vLLM's ``update_peagle`` makes of it: its own
    ``norm_before_residual`` default (false, where eagle3's is true); ``fc_norm`` and ``norm_output`` are not
    carried over (vLLM builds the head without them), so a config that sets them is refused."""
    if cfg.get("speculators_model_type") != "peagle":
        unsupported("speculators_model_type", cfg.get("speculators_model_type"), "not a Speculators peagle config")
    for name in ("fc_norm", "norm_output"):
        if cfg.get(name):
            unsupported(name, cfg[name], "vLLM 0.32's peagle reader does not carry it to the head")
    return {**cfg, "speculators_model_type": "eagle3",
            "norm_before_residual": bool(cfg.get("norm_before_residual", False))}


def _mask_token(cfg: dict):
    mask = (cfg.get("dflash_config") or {}).get("mask_token_id")
    for name in MASK_FIELDS:
        if mask is None:
            mask = cfg.get(name)
    return mask


def _eagle_layout(cfg: dict) -> dict:
    """vLLM's own EAGLE-3 config (the head's layer config at the top, ``eagle_config`` for the aux layers) as a
    Speculators eagle3 config: vLLM reads its flags as attributes, absent ones false (``norm_before_residual``
    too)."""
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in EAGLE_ARCHITECTURES:
        unsupported("architectures", cfg.get("architectures"),
                    f"a P-EAGLE head is one of {sorted(EAGLE_ARCHITECTURES)} (or a Speculators peagle config)")
    eagle = cfg.get("eagle_config") or {}
    layer = {k: v for k, v in cfg.items() if k not in ("eagle_config", "architectures")}
    layer["model_type"] = EAGLE_ARCHITECTURES[arch]
    return {"speculators_model_type": "eagle3", "transformer_layer_config": layer, "eagle_config": eagle,
            "eagle_aux_hidden_state_layer_ids": eagle.get("eagle_aux_hidden_state_layer_ids")
            or cfg.get("eagle_aux_hidden_state_layer_ids"),
            "draft_vocab_size": cfg.get("draft_vocab_size"), "target_hidden_size": cfg.get("target_hidden_size"),
            "norm_before_residual": bool(cfg.get("norm_before_residual", False)),
            "fc_norm": bool(cfg.get("fc_norm", False)), "norm_output": bool(cfg.get("norm_output", False))}


class PEagleHead(EagleHead):
    """An EAGLE-3 head with ``mask_hidden`` [1, n_aux * target_hidden] (vLLM's buffer, viewed [1, -1] on load)."""

    def __init__(self, spec: PEagleSpec):
        super().__init__(spec)
        self.mask_hidden = nn.Parameter(torch.zeros(1, len(spec.aux_layer_ids) * spec.target_hidden_size),
                                        requires_grad=False)

    def placeholder_state(self) -> torch.Tensor:
        """fc(mask_hidden) [1, H]: the state every placeholder position reads (vLLM projects it once, at load)."""
        return self.combine(self.mask_hidden.to(self.fc.weight.dtype))

    def block_inputs(self, feed: list[int], k: int) -> list[int]:
        """The tokens a pass feeds: the real pairs' tokens, then k - 1 placeholders."""
        return list(feed) + [self.spec.mask_token_id] * max(k - 1, 0)

    @torch.no_grad()
    def draft(self, tokens: list[int], aux: torch.Tensor, k: int, return_logits: bool = False):
        """Greedy drafts after ``tokens`` (x_0..x_{n+1}, the last one the verifier's, without a state yet) from the
        target's aux states [n+1, n_aux * target_hidden], in one causal pass over the whole context: the slow,
        obvious reference. With ``return_logits``, also the draft-vocabulary logits [k, Vd] of each draft."""
        n1 = len(tokens) - 1  # real pairs (x_{t+1}, g_t), t = 0..n
        assert aux.shape[0] == n1, (aux.shape, n1)
        dev = aux.device
        ids = torch.tensor([self.block_inputs(tokens[1:], k)], device=dev)
        T = ids.shape[1]
        h = torch.cat([self.combine(aux.to(self.fc.weight.dtype)), self.placeholder_state().expand(T - n1, -1)])
        mask = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
        logits, _ = self.layer(ids, h.unsqueeze(0), torch.arange(T, device=dev).unsqueeze(0), [], mask)
        rows = logits[0, n1 - 1:]  # positions n..n+k-1
        drafts = [int(self.to_target(r.argmax())) for r in rows]
        return (drafts, rows) if return_logits else drafts


# ---------------------------------------------------------------------- checkpoints
def _mask_shape(shapes: dict) -> None:
    """``mask_hidden`` as [1, width] whatever the checkpoint's own shape (vLLM views it [1, -1])."""
    if "mask_hidden" in shapes:
        shapes["mask_hidden"] = (1, int(torch.Size(shapes["mask_hidden"]).numel()))


def read_spec(path: Path, verifier) -> PEagleSpec:
    cfg = json.loads((path / "config.json").read_text())
    return PEagleSpec.from_config(cfg, verifier_layers(verifier) if verifier is not None else None)


def _require_mask(path: Path, names) -> None:
    if "mask_hidden" not in names:
        raise UnsupportedHead(f"{path}: mask_hidden absent: a parallel-drafting head needs the placeholders' state "
                              "(vLLM refuses the head without it)")


def check_head(path: str | Path, verifier: str | Path) -> PEagleSpec:
    """The build-time check of a head for a verifier, reading headers only (``core.eagle3.check_head``'s
    counterpart, ``mask_hidden`` included). Returns the spec."""
    from safetensors import safe_open

    path = checkpoint_dir(path)
    spec = read_spec(path, verifier)
    shapes = {}
    for f in _safetensors_files(path):
        with safe_open(str(f), "pt") as h:
            shapes.update({_names(k): tuple(h.get_slice(k).get_shape()) for k in h.keys()})
    _require_mask(path, shapes)
    _mask_shape(shapes)
    check_reads(path, spec, verifier, shapes)
    shapes.update({k: tuple(v) for k, v in _borrowed(path, spec, set(shapes), verifier, _verifier_shape).items()})
    shapes.pop("inv_freq", None)
    _complete(path, spec, shapes, PEagleHead)
    return spec


def load_head(path: str | Path, dtype=torch.float32, device="cpu", verifier: str | Path | None = None) -> PEagleHead:
    """A P-EAGLE head in either layout; ``verifier``: the target's directory, for what the head leaves to it
    (as ``core.eagle3.load_head``)."""
    path = Path(path)
    spec = read_spec(path, verifier)
    head = PEagleHead(spec)
    state = {_names(k): v for k, v in read_state(path).items()}
    state.pop("inv_freq", None)
    _require_mask(path, state)
    state["mask_hidden"] = state["mask_hidden"].reshape(1, -1)
    check_reads(path, spec, verifier, {k: tuple(v.shape) for k, v in state.items()})
    state.update(_borrowed(path, spec, set(state), verifier, verifier_tensor))
    if "t2d" not in state and spec.draft_vocab_size != spec.vocab_size:  # d2t absent: vLLM's zeros
        d2t = state.get("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
        t2d[torch.arange(spec.draft_vocab_size) + d2t] = True
        state["t2d"] = t2d
    _complete(path, spec, {k: tuple(v.shape) for k, v in state.items()}, PEagleHead)
    head.load_state_dict(state, strict=False)
    return head.to(device=device, dtype=dtype).eval()
