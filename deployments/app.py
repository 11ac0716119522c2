"""App builder: ``serve run serve_config.yaml`` calls ``build_app(args)``.

``args`` is validated as ``configs.AppConfig``; per-deployment settings (replicas,
autoscaling, resources) stay in the serve config's ``deployments:`` section.
"""

from __future__ import annotations

from configs import AppConfig


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
    # health checked every 2 s (Serve: 10) and a stopping replica waits 5 s for its calls (Serve: 20):
    # a stalled engine (stall_timeout_s) is replaced quickly, and the streams of a stopping replica
    # resume on another one from their tokens anyway
    health = {"health_check_period_s": 2, "health_check_timeout_s": 10, "graceful_shutdown_timeout_s": 5}
    drafter = serve.deployment(DrafterServer, name="Drafter", max_ongoing_requests=128,
                               ray_actor_options={"num_cpus": 0.5}, request_router_config=affinity, **health)
    verifier = serve.deployment(VerifierServer, name="Verifier", max_ongoing_requests=128,
                                ray_actor_options={"num_cpus": 1}, request_router_config=affinity, **health)
    router = serve.deployment(Router, name="Router", max_ongoing_requests=256, ray_actor_options={"num_cpus": 0.1})
    drafter = drafter.options(**overrides.get("Drafter", {})).bind(
        cfg["drafter"], max_batch=config.max_batch, max_queue=config.max_queue, stall_timeout_s=config.stall_timeout_s)
    verifier = verifier.options(**overrides.get("Verifier", {})).bind(
        cfg["verifier"], max_batch=config.max_batch, max_queue=config.max_queue, drafter=drafter,
        pipeline_drafts=config.pipeline_drafts, drafter_timeout_s=config.drafter_timeout_s,
        stall_timeout_s=config.stall_timeout_s, drafter_transport=config.drafter_transport)
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
    """Fail at build time, with a clear message, on a missing model or a drafter whose tokenizer is not
    the verifier's. Tokenizers are compared token by token, not by ``vocab_size``: padded embedding
    tables of one tokenizer differ in size and are compatible; two tokenizers of one size are not."""
    from pathlib import Path

    from transformers import AutoConfig

    paths = [("verifier", config.verifier.model)]
    if config.drafter.method == "draft_model":
        paths.append(("drafter", config.drafter.model))
    sizes = {}
    for role, path in paths:
        if not (Path(path) / "config.json").exists():
            raise ValueError(f"{role} model directory {path!r} has no config.json (models load from local files only)")
        sizes[role] = AutoConfig.from_pretrained(path).get_text_config().vocab_size
    vocab = tokenizer_vocab(config.verifier.model)
    if vocab is None:
        raise ValueError(f"verifier model directory {config.verifier.model!r} has no tokenizer")
    if len(paths) > 1:
        theirs = tokenizer_vocab(paths[1][1])  # a drafter without tokenizer files uses the verifier's
        if theirs is not None and theirs != vocab:
            differ = sum(1 for t in set(vocab) | set(theirs) if vocab.get(t) != theirs.get(t))
            raise ValueError(f"drafter and verifier tokenizers differ ({differ} tokens map to different ids): "
                             "a drafter must use the verifier's tokenizer")
    needed = max(vocab.values()) + 1
    for role, size in sizes.items():
        if size < needed:
            raise ValueError(f"{role} model's vocab_size {size} does not cover the tokenizer's {needed} ids")


def tokenizer_vocab(path: str) -> dict[str, int] | None:
    """A model directory's tokenizer as {token: id} (added tokens included), None without one."""
    from pathlib import Path

    if not any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).get_vocab()
