"""A request's statistics as data: vLLM's counters by default, the time breakdown when asked for."""

import pytest

from configs import SamplingParams
from core.protocol import StepInfo, VerifyResult
from core.sequence import Sequence
from core.stats import RequestStats, exposed_s

TIMING_KEYS = {"mean_step_ms", "mean_exposed_ms", "mean_forward_ms", "mean_draft_ms", "mean_draft_engine_ms",
               "by_pre_draft", "mean_emit_ms", "replica_chunks", "pre_draft_hits", "pre_draft_misses",
               "mean_pre_branches", "pre_draft_by_outcome", "aux_bytes_per_token"}


def run(steps: list[tuple[StepInfo, float]], k: int = 4) -> tuple[Sequence, RequestStats]:
    """Apply each step (its tokens: accepted + 1) to a sequence, recording it as the router does."""
    seq = Sequence([1, 2, 3], SamplingParams(temperature=0, max_tokens=100), k, None, set(), 1000, seq_id="s")
    stats = RequestStats(k)
    for info, wall in steps:
        seq.apply(VerifyResult("s", tokens=[7] * (info.accepted + 1), num_accepted=info.accepted, num_drafts=info.k))
        stats.record(info, wall, len(seq.output_ids))
        stats.emitted(0.001)
    return seq, stats


def test_counters_by_default_and_the_breakdown_only_when_asked():
    steps = [(StepInfo(k=4, accepted=3, forward_s=0.010, draft_s=0.004, step_s=0.016, verify_s=0.011,
                       engine_s=0.0105, pre_draft="miss", pre_branches=1, pre_outcome=2), 0.020),
             (StepInfo(k=2, accepted=0, forward_s=0.010, draft_s=0.0, step_s=0.012, pre_draft="hit",
                       pre_branches=3, pre_outcome=2), 0.012),
             (StepInfo(k=0, accepted=0, step_s=0.005), 0.005)]
    seq, stats = run(steps)
    plain = stats.report(seq)
    assert not TIMING_KEYS & set(plain)
    assert plain["num_drafts"] == 2 and plain["num_draft_tokens"] == 6 and plain["num_accepted_tokens"] == 3
    assert plain["accepted_per_pos"] == [1, 1, 1, 0] and plain["mean_acceptance_length"] == 2.5
    assert plain["k"] == 4 and plain["steps_by_k"] == {"0": 1, "2": 1, "4": 1} and plain["steps"] == 3
    assert plain["plain_from_token"] == 5  # 4 + 1 tokens before the policy's first plain step
    timed = stats.report(seq, timing=True)
    assert TIMING_KEYS <= set(timed) and {k: timed[k] for k in plain} == plain
    assert timed["mean_step_ms"] == 16.0 and timed["mean_forward_ms"] == 10.0 and timed["mean_draft_ms"] == 2.0
    assert timed["mean_exposed_ms"] == pytest.approx((0.006 + 0.002) / 2 * 1000)
    # the exposed time in parts, on the one step that timed its verify call
    assert timed["mean_verify_rest_ms"] == 0.5 and timed["mean_handoff_ms"] == 0.5
    assert timed["mean_loop_ms"] == 1.0 and timed["mean_transit_ms"] == 4.0
    assert timed["pre_draft_hits"] == 1 and timed["pre_draft_misses"] == 1 and timed["mean_pre_branches"] == 2.0
    assert timed["pre_draft_by_outcome"] == {"2": [1, 2]}
    assert timed["by_pre_draft"] == {"hit": {"steps": 1, "mean_draft_ms": 0.0, "mean_step_ms": 12.0},
                                     "miss": {"steps": 1, "mean_draft_ms": 4.0, "mean_step_ms": 20.0}}
    assert timed["replica_chunks"] == 4 and timed["mean_emit_ms"] == 1.0


def test_degraded_steps_are_not_the_policys_choice():
    seq, stats = run([(StepInfo(k=0, accepted=0, degraded=True), 0.004), (StepInfo(k=3, accepted=3), 0.01)])
    out = stats.report(seq)
    assert out["degraded_steps"] == 1 and out["steps_by_k"] == {"3": 1} and out["plain_from_token"] is None
    # a request that asked for no speculation never "chose" plain decoding
    seq, stats = run([(StepInfo(k=0, accepted=0), 0.004)] * 2, k=0)
    assert stats.report(seq)["plain_from_token"] is None


def test_exposed_time_never_negative():
    assert exposed_s(StepInfo(k=2, accepted=1, forward_s=0.02, draft_s=0.01), 0.025) == 0.0
    assert exposed_s(StepInfo(k=2, accepted=1, forward_s=0.02, draft_s=0.01), 0.04) == pytest.approx(0.01)


def test_an_items_wall_time_split_over_its_steps_adds_up():
    """The router sees one wall time per stream item: its steps get their own step times, and its
    last speculative step the rest (the transit time), so the per-step figures add up to the client's."""
    from deployments.generation import split_wall

    group = [([1], None, StepInfo(k=2, accepted=0, step_s=0.010)), ([2], None, StepInfo(k=2, accepted=1, step_s=0.012)),
             ([3], None, StepInfo(k=0, accepted=0, step_s=0.004))]
    walls = split_wall(group, 0.030)
    assert walls == pytest.approx([0.010, 0.016, 0.004]) and sum(walls) == pytest.approx(0.030)
    # a wall shorter than the replica's own times (clock skew): nothing negative, still the total
    assert split_wall(group, 0.008) == pytest.approx([0.008, 0.0, 0.0])
    assert split_wall([([1], None, StepInfo(k=0, accepted=0, step_s=0.01))], 0.02) == [0.02]
