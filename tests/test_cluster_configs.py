"""The cluster configs (configs/cluster_aws.yaml, configs/kuberay_rayservice.yaml,
configs/cluster_local.yaml) against their schemas, and against the serve config they carry:
each pool's node type advertises the resource its deployment requires, and nothing else does."""

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from ray.serve.schema import ServeDeploySchema

from deployments.autoscaling import PoolPolicy
from tests.autoscaling_scenario import LOCAL_ARGS, local_variant

pytestmark = pytest.mark.cpu
ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
RAY_SCHEMA = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"
POOLS = {"Drafter": "drafter_pool", "Verifier": "verifier_pool"}


def load(name):
    return yaml.safe_load((CONFIGS / name).read_text())


@pytest.fixture(scope="module")
def gpu_serve():
    return load("serve_gpu_cluster.yaml")


def deployments(serve_config) -> dict:
    (app,) = [a for a in serve_config["applications"] if a["name"] == "splitspec"]
    return {d["name"]: d for d in app["deployments"]}


def check_launcher_schema(config, ray_checks: bool = True, fill_defaults: bool = False):
    jsonschema.validate(config, json.loads(RAY_SCHEMA.read_text()))
    if ray_checks:  # Ray's own check (`ray up` runs it): provider defaults merged in, then validated
        from ray.autoscaler._private.util import prepare_config, validate_config
        config = copy.deepcopy(config)
        validate_config(prepare_config(config) if fill_defaults else config)


def check_pools_map_to_node_types(node_types: dict, head: str, serve_config, gpus: bool):
    """Every pool deployment's demand fits exactly one worker node type, and only that one:
    the node type the autoscaler must launch when the deployment scales up."""
    for name, pool in POOLS.items():
        opts = deployments(serve_config)[name]["ray_actor_options"]
        demand = {"CPU": opts.get("num_cpus", 0), "GPU": opts.get("num_gpus", 0), **opts.get("resources", {})}
        if opts.get("accelerator_type"):
            demand[f"accelerator_type:{opts['accelerator_type']}"] = 0.001
        if not gpus:
            demand.pop("GPU"), demand.pop(f"accelerator_type:{opts.get('accelerator_type')}", None)
        fits = [t for t, spec in node_types.items()
                if all(spec["resources"].get(r, 0) >= v for r, v in demand.items() if v)]
        assert len(fits) == 1 and fits[0] != head, (name, demand, fits)
        with_pool = [t for t, spec in node_types.items() if spec["resources"].get(pool)]
        assert with_pool == fits, (pool, with_pool)
        spec = node_types[fits[0]]
        assert spec.get("min_workers", 0) == 0 and spec["max_workers"] >= 2
    assert not any(node_types[head]["resources"].get(p) for p in POOLS.values())


def test_aws_cluster_config_validates_and_maps_pools_to_gpu_node_types(gpu_serve):
    config = load("cluster_aws.yaml")
    check_launcher_schema(config, fill_defaults=True)
    assert config["provider"]["type"] == "aws" and config["idle_timeout_minutes"] > 0
    types = config["available_node_types"]
    check_pools_map_to_node_types(types, config["head_node_type"], gpu_serve, gpus=True)
    assert types["drafter_l4"]["node_config"]["InstanceType"].startswith("g6.")  # NVIDIA L4
    assert types["verifier_h100"]["node_config"]["InstanceType"].startswith("p5.")  # NVIDIA H100
    # the model directories the serve config names are the ones the setup commands download
    commands = " ".join(config["head_setup_commands"] + types["verifier_h100"]["worker_setup_commands"]
                        + types["drafter_l4"]["worker_setup_commands"])
    args = gpu_serve["applications"][0]["args"]
    assert f"--local-dir {args['verifier']['model']}" in commands
    assert f"--local-dir {args['drafter']['model']}" in commands


def test_local_cluster_config_mirrors_the_cloud_node_types(gpu_serve):
    local, aws = load("cluster_local.yaml"), load("cluster_aws.yaml")
    check_launcher_schema(local)
    assert local["provider"]["type"] == "fake_multinode"
    types = local["available_node_types"]
    assert set(types) == {"ray.head.default", "drafter_pool", "verifier_pool"}
    assert not any("GPU" in t["resources"] for t in types.values())  # CPU only
    check_pools_map_to_node_types(types, local["head_node_type"], gpu_serve, gpus=False)
    pools = lambda node_types: sorted(p for t in node_types.values() for p in POOLS.values() if p in t["resources"])
    assert pools(types) == pools(aws["available_node_types"])


def strict(schema):
    """An openAPI (Kubernetes structural) schema as JSON schema that rejects unknown fields,
    as the API server prunes them, except where the CRD preserves unknown fields."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out \
                and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        if out.get("x-kubernetes-int-or-string"):
            out.pop("type", None)
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def rayservice():
    return load("kuberay_rayservice.yaml")


def test_kuberay_manifest_validates_against_the_rayservice_crd_schema(rayservice):
    schema = strict(json.loads((ROOT / "tests" / "data" / "kuberay_rayservice_v1.schema.json").read_text()))
    jsonschema.validate(rayservice, schema)
    assert rayservice["apiVersion"] == "ray.io/v1" and rayservice["kind"] == "RayService"
    # the check itself rejects a misspelt field
    broken = copy.deepcopy(rayservice)
    broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_kuberay_embeds_the_gpu_serve_config_and_its_groups_are_the_pools(rayservice, gpu_serve):
    embedded = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    assert embedded == gpu_serve
    ServeDeploySchema.model_validate(embedded)
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True and cluster["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    assert cluster["rayVersion"] == ray.__version__
    for group in cluster["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        assert group["minReplicas"] == 0 and group["maxReplicas"] >= 2
        assert pod["nodeSelector"]
        container = pod["containers"][0]
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    # the autoscaler's own reading of the groups (Ray's KubeRay integration)
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr
    derived = _derive_autoscaling_config_from_ray_cr(
        {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "splitspec", "namespace": "default"},
         "spec": cluster})
    check_launcher_schema(derived, ray_checks=False)  # a partial config, completed by the operator
    check_pools_map_to_node_types(derived["available_node_types"], derived["head_node_type"], gpu_serve, gpus=True)


def test_serve_configs_parse_with_their_autoscaling_policies(gpu_serve):
    for name in ("serve_gpu_cluster.yaml", "../serve_config.yaml"):
        config = load(name)
        schema = ServeDeploySchema.model_validate(config)  # imports and pickles the policy functions
        for dep in schema.applications[0].deployments:
            auto = dep.autoscaling_config
            policy = (auto or {}).get("policy") if isinstance(auto, dict) else getattr(auto, "policy", None)
            if isinstance(policy, dict) and policy.get("policy_function", "").endswith(":PoolPolicy"):
                PoolPolicy(**policy.get("policy_kwargs", {}))
    for name in POOLS:
        policy = deployments(gpu_serve)[name]["autoscaling_config"]["policy"]
        assert policy["policy_function"] == "deployments.autoscaling:PoolPolicy"


def test_the_scenario_deploys_the_gpu_serve_config_changed_only_for_cpus(gpu_serve, tmp_path):
    """tests/autoscaling_scenario.py deploys local_variant(serve_gpu_cluster.yaml): the same
    application, deployments, pool resources and policy functions; CPU engine settings."""
    app = local_variant(gpu_serve, str(tmp_path / "t"), str(tmp_path / "d"))
    original = deployments(gpu_serve)
    assert app["import_path"] == gpu_serve["applications"][0]["import_path"]
    assert {d["name"] for d in app["deployments"]} == set(original)
    for dep in app["deployments"]:
        before = original[dep["name"]]
        assert dep["ray_actor_options"].get("resources") == before["ray_actor_options"].get("resources")
        assert dep["max_ongoing_requests"] == before["max_ongoing_requests"]
        policy, policy_before = (dep["autoscaling_config"].get("policy"), before["autoscaling_config"].get("policy"))
        assert (policy or {}).get("policy_function") == (policy_before or {}).get("policy_function")
    args, args_before = app["args"], gpu_serve["applications"][0]["args"]
    for role in ("verifier", "drafter"):
        changed = {k for k in set(args[role]) | set(args_before[role]) if args[role].get(k) != args_before[role].get(k)}
        assert changed <= {"model", *LOCAL_ARGS[role]}
    ServeDeploySchema.model_validate({"applications": [app]})


def test_the_vllm_gpu_config_gives_each_verifier_replica_its_tensor_parallel_gpus():
    """configs/serve_gpu_vllm.yaml: a verifier replica on vLLM over tensor_parallel_size GPUs gets a
    placement group of one CPU bundle (the replica, with its pool's resource) and one GPU bundle per
    rank on one node; vLLM compiles there (enforce_eager unset: CUDA graphs on GPUs)."""
    from configs import AppConfig

    config = load("serve_gpu_vllm.yaml")
    ServeDeploySchema.model_validate(config)
    args = AppConfig.model_validate(config["applications"][0]["args"])
    v = args.verifier
    assert v.backend == "vllm" and v.vllm_loop == "engine" and v.device == "cuda" and v.vllm_enforce_eager is None
    dep = deployments(config)["Verifier"]
    bundles = dep["placement_group_bundles"]
    assert dep["placement_group_strategy"] == "STRICT_PACK"
    gpu = [b for b in bundles if b.get("GPU")]
    assert len(gpu) == v.tensor_parallel_size > 1 and all(b["GPU"] == 1 for b in gpu)
    opts = dep["ray_actor_options"]  # the replica itself fits the first bundle, which has no GPU
    assert not bundles[0].get("GPU") and not opts.get("num_gpus")
    assert all(bundles[0].get(r, 0) >= n for r, n in {"CPU": opts.get("num_cpus", 1), **opts["resources"]}.items())
    assert args.drafter.num_speculative_tokens <= v.vllm_num_speculative_tokens
