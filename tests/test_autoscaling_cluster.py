"""Cluster autoscaling on a local autoscaling cluster (fake_multinode provider, the cloud node
types of configs/cluster_aws.yaml on one machine): the autoscaler launches each pool's node on
demand, adds a verifier-pool node (and no drafter-pool node) when the verifier deployment scales
up under load, and gives the extra node back when the load stops.

Several minutes, so it is marked ``cluster`` and left out of ``make test``:
run it with ``make test-cluster``. tests/autoscaling_scenario.py runs in a subprocess (its own
Ray cluster, on free ports) and stops exactly the processes it started.
"""

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def scenario():
    sys.path.insert(0, str(ROOT / "tests"))
    from autoscaling_scenario import marked_pids, stop_marked

    marker = f"pytest-{uuid.uuid4().hex[:12]}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, str(ROOT / "tests" / "autoscaling_scenario.py"),
                               str(ROOT / "models" / "tiny-code-target"), str(ROOT / "models" / "tiny-code-drafter"),
                               marker], capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    finally:
        stop_marked(marker)  # whatever happened to the scenario, nothing it started outlives it
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    out = json.loads(lines[-1])
    out["wall_s"] = round(time.monotonic() - t0, 1)
    print(json.dumps(out))
    assert proc.returncode == 0, json.dumps(out)[-3000:] + proc.stderr[-5000:]
    assert not marked_pids(marker)
    return out


def test_deploying_launches_one_node_per_pool_and_replicas_sit_on_their_own_pool(scenario):
    assert scenario["worker_nodes_at_start"] == 0
    assert scenario["nodes_after_deploy"] == {"drafter": 1, "verifier": 1}
    assert scenario["first_request"] == 200 and scenario["first_request_tokens"] == 24
    assert scenario["drafter_placement"] == {"replica_nodes": 1, "on_own_pool": True}
    assert scenario["verifier_placement"] == {"replica_nodes": 1, "on_own_pool": True}


def test_load_scales_the_verifier_pool_onto_a_new_verifier_node_only(scenario):
    assert scenario["peak_replicas"]["Verifier"] == 2
    assert scenario["peak_replicas_any_state"]["Drafter"] == 1  # the drafter pool had headroom
    assert scenario["peak_nodes"] == {"drafter": 1, "verifier": 2}
    # the second verifier node came up under the load, before the replica placed on it ran
    up = scenario["verifier_node2_up_s"]
    assert up is not None and 0 <= up <= scenario["verifier_2_running_s"], scenario
    assert scenario["verifier_placement_scaled"] == {"replica_nodes": 2, "on_own_pool": True}
    # requests kept succeeding while the pool and the cluster changed
    assert scenario["load_requests"] >= 6 and scenario["load_failures"] == []
    # what the policy saw: the verifier's engine saturated, the drafter's not
    assert max(scenario["busy_frac_under_load"]["Verifier"]) > 0.8
    assert max(scenario["busy_frac_under_load"]["Drafter"]) < 0.5


def test_the_extra_node_is_given_back_after_the_load(scenario):
    # the replica went first, then the autoscaler gave back the node it left idle
    down, released = scenario["verifier_scaled_down_s"], scenario["verifier_node_released_s"]
    assert down is not None and released is not None and 0 <= down <= released, scenario
    assert scenario["nodes_at_end"] == {"drafter": 1, "verifier": 1}
    assert scenario["request_after_scale_down"] == 200
    assert scenario["left_processes"] == 0
