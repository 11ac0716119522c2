"""A multi-node Ray cluster on one machine (ray.cluster_utils.Cluster) whose nodes each have a Hugging Face
cache of their own (``HF_HOME`` per node, ``HF_HUB_OFFLINE=1``), serving a head-only config by ids:

- the head node (the router; this process builds the app): the target's metadata and the head (the app
  builder checks a head whole: its weights' names and shapes);
- the verifier node: the target, whole;
- the drafter node: the head, whole, and the target's metadata (the head has its own embedding and
  lm_head, so the drafter never reads the target's weights).

Every cache holds the same commits, as caches filled from the Hub at one revision do. Run by
tests/test_model_refs.py in a subprocess (a process can join only one Ray cluster). Prints one JSON
line of observations.
"""

import json
import os
import sys
from pathlib import Path

import httpx

from bench.common import free_port  # (below the ephemeral range: see there)
from tests.hub_cache import SHIPPED, head_files, lay_out, model_files

TARGET, HEAD = "test-org/tiny-code-target", "test-org/tiny-code-eagle3"
METADATA = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def caches(root: Path) -> dict[str, Path]:
    target = model_files(SHIPPED / "tiny-code-target")
    meta = {k: v for k, v in target.items() if k in METADATA}
    head = head_files(SHIPPED / "tiny-code-eagle3", TARGET)
    weights = {k: 10 for k in target if k not in METADATA}  # on the Hub, not in this cache
    homes = {name: root / name for name in ("head", "verifier", "drafter")}
    lay_out(homes["head"], TARGET, meta, listed=weights)
    lay_out(homes["head"], HEAD, head)
    lay_out(homes["verifier"], TARGET, target)
    lay_out(homes["drafter"], TARGET, meta, listed=weights)
    lay_out(homes["drafter"], HEAD, head)
    return homes


def main(root: str):
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    homes = caches(Path(root))
    env = {name: {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"} for name, home in homes.items()}
    os.environ.update(env["head"])  # the app builder's node
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                            "env_vars": env["head"]})
    drafter_node = cluster.add_node(num_cpus=1, resources={"drafter_pool": 1}, env_vars=env["drafter"])
    verifier_node = cluster.add_node(num_cpus=1, resources={"verifier_pool": 1}, env_vars=env["verifier"])
    ray.init(address=cluster.address, log_to_driver=False)
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    from deployments.app import build_app_with

    app = build_app_with({
        "model_name": "tiny",
        "verifier": {"dtype": "float32", "cache_budget_mb": 64, "num_threads": 1},
        "drafter": {"method": "eagle3", "model": HEAD, "dtype": "float32", "cache_budget_mb": 16, "num_threads": 1},
        "k_policy": "fixed",
    }, overrides={
        "Router": {"ray_actor_options": {"num_cpus": 0.1}},
        "Drafter": {"ray_actor_options": {"num_cpus": 0.1, "resources": {"drafter_pool": 1}}, "num_replicas": 1},
        "Verifier": {"ray_actor_options": {"num_cpus": 0.5, "resources": {"verifier_pool": 1}}, "num_replicas": 1},
    })
    serve.run(app, name="splitspec", route_prefix="/")
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=300, json={
        "model": "tiny", "prompt": "def fibonacci(n):\n", "max_tokens": 24, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    body = r.json()
    out = {"status": r.status_code, "tokens": body.get("choices", [{}])[0].get("token_ids"),
           "drafted": (body.get("choices", [{}])[0].get("speculation") or {}).get("num_draft_tokens", 0)}

    def node(name):
        return serve.get_deployment_handle(name, app_name="splitspec").stats.remote().result()["node_id"]

    out["drafter_node"], out["verifier_node"] = node("Drafter"), node("Verifier")
    assert out["drafter_node"] == drafter_node.node_id and out["verifier_node"] == verifier_node.node_id
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()

    # the target's own greedy continuation, in this process, from the shipped directory
    from configs import SamplingParams, VerifierConfig
    from core.loop import generate
    from verifier.engine import VerifierEngine

    plain = VerifierEngine(VerifierConfig(model=str(SHIPPED / "tiny-code-target"), dtype="float32", cache_budget_mb=64))
    prompt = plain.tokenizer.encode("def fibonacci(n):\n")
    (ref,) = generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), 0, None, plain)
    out["reference"] = ref.output_ids
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
