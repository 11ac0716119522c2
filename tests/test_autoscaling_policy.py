"""The pool autoscaling policies (deployments/autoscaling.py) on constructed Serve contexts:
each pool follows its own engine load, so a change of k or of the acceptance rate moves the
pool it loads, where Serve's default (ongoing requests) moves both alike or neither."""

import math

import pytest
from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from core.protocol import DraftRequest, VerifyRequest
from deployments.autoscaling import (
    BATCH_FILL,
    BATCH_TOKENS,
    BUSY,
    QUEUED,
    LoadWindow,
    PoolPolicy,
    drafter_policy,
    pool_decision,
    verifier_policy,
    work_tokens,
)

pytestmark = pytest.mark.cpu


def context(per_replica: list[dict], target: int | None = None, ongoing: float = 0.0, min_replicas: int = 1,
            max_replicas: int = 16, running: list[str] | None = None, **config) -> AutoscalingContext:
    """A context as Serve's controller builds it: one metrics dict per running replica."""
    replicas = [f"r{i}" for i in range(len(per_replica))]
    running = replicas if running is None else running
    metrics: dict[str, dict] = {}
    for rid, values in zip(replicas, per_replica):
        for name, value in values.items():
            metrics.setdefault(name, {})[rid] = value
    config = {"upscale_delay_s": 0, "downscale_delay_s": 0, **config}
    cfg = AutoscalingConfig(min_replicas=min_replicas, max_replicas=max_replicas, **config)
    return AutoscalingContext(
        deployment_id=None, deployment_name="pool", app_name="splitspec", current_num_replicas=len(running),
        target_num_replicas=len(running) if target is None else target, running_replicas=running,
        total_num_requests=ongoing, total_queued_requests=0.0, aggregated_metrics=metrics, raw_metrics={},
        capacity_adjusted_min_replicas=min_replicas, capacity_adjusted_max_replicas=max_replicas,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None, current_time=0.0, config=cfg)


def replicas(policy, ctx) -> int:
    desired, _ = policy(ctx)
    return max(ctx.capacity_adjusted_min_replicas, min(ctx.capacity_adjusted_max_replicas, math.ceil(desired)))


def test_busy_pool_scales_up_idle_pool_scales_down_within_tolerance_holds():
    busy = context([{BUSY: 1.0, QUEUED: 3}, {BUSY: 0.95, QUEUED: 2}])
    assert replicas(verifier_policy, busy) == 3  # 1.95 replicas of engine time / 0.75 -> 2.6
    idle = context([{BUSY: 0.1, QUEUED: 0}, {BUSY: 0.2, QUEUED: 0}, {BUSY: 0.0, QUEUED: 0}])
    assert replicas(verifier_policy, idle) == 1
    at_target = context([{BUSY: 0.8, QUEUED: 1}, {BUSY: 0.8, QUEUED: 1}])  # 2.13 asked: within 10%
    assert pool_decision(at_target)[0] == 2


def test_queue_alone_scales_a_pool_whose_engine_time_looks_fine():
    ctx = context([{BUSY: 0.5, QUEUED: 40}])
    desired, state = pool_decision(ctx, target_busy=0.75, target_queue=8)
    assert desired == 5 and state["asks"] == {BUSY: 0.667, QUEUED: 5.0}


def test_missing_reports_hold_the_current_target():
    # a replica that just started has not reported: its silence is not idleness
    ctx = context([{BUSY: 0.1}], running=["r0", "r1"], target=2)
    assert pool_decision(ctx)[0] == 2
    assert pool_decision(context([], running=["r0"], target=1))[0] == 1
    # no replicas at all: Serve's cold-start path decides; the policy keeps the target
    assert pool_decision(context([], running=[], target=0, min_replicas=0))[0] == 0


def test_signals_without_a_target_are_ignored_and_bad_targets_fail_at_deploy_time():
    ctx = context([{BUSY: 1.0, QUEUED: 100, BATCH_FILL: 0.2, BATCH_TOKENS: 900}])
    assert pool_decision(ctx, target_busy=None, target_queue=None, target_batch_tokens=300)[0] == 3
    assert pool_decision(ctx, target_busy=None, target_queue=None, target_batch_fill=0.5)[0] == 1
    with pytest.raises(ValueError):
        PoolPolicy(target_busy=0)
    with pytest.raises(ValueError):
        PoolPolicy(target_queue="many")
    assert PoolPolicy(target_busy=0.5, target_queue=None)(ctx)[0] == 2


def test_through_serves_wrapper_bounds_and_delays_apply():
    """Serve wraps custom policies with min/max, delays and scaling factors: check the
    decision as the controller would take it."""
    from ray.serve.autoscaling_policy import _apply_autoscaling_config

    wrapped = _apply_autoscaling_config(PoolPolicy(target_busy=0.5, target_queue=None))
    ctx = context([{BUSY: 1.0}, {BUSY: 1.0}], max_replicas=3)
    n, _ = wrapped(ctx)
    assert min(n, 3) == 3  # 4 asked, bounded to max_replicas by the controller's apply_bounds
    slow = context([{BUSY: 1.0}], upscale_delay_s=60)
    assert wrapped(slow)[0] == 1  # wants 2, but the upscale delay has not passed


# ---- a steady-state cost model: which pool does a change of k or acceptance load? ----------

def pool_loads(demand_tokens_s: float, acceptance: float, k: int, seqs_per_batch: int = 32,
               t_draft_pass: float = 0.002, t_verify_base: float = 0.005, t_verify_token: float = 0.0005):
    """Busy seconds per second on each pool for a demand of output tokens per second.
    Tokens per step: (1 - a^(k+1)) / (1 - a). A draft is k sequential drafter passes; a verify
    pass costs a base plus a per-token part for its k + 1 tokens (per sequence, amortised)."""
    per_step = (1 - acceptance ** (k + 1)) / (1 - acceptance)
    steps_s = demand_tokens_s / per_step
    return {"drafter": steps_s * k * t_draft_pass,
            "verifier": steps_s * (t_verify_base + t_verify_token * (k + 1)),
            "verify_tokens_per_pass": seqs_per_batch * (k + 1)}


def pool_contexts(loads: dict, replicas_now: dict, ongoing: float):
    """Contexts for both pools with the modelled engine time spread over the current replicas,
    and the same ongoing requests (each active request has one call in flight on each pool)."""
    out = {}
    for pool in ("drafter", "verifier"):
        n = replicas_now[pool]
        per = {BUSY: min(1.0, loads[pool] / n), QUEUED: 0.0}
        if pool == "verifier":
            per[BATCH_TOKENS] = loads["verify_tokens_per_pass"]
        out[pool] = context([dict(per) for _ in range(n)], ongoing=ongoing, target_ongoing_requests=32)
    return out


def decide(loads, replicas_now, ongoing=128):
    ctxs = pool_contexts(loads, replicas_now, ongoing)
    ours = {"drafter": replicas(drafter_policy, ctxs["drafter"]),
            "verifier": replicas(verifier_policy, ctxs["verifier"])}
    default = {pool: replicas(replica_queue_length_autoscaling_policy, ctxs[pool]) for pool in ctxs}
    return ours, default


def test_raising_k_moves_the_drafter_pool_not_the_verifier_pool():
    now = {"drafter": 4, "verifier": 4}
    base, base_default = decide(pool_loads(1000, 0.8, 4), now)
    longer, longer_default = decide(pool_loads(1000, 0.8, 8), now)
    assert base == {"drafter": 4, "verifier": 3}
    assert longer == {"drafter": 5, "verifier": 3}  # k sequential passes per draft: drafters grow
    # Serve's default sees the same ongoing requests on both pools, whatever k is
    assert base_default == longer_default == {"drafter": 4, "verifier": 4}


def test_falling_acceptance_moves_the_verifier_pool():
    now = {"drafter": 6, "verifier": 6}  # unsaturated: a saturated pool's busy time caps at 1
    good, _ = decide(pool_loads(1000, 0.8, 4), now)
    poor, poor_default = decide(pool_loads(1000, 0.5, 4), now)
    assert good["verifier"] == 3
    assert poor["verifier"] == 6  # 1.94 instead of 3.36 tokens per step: 73% more verify steps
    assert poor_default["verifier"] == poor_default["drafter"]  # the default cannot tell the pools apart


def test_gpu_verifier_on_tokens_per_pass_follows_k():
    """On a GPU the verifier is busy whenever work is queued (continuous batching): the width of
    its passes (k + 1 tokens per sequence) is the signal (configs/serve_gpu_cluster.yaml)."""
    policy = PoolPolicy(target_busy=None, target_queue=32, target_batch_tokens=512)
    narrow = context([{BUSY: 1.0, QUEUED: 4, BATCH_TOKENS: 32 * 5}] * 2)
    wide = context([{BUSY: 1.0, QUEUED: 4, BATCH_TOKENS: 96 * 9}] * 2)
    assert replicas(policy, narrow) == 1
    assert replicas(policy, wide) == 4


def test_load_window_reports_engine_time_queue_and_batch_shape():
    now = [0.0]
    window = LoadWindow(clock=lambda: now[0])
    sampling = {"temperature": 0.0}
    verify = [VerifyRequest(seq_id=f"s{i}", start=10, prefix="h", new_tokens=[1], draft_tokens=[2, 3, 4],
                            sampling=sampling, seed=0) for i in range(4)]
    for start, stop, batch in ((0.5, 1.0, verify), (1.5, 2.5, verify[:2])):
        now[0] = start
        window.begin()
        now[0] = stop
        window.end(batch)
    now[0] = 3.0  # a third batch starts, still running at the report
    window.begin()
    now[0] = 4.0
    report = window.report(queued=3, max_batch=8)
    assert report == {BUSY: 2.5 / 4, QUEUED: 3.0, BATCH_FILL: 3 / 8, BATCH_TOKENS: 12.0}
    # a batch longer than the window reads as busy, its time split between the windows
    now[0] = 6.0
    assert window.report(queued=0, max_batch=8)[BUSY] == 1.0
    now[0] = 6.5
    window.end(verify)
    now[0] = 8.0
    assert window.report(queued=0, max_batch=8) == {BUSY: 0.25, QUEUED: 0.0, BATCH_FILL: 0.5, BATCH_TOKENS: 16.0}
    draft = DraftRequest(seq_id="s", start=0, prefix=None, new_tokens=[5, 6, 7], k=4, sampling=sampling, seed=0)
    assert work_tokens(draft) == 7 and work_tokens(verify[0]) == 4


def test_unusable_metric_values_are_skipped():
    ctx = context([{BUSY: float("nan")}, {BUSY: 1.0}])
    assert pool_decision(ctx, target_busy=0.5, target_queue=None)[0] == 2
