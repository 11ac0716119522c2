"""App builder: ``serve run serve_config.yaml`` calls ``build_app(args)``.

``args`` is validated as ``configs.AppConfig``; per-deployment settings (replicas,
autoscaling, resources) stay in the serve config's ``deployments:`` section.
"""

from __future__ import annotations

from pathlib import Path

from configs import AppConfig
from core.backends import check as check_backend
from core.registry import load
from drafter.registry import METHODS, method


def build_app(args: dict):
    """Validate ``args`` and return the bound Serve application (router -> drafter, verifier; with
    ``drafter_placement: verifier``, router -> verifier, which drafts in its own process).
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
    from deployments.verifier import VerifierOptions, VerifierServer
    from deployments.vllm_metrics import MetricsHub

    config = resolve_model_paths(AppConfig.model_validate(args))  # ids pinned to commits
    aux_layers = check_models(local_view(config))
    check_backend(config.verifier)  # (a vLLM whose internals the backend was not written against: named here)
    check_chat(local_view(config))
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
    colocated = config.drafter_placement == "verifier"  # the drafter engine in each verifier replica: no pool
    if colocated:
        drafter = None
    else:
        drafter = drafter.options(**overrides.get("Drafter", {})).bind(
            cfg["drafter"], max_batch=config.max_batch, max_queue=config.max_queue,
            stall_timeout_s=config.stall_timeout_s)
    verifier = verifier.options(**overrides.get("Verifier", {})).bind(
        cfg["verifier"], drafter=drafter, options=VerifierOptions.of(config, aux_layers))
    # vLLM's metric families: the router replicas' counts added up in one place (GET /metrics on any of them)
    hub = serve.deployment(MetricsHub, name="Metrics", num_replicas=1, ray_actor_options={"num_cpus": 0}, **health)
    hub = hub.options(**overrides.get("Metrics", {})).bind(config.model_name,
                                                           config.drafter.num_speculative_tokens or 0)
    return router.options(**overrides.get("Router", {})).bind(cfg, drafter, verifier, hub)


PROJECT_ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def resolve_model_paths(config: AppConfig) -> AppConfig:
    """The config replicas receive: every model reference pinned (``core.hub.pin``): a local directory
    made absolute (against the working directory, else the project root), so replicas find it whatever
    directory Ray starts them in; a Hugging Face id as ``org/name@commit``. With a head drafter, the
    verifier defaults to the one the head's ``speculators_config`` names and k to its default proposal's
    ``speculative_tokens``. Raises ``ValueError``, one line naming the field, for a reference that does
    not resolve."""
    from core.hub import pin

    bases = (Path.cwd(), PROJECT_ROOT)
    drafter, verifier = config.drafter, config.verifier
    m = method(drafter.method)
    if m.model:
        drafter = drafter.model_copy(update={"model": pin(drafter.model, "drafter.model", bases)})
    if verifier.model is not None:
        verifier = verifier.model_copy(update={"model": pin(verifier.model, "verifier.model", bases)})
    if m.head:
        head = head_defaults(local_model(drafter.model))
        if verifier.model is None:
            if not head["verifier"]:
                raise ValueError(f"verifier.model is not set and the {drafter.method} head {config.drafter.model!r} "
                                 "names no verifier (speculators_config.verifier.name_or_path)")
            field = "verifier.model (the head's speculators_config.verifier.name_or_path)"
            verifier = verifier.model_copy(update={"model": pin(head["verifier"], field, (*bases, head["dir"].parent))})
        if drafter.num_speculative_tokens is None:
            drafter = drafter.model_copy(update={"num_speculative_tokens": head["k"]})
        drafter = drafter.model_copy(update={"verifier_model": verifier.model})
    update = {"verifier": verifier, "drafter": drafter}
    # validated again: the validators see the filled-in verifier and k
    return AppConfig.model_validate(config.model_copy(update=update).model_dump(mode="json"))


def local_model(ref: str, weights: bool = False) -> str:
    """A pinned reference as a directory on this (the building) node; a Hub model's metadata only
    unless ``weights`` (an eagle3 head is read whole: its weights' names and shapes are checked)."""
    from core.hub import local_dir

    return local_dir(ref, weights)


def local_view(config: AppConfig) -> AppConfig:
    """The pinned config with its references as directories on the building node, for the build-time
    checks: verifier and draft model metadata (config, tokenizer), an eagle3 head with its weights."""
    update = {"verifier": config.verifier.model_copy(update={"model": local_model(config.verifier.model)})}
    d, m = config.drafter, method(config.drafter.method)
    if m.head:
        update["drafter"] = d.model_copy(update={"model": local_model(d.model, weights=True),
                                                 "verifier_model": update["verifier"].model})
    elif m.model:
        update["drafter"] = d.model_copy(update={"model": local_model(d.model)})
    return config.model_copy(update=update)


def head_defaults(head: str) -> dict:
    """What an eagle3 head's Speculators config says of its use: ``verifier`` (the
    ``speculators_config.verifier.name_or_path``, None when absent), ``k`` (the ``speculative_tokens``
    of its ``default_proposal_method``, else of its first proposal method, else 4; at most
    ``MAX_SPECULATIVE_TOKENS``) and ``dir`` (the head's directory)."""
    import json

    from configs.models import MAX_SPECULATIVE_TOKENS
    from core.eagle3 import default_proposal

    path = Path(head)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        cfg = {}  # the method's check says what is wrong with the head
    default = default_proposal(cfg)
    k = default.get("speculative_tokens")
    k = min(int(k), MAX_SPECULATIVE_TOKENS) if isinstance(k, int) and k >= 0 else 4
    m = METHODS.get(cfg.get("speculators_model_type"))
    if m is not None and m.max_k is not None:  # a head with a largest k (a parallel head's block): at most it, else it
        try:
            block = load(m.max_k)(cfg)
        except (KeyError, TypeError, ValueError):
            block = k  # the method's check says what is wrong with the head
        k = min(k if default.get("speculative_tokens") is not None else block, block, MAX_SPECULATIVE_TOKENS)
    verifier = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    return {"verifier": verifier, "k": k, "dir": path}


def check_chat(config: AppConfig):
    """Fail at build time, naming the field, on a chat template file that is not there or a parser
    vLLM does not have (or that does not fit the verifier's tokenizer), as the router would at start."""
    v = config.verifier
    if v.chat_template is None and v.reasoning_parser is None and v.tool_call_parser is None:
        return
    from transformers import AutoConfig, AutoTokenizer

    from deployments.chat import ChatFormat

    model_type = AutoConfig.from_pretrained(v.model).model_type
    ChatFormat(AutoTokenizer.from_pretrained(v.model), v, config.model_name, model_type)


def check_models(config: AppConfig) -> tuple[int, ...]:
    """Fail at build time, with a clear message, on a missing model or a drafter whose tokenizer is not
    the verifier's (or a head that does not fit the verifier: its method's ``check``, ``drafter.checks``). Tokenizers
    are compared token by token, not by ``vocab_size``: padded embedding tables of one tokenizer
    differ in size and are compatible; two tokenizers of one size are not. Returns the verifier
    layers whose input states a head reads ((): none)."""
    from pathlib import Path

    from transformers import AutoConfig

    paths = [("verifier", config.verifier.model)]
    m = method(config.drafter.method)
    if m.lm:
        paths.append(("drafter", config.drafter.model))
    aux_layers = tuple(load(m.check)(config).aux_layer_ids) if m.check else ()
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
    return aux_layers


def tokenizer_vocab(path: str) -> dict[str, int] | None:
    """A model directory's tokenizer as {token: id} (added tokens included), None without one."""
    from pathlib import Path

    if not any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).get_vocab()
