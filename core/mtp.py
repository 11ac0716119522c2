"""Native multi-token-prediction (MTP) layers: the target checkpoint's own draft layers, run apart from the target.

Glossary (DeepSeek-V3's MTP; names as in the checkpoints and vLLM 0.32's ``deepseek_mtp`` / ``glm4_moe_mtp``):
- the MTP layer i of an N-layer target is ``model.layers.{N+i}.*`` in the target's own files: ``enorm`` (the
  token's embedding), ``hnorm`` (the state), ``eh_proj`` [H, 2H], a decoder layer of the target's family
  (``mtp_block``: its attention and MLP or mixture of experts, under the layer's own names), ``shared_head.norm``
  and ``shared_head.head`` (the target's lm_head, absent in some checkpoints: then ``lm_head.weight``); the
  embedding is the target's ``model.embed_tokens`` (vLLM shares it);
- the state h_t: what the target's model returns at t, the last layer's output after the final norm. The
  verifier here captures the stream entering layer N (before that norm: ``core.llama``), so the head applies
  the target's ``model.norm`` to it (read from the same files);
- one row, pair (x_{t+1}, h_t) at rotary position t: eh_proj(cat(enorm(embed(x_{t+1})), hnorm(h_t))) through
  the decoder layer (its attention over the rows before it), then ``shared_head``: the logits of x_{t+2}.
  vLLM zeroes the embedding of the row at position 0 (``torch.where(positions == 0, 0, embeds)``); so here.

k drafts (vLLM's ``LLMBaseProposer.propose``): after the verifier has states h_0..h_n for x_0..x_n and chose
x_{n+1}, the first pass runs the rows 0..n (the last one the bonus pair) and samples d_1 from row n; each later
step feeds (d_i, the layer's own output at the previous row) at position n + i. The layer fed back is always
the first MTP layer: vLLM's proposer never passes ``spec_step_idx``, so a checkpoint's further MTP layers are not
run (by vLLM 0.32 either). What is fed back follows vLLM's model class: DeepSeek's MTP model returns (the output,
``shared_head.norm`` of it) and the proposer feeds back the normed one; GLM-4.5's returns the output alone and
the proposer feeds that back. q_i is conditioned on the drafts before i (a chain, like a draft model's).

Families: those transformers builds here and vLLM drafts with: ``glm4_moe`` (GLM-4.5, 4.6, 4.7), ``glm4_moe_lite``
(GLM-4.7-Flash: DeepSeek-V3's latent attention in GLM's mixture of experts; its MTP layer, at index N, has the
experts, as the published checkpoint stores it and ``first_k_dense_replace`` gives for that index) and
``deepseek_v3`` (DeepSeek-V3, R1). Refused at build time, naming the field: other ``model_type`` values
(Qwen3-Next's and Qwen3.5's MTP layers sit among linear-attention layers; MiMo has no transformers class), a config
without ``num_nextn_predict_layers``, quantized checkpoints (``quantization_config``), DeepSeek-V3.2's sparse
attention (``index_topk``), Speculators' FastMTP heads (``speculators_model_type``: a format of their own, which
vLLM 0.32 does not load).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch
from torch import nn

from core.layers import RMSNorm

# model_type -> (transformers' class prefix, whether vLLM feeds back the normed output: its MTP model returns a tuple)
FAMILIES = {"glm4_moe": ("Glm4Moe", False), "glm4_moe_lite": ("Glm4MoeLite", False),
            "deepseek_v3": ("DeepseekV3", True)}


class UnsupportedMtp(ValueError):
    """A target whose MTP layers this project cannot run: the message names the field and its value."""


def unsupported(name: str, value, why: str) -> NoReturn:
    raise UnsupportedMtp(f"{name} {value!r}: {why}")


@dataclass
class MtpSpec:
    """What the drafter needs of the target's config.json (its text config)."""

    family: str
    num_hidden_layers: int  # the target's N: the first MTP layer is model.layers.{N}
    num_mtp_layers: int
    hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    feeds_normed: bool
    config: dict  # the whole text config, for the family's decoder layer

    @property
    def aux_layer_ids(self) -> list[int]:
        """The verifier layer whose entering stream the head reads: N, the last layer's output (before the norm)."""
        return [self.num_hidden_layers]

    @classmethod
    def from_config(cls, cfg: dict) -> MtpSpec:
        """The spec of a target config.json with MTP layers. Raises ``UnsupportedMtp`` (one line naming the field and
        value) for a target this project cannot draft for with its own layers."""
        if cfg.get("speculators_model_type"):
            unsupported("speculators_model_type", cfg["speculators_model_type"],
                        "Speculators' own MTP heads (FastMTP) are a separate format vLLM 0.32 does not load; "
                        "the mtp drafter reads a target checkpoint's MTP layers")
        cfg = cfg.get("text_config") or cfg
        family = cfg.get("model_type")
        if family not in FAMILIES:
            unsupported("model_type", family, f"MTP layers run here for {', '.join(sorted(FAMILIES))} (the families "
                        "transformers builds and vLLM drafts with); Qwen3-Next/Qwen3.5 (linear-attention neighbours) "
                        "and MiMo (no transformers class) are not implemented")
        n_mtp = cfg.get("num_nextn_predict_layers")
        if not isinstance(n_mtp, int) or n_mtp < 1:
            unsupported("num_nextn_predict_layers", n_mtp, "the checkpoint declares no MTP layers")
        if cfg.get("quantization_config"):
            method = (cfg["quantization_config"] or {}).get("quant_method")
            unsupported("quantization_config", method, "quantized MTP weights are not read here (a bf16 checkpoint is)")
        if cfg.get("index_topk"):
            unsupported("index_topk", cfg["index_topk"], "DeepSeek-V3.2's sparse attention indexer is not implemented")
        if cfg.get("hidden_act", "silu") != "silu":
            unsupported("hidden_act", cfg["hidden_act"], "the MTP layers of these families run silu")
        return cls(family=family, num_hidden_layers=int(cfg["num_hidden_layers"]), num_mtp_layers=n_mtp,
                   hidden_size=int(cfg["hidden_size"]), vocab_size=int(cfg["vocab_size"]),
                   rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                   max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                   feeds_normed=FAMILIES[family][1], config=dict(cfg))

    def hf_config(self):
        """The family's transformers config (sdpa attention), for its decoder layer and rotary embedding."""
        from transformers import AutoConfig

        c = AutoConfig.for_model(**{k: v for k, v in self.config.items() if k not in ("architectures", "auto_map")})
        c._attn_implementation = "sdpa"
        c._experts_implementation = "eager"  # the experts as modules of their own (no dispatch through a model)
        kinds = getattr(c, "mlp_layer_types", None)  # GLM-4.7-Flash names each of the N layers' MLP: add layer N's
        if kinds is not None and len(kinds) <= self.num_hidden_layers:
            # the layer at index N: mixture of experts past first_k_dense_replace, as the published checkpoint has it
            moe = c.n_routed_experts and self.num_hidden_layers >= getattr(c, "first_k_dense_replace", 1)
            c.mlp_layer_types = list(kinds) + ["sparse" if moe else "dense"] * (self.num_hidden_layers + 1 - len(kinds))
        return c


def _family_classes(family: str):
    prefix = FAMILIES[family][0]
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return getattr(module, f"{prefix}DecoderLayer"), getattr(module, f"{prefix}RotaryEmbedding")


class RowCache:
    """One sequence's keys and values in the MTP layer ([1, heads, rows, D]), the ``past_key_values`` the family's
    attention writes to (it calls ``update`` only); ``cut`` drops the rows past n."""

    def __init__(self):
        self.k = self.v = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def update(self, key_states, value_states, layer_idx=0, *args, **kwargs):
        if self.k is None:
            self.k, self.v = key_states, value_states
        else:
            self.k, self.v = torch.cat([self.k, key_states], 2), torch.cat([self.v, value_states], 2)
        return self.k, self.v

    def cut(self, n: int) -> None:
        if self.k is not None and n < self.k.shape[2]:
            self.k, self.v = self.k[:, :, :n], self.v[:, :, :n]

    def nbytes(self) -> int:
        return 0 if self.k is None else (self.k.numel() + self.v.numel()) * self.k.element_size()


class SharedHead(nn.Module):
    def __init__(self, H: int, V: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(H, eps)
        self.head = nn.Linear(H, V, bias=False)


class MtpLayer(nn.Module):
    """One MTP layer under the checkpoint's names (``model.layers.{N}.`` removed; the decoder layer's as
    ``mtp_block``)."""

    def __init__(self, spec: MtpSpec, hf_config):
        super().__init__()
        H, eps = spec.hidden_size, spec.rms_norm_eps
        layer_cls, _ = _family_classes(spec.family)
        self.enorm, self.hnorm = RMSNorm(H, eps), RMSNorm(H, eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.shared_head = SharedHead(H, spec.vocab_size, eps)
        self.mtp_block = layer_cls(hf_config, spec.num_hidden_layers)  # its index picks MoE or dense, as in vLLM
        self.mtp_block.self_attn.layer_idx = 0  # the one layer of its own cache


class MtpHead(nn.Module):
    """The target's first MTP layer with the target's embedding and final norm (``target_norm``)."""

    def __init__(self, spec: MtpSpec):
        super().__init__()
        self.spec = spec
        hf = spec.hf_config()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.target_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.layer = MtpLayer(spec, hf)
        self.rotary = _family_classes(spec.family)[1](hf)

    def target_hidden(self, states: torch.Tensor) -> torch.Tensor:
        """The target's returned hidden states (after its final norm) from the captured stream entering layer N."""
        return self.target_norm(states.to(self.target_norm.weight.dtype))

    def step(self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, kv, mask: torch.Tensor):
        """Rows (ids [B, n], positions [B, n], hidden [B, n, H]: the target's h_t or the layer's own feedback) after
        the rows in ``kv`` (a ``RowCache``, extended in place, or any ``past_key_values`` the family's attention
        writes); mask [n, S + n] or [B, n, S + n] bool (True: attend), S the rows before. Returns (logits [B, n, V],
        what the next step is fed [B, n, H])."""
        L = self.layer
        e = self.embed_tokens(ids)
        e = torch.where(positions.unsqueeze(-1) == 0, torch.zeros_like(e), e)  # vLLM: no embedding at position 0
        x = L.eh_proj(torch.cat([L.enorm(e), L.hnorm(hidden.to(e.dtype))], dim=-1))
        additive = torch.zeros(mask.shape, dtype=x.dtype, device=x.device).masked_fill(~mask, float("-inf"))
        out = L.mtp_block(x, attention_mask=additive.view(-1, 1, *mask.shape[-2:]), position_ids=positions,
                          past_key_values=kv, use_cache=True, position_embeddings=self.rotary(x, positions))
        normed = L.shared_head.norm(out)
        return L.shared_head.head(normed), (normed if self.spec.feeds_normed else out)

    @torch.no_grad()
    def draft(self, tokens: list[int], states: torch.Tensor, k: int, return_logits: bool = False):
        """Greedy drafts after ``tokens`` (x_0..x_{n+1}, the last the verifier's, without a state yet) from the
        captured states entering layer N [n+1, H], as vLLM's proposer runs them: the reference drafting.
        With ``return_logits``, also the logits [k, V] each draft was the argmax of."""
        n1 = len(tokens) - 1
        assert states.shape[0] == n1, (states.shape, n1)
        dev = states.device
        kv = RowCache()
        mask = torch.ones(n1, n1, dtype=torch.bool, device=dev).tril()
        logits, fed = self.step(torch.tensor([tokens[1:]], device=dev), torch.arange(n1, device=dev).unsqueeze(0),
                                self.target_hidden(states).unsqueeze(0), kv, mask)
        rows, drafts = [logits[0, -1]], []
        for i in range(k):
            drafts.append(int(rows[-1].argmax()))
            if i + 1 == k:
                break
            one = torch.ones(1, len(kv) + 1, dtype=torch.bool, device=dev)
            logits, fed = self.step(torch.tensor([[drafts[-1]]], device=dev), torch.tensor([[n1 + i]], device=dev),
                                    fed[:, -1:], kv, one)
            rows.append(logits[0, -1])
        return (drafts, torch.stack(rows)) if return_logits else drafts


# ---------------------------------------------------------------------- checkpoints
def _weight_files(path: Path) -> dict[str, Path]:
    """{tensor name: its safetensors file} from the index, or from one file's header."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    files = [single] if single.exists() else sorted(path.glob("*.safetensors"))
    out = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            out.update({k: f for k in h.keys()})
    if not out:
        raise ValueError(f"{path}: no safetensors weights (model.safetensors or an index of shards)")
    return out


def _prefix(names, base: str) -> str:
    """The checkpoint's prefix of the decoder (``model.`` for most, ``model.language_model.`` for some)."""
    for p in ("model.", "model.language_model.", ""):
        if f"{p}layers.{base}.eh_proj.weight" in names:
            return p
    raise UnsupportedMtp(f"no MTP weights: layers.{base}.eh_proj.weight is absent (num_nextn_predict_layers says "
                         "the checkpoint has them)")


def mtp_weight_names(spec: MtpSpec, names) -> dict[str, str]:
    """{the head's name: the checkpoint's} for the weights the head reads: the first MTP layer, the embedding, the
    final norm and the head (the layer's ``shared_head.head``, else the target's ``lm_head``)."""
    p = _prefix(names, spec.num_hidden_layers)
    layer = f"{p}layers.{spec.num_hidden_layers}."
    out = {"embed_tokens.weight": f"{p}embed_tokens.weight", "target_norm.weight": f"{p}norm.weight"}
    for name in names:
        if name.startswith(layer) and not name[len(layer):].startswith("embed_tokens"):
            rest = name[len(layer):]
            ours = rest if rest.split(".")[0] in ("enorm", "hnorm", "eh_proj", "shared_head") else f"mtp_block.{rest}"
            out[f"layer.{ours}"] = name
    if "layer.shared_head.head.weight" not in out:
        out["layer.shared_head.head.weight"] = ("lm_head.weight" if "lm_head.weight" in names
                                                else f"{p}embed_tokens.weight")
    return out


def _pack_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert weights (``experts.{e}.gate_proj``/``up_proj``/``down_proj``, as checkpoints store them) packed
    as transformers' fused experts hold them: ``gate_up_proj`` [E, 2I, H] (gate rows first), ``down_proj`` [E, H, I]."""
    out, experts = {}, {}
    for name, w in state.items():
        parts = name.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            experts.setdefault(".".join(parts[: i + 1]), {})[(int(parts[i + 1]), parts[i + 2])] = w
        else:
            out[name] = w
    for base, ws in experts.items():
        n = 1 + max(e for e, _ in ws)
        out[f"{base}.gate_up_proj"] = torch.stack([torch.cat([ws[(e, "gate_proj")], ws[(e, "up_proj")]])
                                                   for e in range(n)])
        out[f"{base}.down_proj"] = torch.stack([ws[(e, "down_proj")] for e in range(n)])
    return out


def read_spec(path: str | Path) -> MtpSpec:
    return MtpSpec.from_config(json.loads((Path(path) / "config.json").read_text()))


def check_model(path: str | Path) -> MtpSpec:
    """The build-time check, reading the config and the weights' names only: a family and config this project runs,
    and the first MTP layer's weights present. Returns the spec."""
    path = Path(path)
    spec = read_spec(path)
    names = _weight_files(path)
    wanted = mtp_weight_names(spec, names)
    missing = sorted(v for v in wanted.values() if v not in names)
    if missing:
        raise UnsupportedMtp(f"{path}: MTP weights missing: {missing[:4]}")
    return spec


def load_head(path: str | Path, dtype=torch.float32, device="cpu") -> MtpHead:
    """The target checkpoint's first MTP layer with its embedding, final norm and head: only those tensors are
    read (from the shards that hold them), never the rest of the target."""
    from safetensors import safe_open

    path = Path(path)
    spec = check_model(path)
    files = _weight_files(path)
    state = {}
    for ours, theirs in mtp_weight_names(spec, files).items():
        with safe_open(str(files[theirs]), "pt") as h:
            state[ours] = h.get_tensor(theirs)
    head = MtpHead(spec)
    state = _pack_experts(state)
    expected = head.state_dict()
    wrong = sorted(set(expected) ^ set(state))
    if wrong:
        raise ValueError(f"{path}: the MTP layer's weights do not match the config: {wrong[:6]}")
    head.load_state_dict(state)
    return head.to(device=device, dtype=dtype).eval()
