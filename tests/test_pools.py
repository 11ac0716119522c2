"""Separate pools, independent autoscaling and replica death on a multi-node Ray cluster."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster  # its own multi-node cluster in a subprocess: minutes
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def scenario(tiny_model_dirs):
    target, drafter = tiny_model_dirs
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "pools_scenario.py"), str(target), str(drafter)],
                          capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1])


def test_replicas_sit_on_their_own_pool(scenario):
    assert scenario["first_request"] == 200
    assert scenario["drafter_placements"] == [scenario["drafter_node"]]
    assert scenario["verifier_placements_before"] == [scenario["verifier_node"]]
    assert scenario["verifier_placements_scaled"] == [scenario["verifier_node"]]


def test_verifier_death_mid_request_costs_a_recompute_not_a_failure(scenario):
    assert scenario["killed"][0] >= 1 and scenario["killed"][1] >= 1
    assert all(n < 200 for n in scenario["killed_after_tokens"])  # killed mid-request
    assert scenario["kill_status"] == 200 and scenario["kill_output_identical"]
    assert scenario["kill_recomputes"] >= 1
    # speculation off: the verifier's decoding stream resumes on the replacement replica
    assert scenario["plain_kill_status"] == 200 and scenario["plain_kill_output_identical"]


def test_verifier_scales_independently_under_load(scenario):
    assert scenario["peak_replicas"] == {"Verifier": 2, "Drafter": 1}, scenario["scaled_after_s"]
    assert scenario["load_requests"] > 10 and scenario["load_failures"] == 0
    assert scenario["verifier_replicas_after"] == 1


def test_drafter_death_degrades_to_plain_decoding_then_speculation_resumes(scenario):
    assert scenario["killed"][2] >= 1
    assert scenario["drafter_kill_status"] == 200 and scenario["drafter_kill_output_identical"]
    assert scenario["drafter_kill_degraded_steps"] >= 1  # the response records the degradation
    after = scenario["after_drafter_return"]
    assert after["num_draft_tokens"] > 0 and after["degraded_steps"] == 0
    assert scenario["speculation_resumed_after_s"] <= 30


def test_deterministic_sampling_survives_replica_deaths(scenario):
    """Gumbel-coupled verification: a seeded sampled request is identical with speculation
    off and with every drafter (then every verifier) replica killed mid-stream."""
    assert scenario["killed"][3] >= 1 and scenario["killed"][4] >= 1
    assert scenario["gumbel_plain_identical"]
    assert scenario["gumbel_drafter_kill_identical"]
    assert scenario["gumbel_verifier_kill_identical"]
