"""App builder: ``serve run serve_config.yaml`` calls ``build_app(args)``.

``args`` is validated as ``AppConfig``; per-deployment settings (replicas, autoscaling,
resources) stay in the serve config's ``deployments:`` section, where Ray users expect
them. The defaults below are chosen for this workload, not Serve's generic ones.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from configs import DrafterConfig, VerifierConfig


class AppConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_name: str = Field("tiny-code", min_length=1, description="The name clients pass as `model`.")
    verifier: VerifierConfig = Field(..., description="The target model that verifies drafts.")
    drafter: DrafterConfig = Field(..., description="How drafts are proposed (method: draft_model | ngram).")
    max_tokens_limit: int = Field(1024, ge=1, le=1_000_000, description="Largest max_tokens a request may ask for.")
    clamp_speculative_tokens: bool = Field(False, description="Clamp a request's num_speculative_tokens to the drafter's k instead of letting it raise it (up to the global maximum).")
    drafter_timeout_s: float = Field(2.0, gt=0, le=600, description="A drafter call slower than this is abandoned and the step decoded without speculation.")
    k_policy: Literal["adaptive", "fixed"] = Field("adaptive", description="adaptive: pick k per step from measured acceptance, drafter cost and verifier load (a request's num_speculative_tokens is the upper bound); fixed: always speculate the request's k.")
    pipeline_drafts: bool = Field(True, description="Draft the next block while the current one is verified (assuming it is fully accepted), so the drafter round trip is hidden when the guess holds.")
    verifier_retry_s: float = Field(120.0, ge=0, le=3600, description="How long a request keeps retrying failed verify calls (a replica died: another one, or its replacement, recomputes from the tokens) before it fails.")
    verification: Literal["rejection", "gumbel"] = Field("rejection", description="Default verification of sampled requests (a request's `verification` overrides it): rejection sampling, or Gumbel-max coupling whose seeded output does not depend on drafts, k or replica failures. See SamplingParams.verification.")
    request_timeout_s: float = Field(600.0, gt=0, le=86_400, description="Deadline of every request (a request's `timeout` may shorten it): past it the request stops, its caches are released, and the client gets a 504 (an error event when streaming).")
    max_active_requests: int = Field(192, ge=1, le=1_000_000, description="Requests a router replica runs at once; beyond it new requests get 429 with Retry-After at once instead of queueing.")
    max_batch: int = Field(64, ge=1, le=4096, description="Most sequences per batched forward pass on a replica.")
    max_queue: int = Field(1024, ge=1, le=1_000_000, description="Most sequence steps waiting on a replica; beyond it calls fail fast.")


def build_app(args: dict):
    """Validate ``args`` and return the bound Serve application (router -> drafter, verifier).
    Serve calls this with the serve config's ``args``."""
    return build_app_with(args)


def build_app_with(args: dict, overrides: dict[str, dict] | None = None):
    """``build_app`` for programmatic use (tests): ``overrides`` maps a deployment name to
    ``.options()``; serve config files put the same settings in their ``deployments:`` section.
    """
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from deployments.affinity import ROUTER_PATH
    from deployments.drafter import DrafterServer
    from deployments.router import Router
    from deployments.verifier import VerifierServer

    config = resolve_model_paths(AppConfig.model_validate(args))
    check_models(config)
    cfg = config.model_dump(mode="json")
    overrides = overrides or {}
    # Defaults for this workload (Serve's are 5 ongoing requests and 1 CPU per replica): each
    # request keeps one step in flight on each pool, and replicas batch them, so replicas
    # take many concurrent calls. The serve config's `deployments:` section overrides these.
    affinity = RequestRouterConfig(request_router_class=ROUTER_PATH)
    drafter = serve.deployment(DrafterServer, name="Drafter", max_ongoing_requests=128,
                               ray_actor_options={"num_cpus": 0.5}, request_router_config=affinity)
    verifier = serve.deployment(VerifierServer, name="Verifier", max_ongoing_requests=128,
                                ray_actor_options={"num_cpus": 1}, request_router_config=affinity)
    router = serve.deployment(Router, name="Router", max_ongoing_requests=256, ray_actor_options={"num_cpus": 0.1})
    drafter = drafter.options(**overrides.get("Drafter", {})).bind(
        cfg["drafter"], max_batch=config.max_batch, max_queue=config.max_queue)
    verifier = verifier.options(**overrides.get("Verifier", {})).bind(
        cfg["verifier"], max_batch=config.max_batch, max_queue=config.max_queue)
    return router.options(**overrides.get("Router", {})).bind(cfg, drafter, verifier)


PROJECT_ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def resolve_model_paths(config: AppConfig) -> AppConfig:
    """Make relative model paths absolute (against the working directory, else the project
    root), so replicas find them whatever directory Ray starts them in."""
    from pathlib import Path

    def resolve(path: str) -> str:
        p = Path(path).expanduser()
        if p.is_absolute():
            return str(p)
        return str((p if p.exists() else PROJECT_ROOT / p).resolve())

    update = {"verifier": config.verifier.model_copy(update={"model": resolve(config.verifier.model)})}
    if config.drafter.method == "draft_model":
        update["drafter"] = config.drafter.model_copy(update={"model": resolve(config.drafter.model)})
    return config.model_copy(update=update)


def check_models(config: AppConfig):
    """Fail at build time, with a clear message, on a missing model or mismatched vocabularies."""
    from pathlib import Path

    from transformers import AutoConfig

    paths = [("verifier", config.verifier.model)]
    if config.drafter.method == "draft_model":
        paths.append(("drafter", config.drafter.model))
    vocab = {}
    for role, path in paths:
        if not (Path(path) / "config.json").exists():
            raise ValueError(f"{role} model directory {path!r} has no config.json (models load from local files only)")
        vocab[role] = AutoConfig.from_pretrained(path).get_text_config().vocab_size
    if len(set(vocab.values())) > 1:
        raise ValueError(f"drafter and verifier vocabularies differ: {vocab}")
