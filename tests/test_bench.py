"""Smoke run of every benchmark tool on tiny settings (the shipped model pair, one prompt,
16 tokens): the JSON and the report come out with sane values; and the published
results (one folder per machine kind) re-render from their own JSON. The full-size runs are
`make bench` and the other bench-* targets, not tests; the tools that serve an app or start vLLM
are marked long."""

import json
import math
import os
import shutil
from pathlib import Path

import pytest

from bench.common import PUBLISHED, cpu_info, expected_tokens, machine_slug, per_token_acceptance, percentile

TOKENS = 16


def test_bound_formulas():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert math.isclose(expected_tokens(0.5, 3), 1 + 0.5 + 0.25 + 0.125)
    # 10 steps of k=4: 3 accepted everything (12 tokens), 7 rejected somewhere after 2 each (14 tokens)
    assert math.isclose(per_token_acceptance(10, 26, 3), 26 / (26 + 7))
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5


@pytest.fixture(scope="module")
def bench_urls(serve_app):
    """The benchmark's app on the shipped pair, beside the test app. One app (fixed k <= 2)
    stands in for both of the full run's apps (adaptive and fixed k): half the start-up time."""
    from bench.client import app_args, serving

    with serving({"fixed": app_args(1, "fixed", 2, streams=2, dtype="float32")}, 1) as urls:
        yield {"adaptive": urls["fixed"], "fixed": urls["fixed"]}


@pytest.mark.long  # a served app and every benchmark script end to end
def test_bench_smoke(bench_urls, tmp_path):
    from bench import breakdown, latency, load, report

    out = tmp_path
    # --- single-stream latency: every system but vLLM (its engine start takes minutes: see the slow test)
    args = latency.parse(["--dtype", "float32", "--prompts", "1", "--repeats", "1", "--max-tokens", str(TOKENS),
                          "--temperatures", "0,0.8", "--ks", "1,2", "--default-k", "2", "--no-vllm", "--out", str(out)])
    lat = latency.run(args, urls=bench_urls)
    assert lat["skipped"]["vllm"].startswith("skipped")
    (out / "latency.json").write_text(json.dumps(lat))
    greedy = lat["temperatures"]["0"]
    systems = greedy["systems"]
    assert {"splitspec_off", "splitspec_default", "splitspec_k1", "splitspec_k2", "reference_off", "reference_k1",
            "reference_k2"} <= set(systems)
    for sid, e in systems.items():
        assert e["tokens"] == TOKENS, sid
        assert 0 < e["ms_per_token"] < 5_000, sid
        assert e["speedup_vs_best_plain"] > 0, sid
        if e["k"] > 0 and "acceptance_rate" in e:
            assert 0 <= e["acceptance_rate"] <= 1 and 1 <= e["mean_acceptance_length"] <= e["k"] + 1, sid
        # greedy: every system emits exactly the reference loop's tokens
        assert e.get("same_tokens_as_reference") is True, sid
    assert greedy["best_plain"]["system"] == "splitspec_off"
    served = systems["splitspec_k2"]
    assert served["median_mean_step_ms"] > 0 and served["median_mean_forward_ms"] > 0
    assert 0 <= served["exposed_fraction_of_step"] < 1
    b = greedy["bound"]
    assert b["plain_forward_ms"] > 0 and [r["k"] for r in b["per_k"]] == [1, 2]
    for r in b["per_k"]:
        assert 0 <= r["per_token_acceptance"] <= 1
        assert 1 <= r["expected_tokens_per_step"] <= r["k"] + 1
        assert r["bound"] > 0 and r["textbook"] > 0 and r["step_cost_vs_plain"] > 0
        assert math.isclose(r["bound"], r["expected_tokens_per_step"] / r["step_cost_vs_plain"], rel_tol=0.01)
        assert r["served_fraction_of_bound"] > 0
    assert set(lat["temperatures"]["0.8"]["systems"]) >= {"splitspec_default", "splitspec_k2", "reference_k2"}

    # --- per-step time breakdown
    bd = breakdown.run(breakdown.parse(["--dtype", "float32", "--prompts", "1", "--max-tokens", str(TOKENS),
                                        "--ks", "1,2", "--default-k", "2", "--out", str(out)]), urls=bench_urls)
    (out / "breakdown.json").write_text(json.dumps(bd))
    assert set(bd["per_config"]) == {"default", "k1", "k2"} and set(bd["workloads"]) == {"humaneval", "held-out"}
    assert bd["per_config"] == bd["workloads"]["humaneval"]["per_config"] and bd["heads"] is None  # no head app here
    for w in bd["workloads"].values():
        assert set(w["per_config"]) == {"default", "k1", "k2"} and w["workload"]["prompts"] == 1
        assert all(0 <= e["pre_draft_hidden_share"] <= 1 and e["draft_engine_ms"] <= e["draft_ms"] + 1e-3
                   for e in w["per_config"].values())
    for name, e in bd["per_config"].items():
        assert e["step_ms"] > 0 and e["verify_forward_ms"] > 0, name
        assert all(e[c] >= 0 for c in breakdown.COMPONENTS), name
        assert e["draft_ms"] + e["verify_forward_ms"] <= e["step_ms"] * 1.01, name
        assert 0 <= e["exposed_fraction"] < 1 and e["ms_per_token"] > 0, name

    # --- load: two concurrency levels, speculation on and off
    # (two rounds: each mode's figures pool both, the ratio is the median of the rounds')
    ld = load.run(load.parse(["--dtype", "float32", "--concurrency", "1,2", "--min-requests", "2", "--prompts", "2",
                              "--max-tokens", str(TOKENS), "--default-k", "2", "--rounds", "2", "--out", str(out)]),
                  url=bench_urls["adaptive"])
    (out / "load.json").write_text(json.dumps(ld))
    assert [lv["concurrency"] for lv in ld["levels"]] == [1, 2]
    for lv in ld["levels"]:
        assert len(lv["round_ratios_on_vs_off"]) == 2
        assert lv["throughput_ratio_on_vs_off"] == pytest.approx(sum(lv["round_ratios_on_vs_off"]) / 2, abs=1e-3)
        for mode in ("spec_on", "spec_off"):
            e = lv[mode]
            assert e["requests"] == 4 and e["output_tokens"] == 4 * TOKENS, (lv["concurrency"], mode)
            assert e["throughput_tok_s"] > 0
            assert 0 < e["ttft_ms_p50"] <= e["ttft_ms_p99"]
            assert 0 <= e["itl_ms_p50"] <= e["itl_ms_p99"]
        assert lv["spec_off"]["mean_k"] == 0 and lv["spec_on"]["tokens_per_chunk"] >= 1
        assert lv["throughput_ratio_on_vs_off"] > 0

    assert set(lat["workloads"]) == set(ld["workloads"]) == {"humaneval", "held-out"}
    assert lat["temperatures"] == lat["workloads"]["humaneval"]["temperatures"]
    assert ld["levels"] == ld["workloads"]["humaneval"]["levels"]
    assert lat["workloads"]["humaneval"]["workload"]["task_ids"][0].startswith("HumanEval/")

    # --- acceptance through the running server: its drafter, from the responses' speculation blocks
    from bench import acceptance

    acc = acceptance.run(acceptance.parse(["--url", bench_urls["fixed"], "--workload", "humaneval", "--prompts", "2",
                                           "--max-tokens", str(TOKENS), "--k-max", "2", "--temperatures", "0",
                                           "--out", str(out)]))
    (row,) = acc["results"]
    assert acc["source"] == "server" and row["drafter"] == "server" and row["num_drafts"] > 0
    assert sum(row["accepted_length_counts"]) == row["num_drafts"] and len(row["mean_acceptance_length_by_k"]) == 2
    assert 1 <= row["mean_acceptance_length_by_k"][0] <= row["mean_acceptance_length_by_k"][1] <= 3
    (out / "acceptance.json").write_text(json.dumps(acc))

    # --- report: cost from the measured throughput, results.json, report.md
    merged = report.render(out, verifier_price=3.0, drafter_price=1.0)
    co = json.loads((out / "cost.json").read_text())
    assert set(co["workloads"]) == {"humaneval", "held-out"} and co["workloads"]["humaneval"]["levels"] == co["levels"]
    for r, lv in zip(co["levels"], ld["levels"]):
        assert math.isclose(r["usd_per_m_tokens_on"], 4.0 / (lv["spec_on"]["throughput_tok_s"] * 3600) * 1e6,
                            rel_tol=1e-3)
        assert math.isclose(r["usd_per_m_tokens_off"], 3.0 / (lv["spec_off"]["throughput_tok_s"] * 3600) * 1e6,
                            rel_tol=1e-3)
    assert set(merged) >= {"latency", "breakdown", "load", "cost"} and "goals" not in merged
    assert json.loads((out / "results.json").read_text())["cost"] == co
    m = json.loads((out / "meta.json").read_text())
    assert m["machine"] == machine_slug() and m["dtype"] == "float32" and m["torch_threads_per_engine"] == 1
    assert m["cpu_flags"] == cpu_info()["flags"] and m["commit"] not in (None, "unknown")
    assert set(m["commands"]) == {"latency", "breakdown", "load", "acceptance"}
    md = (out / "report.md").read_text()
    assert md.startswith(f"# splitspec benchmark report: {machine_slug()}")
    for heading in ("## Per workload", "## Acceptance per workload", "## Single-stream latency",
                    "Zero-overhead bound", "## Where the time goes", "## Load", "## Cost per million output tokens"):
        assert heading in md, heading
    assert "## Goals" not in md  # measurements and bounds only: goals are the decision records'


@pytest.mark.long  # four apps deployed
def test_ab_serves_two_checkouts_side_by_side_and_pairs_their_runs(ray_cluster, tmp_path):
    """``bench.ab`` against this very checkout: both sides run the same code, so greedy tokens match
    and every run is paired; the working directory is given back."""
    from bench import ab
    from bench.common import ROOT

    cwd = os.getcwd()
    res = ab.run(ab.parse(["--old", str(ROOT), "--systems", "k2,default", "--prompts", "1", "--repeats", "2",
                           "--workload", "humaneval", "--max-tokens", str(TOKENS), "--dtype", "float32",
                           "--out", str(tmp_path)]))
    assert os.getcwd() == cwd
    assert [t.split("/")[0] for t in res["workload"]["task_ids"]] == ["HumanEval"]
    assert set(res["summary"]) == {"k2", "default"} and res["commits"]["old"] == res["commits"]["new"]
    for s, e in res["summary"].items():
        assert e["runs"] == 2 and e["same_tokens"] is True, s
        assert e["new_over_old_paired"] > 0 and e["old_ms_per_token"] > 0, s
        # the per-step means, paired like ms/token (fixed k = 2 speculates every step)
        assert s != "k2" or e["mean_forward_ms_new_over_old_paired"] > 0, e
    assert [r["pair"] for r in res["runs"]["k2-old"]] == [[0, 0], [1, 0]]
    assert all(r["num_drafts"] > 0 and r["mean_step_ms"] >= r["mean_forward_ms"] > 0 for r in res["runs"]["k2-new"])


@pytest.mark.long  # a served app
def test_ab_pairs_a_running_servers_systems_on_it(bench_urls, tmp_path):
    """``bench.ab --url``: one running server, its systems paired with each other on it, speculation off as
    ``num_speculative_tokens: 0`` on the same replicas."""
    from bench import ab

    res = ab.run(ab.parse(["--url", bench_urls["fixed"], "--systems", "k2,off", "--workload", "humaneval",
                           "--prompts", "1", "--repeats", "2", "--max-tokens", str(TOKENS), "--temperature", "0,0.8",
                           "--out", str(tmp_path)]))
    assert set(res["summary"]) == {"k2@T0", "off@T0", "k2@T0.8", "off@T0.8"} and set(res["commits"]) == {"served"}
    for s, e in res["summary"].items():
        assert e["runs"] == 2 and e["ms_per_token"] > 0 and e["off_over"]["served"] > 0, s
    assert all(r["num_drafts"] > 0 for r in res["runs"]["k2@T0-served"])


@pytest.mark.long  # four apps deployed
def test_ab_pairs_waves_of_streams(ray_cluster, tmp_path):
    """``bench.ab --streams 3``: each version runs waves of 3 concurrent requests, paired per wave; ``off_over``
    is each version's speed over speculation off."""
    from bench import ab
    from bench.common import ROOT

    res = ab.run(ab.parse(["--old", str(ROOT), "--systems", "k2,off", "--streams", "3", "--prompts", "2",
                           "--repeats", "2", "--max-tokens", str(TOKENS), "--dtype", "float32",
                           "--out", str(tmp_path)]))
    for s, e in res["summary"].items():
        assert e["runs"] == 2 and e["wave_ms_per_token_new_over_old_paired"] > 0, s
    for v in ("old", "new"):
        assert res["summary"]["k2"]["off_over"][v] > 0 and res["summary"]["off"]["off_over"][v] == 1.0
        for r in res["runs"][f"k2-{v}"]:
            assert r["tokens"] == 3 * TOKENS and r["wave_ms_per_token"] < r["ms_per_token"], r
            assert int(max(r["steps_by_k"], key=int)) == 2 and r["mean_draft_ms"] > 0, r
        assert all(set(r["steps_by_k"]) == {"0"} for r in res["runs"][f"off-{v}"])
    with pytest.raises(SystemExit):
        ab.parse(["--old", str(ROOT), "--streams", "0"])


@pytest.mark.slow
def test_vllm_peer_smoke():
    """vLLM, plain and with draft-model speculation, answers through the peer protocol with the
    reference loop's greedy tokens (slow: each engine takes minutes to start on a CPU)."""
    from transformers import AutoTokenizer

    from bench import workloads
    from bench.common import TARGET, vllm_python
    from bench.inproc import Reference
    from bench.vllm import VllmPeer

    py = vllm_python()
    if py is None:
        pytest.skip("vllm not importable")
    (_, ids), = workloads.load(workloads.HELD_OUT, 1, AutoTokenizer.from_pretrained(TARGET)).prompts
    want = Reference(1, "float32").run(ids, TOKENS, 0.0, 1, 0)["output_ids"]
    for k in (0, 2):
        peer = VllmPeer(py, k, 1, dtype="float32")
        try:
            r = peer.run(ids, TOKENS, 0.0, 1)
        finally:
            peer.close()
        assert r["tokens"] == TOKENS and r["wall_s"] > 0
        assert r["output_ids"] == want, k
        if k:
            assert r["spec"]["spec_decode_num_draft_tokens"] > 0


@pytest.mark.long  # the GPU kit's every phase, on CPU at tiny shapes
def test_gpu_kit_runs_at_tiny_shapes_without_the_serving_stack(tmp_path):
    """bench.gpu at tiny shapes on the CPU, in a process where ray, pydantic, vllm, fastapi and yaml
    cannot be imported (the GPU machine has torch and transformers, which brings yaml): it prints its
    table and its oracle drafter lands near the acceptance it was set to."""
    import subprocess
    import sys

    from tests.test_layers import ROOT
    blocked = ("ray", "fastapi", "starlette", "pydantic", "vllm")

    probe = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
from bench import gpu
gpu.main(["--shapes", "tiny", "--device", "cpu", "--dtype", "float32", "--acceptance", "0.6,0.8", "--ks", "2,4",
          "--tokens", "48", "--repeats", "1", "--out", {str(tmp_path)!r}])
"""
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "plain decoding" in out.stdout and "ratio" in out.stdout
    r = json.loads((tmp_path / "gpu.json").read_text())
    assert [f["forward"] for f in r["by_forward"]] == ["compact", "transformers"]
    for f in r["by_forward"]:
        assert f["plain_ms_per_token"] > 0
        assert [(row["a_set"], row["k"]) for row in f["rows"]] == [(0.6, 2), (0.6, 4), (0.8, 2), (0.8, 4)]
        for row in f["rows"]:
            assert abs(row["a_measured"] - row["a_set"]) < 0.25, row
            assert row["bound_ms_per_token"] > 0 and row["ratio_to_bound"] > 0
            assert 1 <= row["tokens_per_step"] <= row["k"] + 1
            assert row["same_tokens_as_plain"] is True  # float32: greedy speculation is the target's greedy
    # what the planner plans with, in the same run: the device's probes and every forward's engine terms
    assert r["probes"]["flops"] > 0 and len(r["probes"]["bandwidth"]) == 2
    for f in r["by_forward"]:
        et = f["engine_terms"]
        assert list(et["verify_ms_by_width"]) == ["1", "2", "3", "4", "5"]
        assert list(et["draft_ms_by_k"]) == ["1", "2", "3", "4"]


CPUINFO = """processor\t: 0
vendor_id\t: {vendor}
model name\t: {model}
flags\t\t: fpu sse2 {flags}

processor\t: 1
model name\t: another
"""


@pytest.mark.parametrize("model,flags,slug", [
    ("AMD EPYC 7B13 64-Core Processor", "avx2 fma", "amd-epyc-avx2"),
    ("AMD EPYC 9B14 96-Core Processor", "avx2 fma avx512f avx512_bf16", "amd-epyc-avx512bf16"),
    ("Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", "avx2 avx512f avx512_bf16 amx_bf16 amx_tile", "intel-xeon-amx"),
    ("Intel(R) Xeon(R) Processor", "avx2 avx512f", "intel-xeon-avx512"),
    ("Intel(R) Core(TM) i7-8700 CPU @ 3.20GHz", "sse4_2", "intel-core"),
])
def test_machine_slug_names_the_cpu_line_and_the_widest_instruction_set_the_kernels_use(model, flags, slug):
    info = cpu_info(CPUINFO.format(vendor="v", model=model, flags=flags))
    assert info["model"] == model and set(info["flags"]) <= set(flags.split())
    assert machine_slug(info) == slug


def test_published_results_hold_one_current_report_per_machine(tmp_path):
    """bench/results/ holds machine folders only, each with its meta.json (named like the folder), and
    its report.md is what bench.report renders from the folder's own JSON today; so is a scenario's
    report in a folder of its own inside (``make bench-policy``: policy/)."""
    from bench import report

    machines = sorted(PUBLISHED.iterdir())
    assert machines and all(f.is_dir() for f in machines), machines
    folders = [f for machine in machines for f in [machine, *sorted(d for d in machine.iterdir() if d.is_dir())]]
    for folder in folders:
        m = json.loads((folder / "meta.json").read_text())
        assert m["machine"] == (folder.name if folder.parent == PUBLISHED else folder.parent.name)
        for key in ("commit", "date", "dtype", "torch_threads_per_engine", "cpu_flags", "host_cpus"):
            assert m.get(key) not in (None, "unknown"), (folder.name, key)
        copy = tmp_path / folder.relative_to(PUBLISHED)
        copy.mkdir()
        for f in folder.iterdir():
            if f.suffix == ".json" and f.name != "results.json":
                shutil.copy(f, copy / f.name)
        report.render(copy)
        assert (copy / "report.md").read_text() == (folder / "report.md").read_text(), folder.name
        assert json.loads((copy / "meta.json").read_text()) == m
        # a meta.json of another run lends nothing: the flags are then the figures' own record, or unknown
        recorded = any("cpu_flags" in (d.get("environment") or {}) for d in report.load_all(copy).values())
        (copy / "meta.json").write_text(json.dumps({**m, "date": "another run"}))
        report.render(copy)
        assert json.loads((copy / "meta.json").read_text())["cpu_flags"] == (m["cpu_flags"] if recorded else "unknown")


@pytest.mark.long  # two vLLM engines, one after the other
def test_vllm_eagle3_measures_both_drafters_and_leaves_the_model_card_alone(tmp_path):
    from bench import vllm
    from bench.common import EAGLE3, vllm_python

    if vllm_python() is None:
        pytest.skip("vllm not importable")
    card = (Path(EAGLE3) / "acceptance.json").read_text()
    r = vllm.main(["eagle3", "--prompts", "1", "--max-tokens", str(TOKENS), "--out", str(tmp_path)])
    assert set(r) == {"eagle3", "draft_model"}
    for e in r.values():
        assert e["num_drafts"] > 0 and 0 <= e["acceptance_rate"] <= 1 and 1 <= e["mean_acceptance_length"] <= 5
    assert (Path(EAGLE3) / "acceptance.json").read_text() == card
    assert json.loads((tmp_path / "vllm_eagle3.json").read_text())["drafters"] == r


# ------------------------------------------------------------------ acceptance on a workload (bench.acceptance)
def test_acceptance_figures_from_step_records():
    from bench.acceptance import records_from_counts, summarise

    # k_max 4: steps that accepted 0, 2, 4 and 4 drafts; one that drafted 2 and accepted 1; one without drafts
    s = summarise([(4, 0), (4, 2), (4, 4), (4, 4), (2, 1), (0, 0)], 4)
    assert s["steps"] == 6 and s["num_drafts"] == 5 and s["num_draft_tokens"] == 18 and s["num_accepted_tokens"] == 11
    assert s["accepted_length_counts"] == [1, 1, 1, 0, 2]
    assert sum(s["accepted_length_distribution"]) == pytest.approx(1.0)
    assert s["per_position_acceptance_rate"] == [0.8, 0.6, 0.4, 0.4]
    # position 3 is tested by the steps that drafted it with both earlier drafts accepted: three of the k = 4 steps
    assert s["conditional_acceptance"][2] == pytest.approx(2 / 3, abs=1e-4)
    e = s["mean_acceptance_length_by_k"]
    assert e == [pytest.approx(1 + x / 5, abs=1e-4) for x in (4, 7, 9, 11)] and e == sorted(e)
    assert s["tokens_per_step_by_k"][-1] == pytest.approx(1 + 11 / 6, abs=1e-4)
    # a response's counts give back the distribution of a fixed-k run
    spec = {"num_drafts": 4, "accepted_per_pos": [3, 3, 2, 2], "steps": 5}
    recs = records_from_counts(spec, 4)
    assert sorted(recs) == [(0, 0), (4, 0), (4, 2), (4, 4), (4, 4)]
    assert summarise(recs, 4)["per_position_acceptance_rate"] == [0.75, 0.75, 0.5, 0.5]


@pytest.mark.heavy  # two drafters x two workloads x two temperatures through the real engines, tens of seconds
def test_acceptance_in_process_measures_each_drafter_and_workload(tmp_path):
    """The real engines through the loop: the JSON's shape, and at k = k-max the curve's last point is
    the length measured by a run at that k (the same steps: one generation, run twice)."""
    from bench import acceptance

    args = acceptance.parse(["--workload", "humaneval,held-out", "--prompts", "1", "--max-tokens", "24",
                             "--drafters", "draft_model,ngram", "--k-max", "3", "--measure-ks", "3",
                             "--temperatures", "0,0.8", "--dtype", "float32", "--out", str(tmp_path)])
    data = acceptance.run(args)
    rows = data["results"]
    assert [(r["drafter"], r["workload"], r["temperature"]) for r in rows] == [
        (d, w, t) for d in ("draft_model", "ngram") for w in ("humaneval", "held-out") for t in (0.0, 0.8)]
    assert set(data["workloads"]) == {"humaneval", "held-out"}
    for r in rows:
        assert len(r["per_position_acceptance_rate"]) == 3 and len(r["accepted_length_distribution"]) == 4
        e = r["mean_acceptance_length_by_k"]
        assert 1 <= e[0] <= e[1] <= e[2] <= 4
        t = r["tokens_per_step_by_k"]
        assert 1 <= t[0] <= t[1] <= t[2] <= e[2]  # every step counted, those without drafts as one token
        pos = r["per_position_acceptance_rate"]
        assert all(0 <= x <= 1 for x in pos) and pos == sorted(pos, reverse=True)  # accepting i needs i - 1
        assert all(x is None or 0 <= x <= 1 for x in r["conditional_acceptance"])
        assert sum(r["accepted_length_distribution"]) == pytest.approx(1.0, abs=1e-3)
        assert 0 <= r["acceptance_rate"] <= 1 and 0 <= r["per_token_acceptance"] <= 1
        assert r["num_drafts"] > 0 and sum(r["accepted_length_counts"]) == r["num_drafts"]
        if r["temperature"] == 0:
            assert r["measured_mean_acceptance_length"]["3"] == e[2]


@pytest.mark.heavy  # the real engines, three model choices: tens of seconds
def test_acceptance_measures_the_users_own_models_and_says_how_many_prompts(tmp_path, capsys):
    """``--verifier`` and ``--drafter`` (any drafter method, told apart by its config) or ``--config`` (a serve
    config's sections): the rows name the models measured and how many prompts each used."""
    from bench import acceptance
    from bench.common import EAGLE3, ROOT, TARGET

    common = ["--workload", "humaneval", "--prompts", "2", "--max-tokens", "12", "--k-max", "2", "--measure-ks", "2",
              "--temperatures", "0", "--dtype", "float32", "--out", str(tmp_path)]
    data = acceptance.run(acceptance.parse(["--verifier", TARGET, "--drafter", EAGLE3, "--drafter", "ngram", *common]))
    assert [r["drafter"] for r in data["results"]] == ["eagle3: tiny-code-eagle3", "ngram"]
    assert data["config"]["target"] == TARGET and all(r["prompts"] == 2 for r in data["results"])
    assert all(r["num_drafts"] > 0 for r in data["results"])
    assert "humaneval: 2 of 164 prompts" in capsys.readouterr().err
    # a serve config: the Serve YAML's application args, model paths as it names them
    config = tmp_path / "serve.yaml"
    config.write_text((ROOT / "serve_config.yaml").read_text().replace("models/", f"{ROOT}/models/"))
    data = acceptance.run(acceptance.parse(["--config", str(config), *common]))
    (row,) = data["results"]
    assert row["drafter"] == "draft_model: tiny-code-drafter" and data["config"]["target"] == TARGET
    assert row["num_drafts"] > 0 and row["prompts"] == 2
    with pytest.raises(SystemExit):
        acceptance.parse(["--config", str(config), "--drafter", "ngram"])
