"""The planner (bench.plan): model shapes, the roofline's monotone sanity, the plan's JSON, the
recommendation's response to the drafter pool's price, the serve config it writes, and the check on
this CPU (a real engine probe; the comparison's arithmetic on a given latency JSON)."""

import copy
import json

import pytest
import yaml

from bench import plan as P
from bench.common import DRAFTER, TARGET


def test_model_shapes_match_the_published_parameter_counts():
    v, d = P.load_shape("llama-3.1-8b"), P.load_shape("llama-3.2-1b")
    assert v["params"] == pytest.approx(8.03e9, rel=0.005) and d["params"] == pytest.approx(1.236e9, rel=0.005)
    assert v["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2 and v["layers"] == 32
    # the shipped pair (docs/models.md: 27.8M and 0.74M parameters)
    assert P.load_shape(TARGET)["params"] == pytest.approx(27.8e6, rel=0.01)
    assert P.load_shape(DRAFTER)["params"] == pytest.approx(0.74e6, rel=0.01)
    # float32 doubles every byte, not the FLOPs
    v4 = P.load_shape("llama-3.1-8b", 4)
    assert v4["read_bytes"] == 2 * v["read_bytes"] and v4["flops_per_token"] == v["flops_per_token"]


def _machines():
    return P.gpu_machines(P.load_catalogue())


def test_more_bandwidth_is_faster_and_a_wide_pass_turns_compute_bound():
    v, m = P.load_shape("llama-3.1-8b"), _machines()
    slow, fast = m["H100-SXM"], copy.copy(m["H100-SXM"])
    fast.bandwidth = 2 * slow.bandwidth
    assert P.forward_s(v, fast, 1, 1, 512) < P.forward_s(v, slow, 1, 1, 512)
    # decoding reads the weights once whatever the batch: 8 sequences cost far less than 8 times one
    assert P.forward_s(v, slow, 8, 1, 512) < 2 * P.forward_s(v, slow, 1, 1, 512)
    # a 4096-token prefill is compute-bound: twice the FLOP rate, about half the time
    quick = copy.copy(slow)
    quick.flops = 2 * slow.flops
    assert P.forward_s(v, quick, 1, 4096, 2048) < 0.6 * P.forward_s(v, slow, 1, 4096, 2048)
    # the H200 (more bandwidth, the same FLOPs) decodes faster than the H100
    assert P.forward_s(v, m["H200"], 1, 1, 512) < P.forward_s(v, m["H100-SXM"], 1, 1, 512)


@pytest.mark.parametrize("placement", ["colocated", "split"])
def test_higher_acceptance_never_lowers_the_best_k(placement):
    v, d, m = P.load_shape("llama-3.1-8b"), P.load_shape("llama-3.2-1b"), _machines()
    h100, dm = m["H100-SXM"], m["A100-80GB"] if placement == "split" else m["H100-SXM"]
    def best_k(curve):  # the k with the least time per token at 8 sequences
        return min(range(1, 9), key=lambda k: (s := P.step(placement, k, 8, 768, v, h100, d, dm, curve))["step_s"]
                   / s["tokens_per_step"])

    ks = [best_k(P.Curve.geometric(a)) for a in (0.3, 0.5, 0.7, 0.8, 0.9, 0.95)]
    assert ks == sorted(ks) and ks[-1] > ks[0], ks
    # and more tokens per step at the same cost is less time per token
    s_lo = P.step(placement, 4, 8, 768, v, h100, d, dm, P.Curve.geometric(0.6))
    s_hi = P.step(placement, 4, 8, 768, v, h100, d, dm, P.Curve.geometric(0.9))
    assert s_hi["step_s"] / s_hi["tokens_per_step"] < s_lo["step_s"] / s_lo["tokens_per_step"]


def test_the_curve_comes_from_the_acceptance_json():
    acc = {"results": [{"workload": "humaneval", "drafter": "draft_model", "temperature": 0.0, "k_max": 3,
                        "tokens_per_step_by_k": [1.7, 2.2, 2.5], "per_position_acceptance_rate": [0.7, 0.5, 0.3]}]}
    c = P.Curve.from_acceptance(acc, "humaneval", "draft_model", 0.0)
    assert c.at(0) == (1.0, 0.0) and c.at(2) == (2.2, 0.5) and c.at(8) == (2.5, 0.3)
    with pytest.raises(ValueError, match="no acceptance row"):
        P.Curve.from_acceptance(acc, "held-out", "draft_model", 0.0)


def test_the_plan_covers_every_shape_and_its_json_holds_the_figures(tmp_path):
    acc = tmp_path / "acceptance.json"
    acc.write_text(json.dumps({"results": [{"workload": "humaneval", "drafter": "draft_model", "temperature": 0.0,
                                            "k_max": 8,
                                            "tokens_per_step_by_k": [1.8, 2.5, 3.0, 3.4, 3.7, 3.9, 4.0, 4.1],
                                            "per_position_acceptance_rate": [.8, .65, .5, .4, .3, .2, .15, .1]}]}))
    P.main(["--acceptance", str(acc), "--out", str(tmp_path), "--concurrency", "16", "--tpot-ms", "20"])
    data = json.loads((tmp_path / "plan.json").read_text())
    n = len(P.load_catalogue()["gpus"])
    assert len(data["shapes"]) == n + n + n * n  # plain, colocated, split (every verifier x drafter type)
    assert data["validated"] is False and "humaneval" in data["acceptance"]
    for r in data["shapes"]:
        if not r["fits"]:
            continue
        assert (r["k"] == 0) == (r["placement"] == "plain") and 1 <= r["tokens_per_step"] <= r["k"] + 1
        assert r["decode_tpot_ms"] == pytest.approx(r["step_ms"] / r["tokens_per_step"], rel=1e-3)
        # the latency counts prefill as the capacity does: the batch's prefills stall a request's decoding
        out = data["traffic"]["output_tokens"]
        assert r["tpot_ms"] == pytest.approx((r["batch"] * r["prefill_ms"] + out * r["decode_tpot_ms"]) / out, rel=1e-3)
        assert r["tokens_per_s_per_replica"] == pytest.approx(1e3 * r["batch"] / r["tpot_ms"], rel=1e-3)
        assert r["usd_per_m_tokens"] == pytest.approx(r["usd_per_hour"] / (r["demand_tokens_per_s"] * 3600) * 1e6,
                                                      rel=1e-3)
        assert r["verifier_replicas"] * r["batch"] >= 16 and (r["drafter_replicas"] > 0) == (r["placement"] == "split")
    met = [r for r in data["shapes"] if r["meets_target"]]
    rec = data["recommendation"]
    assert rec == min(met, key=lambda r: r["usd_per_m_tokens"]) and rec["tpot_ms"] <= 20
    # the serve config the recommendation writes is one the app accepts
    from configs import AppConfig

    cfg = yaml.safe_load((tmp_path / "plan_serve.yaml").read_text())
    AppConfig(**cfg["applications"][0]["args"])
    # the header, its rule, a row a shape
    assert (tmp_path / "plan.md").read_text().count("\n|") == len(data["shapes"]) + 2
    assert (tmp_path / "plan.png").read_bytes()[:4] == b"\x89PNG"


def test_the_recommendation_follows_the_drafter_pools_price():
    """A verifier GPU too small for the drafter beside the verifier: speculation needs a drafter pool,
    which pays while its GPU is cheap and stops paying when its price rises."""
    cat = {"defaults": P.load_catalogue()["defaults"],
           "gpus": {"V": {"memory_gb": 20, "bandwidth_gbs": 2000, "bf16_tflops": 400, "price_per_hour": 4.0},
                    "D": {"memory_gb": 24, "bandwidth_gbs": 1000, "bf16_tflops": 200, "price_per_hour": 0.5}}}
    v, d = P.load_shape("llama-3.1-8b"), P.load_shape("llama-3.2-1b")
    traffic, curve = P.Traffic(512, 256, 4), P.Curve.geometric(0.8)

    def rec(price_d):
        m = P.gpu_machines(cat)
        m["D"].price_per_hour = price_d
        m["D"].memory_bytes = 3e9  # the drafter fits on D, the verifier does not
        return next(r for r in P.plan(v, d, m, curve, traffic, tpot_ms=20.0) if r["meets_target"])

    cheap, dear = rec(0.5), rec(40.0)
    assert (cheap["placement"], cheap["verifier_gpu"], cheap["drafter_gpu"]) == ("split", "V", "D")
    assert dear["placement"] != "split" or dear["drafter_gpu"] != "D"
    assert cheap["usd_per_m_tokens"] < dear["usd_per_m_tokens"]


def test_cost_rises_with_the_price_and_nothing_else_moves():
    v, d = P.load_shape("llama-3.1-8b"), P.load_shape("llama-3.2-1b")
    curve, traffic = P.Curve.geometric(0.8), P.Traffic(512, 256, 16)

    def shape_cost(price):
        m = _machines()
        m["H100-SXM"].price_per_hour = price
        return P.evaluate("colocated", 4, 16, v, m["H100-SXM"], d, m["H100-SXM"], curve, traffic)

    lo, hi = shape_cost(2.0), shape_cost(4.0)
    assert hi["usd_per_m_tokens"] == pytest.approx(2 * lo["usd_per_m_tokens"], rel=1e-3)
    assert {k: x for k, x in lo.items() if "usd" not in k} == {k: x for k, x in hi.items() if "usd" not in k}


ENGINE_PROBE = {"verify_ms_by_width": {str(w): 3.0 + 0.1 * (w - 1) for w in range(1, 10)},
                "draft_ms_by_k": {str(k): 0.2 * k for k in range(1, 9)}, "prefill_ms": [(100, 20.0), (200, 40.0)],
                "loop_overhead_ms": {"plain": 0.1, "speculative": 0.2}, "samples_per_width": 10,
                "load_average": [1.0, 1.0, 1.0]}


def test_the_check_sets_projection_beside_measurement():
    acc = {"results": [{"workload": w, "drafter": "draft_model", "temperature": 0.0, "k_max": 8,
                        "tokens_per_step_by_k": [1.7, 2.2, 2.6, 2.9, 3.1, 3.3, 3.4, 3.5],
                        "per_position_acceptance_rate": [.7, .5, .4, .3, .25, .2, .15, .1]}
                       for w in ("humaneval", "held-out")]}

    def systems(scale):
        sy = {"splitspec_off": {"k": 0, "ms_per_token": 5.0 * scale, "ms_per_token_runs": [4.9 * scale, 5.1 * scale]}}
        for k in (2, 4):
            sy[f"splitspec_k{k}"] = {"k": k, "ms_per_token": 3.0 * scale, "ms_per_token_runs": [3.0 * scale]}
        sy["reference_off"] = {"k": 0, "ms_per_token": 1.0}
        return {"0": {"systems": sy}}

    lat = {"config": {"dtype": "bfloat16", "max_tokens": 256, "prompt_tokens": [100]},
           "workloads": {"humaneval": {"workload": {"prompt_tokens": [80, 120]}, "temperatures": systems(1.0)},
                         "held-out": {"workload": {"prompt_tokens": [150]}, "temperatures": systems(100.0)}},
           "environment": {"load_average_at_start": [2.0, 2.0, 2.0]}}
    out = P.check_cpu(lat, acc, {"humaneval": ENGINE_PROBE, "held-out": ENGINE_PROBE})
    assert set(out["workloads"]) == {"humaneval", "held-out"}
    for w in out["workloads"].values():
        assert [r["k"] for r in w["rows"]] == [0, 2, 4] and w["projected_best_k"] in (2, 4)
        for r in w["rows"]:
            assert r["error"] == pytest.approx(r["projected_ms_per_token"] / r["measured_ms_per_token"] - 1, abs=1e-3)
            assert r["within_bound"] == (abs(r["error"]) <= 0.2)
    # the same projection against measurements 100x slower: never within the bound
    assert not any(r["within_bound"] for r in out["workloads"]["held-out"]["rows"])
    md = P.check_markdown(out)
    assert "## humaneval" in md and "| splitspec_off | 0 |" in md and "Load average at the probe 1.00" in md


def _breakdown(workload="humaneval"):
    rows = {f"k{k}": {"k": k, "policy": "fixed", "draft_ms": 0.5 + 0.2 * k, "draft_engine_ms": 0.1 * k,
                      "pre_draft_hidden_share": 0.8 - 0.05 * k, "rpc_queue_ms": 0.4, "detok_stream_ms": 0.5}
            for k in (1, 2, 4, 8)}
    rows["default"] = {"k": 8, "policy": "adaptive", "draft_ms": 9.0, "draft_engine_ms": 1.0,
                       "pre_draft_hidden_share": 0.1, "rpc_queue_ms": 9.0, "detok_stream_ms": 9.0}
    return {"workloads": {workload: {"per_config": rows}}}


def test_the_served_terms_come_from_the_breakdowns_own_requests():
    t = P.served_terms(_breakdown(), "humaneval", range(1, 9))
    # the channel: drafting on the path less the engine's, 0.5 + 0.1 k, fitted over the fixed k (not the default)
    assert t["channel_ms"] == [pytest.approx(0.5), pytest.approx(0.1)]
    assert t["step_overhead_ms"] == pytest.approx(0.9) and t["ks"] == [1, 2, 4, 8]
    # measured at 1, 2, 4, 8; between them, interpolated
    assert t["hidden_share"]["2"] == pytest.approx(0.7) and t["hidden_share"]["3"] == pytest.approx(0.65)
    assert P.served_terms(_breakdown(), "held-out", range(1, 9)) == {} and P.served_terms(None, "x", [1]) == {}
    # the served verify pass over the in-process one: the prefill step taken out of the served mean first
    bd = _breakdown()
    for k, e in ((e["k"], e) for e in bd["workloads"]["humaneval"]["per_config"].values()):
        e["verify_forward_ms"], e["steps"] = (1.2 * (3.0 + 0.1 * k) * 100 + 30.0) / 101, 101
    eng = {"verify_ms_by_width": {str(w): 3.0 + 0.1 * (w - 1) for w in range(1, 10)},
           "prefill_ms": [(100, 20.0), (200, 40.0)]}
    assert P.served_verify_factor(P.served_terms(bd, "humaneval", range(1, 9)), eng) == pytest.approx(1.2, abs=1e-3)


def test_the_check_composes_the_probed_terms():
    """With the engine probe and the breakdown's served terms, a row's projection is their composition: a
    step's parts over the curve's tokens per step, the prefill spread over the output."""
    acc = {"results": [{"workload": "humaneval", "drafter": "draft_model", "temperature": 0.0, "k_max": 8,
                        "tokens_per_step_by_k": [1.7, 2.2, 2.6, 2.9, 3.1, 3.3, 3.4, 3.5],
                        "per_position_acceptance_rate": [.7, .5, .4, .3, .25, .2, .15, .1]}]}
    sy = {"splitspec_off": {"k": 0, "ms_per_token": 4.0},
          "reference_off": {"k": 0, "ms_per_token": 3.2, "forward_ms_decode": 3.0}}
    for k in (1, 2, 4, 8):
        sy[f"splitspec_k{k}"] = {"k": k, "ms_per_token": 2.5}
        sy[f"reference_k{k}"] = {"k": k, "ms_per_token": 2.0, "forward_ms_decode": 3.0 + 0.1 * k}
    lat = {"config": {"dtype": "bfloat16", "max_tokens": 101},
           "workloads": {"humaneval": {"workload": {"prompt_tokens": [100, 200]},
                                       "temperatures": {"0": {"systems": sy}}}}}
    data = P.check_cpu(lat, acc, {"humaneval": ENGINE_PROBE}, _breakdown(), 0.7, 0.63)
    out = data["workloads"]["humaneval"]
    rows = {r["k"]: r for r in out["rows"]}
    # plain: (prefill 30 + the overhead, then 100 steps of verify(1) + the overhead) / 101 tokens
    assert rows[0]["projected_ms_per_token"] == pytest.approx((30 + 0.7 + 100 * 3.7) / 101, abs=1e-3)
    # k = 4: verify(5) + (1 - hidden 0.6) draft(4) + channel (0.5 + 0.4) + served overhead 0.9, over 2.9 tokens a step
    step4 = 3.4 + 0.4 * 0.8 + 0.9 + 0.9
    assert rows[4]["projected_ms_per_token"] == pytest.approx((30 + 0.9 + 100 * step4 / 2.9) / 101, abs=1e-3)
    assert rows[4]["parts"]["draft_on_path_ms_projected"] == pytest.approx(0.4 * 0.8 + 0.9, abs=1e-3)
    assert rows[4]["parts"]["verify_vs_plain_projected"] == pytest.approx(3.4 / 3.0, abs=1e-3)
    best = out["best"]
    assert best["projected_k"] == min((1, 2, 4, 8), key=lambda k: rows[k]["projected_ms_per_token"])
    assert best["error"] == pytest.approx(rows[best["projected_k"]]["projected_ms_per_token"] / 2.5 - 1, abs=1e-3)
    assert best["regret"] == 0.0  # every fixed k measured the same here
    assert best["measured_k"] == 1 and best["measured_ms_per_token"] == 2.5
    assert "| splitspec_off | 0 |" in P.check_markdown(data) and data["machine"]["step_overhead_ms"] == 0.7


@pytest.mark.heavy  # the shipped pair's engines, a few seconds
def test_the_engine_probe_times_every_width_and_k():
    from transformers import AutoTokenizer

    from bench.common import TARGET

    ids = AutoTokenizer.from_pretrained(TARGET)("def add(a, b):\n    return")["input_ids"]
    e = P.probe_engines([ids], 40, "float32", 1, k_max=3)
    assert list(e["verify_ms_by_width"]) == ["1", "2", "3", "4"] and list(e["draft_ms_by_k"]) == ["1", "2", "3"]
    assert all(x > 0 for x in [*e["verify_ms_by_width"].values(), *e["draft_ms_by_k"].values()])
    assert e["prefill_ms"][0][0] == len(ids) and e["prefill_ms"][0][1] > 0 and e["samples_per_width"] >= 2
    assert set(e["loop_overhead_ms"]) == {"plain", "speculative"}


@pytest.mark.heavy  # the GPU kit at tiny shapes, seconds
def test_the_planner_reads_the_gpu_kits_output(tmp_path):
    """The kit's output, made by running the kit (tiny shapes, on this CPU, one forward): the planner plans with
    its measured bandwidth and matmul rate in place of the catalogue's for the GPU it ran on."""
    from bench import gpu

    gpu.main(["--shapes", "tiny", "--device", "cpu", "--dtype", "float32", "--quick", "--forwards", "compact",
              "--out", str(tmp_path)])
    kit = json.loads((tmp_path / "gpu.json").read_text())
    assert kit["probes"]["flops"] > 0 and len(kit["probes"]["bandwidth"]) == 2
    (fw,) = kit["by_forward"]
    et = fw["engine_terms"]
    assert list(et["verify_ms_by_width"]) == ["1", "2", "3", "4", "5"]
    assert list(et["draft_ms_by_k"]) == ["1", "2", "3", "4"]
    P.main(["--gpu-json", str(tmp_path / "gpu.json"), "--gpu", "L4", "--acceptance-a", "0.7", "--out", str(tmp_path),
            "--concurrency", "4"])
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["measured_gpu"] == "L4" and plan["validated"] is False
    # the L4 rows now use this CPU's bandwidth: far slower than the datasheet's
    l4 = next(r for r in plan["shapes"] if r["shape"] == "L4, plain")
    assert l4["step_ms"] > 10 * next(r for r in plan["shapes"] if r["shape"] == "H100-SXM, plain")["step_ms"]


def test_the_plan_reads_the_workload_writes_a_config_that_fits_and_heads_with_plain(tmp_path, capsys):
    """Prompt and output lengths from the acceptance JSON's workload, the serve config at the verifier's own
    context, a headline against plain decoding, and --help naming every option."""
    acc = tmp_path / "acceptance.json"
    acc.write_text(json.dumps({
        "config": {"max_tokens": 128},
        "workloads": {"mine": {"prompt_tokens": [900, 1100], "max_tokens": [300, 500]}},
        "results": [{"workload": "mine", "drafter": "eagle3: head", "temperature": 0.0, "k_max": 8,
                     "tokens_per_step_by_k": [1.8, 2.5, 3.0, 3.4, 3.7, 3.9, 4.0, 4.1],
                     "per_position_acceptance_rate": [.8, .65, .5, .4, .3, .2, .15, .1]}]}))
    P.main(["--acceptance", str(acc), "--out", str(tmp_path), "--workload", "mine", "--curve-drafter", "eagle3: head",
            "--drafter-method", "eagle3", "--concurrency", "16", "--tpot-ms", "20"])
    data = json.loads((tmp_path / "plan.json").read_text())
    assert (data["traffic"]["prompt_tokens"], data["traffic"]["output_tokens"]) == (1000, 400)
    assert "mean of workload 'mine'" in data["traffic"]["lengths_from"]
    assert "against plain decoding's best" in data["headline"] or "does not pay" in data["headline"]
    assert data["headline"] in (tmp_path / "plan.md").read_text()
    args = yaml.safe_load((tmp_path / "plan_serve.yaml").read_text())["applications"][0]["args"]
    assert args["verifier"]["max_model_len"] == P.load_shape("llama-3.1-8b")["max_position_embeddings"] == 131072
    if data["recommendation"]["placement"] != "plain":
        assert args["drafter"]["method"] == "eagle3"
    # the flags override the workload; without a workload's lengths the acceptance run's length is the output's
    P.main(["--acceptance", str(acc), "--out", str(tmp_path), "--workload", "mine", "--curve-drafter", "eagle3: head",
            "--prompt-tokens", "64"])
    assert json.loads((tmp_path / "plan.json").read_text())["traffic"]["prompt_tokens"] == 64
    capsys.readouterr()
    with pytest.raises(SystemExit):
        P.main(["--help"])
    text = capsys.readouterr().out
    assert all(f"--{o}" in text for o in ("verifier", "drafter", "workload", "prompt-tokens", "output-tokens",
                                          "tpot-ms", "concurrency", "price", "verifier-model"))
