"""The verifier backends: what the rest of the system knows of each, in one place.

A verifier config's ``backend`` selects one ``Backend`` here. Each declares its ``Capabilities``: what a
request or a drafter may ask of it. The edge (the OpenAI API's parameter checks, the router, the drafters'
build-time checks) and the verifier replica read that record and never compare backend names. Adding a
backend is its engine (a module under ``verifier/`` with a ``build`` function), its options in
``configs.models.VerifierConfig`` (nested under the backend's name, as ``verifier.vllm``) and one
``register(Backend(...))`` line at the end of this file. ``tests/test_backend_contract.py`` runs every
backend (and a fake one, ``tests/fake_backend.py``) through the same contract.

The engine interface (what the verifier replica, ``deployments.verifier.VerifierServer``, calls; the protocols
``Engine``, ``BatchingEngine`` and ``LoopEngine`` below):

- always: ``capabilities``, ``eos_ids``, ``max_len``, ``verify(requests)``, ``release(seq_id) -> bool``,
  ``num_cached()``;
- ``is_async`` False (the default): ``verify`` runs on the replica's batcher thread, which batches concurrent
  calls and watches for stalls; ``on_progress`` is called after each forward pass; with ``structured_outputs``,
  ``masks`` (the grammars); with ``echo_logprobs``, ``prompt_logprobs(tokens, top)``; with ``aux_states``,
  ``aux_states(tokens, layers)`` (a lost sequence's states recomputed);
- ``is_async`` True: ``verify`` is a coroutine and the engine batches concurrent calls itself; ``inflight``
  (sequences in it now), ``report() -> dict`` (its part of the replica's ``stats()``) and ``check_health()``
  (``RuntimeError`` when it cannot serve);
- ``engine_loop``: the engine runs the speculative loop itself (``deployments.engine_loop``):
  ``generate``, ``sampling_params``, ``max_k``, ``speculative``, ``in_engine``, and, when it drafts
  through the drafter pool, ``bind`` and ``proposer_status``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from core.registry import Registry, check_paths, load


@dataclass(frozen=True)
class Capabilities:
    """What a backend (in one of its modes) can serve. Every field is True where the feature works as on this
    package's own engine; ``label`` names the backend and mode in the errors the edge returns."""

    label: str
    gumbel: bool = True  # SamplingParams.verification "gumbel" (else rejection sampling only)
    min_p: bool = True
    logit_bias: bool = True
    repetition_penalty: bool = True
    predicted_outputs: bool = True  # a chat request's `prediction`, drafted where it continues the sequence
    echo_logprobs: bool = True  # completions' echo with logprobs: the prompt's own log-probabilities
    structured_outputs: bool = True  # p masked by a request's grammar
    aux_states: bool = True  # the states entering chosen layers, for an EAGLE-3 style head on the drafter pool
    step_states: bool = True  # every verify's states at the layers a head names (DFlash, DSpark, MTP)
    traffic_capture: bool = True  # VerifierConfig.capture: served traffic recorded for training a head
    adaptive_k: bool = True  # k chosen per step by the replica's policy (else the request's k, the engine's cap)
    local_drafter: bool = True  # drafter_placement verifier: a drafter engine beside it in the replica
    engine_loop: bool = False  # the engine runs the speculative loop, one engine request per stream
    in_engine_drafters: tuple[str, ...] = ()  # drafter methods it runs in its own engine (drafter_placement verifier)


@runtime_checkable
class Engine(Protocol):
    """What every backend's engine has (the module docstring says what each member is for)."""

    capabilities: Capabilities
    eos_ids: set[int]
    max_len: int

    def verify(self, requests: list) -> list: ...

    def release(self, seq_id: str) -> bool: ...

    def num_cached(self) -> int: ...


@runtime_checkable
class BatchingEngine(Engine, Protocol):
    """An engine whose ``verify`` is a coroutine and which batches concurrent calls itself (``is_async``)."""

    is_async: bool
    inflight: int

    def check_health(self) -> None: ...

    def report(self) -> dict: ...


@runtime_checkable
class LoopEngine(BatchingEngine, Protocol):
    """An engine that runs each stream's loop itself (``Capabilities.engine_loop``); one that drafts through
    the drafter pool (``speculative`` and not ``in_engine``) also has ``bind`` and ``proposer_status``."""

    max_k: int
    speculative: bool
    in_engine: bool

    def sampling_params(self, params, k: int, seq_id: str, seed: int, num_prompt: int, max_tokens: int,
                        logprobs: int | None, constraint=None): ...

    def generate(self, tokens: list[int], params, request_id: str, cache_salt: str | None = None,
                 cached: dict | None = None): ...


@dataclass(frozen=True)
class Backend:
    """One backend's record. ``build``: ``"module:function"``, ``build(config, drafting=..., aux_layers=...,
    head=...) -> engine`` (named, not imported: a backend's module may need packages the edge lacks).
    ``capabilities``: its own; ``modes``: where its options' ``loop`` changes them, the capabilities of each.
    ``check``: ``"module:function"``, ``check(config)`` run by the app builder on the building node: raises
    ``ValueError`` naming what it cannot run."""

    name: str
    build: str
    capabilities: Capabilities
    modes: dict[str, Capabilities] = field(default_factory=dict)
    check: str | None = None

    def __post_init__(self):
        check_paths(self, ("build", "check"), "module:function")


BACKENDS: Registry = Registry("verifier backend")
register = BACKENDS.register


def backend(name: str) -> Backend:
    """The record of a backend; ``ValueError`` naming the registered ones for an unknown name."""
    return BACKENDS.named(name)


def capabilities(config) -> Capabilities:
    """A verifier config's capabilities (``configs.VerifierConfig``, read by attribute: core imports no
    pydantic): its backend's, or those of the mode its options' ``loop`` selects."""
    b = backend(config.backend)
    options = getattr(config, b.name, None)  # the backend's nested options (verifier.vllm), where it has any
    loop = getattr(options, "loop", None)
    return b.modes.get(loop, b.capabilities) if loop is not None else b.capabilities


def build(config, **kwargs):
    """The engine of a verifier config's backend (its ``build`` function, imported now)."""
    return load(backend(config.backend).build)(config, **kwargs)


def check(config) -> None:
    """The build-time check of a verifier config's backend, where it has one."""
    b = backend(config.backend)
    if b.check is not None:
        load(b.check)(config)


register(Backend("transformers", "verifier.engine:build", Capabilities(label="the transformers verifier backend")))
# vLLM's own loop: its rejection sampler verifies, and vLLM 0.32 refuses min_p and logit_bias in an engine that
# speculates (docs/vllm.md); splitspec's loop on vLLM (per_step) reads log-probabilities, which a repetition
# penalty (it scales logits) cannot be applied to, and returns no states
_VLLM_PER_STEP = Capabilities(
    label="the vllm verifier backend's per-step loop (verifier.vllm.loop: per_step)", repetition_penalty=False,
    predicted_outputs=False, echo_logprobs=False, structured_outputs=False, aux_states=False, step_states=False,
    traffic_capture=False, local_drafter=False)
_VLLM_ENGINE = Capabilities(
    label="the vllm verifier backend's engine loop (verifier.vllm.loop: engine)", gumbel=False, min_p=False,
    logit_bias=False, predicted_outputs=False, echo_logprobs=False, step_states=False, traffic_capture=False,
    adaptive_k=False, local_drafter=False, engine_loop=True, in_engine_drafters=("eagle3",))
register(Backend("vllm", "verifier.vllm_engine:build", _VLLM_ENGINE,
                 modes={"engine": _VLLM_ENGINE, "per_step": _VLLM_PER_STEP}, check="verifier.vllm_compat:check_build"))
