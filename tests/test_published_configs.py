"""The serve configs for the published EAGLE-3 pairs (``configs/serve_gpu_*_eagle3.yaml``, and the one-machine
variant), built and served with tiny stand-ins of the same architectures under the same Hugging Face ids.

Each stand-in is a random verifier of the config's family (Llama 3.1, Qwen3, Gemma 4 text), built from
transformers' own config class as in tests/test_families.py, and a random head in the published style
for it (tests/test_eagle3_heads.py), both laid out in an offline hub cache (tests/hub_cache.py) under the
ids the config names. The configs' args are used as written but for the engine settings a CPU needs
(``CPU_ARGS``), and their deployments' options but for the resources (no GPUs or pools here).

Unit tier: every config validates as a Serve config and an ``AppConfig``, resolves its ids and passes the
app builder's checks; its pools sit on the node types of configs/cluster_aws.yaml (the Verifier on the
H100 type, the Drafter on the L4 type, or no Drafter where the head drafts in the verifier replica).
Ray tier (a served app per config, its replicas resolving the ids from the cache): each serves greedy text
equal to its stand-in target's own, with drafts.
"""

import json
from pathlib import Path

import pytest
import torch
import transformers
import yaml

from tests.hub_cache import head_files, lay_out, model_files, offline_home

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {  # config -> the family of its verifier
    "serve_gpu_llama31_8b_eagle3.yaml": "llama",
    "serve_gpu_qwen3_8b_eagle3.yaml": "qwen3",
    "serve_gpu_qwen3_8b_one_machine.yaml": "qwen3",
    "serve_gpu_gemma4_31b_eagle3.yaml": "gemma4",
}
HEAD_STYLE = {"llama": "llama31", "qwen3": "qwen3", "gemma4": "llama31"}  # Speculators' heads for Gemma: Llama layers
VOCAB, MAX_LEN = 320, 128
# the only args changed for a CPU: the engine's device, dtype, memory, context and threads
CPU_ARGS = {"device": "cpu", "dtype": "float32", "cache_budget_mb": 32, "max_model_len": MAX_LEN, "num_threads": 1}


def load(name: str) -> dict:
    return yaml.safe_load((ROOT / "configs" / name).read_text())


def application(config: dict) -> dict:
    (app,) = config["applications"]
    return app


def stand_in(family: str):
    """A random causal LM of the family, float32, peaked so that greedy picks are far from ties."""
    torch.manual_seed(0)
    common = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 8,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": MAX_LEN,
              "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
    T = transformers
    if family == "llama":
        model = T.LlamaForCausalLM(T.LlamaConfig(**common, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}))
    elif family == "qwen3":
        model = T.Qwen3ForCausalLM(T.Qwen3Config(**common))
    else:
        model = T.Gemma4ForCausalLM(T.Gemma4TextConfig(
            **common, sliding_window=16, global_head_dim=32, num_global_key_value_heads=1,
            attention_k_eq_v=True, num_kv_shared_layers=2, hidden_size_per_layer_input=8,
            vocab_size_per_layer_input=VOCAB, final_logit_softcapping=30.0,
            layer_types=(["sliding_attention"] * 3 + ["full_attention"]) * 2))
    model = model.float().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return model


@pytest.fixture(scope="module")
def stand_ins(tmp_path_factory):
    """{family: (verifier directory, head directory)}: the head in its family's published style, naming the
    stand-in's architecture as its verifier's."""
    from tests.helpers import tiny_tokenizer
    from tests.test_eagle3_heads import published_head

    root = tmp_path_factory.mktemp("stand_ins")
    out = {}
    for family in sorted(set(CONFIGS.values())):
        target = root / family
        model = stand_in(family)
        model.save_pretrained(target)
        tiny_tokenizer(VOCAB).save_pretrained(target)
        head = published_head(root / f"{family}-head", target, HEAD_STYLE[family], seed=1)
        cfg = json.loads((head / "config.json").read_text())
        cfg["speculators_config"]["verifier"]["architectures"] = list(model.config.architectures)
        (head / "config.json").write_text(json.dumps(cfg))
        out[family] = (target, head)
    return out


def cpu_args(app: dict) -> dict:
    args = json.loads(json.dumps(app["args"]))
    for role in ("verifier", "drafter"):
        args[role].update(CPU_ARGS)
    return args


def cached_ids(home: Path, name: str, stand_ins) -> dict:
    """The config's ids laid out in the hub cache at ``home`` with the stand-ins of its family; returns the
    config's args for a CPU."""
    app = application(load(name))
    target, head = stand_ins[CONFIGS[name]]
    ids = app["args"]["verifier"]["model"], app["args"]["drafter"]["model"]
    lay_out(home, ids[0], model_files(target))
    lay_out(home, ids[1], head_files(head, ids[0]))
    return cpu_args(app)


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    return offline_home(tmp_path, monkeypatch)


@pytest.mark.parametrize("name", CONFIGS)
def test_a_published_config_builds_with_stand_ins_under_its_ids(name, stand_ins, offline_cache):
    from ray.serve.schema import ServeDeploySchema

    from configs import AppConfig
    from core.hub import parse
    from deployments.app import check_models, local_view, resolve_model_paths

    config = load(name)
    ServeDeploySchema.model_validate(config)  # imports the autoscaling policies
    args = cached_ids(offline_cache, name, stand_ins)
    written = application(config)["args"]
    for role in ("verifier", "drafter"):
        assert {k for k in args[role] if args[role][k] != written[role].get(k)} <= set(CPU_ARGS)
        assert parse(written[role]["model"]) is not None  # Hub ids, not local paths
    cfg = resolve_model_paths(AppConfig.model_validate(args))
    assert cfg.verifier.model.startswith(written["verifier"]["model"] + "@")
    assert cfg.drafter.model.startswith(written["drafter"]["model"] + "@")
    assert cfg.drafter.verifier_model == cfg.verifier.model
    head = json.loads((stand_ins[CONFIGS[name]][1] / "config.json").read_text())
    k = head["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    assert "num_speculative_tokens" not in written["drafter"] and cfg.drafter.num_speculative_tokens == k
    assert check_models(local_view(cfg))  # the aux layers the head reads


def demand(options: dict) -> dict:
    d = {"CPU": options.get("num_cpus", 1), "GPU": options.get("num_gpus", 0), **options.get("resources", {})}
    if options.get("accelerator_type"):
        d[f"accelerator_type:{options['accelerator_type']}"] = 0.001
    return d


@pytest.mark.parametrize("name", [n for n in CONFIGS if "one_machine" not in n])
def test_a_cluster_config_puts_each_pool_on_its_node_type(name):
    """The published pairs run on the cluster configs as they are: each pool's demand fits exactly one worker
    node type of configs/cluster_aws.yaml, the Verifier's the H100 type and the Drafter's the L4 type; a
    config whose head drafts in the verifier replica has no Drafter deployment."""
    config = load(name)
    app = application(config)
    types = yaml.safe_load((ROOT / "configs" / "cluster_aws.yaml").read_text())["available_node_types"]
    deps = {d["name"]: d for d in app["deployments"]}
    colocated = app["args"].get("drafter_placement") == "verifier"
    assert set(deps) == ({"Router", "Verifier"} if colocated else {"Router", "Verifier", "Drafter"})
    for dep, node_type in (("Verifier", "verifier_h100"), ("Drafter", "drafter_l4")):
        if dep not in deps:
            continue
        need = demand(deps[dep]["ray_actor_options"])
        fits = [t for t, spec in types.items() if all(spec["resources"].get(r, 0) >= v for r, v in need.items() if v)]
        assert fits == [node_type], (dep, need, fits)
        assert deps[dep]["autoscaling_config"]["policy"]["policy_function"] == "deployments.autoscaling:PoolPolicy"
        assert deps[dep]["autoscaling_config"]["max_replicas"] > 1


def test_the_one_machine_config_is_the_cluster_one_but_for_placement():
    one = application(load("serve_gpu_qwen3_8b_one_machine.yaml"))
    cluster = application(load("serve_gpu_qwen3_8b_eagle3.yaml"))
    for role in ("verifier", "drafter"):
        assert one["args"][role]["model"] == cluster["args"][role]["model"]
    assert one["args"]["drafter_placement"] == cluster["args"]["drafter_placement"] == "verifier"
    (verifier,) = [d for d in one["deployments"] if d["name"] == "Verifier"]
    assert demand(verifier["ray_actor_options"]) == {"CPU": 2, "GPU": 1}  # any one GPU, no pools


def serve_overrides(app: dict, env: dict) -> dict:
    """The config's deployment options for a CPU: one replica each, every resource but a little CPU dropped,
    the replicas' hub cache in their environment (a cluster's nodes have it in theirs)."""
    out = {}
    for dep in app["deployments"]:
        opts = {k: v for k, v in dep.items() if k not in ("name", "ray_actor_options", "autoscaling_config")}
        auto = dict(dep.get("autoscaling_config") or {}, min_replicas=1, max_replicas=1)
        opts["autoscaling_config"] = auto
        opts["ray_actor_options"] = {"num_cpus": 0.1, "runtime_env": {"env_vars": env}}
        out[dep["name"]] = opts
    return out


@pytest.mark.parametrize("name", CONFIGS)
def test_a_published_config_serves_greedy_equal_to_its_target(name, stand_ins, offline_cache, ray_cluster):
    import httpx
    from ray import serve
    from ray.serve.context import _get_global_client

    from bench.common import free_port
    from configs import SamplingParams, VerifierConfig
    from core.loop import generate
    from deployments.app import build_app_with
    from verifier.engine import VerifierEngine

    app = application(load(name))
    args = cached_ids(offline_cache, name, stand_ins)
    env = {"HF_HOME": str(offline_cache), "HF_HUB_OFFLINE": "1"}
    serve.start(http_options={"host": "127.0.0.1", "port": free_port()})  # no-op where Serve runs already
    port = _get_global_client().http_config.port
    route = "published-" + name.removesuffix(".yaml").replace("_", "-")
    serve.run(build_app_with(args, overrides=serve_overrides(app, env)), name=route, route_prefix=f"/{route}")
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/{route}/v1/completions", timeout=300, json={
            "model": args["model_name"], "prompt": "def add(a, b):", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        drafted = r.json()["choices"][0]["speculation"]["num_draft_tokens"]
    finally:
        serve.delete(route)
    target = stand_ins[CONFIGS[name]][0]
    plain = VerifierEngine(VerifierConfig(model=str(target), dtype="float32", cache_budget_mb=16,
                                          max_model_len=MAX_LEN))
    (ref,) = generate([choice["prompt_token_ids"]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                      0, None, plain)
    assert choice["token_ids"] == ref.output_ids
    assert drafted > 0
