import contextlib
import os
import sys

import pytest
import torch

# Tests share two cores with each other and with Ray; keep torch from oversubscribing them.
torch.set_num_threads(int(os.environ.get("SPLITSPEC_TEST_THREADS", "1")))

# The fixtures that start Ray: a test that uses one (directly or through another fixture) is in the Ray tier.
RAY_FIXTURES = frozenset({"ray_cluster", "serve_app"})


@pytest.fixture(autouse=True)
def _unit_tests_start_no_ray(request):
    """A test outside the Ray tier that starts Ray (Ray's auto-init: a Serve or runtime-context call in a
    process without Ray) fails, naming the tier it belongs to, so the unit tier stays free of Ray."""
    ray = sys.modules.get("ray")
    before = ray is not None and ray.is_initialized()
    yield
    if request.node.get_closest_marker("ray") is None and not before:
        ray = sys.modules.get("ray")
        assert ray is None or not ray.is_initialized(), (
            f"{request.node.nodeid} started Ray outside the Ray tier: use a Ray fixture (it then runs in that tier) "
            "or avoid the call that starts Ray")


def pytest_collection_modifyitems(config, items):
    """Mark every test that starts Ray (it uses a Ray fixture, or is marked ``serve`` or ``cluster``) as ``ray``,
    so ``make test`` runs the unit tier (``-m "not ray"``) before the Ray tier (``-m ray``)."""
    for item in items:
        if RAY_FIXTURES & set(getattr(item, "fixturenames", ())) or any(
                item.get_closest_marker(m) for m in ("serve", "cluster")):
            item.add_marker(pytest.mark.ray)


@pytest.fixture(scope="session")
def tiny_pair():
    """(tokenizer, peaked target, drafter that agrees often but not always)."""
    from tests.helpers import noisy_copy, tiny_llama, tiny_tokenizer

    tok = tiny_tokenizer()
    target = tiny_llama(len(tok), peak=30.0, eos_token_id=None)
    return tok, target, noisy_copy(target, 0.15)


@pytest.fixture(scope="module")
def tiny_engines(tiny_pair):
    """(tokenizer, target, VerifierEngine, ModelDrafter) on the tiny pair, in process."""
    from configs import DraftModelConfig, VerifierConfig
    from drafter.model_drafter import ModelDrafter
    from verifier.engine import VerifierEngine

    tok, target, draft = tiny_pair
    ver = VerifierEngine(VerifierConfig(model="tiny", cache_budget_mb=64), model=target, tokenizer=tok)
    return tok, target, ver, ModelDrafter(DraftModelConfig(model="tiny", cache_budget_mb=64), model=draft)


def _free_port() -> int:
    from bench.common import free_port
    return free_port()


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the whole test session (starting one takes seconds)."""
    import ray
    metrics_port = _free_port()
    ray.init(num_cpus=8, include_dashboard=False, configure_logging=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}}, _metrics_export_port=metrics_port,
             _system_config={"metrics_report_interval_ms": 1000})
    yield f"http://127.0.0.1:{metrics_port}/metrics"
    from ray import serve
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, tiny_pair):
    tok, target, draft = tiny_pair
    root = tmp_path_factory.mktemp("models")
    for name, model in (("target", target), ("drafter", draft)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root / "target", root / "drafter"


@pytest.fixture(scope="session")
def serve_app(ray_cluster, tiny_model_dirs, tiny_pair):
    """The splitspec app on tiny models, served over real HTTP on a free port.
    Yields (base_url, tokenizer, target_model, drafter_model)."""
    from ray import serve
    from ray.serve.context import _get_global_client

    from deployments.app import build_app_with

    # no-op if a module before started Serve (its http_options then stand): use the port it listens on
    serve.start(http_options={"host": "127.0.0.1", "port": _free_port()})
    port = _get_global_client().http_config.port
    target_dir, drafter_dir = tiny_model_dirs
    app = build_app_with({
        "model_name": "tiny",
        "verifier": {"model": str(target_dir), "dtype": "float32", "cache_budget_mb": 64, "num_threads": 1},
        "drafter": {"method": "draft_model", "model": str(drafter_dir), "dtype": "float32", "num_speculative_tokens": 4,
                    "cache_budget_mb": 32, "num_threads": 1},
        "max_tokens_limit": 512,
        "max_active_requests": 24,  # small, so a burst test can exceed it
        "k_policy": "fixed",  # the tiny drafter costs as much as the target: adaptive k would switch it off
    }, overrides={"Verifier": {"num_replicas": 2}})  # two verifier replicas: affinity matters
    serve.run(app, name="splitspec", route_prefix="/")
    tok, target, draft = tiny_pair
    yield f"http://127.0.0.1:{port}", tok, target, draft
    serve.delete("splitspec")


@contextlib.contextmanager
def side_app(serve_app, name: str, args: dict, overrides: dict | None = None):
    """Another splitspec app beside ``serve_app`` (its HTTP proxy, route ``/name``): yields its base URL."""
    from ray import serve

    from deployments.app import build_app_with

    serve.run(build_app_with(args, overrides=overrides), name=name, route_prefix=f"/{name}")
    try:
        yield f"{serve_app[0]}/{name}"
    finally:
        serve.delete(name)
