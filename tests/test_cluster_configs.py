"""Every manifest and cluster config in the repository against its schema (Kubernetes' API schemas through
kubernetes-validate, KubeRay's RayService CRD in tests/data, Ray's cluster launcher schema, Serve's config
schema), and against the serve config it carries: each pool's node type advertises the resource its deployment
requires, and nothing else does; the models the serve config names are the ones the nodes' caches get."""

import copy
import functools
import json
import re
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
CRD_SCHEMA = ROOT / "tests" / "data" / "kuberay_rayservice_v1.schema.json"  # its $comment: source and version
# the Kubernetes APIs the manifest is checked against (kubernetes-validate ships them)
K8S_VERSIONS = ("1.29.0", "1.37.0")
POOLS = {"Drafter": "drafter_pool", "Verifier": "verifier_pool"}
IMAGE = "splitspec:0.1.0-gpu"  # the manifest's image name: docs/clusters.md replaces it with the pushed image's


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


def hub_models(serve_config) -> dict[str, str]:
    """{role: (repo id, revision)} of the serve config's splitspec models (ids pinned to a revision)."""
    args = serve_config["applications"][0]["args"]
    out = {}
    for role in ("verifier", "drafter"):
        repo, _, revision = args[role]["model"].partition("@")
        assert re.fullmatch(r"[0-9a-f]{40}", revision), f"{role}.model is not pinned to a commit: {args[role]['model']}"
        out[role] = (repo, revision)
    return out


def downloads(commands: list[str]) -> dict[tuple[str, str], str]:
    """{(repo, revision): '--include ...' / '--exclude ...' / ''} of the `hf download` commands."""
    found = {}
    for c in commands:
        m = re.fullmatch(r"hf download (\S+) --revision (\S+)(.*)", c.strip())
        if m:
            found[(m[1], m[2])] = m[3].strip()
    return found


def test_aws_cluster_config_validates_and_maps_pools_to_gpu_node_types(gpu_serve):
    config = load("cluster_aws.yaml")
    check_launcher_schema(config, fill_defaults=True)
    assert config["provider"]["type"] == "aws" and config["idle_timeout_minutes"] > 0
    types = config["available_node_types"]
    check_pools_map_to_node_types(types, config["head_node_type"], gpu_serve, gpus=True)
    assert types["drafter_l4"]["node_config"]["InstanceType"].startswith("g6.")  # NVIDIA L4
    assert types["verifier_h100"]["node_config"]["InstanceType"].startswith("p5.")  # NVIDIA H100
    # every node type names its image: the header's command writes the region's AMI into these fields
    assert {t["node_config"].get("ImageId") for t in types.values()} == {"ami-set-me-see-header"}
    assert """sed -i "s/ImageId: .*/ImageId: $AMI/" configs/cluster_aws.yaml""" in (
        CONFIGS / "cluster_aws.yaml").read_text()


def test_aws_nodes_get_python_311_the_pinned_stack_and_the_serve_configs_models(gpu_serve):
    config = load("cluster_aws.yaml")
    text = (CONFIGS / "cluster_aws.yaml").read_text()
    assert "huggingface-cli" not in text  # huggingface_hub 1.x ships `hf` only
    setup = " ".join(config["setup_commands"])
    assert "sys.version_info >= (3, 11)" in setup and "python3 -m venv ~/venv" in setup
    assert f'"ray[default,serve]=={ray.__version__}"' in setup and "-m core.native" in setup
    assert re.search(r'"torch==2\.13\.0" --index-url https://download\.pytorch\.org/whl/cu\d+', setup)
    # Ray's token auth on every node: the token file copied there, RAY_AUTH_MODE=token in its login shells
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    # the Hugging Face token as a file too: a command's ${HF_TOKEN} would be the node's (empty), not yours
    assert config["file_mounts"]["~/.cache/huggingface/token"] == "~/.cache/huggingface/token"
    assert "HF_TOKEN" not in yaml.safe_dump({k: v for k, v in config.items() if k.endswith("commands")})
    assert any("export RAY_AUTH_MODE=token" in c for c in config["initialization_commands"])
    # each node type caches the weights it loads at the serve config's revision, and the other model's metadata
    models, types = hub_models(gpu_serve), config["available_node_types"]
    for node_type, role in (("verifier_h100", "verifier"), ("drafter_l4", "drafter")):
        got = downloads(types[node_type]["worker_setup_commands"])
        assert set(got) == set(models.values()), (node_type, got)
        for other, ref in models.items():
            assert got[ref] == ("--exclude 'original/*'" if other == role else "--include '*.json'"), (node_type, ref)
    head = downloads(config["head_setup_commands"])
    assert head == {ref: "--include '*.json'" for ref in models.values()}


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


@functools.cache
def crd():
    """A validator of the RayService CRD's schema (jsonschema.validate would check the 160 kB schema itself on
    every call: seconds)."""
    return jsonschema.validators.validator_for({})(strict(json.loads(CRD_SCHEMA.read_text())))


def manifest(name: str = "kuberay_rayservice.yaml") -> dict[str, dict]:
    """A multi-document manifest's objects by kind (one of each)."""
    docs = [d for d in yaml.safe_load_all((CONFIGS / name).read_text()) if d]
    kinds = {d["kind"]: d for d in docs}
    assert len(kinds) == len(docs), "one object of each kind"
    return kinds


@pytest.fixture(scope="module")
def kuberay():
    return manifest()


@pytest.fixture(scope="module")
def rayservice(kuberay):
    return kuberay["RayService"]


def pod_templates(rayservice) -> dict[str, dict]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"]["template"],
            **{g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]}}


def check_kubernetes(obj: dict):
    """The Kubernetes API's schema for the object's kind, unknown fields rejected (kubectl's strict validation)."""
    import kubernetes_validate

    for version in K8S_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


def as_pod_template(template: dict) -> dict:
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}


def test_kuberay_manifest_validates_against_kubernetes_and_the_rayservice_crd(kuberay, rayservice):
    import kubernetes_validate

    assert "kuberay" in crd().schema["$comment"] and "v1.7.0" in crd().schema["$comment"]
    crd().validate(rayservice)
    assert rayservice["apiVersion"] == "ray.io/v1" and rayservice["kind"] == "RayService"
    for kind, obj in kuberay.items():
        if kind != "RayService":
            check_kubernetes(obj)
    for template in pod_templates(rayservice).values():  # the CRD embeds them; checked as the API server would
        check_kubernetes(as_pod_template(template))
    # each check rejects a misspelt field
    broken = copy.deepcopy(rayservice)
    broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3
    with pytest.raises(jsonschema.ValidationError):
        crd().validate(broken)
    broken = as_pod_template(copy.deepcopy(pod_templates(rayservice)["verifier-h100"]))
    broken["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        check_kubernetes(broken)
    service = copy.deepcopy(kuberay["Service"])
    service["spec"]["ports"][0]["port"] = "8000"
    with pytest.raises(kubernetes_validate.ValidationError):
        check_kubernetes(service)


def test_kuberay_embeds_the_gpu_serve_config_and_its_groups_are_the_pools(rayservice, gpu_serve):
    embedded = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    assert embedded == gpu_serve
    ServeDeploySchema.model_validate(embedded)
    cluster = rayservice["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True and cluster["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    assert cluster["rayVersion"] == ray.__version__
    assert cluster["authOptions"] == {"mode": "token"}  # serve status / ray status in the head pod authenticate
    products = {"drafter-l4": "NVIDIA-L4", "verifier-h100": "NVIDIA-H100-80GB-HBM3"}
    for group in cluster["workerGroupSpecs"]:
        pod = group["template"]["spec"]
        assert group["minReplicas"] == 0 and group["maxReplicas"] >= 2
        # GPU model by NVIDIA's common node label first; the cloud-specific labels are alternative terms
        terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        first = terms[0]["matchExpressions"][0]
        assert first["key"] == "nvidia.com/gpu.product" and products[group["groupName"]] in first["values"]
        container = pod["containers"][0]
        assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    # the autoscaler's own reading of the groups (Ray's KubeRay integration)
    from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr
    derived = _derive_autoscaling_config_from_ray_cr(
        {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "splitspec", "namespace": "default"},
         "spec": cluster})
    check_launcher_schema(derived, ray_checks=False)  # a partial config, completed by the operator
    check_pools_map_to_node_types(derived["available_node_types"], derived["head_node_type"], gpu_serve, gpus=True)


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def test_kuberay_fills_one_model_cache_that_every_ray_pod_reads_offline(kuberay, rayservice, gpu_serve):
    """The Job downloads exactly the serve config's models at its revisions into the shared cache (HF_TOKEN from
    a Secret) and marks it filled; every Ray pod waits for the mark, mounts the cache read-only and loads offline.
    The volume is ReadWriteMany: a ReadWriteOnce block volume (EBS) is not shared by pods on several nodes."""
    pvc, job = kuberay["PersistentVolumeClaim"], kuberay["Job"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    (fill,) = job["spec"]["template"]["spec"]["containers"]
    script = fill["command"][-1]
    assert downloads(script.splitlines()) == {ref: "--exclude 'original/*'" for ref in hub_models(gpu_serve).values()}
    env = env_of(fill)
    cache = env["HF_HUB_CACHE"]["value"]
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "splitspec-hf-token", "key": "HF_TOKEN"}
    assert "$HF_HUB_CACHE/.splitspec-filled" in script.splitlines()[-1]
    claims = {v["name"]: v["persistentVolumeClaim"] for v in job["spec"]["template"]["spec"]["volumes"]}
    assert claims["models"]["claimName"] == pvc["metadata"]["name"]
    for name, template in pod_templates(rayservice).items():
        spec = template["spec"]
        (init,) = spec["initContainers"]
        assert f"{cache}/.splitspec-filled" in " ".join(init["command"]), name
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"] == {"claimName": pvc["metadata"]["name"], "readOnly": True}
        for c in (init, *spec["containers"]):
            assert c["image"] == IMAGE, name
            mount = next(m for m in c["volumeMounts"] if m["name"] == "models")
            assert mount["readOnly"] and cache.startswith(mount["mountPath"] + "/"), name
        (ray_container,) = spec["containers"]
        env = env_of(ray_container)
        assert env["HF_HUB_CACHE"]["value"] == cache and env["HF_HUB_OFFLINE"]["value"] == "1", name
        assert "HF_TOKEN" not in env  # only the Job downloads
        keys = env["SPLITSPEC_API_KEYS"]["valueFrom"]["secretKeyRef"]  # the Router may run on any Ray node
        assert keys == {"name": "splitspec-api-keys", "key": "SPLITSPEC_API_KEYS"}, name
    assert fill["image"] == IMAGE


def test_kuberay_service_reaches_only_pods_that_answer_ready_and_prometheus_scrapes_them(kuberay, rayservice):
    service = kuberay["Service"]
    selector = service["spec"]["selector"]
    port = {p["name"]: p for p in service["spec"]["ports"]}["openai"]
    serve_port = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["http_options"]["port"]
    assert port["port"] == serve_port
    scrape = yaml.safe_load(kuberay["ConfigMap"]["data"]["scrape-splitspec.yaml"])
    (job,) = scrape["scrape_configs"]
    assert job["kubernetes_sd_configs"] == [{"role": "pod"}] and job["metrics_path"] == "/metrics"
    keep = {r["source_labels"][0]: r["regex"] for r in job["relabel_configs"] if r.get("action") == "keep"}
    metrics_port = keep["__meta_kubernetes_pod_container_port_name"]
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = {"head": cluster["headGroupSpec"], **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}
    for name, template in pod_templates(rayservice).items():
        labels = template["metadata"]["labels"]
        (c,) = template["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        # Ray's metrics (splitspec_* included) on the port Prometheus keeps
        assert ports[metrics_port] == int(groups[name]["rayStartParams"]["metrics-export-port"]), name
        assert re.fullmatch(keep["__meta_kubernetes_pod_label_app_kubernetes_io_name"],
                            labels["app.kubernetes.io/name"])
        selected = all(labels.get(k) == v for k, v in selector.items())
        if name == "head":
            # KubeRay deploys the app only once the head pod is ready: an app-level probe there would block it
            assert not selected and "readinessProbe" not in c and "livenessProbe" not in c
            continue
        assert selected, name
        probe = c["readinessProbe"]
        assert probe["httpGet"] == {"path": "/ready", "port": serve_port}, name
        # the probe outlasts the slowest /ready answer (a verifier replica that waits for a drafter's)
        from deployments.router import READY_TIMEOUT_S
        assert probe["timeoutSeconds"] > 2 * READY_TIMEOUT_S, name
        assert ports[port["targetPort"]] == serve_port, name


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
    assert v.backend == "vllm" and v.vllm.loop == "engine" and v.device == "cuda" and v.vllm.enforce_eager is None
    dep = deployments(config)["Verifier"]
    bundles = dep["placement_group_bundles"]
    assert dep["placement_group_strategy"] == "STRICT_PACK"
    gpu = [b for b in bundles if b.get("GPU")]
    assert len(gpu) == v.tensor_parallel_size > 1 and all(b["GPU"] == 1 for b in gpu)
    opts = dep["ray_actor_options"]  # the replica itself fits the first bundle, which has no GPU
    assert not bundles[0].get("GPU") and not opts.get("num_gpus")
    assert all(bundles[0].get(r, 0) >= n for r, n in {"CPU": opts.get("num_cpus", 1), **opts["resources"]}.items())
    assert args.drafter.num_speculative_tokens <= v.vllm.num_speculative_tokens


DEPLOY_CONFIGS = sorted([*CONFIGS.glob("*.yaml"), ROOT / "serve_config.yaml",
                         *ROOT.glob("bench/results/*/plan_serve.yaml")])


@pytest.mark.parametrize("path", DEPLOY_CONFIGS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_config_in_the_repository_passes_its_schema(path):
    """Each deployable file, by what it is: Kubernetes objects (the API's schemas; a RayService, KubeRay's CRD),
    a Ray cluster launcher config (Ray's schema and checks), a Serve config (Serve's schema, and AppConfig for a
    splitspec application's args)."""
    from configs import AppConfig

    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    if all("apiVersion" in d and "kind" in d for d in docs):
        for d in docs:
            crd().validate(d) if d["kind"] == "RayService" else check_kubernetes(d)
    elif len(docs) == 1 and "provider" in docs[0]:
        check_launcher_schema(docs[0], fill_defaults=docs[0]["provider"]["type"] != "fake_multinode")
    elif len(docs) == 1 and "applications" in docs[0]:
        schema = ServeDeploySchema.model_validate(docs[0])
        apps = [a for a in schema.applications if a.import_path == "deployments.app:build_app"]
        assert apps, f"{path}: no splitspec application"
        for app in apps:
            AppConfig.model_validate(app.args)
    else:
        pytest.fail(f"{path}: neither Kubernetes objects, a cluster launcher config nor a Serve config")
