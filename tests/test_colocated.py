"""drafter_placement: verifier — each verifier replica drafts with an engine of its own, in its
process: no Drafter deployment, no network hop per draft, the same loop and guarantees."""

import httpx
import pytest

from tests.test_serve import PROMPTS, ref_greedy

pytestmark = pytest.mark.serve


@pytest.fixture(scope="module")
def colocated_app(ray_cluster, serve_app, tiny_model_dirs):
    from tests.conftest import side_app

    target_dir, drafter_dir = tiny_model_dirs
    with side_app(serve_app, "colocated", {
        "model_name": "tiny", "drafter_placement": "verifier", "k_policy": "fixed",
        "verifier": {"model": str(target_dir), "dtype": "float32", "cache_budget_mb": 32, "num_threads": 1},
        "drafter": {"method": "draft_model", "model": str(drafter_dir), "dtype": "float32", "num_speculative_tokens": 4,
                    "cache_budget_mb": 16, "num_threads": 1},
    }, overrides={"Verifier": {"ray_actor_options": {"num_cpus": 0.2}},
                  "Router": {"ray_actor_options": {"num_cpus": 0.05}}}) as url:
        yield url


def complete(url, **body):
    r = httpx.post(f"{url}/v1/completions", timeout=120,
                   json={"model": "tiny", "ignore_eos": True, "return_token_ids": True, **body})
    assert r.status_code == 200, r.text
    return r.json()


def verifier_stats():
    from ray import serve

    return serve.get_deployment_handle("Verifier", app_name="colocated").stats.remote().result()


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_is_the_targets_own_with_drafts_made_in_the_verifier_replica(colocated_app, serve_app, k):
    from ray import serve

    _, tok, target, _ = serve_app
    # no drafter pool
    assert set(serve.status().applications["colocated"].deployments) == {"Router", "Verifier", "Metrics"}
    before = verifier_stats()["drafter_calls"]
    for text in PROMPTS:
        body = complete(colocated_app, prompt=text, max_tokens=24, temperature=0, num_speculative_tokens=k)
        assert body["choices"][0]["token_ids"] == ref_greedy(target, tok, text, 24), text
        spec = body["choices"][0]["speculation"]
        assert spec["num_draft_tokens"] > 0 and spec["degraded_steps"] == 0, spec
    after = verifier_stats()
    assert after["drafter_calls"]["local"] > before["local"] and after["drafter_calls"]["direct"] == 0
    assert after["local_drafter"]["cached_sequences"] == 0  # every finished sequence released on both engines
    assert after["cached_sequences"] == 0


def test_a_seeded_sample_is_the_same_as_with_a_drafter_pool(colocated_app, serve_app):
    """Gumbel verification (the default): a seed fixes the output whatever drafts come, so the
    colocated drafter and the pool's give the same tokens; the statistical tests of the loop hold
    for both (one loop, ``core.loop.speculate``)."""
    base, *_ = serve_app
    for seed in (1, 2):
        body = dict(prompt="def mean(xs):", max_tokens=32, temperature=0.8, seed=seed, num_speculative_tokens=4)
        here, pool = complete(colocated_app, **body), complete(base, **body)
        assert here["choices"][0]["token_ids"] == pool["choices"][0]["token_ids"]
        assert here["choices"][0]["speculation"]["num_draft_tokens"] > 0


def test_bad_placements_are_refused_naming_the_setting(tiny_model_dirs):
    import pydantic

    from configs import AppConfig

    target_dir, drafter_dir = tiny_model_dirs
    base = {"model_name": "tiny", "drafter_placement": "verifier", "verifier": {"model": str(target_dir)},
            "drafter": {"method": "draft_model", "model": str(drafter_dir)}}
    AppConfig.model_validate(base)
    with pytest.raises(pydantic.ValidationError, match="drafter.cpu_affinity"):
        AppConfig.model_validate({**base, "drafter": {**base["drafter"], "cpu_affinity": [0]}})
    with pytest.raises(pydantic.ValidationError, match="num_threads"):
        AppConfig.model_validate({**base, "verifier": {**base["verifier"], "num_threads": 1},
                                  "drafter": {**base["drafter"], "num_threads": 2}})
    with pytest.raises(pydantic.ValidationError, match="drafter.method eagle3"):  # only vLLM's own EAGLE-3 runs in it
        AppConfig.model_validate({**base, "verifier": {**base["verifier"], "backend": "vllm"}})
    with pytest.raises(pydantic.ValidationError, match="drafter_placement"):
        AppConfig.model_validate({**base, "drafter_placement": "node"})
