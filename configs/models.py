"""Configs for the drafter, the verifier and sampling. Every number is bounded."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Annotated, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

log = logging.getLogger(__name__)

MAX_SPECULATIVE_TOKENS = 16

# Fields that model configs without a common base share, each defined once: its type, bounds and description.
Forward = Annotated[Literal["auto", "native", "compact", "transformers"], Field(description=(
    "Decoder forward for Llama-family models (llama, mistral, qwen2, qwen3): native (the compact forward as one C++ "
    "call, core/csrc/decoder.cpp, "
    "built once per machine; CPU only), compact (the same forward as eager PyTorch ops), or transformers (the model's "
    "own modules, any "
    "architecture). auto: native on CPUs where it builds, else compact, and transformers for other architectures."))]
DraftTopK = Annotated[int, Field(ge=1, le=1_000_000, description=(
    "The drafter samples from its own top draft_top_k tokens (a head's mapped to the target's vocabulary), so q is "
    "exactly sparse and only these "
    "entries travel to the verifier."))]
_DTYPE = Literal["auto", "float32", "bfloat16", "float16"]


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _EngineConfig(_Config):
    """What every model engine runs with: a drafter's model or head, the verifier's target."""

    dtype: _DTYPE = Field("auto", description=(
        "Compute dtype; auto: bfloat16 on GPUs and on CPUs with native bf16 (AVX-512 BF16, AMX), float32 elsewhere "
        "(logged at start)."))
    kv_cache_dtype: _DTYPE = Field("auto", description=(
        "KV cache dtype; auto: float32 on CPUs (bf16 attention kernels are slower there), the compute dtype "
        "elsewhere."))
    device: str = Field("cpu", description="torch device the model (or the head) runs on.")
    max_model_len: int | None = Field(None, ge=2, le=1_000_000, description=(
        "Longest sequence (prompt + output); default: the model's (or the head's) max_position_embeddings."))
    num_threads: int | None = Field(None, ge=1, le=1024, description=(
        "torch intra-op threads; default: leave torch's setting."))
    cpu_affinity: list[Annotated[int, Field(ge=0, le=65535)]] | None = Field(
        None, min_length=1, max_length=4096, description=(
        "Linux: the CPU cores (ids) this pool's replica processes run on, every thread of them; default: the OS "
        "schedules. For one machine running "
        "both pools (a laptop): disjoint cores for the verifier and the drafter, as vLLM's CPU backend binds its "
        "threads (VLLM_CPU_OMP_THREADS_BIND); "
        "pre-draft trees then run beside the verify forward instead of slowing it "
        "(docs/decisions/0015-whole-replica-pinning.md). On a cluster leave "
        "it unset."))


class _HeadConfig(_EngineConfig):
    """A draft head on the drafter pool that reads the target's hidden states (EAGLE-3, DFlash, DSpark)."""

    draft_top_k: DraftTopK = 64
    verifier_model: str | None = Field(None, description=(
        "The target's reference (its EOS ids, for penalties in q; its embedding or lm_head when the head has none); "
        "the app builder sets it from "
        "verifier.model."))


class SamplingParams(_Config):
    """How one request samples. The verifier applies these to its logits to get p; the
    drafter applies the same to its own logits to get q, so that q approximates p."""

    temperature: float = Field(1.0, ge=0.0, le=10.0, description=(
        "Softmax temperature; 0 means greedy (argmax) decoding."))
    top_p: float = Field(1.0, gt=0.0, le=1.0, description=(
        "Nucleus sampling: keep the smallest set of most likely tokens whose probability sums to at least top_p."))
    top_k: int = Field(0, ge=0, le=1_000_000, description="Keep only the top_k most likely tokens; 0 disables the cut.")
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description=(
        "Seed of the request's random numbers; the same seed, prompt and parameters give the same output whatever "
        "else is batched with it."))
    max_tokens: int = Field(256, ge=1, le=1_000_000, description=(
        "Most tokens to generate (the context limit may end generation earlier)."))
    stop: tuple[str, ...] = Field((), max_length=16, description=(
        "Strings that end generation; the returned text excludes them."))
    ignore_eos: bool = Field(False, description="Keep generating after an end-of-sequence token.")
    stop_token_ids: tuple[int, ...] = Field((), max_length=256, description=(
        "Token ids that end generation like EOS (even with ignore_eos); the id is returned, its text is not."))
    min_tokens: int = Field(0, ge=0, le=1_000_000, description=(
        "Generate at least this many tokens: EOS and stop_token_ids are masked out, and stop strings are not "
        "searched, before then."))
    logit_bias: dict[int, float] = Field(default_factory=dict, description=(
        "Added to the logits of these token ids (each in [-100, 100]) before the penalties."))
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description=(
        "Divides positive (multiplies negative) logits of tokens already in the prompt or the output; 1 is off."))
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description=(
        "Subtracted from a token's logit once per time it occurs in the output."))
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description=(
        "Subtracted from the logit of every token that occurs in the output."))
    min_p: float = Field(0.0, ge=0.0, le=1.0, description=(
        "After temperature, drop tokens whose probability is below min_p times the most likely token's."))
    verification: Literal["rejection", "gumbel"] = Field(
        "rejection", description="How sampled drafts are verified. rejection: Leviathan/Chen rejection sampling, the "
        "highest acceptance; a seeded request repeats exactly only when the same drafts happen. gumbel: Gumbel-max "
        "coupling, where every token is argmax(log p + g) with noise g keyed by (seed, position) alone, so seeded "
        "output is identical whatever the drafter, k or replica did (and equals plain decoding); acceptance is "
        "somewhat lower. Both emit tokens distributed exactly as the target's p; greedy ignores this.")

    capture: bool = Field(True, description=(
        "Whether the verifier's traffic capture (VerifierConfig.capture, when configured) may record this request; "
        "the OpenAI API's "
        "`store: false` sets it false."))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def history_dependent(self) -> bool:
        """Whether p depends on the tokens before a position (penalties, min_tokens), not only on
        the logits there."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.min_tokens > 0)

    @property
    def processed(self) -> bool:
        """Whether any logits processor runs before temperature (the greedy fast path skips them)."""
        return self.history_dependent or bool(self.logit_bias)

    @model_validator(mode="after")
    def _check(self):
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if any(not -100.0 <= b <= 100.0 for b in self.logit_bias.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self


class DraftModelConfig(_EngineConfig):
    """A small causal LM that shares the target's tokenizer proposes the draft tokens."""

    method: Literal["draft_model"] = Field("draft_model", description="Selects this drafter type.")
    model: str = Field(..., min_length=1, description=(
        "A Hugging Face causal LM with the target's vocabulary: a local directory, or a Hub repo id "
        "`org/name[@revision]` (docs/serving.md, Model "
        "references)."))
    num_speculative_tokens: int = Field(4, ge=0, le=MAX_SPECULATIVE_TOKENS, description=(
        "k: the most draft tokens proposed per step (0 turns speculation off)."))
    draft_top_k: DraftTopK = 64
    forward: Forward = "auto"
    cache_budget_mb: float = Field(256, gt=0, le=1_000_000, description=(
        "Memory for the drafter's paged KV cache (blocks of 16 tokens; sequences are bounded by tokens held); the "
        "least recently used sequence is "
        "evicted when full."))
    prefix_caching: bool = Field(True, description=(
        "Share the draft model's full KV blocks across requests, as the verifier's (docs/serving.md, Prefix caching)."))


class NgramConfig(_Config):
    """Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
    sequence's last n tokens. No model, no q (treated as one-hot, which stays lossless)."""

    method: Literal["ngram"] = Field("ngram", description="Selects this drafter type.")
    num_speculative_tokens: int = Field(4, ge=0, le=MAX_SPECULATIVE_TOKENS, description=(
        "k: the most draft tokens proposed per step."))
    min_n: int = Field(1, ge=1, le=64, description="Shortest suffix n-gram to match.")
    max_n: int = Field(4, ge=1, le=64, description="Longest suffix n-gram to match (tried first).")
    cache_budget_mb: float = Field(256, gt=0, le=1_000_000, description=(
        "Memory for the sequences' tokens and n-gram indexes (estimated); the least recently used sequence is dropped "
        "when full."))

    @model_validator(mode="after")
    def _n_range(self):
        if self.min_n > self.max_n:
            raise ValueError(f"min_n ({self.min_n}) must not exceed max_n ({self.max_n})")
        return self


class Eagle3Config(_HeadConfig):
    """An EAGLE-3 head (Speculators format) on the drafter pool: it reads the target's hidden states,
    which the verifier captures in its verification pass and sends with each draft request."""

    method: Literal["eagle3"] = Field("eagle3", description="Selects this drafter type.")
    model: str = Field(..., min_length=1, description=(
        "A Speculators eagle3 head (config.json with speculators_model_type eagle3, safetensors weights) trained for "
        "the verifier's model: a local "
        "directory, or a Hub repo id `org/name[@revision]` (docs/serving.md, Model references)."))
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS, description=(
        "k: the most draft tokens proposed per step (0 turns speculation off). Default: the speculative_tokens of the "
        "head's default proposal method "
        "(its speculators_config), else 4; the app builder sets it."))
    cache_budget_mb: float = Field(64, gt=0, le=1_000_000, description=(
        "Memory for the head's paged KV cache (one layer; blocks of 16 tokens); the least recently used sequence is "
        "evicted when full."))


class ParallelHeadConfig(_HeadConfig):
    """A parallel draft head (Speculators' DFlash or DSpark format) on the drafter pool: like an EAGLE-3 head it
    reads the target's hidden states, which the verifier sends with each draft request, and it drafts a whole
    block in one forward pass (docs/parallel-drafters.md)."""

    method: Literal["dflash", "dspark"] = Field(..., description=(
        "Selects this drafter type: dflash, or dspark (DFlash with a Markov head)."))
    model: str = Field(..., min_length=1, description=(
        "A Speculators dflash or dspark head (config.json with speculators_model_type dflash or dspark, safetensors "
        "weights) trained for the "
        "verifier's model: a local directory, or a Hub repo id `org/name[@revision]` (docs/serving.md, Model "
        "references)."))
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS, description=(
        "k: the most draft tokens proposed per step (0 turns speculation off), at most the head's block (block_size - "
        "1 mask positions). Default: "
        "the speculative_tokens of the head's default proposal method, else the block's; the app builder sets it."))
    confidence_stop: float | None = Field(None, ge=0.0, le=1.0, description=(
        "dspark with a confidence head: end a block at the first position (after the first) whose confidence is below "
        "this; default: draft the "
        "whole block (docs/decisions/0029-dspark-whole-blocks.md)."))
    cache_budget_mb: float = Field(64, gt=0, le=1_000_000, description=(
        "Memory for the sequences' context keys and values; the least recently used sequence is evicted when full."))


class PEagleConfig(_HeadConfig):
    """A P-EAGLE head (an EAGLE-3 head that drafts the whole block in one pass: vLLM's eagle3 with parallel_drafting) on
    the drafter pool, reading the target's hidden states as an EAGLE-3 head does (docs/eagle3.md, P-EAGLE heads)."""

    method: Literal["peagle"] = Field("peagle", description="Selects this drafter type.")
    model: str = Field(..., min_length=1, description=(
        "A P-EAGLE head: a Speculators peagle config, or vLLM's EAGLE-3 layout with a mask token (ptd_token_id, "
        "pard_token or mask_token_id) "
        "and mask_hidden in its weights, trained for the verifier's model: a local directory, or a Hub repo id "
        "`org/name[@revision]`."))
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS, description=(
        "k: the drafts of one pass (0 turns speculation off). Default: the speculative_tokens of the head's default "
        "proposal method, else 4; "
        "a head drafts best up to the k it was trained for."))
    cache_budget_mb: float = Field(64, gt=0, le=1_000_000, description=(
        "Memory for the head's paged KV cache; the least recently used sequence is evicted when full."))


class MtpConfig(_HeadConfig):
    """The target checkpoint's own multi-token-prediction layer on the drafter pool (docs/mtp.md): only that layer, the
    embedding, the final norm and the head are read from the target's files. (kv_cache_dtype is not used: the layer's
    keys and values stay in the compute dtype.)"""

    method: Literal["mtp"] = Field("mtp", description="Selects this drafter type.")
    model: str = Field(..., min_length=1, description=(
        "The target checkpoint with MTP layers (num_nextn_predict_layers; glm4_moe, glm4_moe_lite or deepseek_v3): "
        "normally verifier.model itself."))
    num_speculative_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS, description=(
        "k: the MTP layer is applied k times, each draft fed back (0 turns speculation off). Default 4."))
    cache_budget_mb: float = Field(64, gt=0, le=1_000_000, description=(
        "Memory for the MTP layer's keys and values; the least recently used sequence is evicted when full."))


DrafterConfig = Annotated[DraftModelConfig | NgramConfig | Eagle3Config | ParallelHeadConfig | PEagleConfig | MtpConfig,
                          Field(discriminator="method")]


class CaptureConfig(_Config):
    """Recording served traffic for training a draft head (docs/training.md): for the sampled requests that do not
    opt out (`store: false`), the tokens and the target's states an EAGLE-3 head reads, written as shards on the
    verifier replica's disk (verifier/capture.py). This is user data on disk: the prompts and outputs of the requests
    recorded."""

    dir: str = Field(..., min_length=1, description=(
        "Directory of the shards (created if missing), on each verifier replica's node."))
    layers: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1, max_length=16, description=(
        "The aux layers recorded (vLLM's layer ids: the residual stream entering layer L), those of the head to be "
        "trained; default vLLM's "
        "(2, N // 2, N - 3). The last layer's output, from which the trainer computes the target's distribution, is "
        "always recorded."))
    sample_rate: float = Field(1.0, ge=0.0, le=1.0, description="The share of requests recorded (drawn per request).")
    max_bytes: int = Field(..., ge=1, description=(
        "The byte budget of all shards in dir: the oldest shards are deleted to stay within it."))
    shard_bytes: int = Field(64 * 2**20, ge=1, description=(
        "A shard is written once the finished requests buffered in memory hold this many bytes (or flush_interval_s "
        "passed)."))
    flush_interval_s: float = Field(60.0, ge=0.0, description=(
        "A shard is written once its oldest buffered request is this old (0: at each request's end)."))
    max_shards: int | None = Field(None, ge=1, description=(
        "Retention: the most shards kept (the oldest deleted first); default no limit."))
    max_age_s: float | None = Field(None, gt=0, description=(
        "Retention: shards older than this are deleted; default no limit."))
    dtype: Literal["bfloat16", "float32"] = Field("bfloat16", description="The dtype the states are stored in.")

    @model_validator(mode="after")
    def _check(self):
        if self.shard_bytes > self.max_bytes:
            raise ValueError(f"capture.shard_bytes {self.shard_bytes} exceeds capture.max_bytes {self.max_bytes}")
        if self.layers is not None and len(set(self.layers)) != len(self.layers):
            raise ValueError(f"capture.layers {self.layers} repeats a layer")
        return self


# the vLLM options' former flat names in VerifierConfig (``vllm_<name>``): accepted with a deprecation warning
# (``VerifierConfig._flat_vllm_fields``)
# the backends with options of their own, nested under the backend's name (``verifier.vllm``)
BACKEND_OPTIONS = ("vllm",)
FLAT_VLLM_FIELDS = ("kv_cache_gib", "block_size", "max_num_seqs", "tracked_sequences", "enforce_eager", "loop",
                    "num_speculative_tokens", "speculate")


class VllmOptions(_Config):
    """The vllm verifier backend's settings (``verifier.vllm``; docs/vllm.md)."""

    kv_cache_gib: float = Field(1.0, gt=0, le=100_000, description=(
        "Memory for vLLM's paged KV cache in GiB (kv_cache_memory_bytes; replaces cache_budget_mb). Set it "
        "explicitly: vLLM's CPU default reserves a share of all RAM per engine."))
    block_size: int = Field(32, ge=16, le=1024, multiple_of=16, description=(
        "Tokens per KV cache block. Prefix caching reuses whole blocks, so each step also recomputes the partial "
        "last block; the CPU backend prefers multiples of 32."))
    max_num_seqs: int = Field(64, ge=1, le=4096, description=(
        "Most engine requests in one vLLM step (a sampled verify step of k drafts uses k + 1)."))
    tracked_sequences: int = Field(4096, ge=1, le=10_000_000, description=(
        "Sequences whose token ids the replica remembers (least recently used forgotten) to rebuild prompts; a "
        "forgotten sequence's next call is a cache miss."))
    enforce_eager: bool | None = Field(None, description=(
        "Run the model eagerly (no torch.compile or CUDA graphs). Default (None): eager on CPU, where compiling "
        "takes minutes; compiled with CUDA graphs on GPUs."))
    loop: Literal["engine", "per_step"] = Field("engine", description=(
        "engine: vLLM runs the speculative loop (its scheduler, batching and rejection sampler) and drafts through "
        "splitspec's proposer, which calls the drafter pool from vLLM's worker (verifier/vllm_proposer.py); "
        "per_step: splitspec's verifier-side loop, each verify step one vLLM engine request (splitspec's own "
        "rejection sampler: gumbel verification, the adaptive policy; far slower per step: "
        "docs/decisions/0019-vllm-runs-the-loop.md)."))
    num_speculative_tokens: int = Field(8, ge=1, le=32, description=(
        "Engine loop: the most drafts vLLM verifies per step (its num_speculative_tokens); a request's k is capped "
        "by it."))
    speculate: Literal["measured", "always"] = Field("measured", description=(
        "Engine loop: whether an engine step speculates. measured (default): per batch size (powers of two), by "
        "the tokens per second each choice measures in engine steps, each arm measured once it has run a few steps "
        "in a row (a switch costs the drafter its warm state); speculation goes off where verification saturates "
        "or the drafter pool cannot keep up, and is retried now and then. always: every step drafts for every "
        "request that asks. Pre-draft trees run only while at most 4 requests do."))


class VerifierConfig(_EngineConfig):
    """The target model that verifies drafts."""

    model: str | None = Field(None, min_length=1, description=(
        "A Hugging Face causal LM (config, safetensors weights, tokenizer): a local directory, or a Hub repo id "
        "`org/name[@revision]`, pinned to a "
        "commit when the app is built (docs/serving.md, Model references). Default: with an eagle3 drafter, the "
        "verifier the head's "
        "speculators_config names; required otherwise."))
    forward: Forward = "auto"
    cache_budget_mb: float = Field(1024, gt=0, le=10_000_000, description=(
        "Memory for the paged KV cache (blocks of 16 tokens; sequences are bounded by tokens held); the least "
        "recently used sequence is evicted when "
        "full."))
    max_batch_tokens: int = Field(2048, ge=1, le=1_000_000, description=(
        "Most (padded) tokens in one forward pass; larger batches are split."))
    prefix_caching: bool = Field(True, description=(
        "Share full KV blocks across requests by a chained hash of their tokens and the request's cache_salt: a "
        "request prefills only "
        "what no earlier request on the replica left cached (transformers backend; docs/serving.md, Prefix caching)."))
    backend: Literal["transformers", "vllm"] = Field("transformers", description=(
        "transformers: this package's engine (per-sequence KV slots, batched forward); vllm: vLLM's AsyncLLM (paged "
        "attention, continuous batching, prefix caching), one per replica, with the same verify protocol and "
        "guarantees, set up by the `vllm` options."))
    vllm: VllmOptions | None = Field(None, description=(
        "backend vllm: vLLM's settings (defaults filled in when left out); not allowed with another backend."))
    tensor_parallel_size: int = Field(1, ge=1, le=64, description=(
        "vllm backend: GPUs one verifier replica shards the target over (vLLM's tensor parallelism). Give the "
        "Verifier deployment a placement group of that many GPU bundles (configs/serve_gpu_vllm.yaml)."))
    capture: CaptureConfig | None = Field(None, description=(
        "Record served traffic for training a draft head (off by default; user data on disk: docs/training.md). "
        "transformers backend only."))
    chat_template: str | None = Field(None, min_length=1, max_length=200_000, description=(
        "The chat template the router applies in place of the tokenizer's: a Jinja template, or the path of a file "
        "holding one (vLLM's "
        "--chat-template). Default: the model's own."))
    trust_request_chat_template: bool = Field(False, description=(
        "Let a chat request carry its own chat_template (vLLM's --trust-request-chat-template); off: such a request "
        "is a 400."))
    reasoning_parser: str | None = Field(None, min_length=1, max_length=64, description=(
        "vLLM's name of the parser that splits the model's reasoning from its answer (vLLM's --reasoning-parser: "
        "qwen3, deepseek_r1, "
        "openai_gptoss ...): responses then carry message.reasoning, streams delta.reasoning (docs/serving.md, "
        "Reasoning and tools)."))
    tool_call_parser: str | None = Field(None, min_length=1, max_length=64, description=(
        "vLLM's name of the parser that reads tool calls from the model's output (vLLM's --tool-call-parser: hermes, "
        "llama3_json, openai ...); "
        "needs enable_auto_tool_choice."))
    enable_auto_tool_choice: bool = Field(False, description=(
        "Serve tools with tool_choice auto, the model deciding when to call one (vLLM's --enable-auto-tool-choice); "
        "needs tool_call_parser."))

    @model_validator(mode="before")
    @classmethod
    def _flat_vllm_fields(cls, data):
        """A backend's options filled in with their defaults when left out; the vLLM options' former flat fields
        (``vllm_loop`` ...) accepted with a warning and moved under ``vllm`` (ignored with another backend, as
        before), so a config written for an earlier version still deploys unchanged."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        backend = data.get("backend", "transformers")
        if backend in BACKEND_OPTIONS and data.get(backend) is None:
            data[backend] = {}
        flat = {n: data.pop(f"vllm_{n}") for n in FLAT_VLLM_FIELDS if f"vllm_{n}" in data}
        for name in flat:
            msg = f"VerifierConfig.vllm_{name} is deprecated: write it as verifier.vllm.{name}"
            warnings.warn(msg, DeprecationWarning, stacklevel=2)
            log.warning(msg)
        nested = data.get("vllm")
        if flat and not isinstance(nested, dict):
            log.warning("verifier.vllm_%s ignored: verifier.backend is %s", ", vllm_".join(flat), backend)
        elif flat:
            both = sorted(flat.keys() & nested.keys())
            if both:
                raise ValueError(f"verifier.vllm_{both[0]} and verifier.vllm.{both[0]} are both set: keep "
                                 f"verifier.vllm.{both[0]}")
            data["vllm"] = {**nested, **flat}
        return data

    @model_validator(mode="after")
    def _check_backend_options(self):
        for name in BACKEND_OPTIONS:
            if getattr(self, name) is not None and self.backend != name:
                raise ValueError(f"verifier.{name} sets the {name} backend's options, but verifier.backend is "
                                 f"{self.backend!r}: set backend {name}, or leave {name} out")
        if self.tensor_parallel_size > 1 and self.vllm is None:
            raise ValueError(f"verifier.tensor_parallel_size {self.tensor_parallel_size} needs backend vllm: "
                             f"backend {self.backend!r} runs a replica on one device")
        return self

    @model_validator(mode="after")
    def _check_capture(self):
        if self.capture is not None and self.backend != "transformers":
            raise ValueError(f"capture: traffic capture needs backend transformers, not {self.backend!r}")
        return self

    @model_validator(mode="after")
    def _check_tools(self):
        if self.enable_auto_tool_choice and not self.tool_call_parser:  # as vLLM refuses to start
            raise ValueError("enable_auto_tool_choice needs tool_call_parser: the name of vLLM's parser for the "
                             "model's tool calls")
        return self


_C = TypeVar("_C", bound=BaseModel)


def to_yaml(config: BaseModel) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def from_yaml(cls: type[_C], text_or_path: str | Path) -> _C:
    """Parse a config from YAML text or a YAML file path."""
    text = text_or_path
    if isinstance(text_or_path, Path) or (isinstance(text_or_path, str) and "\n" not in text_or_path
                                          and text_or_path.endswith((".yaml", ".yml"))):
        text = Path(text_or_path).read_text()
    data = yaml.safe_load(text) or {}
    if hasattr(cls, "model_validate"):
        return cls.model_validate(data)
    from pydantic import TypeAdapter
    return TypeAdapter(cls).validate_python(data)
