"""vLLM's metric families on GET /metrics and vLLM's per-request ``metrics.speculative_decoding``:
definitions checked against the installed vLLM, the router replicas' counts added up once, and the
figures equal to the responses' ``speculation`` blocks, as Speculators' evaluation script reads them."""

import asyncio
import inspect

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from core.protocol import StepInfo
from core.stats import RequestStats
from deployments.vllm_metrics import COUNTERS, GAUGES, HISTOGRAMS, PER_POS, Exporter, MetricsHub
from tests.test_metrics_cancel import scrape, wait_for

VLLM_FAMILIES = {**{n: "counter" for n in COUNTERS}, PER_POS[0]: "counter", **{n: "gauge" for n in GAUGES},
                 **{n: "histogram" for n in HISTOGRAMS}}


def test_families_are_vllms_own():
    """Names, help texts, buckets and labels as vLLM 0.32 defines them (its source, installed here)."""
    import vllm.v1.metrics.buckets as vb
    import vllm.v1.metrics.loggers as vl
    import vllm.v1.spec_decode.metrics as vs

    assert HISTOGRAMS["vllm:time_to_first_token_seconds"][1] == vb.TIME_TO_FIRST_TOKEN_BUCKETS
    assert HISTOGRAMS["vllm:inter_token_latency_seconds"][1] == vb.INTER_TOKEN_LATENCY_BUCKETS
    assert HISTOGRAMS["vllm:e2e_request_latency_seconds"][1] == vb.REQUEST_LATENCY_BUCKETS
    src = inspect.getsource(vl) + inspect.getsource(vs)
    assert 'labelnames = ["model_name", "engine"]' in src
    flat = " ".join(src.split()).replace('( "', '("').replace('" )', '")')
    docs = {**COUNTERS, **GAUGES, PER_POS[0]: PER_POS[1], **{n: d for n, (d, _) in HISTOGRAMS.items()}}
    for name, doc in docs.items():
        assert f'"{name}"' in src, name
        assert doc in flat, (name, doc)


class _Handle:
    """A hub in this process, called as the router calls its Serve handle (``hub.record.remote``)."""

    def __init__(self, hub):
        self.record = type("M", (), {"remote": staticmethod(hub.record)})


def _parse(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_router_replicas_counts_add_up_once():
    hub = MetricsHub("m", 2)
    a, b = Exporter("m", 2, _Handle(hub), "a"), Exporter("m", 2, _Handle(hub), "b")
    ca, cb, cb2 = a.choice(5), b.choice(7), b.choice(3)
    ca.step(StepInfo(k=2, accepted=1), 2, 0.0)
    ca.step(StepInfo(k=2, accepted=2, pre_draft="hit", batch_size=3), 3, 0.05)
    cb.step(StepInfo(k=2, accepted=0), 1, 0.0)
    ca.end()
    cb.end()
    b.flush(force=True)  # cb2 still waiting on replica b
    fams = _parse(hub.exposition().decode())

    def value(name, **labels):
        return sum(s.value for s in fams[name].samples if all(s.labels.get(k) == v for k, v in labels.items())
                   and s.name == fams[name].name + ("_total" if fams[name].type == "counter" else ""))

    assert value("vllm:spec_decode_num_drafts") == 3
    assert value("vllm:spec_decode_num_draft_tokens") == 6
    assert value("vllm:spec_decode_num_accepted_tokens") == 3
    assert value("vllm:spec_decode_num_accepted_tokens_per_pos", position="0") == 2
    assert value("vllm:spec_decode_num_accepted_tokens_per_pos", position="1") == 1
    assert value("vllm:prompt_tokens") == 12 and value("vllm:generation_tokens") == 6
    assert value("vllm:num_requests_waiting") == 1 and value("vllm:num_requests_running") == 0
    ttft = {s.name: s.value for s in fams["vllm:time_to_first_token_seconds"].samples}
    assert ttft["vllm:time_to_first_token_seconds_count"] == 2
    itl = [s for s in fams["vllm:inter_token_latency_seconds"].samples if s.labels.get("le") == "0.075"]
    assert itl[0].value == 1  # the one step after a first token, 0.05 s
    assert value("splitspec:steps_by_k", k="2") == 3 and value("splitspec:pre_drafts", outcome="hit") == 1
    batch = {s.labels.get("le"): s.value for s in fams["splitspec:verify_batch_size"].samples if "le" in s.labels}
    assert (batch["2.0"], batch["4.0"]) == (2, 3)
    cb2.end()
    assert _parse(hub.exposition().decode())["vllm:num_requests_waiting"].samples[0].value == 0


def test_speculative_decoding_block_is_vllms():
    """The per-request block computed as vLLM's own ``RequestSpecDecodeMetrics`` does, on the same steps."""
    from vllm.entrypoints.generate.base.protocol import SpeculativeDecodingMetrics
    from vllm.v1.metrics.stats import RequestSpecDecodeMetrics

    steps = [(4, 2), (4, 4), (0, 0), (3, 0), (4, 1), (2, 2)]
    stats, ref = RequestStats(4), RequestSpecDecodeMetrics.new(4)
    for k, acc in steps:
        stats.record(StepInfo(k=k, accepted=acc), 0.01, 1)
        if k:
            ref.observe(k, acc, detailed=True)
    assert stats.speculative_decoding(detailed=True) == ref.to_dict()
    summary = stats.speculative_decoding()
    assert set(summary) == {n for n, f in SpeculativeDecodingMetrics.model_fields.items() if f.is_required()}
    assert summary["num_spec_steps"] == 5 and summary["num_draft_tokens"] == 17


# ------------------------------------------------------------------------------ served


def _speculators_acceptance(before: str, after: str) -> dict:
    """Speculators' evaluation path, reimplemented: vllm-project/speculators,
    examples/evaluate/perf-benchmark/scripts/get_acceptance_rate.py (``parse_prometheus``, ``delta_metrics``,
    ``extract_acceptance``): the ``vllm:spec_decode_*_total`` samples summed over their labels, before and
    after the traffic; acceptance rate = accepted / draft tokens, mean accepted = 1 + accepted / drafts,
    per position = accepted at it / drafts, each rounded to 4 places."""
    wanted = {"vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
              "vllm:spec_decode_num_accepted_tokens_total"}
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos"

    def parse(text):
        out = {}
        for line in text.splitlines():
            if line.startswith("#") or len(line.split()) < 2:
                continue
            full = line.split()[0]
            if full.split("{")[0] in wanted or full.split("{")[0].startswith(per_pos):
                out[full] = float(line.split()[1])
        return out

    b, a = parse(before), parse(after)
    raw = {k: a.get(k, 0) - b.get(k, 0) for k in set(a) | set(b)}

    def total(bare):
        return sum(v for k, v in raw.items() if k.split("{")[0] == bare)

    drafts, draft_tokens = total("vllm:spec_decode_num_drafts_total"), total("vllm:spec_decode_num_draft_tokens_total")
    accepted = total("vllm:spec_decode_num_accepted_tokens_total")
    pos = {}
    for k, v in raw.items():
        if k.split("{")[0] == per_pos + "_total":
            p = int(k.split('position="')[1].split('"')[0])
            pos[p] = pos.get(p, 0.0) + v
    return {"acceptance_rate": round(accepted / draft_tokens, 4) if draft_tokens else 0.0,
            "mean_accepted_tokens": round(1 + accepted / drafts, 4) if drafts else 0.0,
            "per_position_acceptance": [round(pos.get(i, 0.0) / drafts, 4) for i in range(max(pos) + 1)]
            if pos and drafts else []}


async def _traffic(base: str, n_requests: int) -> list[dict]:
    """Mixed completions and chat, temperatures, streaming, drafts per step and drafters (the pool, a
    predicted output): each choice's speculation block, usage and metrics."""
    from openai import AsyncOpenAI

    client, sem = AsyncOpenAI(base_url=f"{base}/v1", api_key="none", timeout=120), asyncio.Semaphore(6)

    async def one(i):
        temp = (0.0, 0.6, 1.0)[i % 3]
        extra = {"ignore_eos": True}
        if i % 8 == 5:  # drafts the request allows: fewer, or none (speculation off)
            extra["num_speculative_tokens"] = (2, 0)[i // 8 % 2]
        common = {"max_tokens": 12 + i % 5 * 6, "temperature": temp, "seed": i, "extra_body": extra}
        n = 2 if i % 10 == 9 else 1
        async with sem:
            if i % 4 == 3:  # streamed, usage (and with it vLLM's metrics) on the last chunk
                stream = await client.completions.create(model="tiny", prompt=f"def f{i}(x):", stream=True, n=n,
                                                         stream_options={"include_usage": True}, **common)
                specs, usage, metrics = [], None, None
                async for c in stream:  # each choice's block on its last chunk
                    specs += [ch.model_extra["speculation"] for ch in c.choices
                              if (ch.model_extra or {}).get("speculation")]
                    if c.usage is not None:
                        usage, metrics = c.usage, (c.model_extra or {}).get("metrics")
                return {"specs": specs, "n": n, "prompt": usage.prompt_tokens, "out": usage.completion_tokens,
                        "metrics": metrics}
            if i % 2:
                if i % 6 == 1 and i % 8 != 5:  # drafts from a predicted output, not the drafter pool
                    extra["prediction"] = {"type": "content", "content": f"write {i} lines " * 4}
                r = await client.chat.completions.create(model="tiny", n=n, messages=[
                    {"role": "user", "content": f"write {i} lines"}], **common)
            else:
                r = await client.completions.create(model="tiny", prompt=f"class C{i}:", n=n, **common)
            return {"specs": [ch.model_extra["speculation"] for ch in r.choices], "n": n,
                    "prompt": r.usage.prompt_tokens, "out": r.usage.completion_tokens,
                    "metrics": r.model_extra.get("metrics")}

    return await asyncio.gather(*(one(i) for i in range(n_requests)))


async def _traffic_watched(base: str, n_requests: int) -> tuple[list[dict], float]:
    """The traffic, and the most requests running or waiting that /metrics showed meanwhile."""
    task, busiest = asyncio.create_task(_traffic(base, n_requests)), 0.0
    async with httpx.AsyncClient() as c:
        while not task.done():
            fams = _parse((await c.get(f"{base}/metrics", timeout=30)).text)
            busiest = max(busiest, sum(fams[n].samples[0].value for n in GAUGES))
            await asyncio.sleep(0.3)
    return await task, busiest


@pytest.mark.serve
def test_metrics_endpoint_sums_router_replicas(serve_app, tiny_model_dirs, ray_cluster):
    from tests.conftest import side_app

    target_dir, drafter_dir = tiny_model_dirs
    args = {"model_name": "tiny", "max_tokens_limit": 512, "k_policy": "fixed",
            "per_request_spec_decode_metrics": "summary",
            "verifier": {"model": str(target_dir), "dtype": "float32", "cache_budget_mb": 64, "num_threads": 1},
            "drafter": {"method": "draft_model", "model": str(drafter_dir), "dtype": "float32",
                        "num_speculative_tokens": 4, "cache_budget_mb": 32, "num_threads": 1}}
    with side_app(serve_app, "observed", args, {"Router": {"num_replicas": 2}}) as base:
        before = httpx.get(f"{base}/metrics", timeout=30).text
        results, busiest = asyncio.run(_traffic_watched(base, 36))
        assert busiest > 0  # the gauges saw requests in flight (and are back to 0 below)
        specs = [s for r in results for s in r["specs"]]
        want = {"vllm:spec_decode_num_drafts": sum(s["num_drafts"] for s in specs),
                "vllm:spec_decode_num_draft_tokens": sum(s["num_draft_tokens"] for s in specs),
                "vllm:spec_decode_num_accepted_tokens": sum(s["num_accepted_tokens"] for s in specs),
                "vllm:prompt_tokens": sum(r["prompt"] * r["n"] for r in results),
                "vllm:generation_tokens": sum(r["out"] for r in results)}
        assert len(specs) == sum(r["n"] for r in results) and want["vllm:spec_decode_num_drafts"] > 0

        def counters(text):
            fams = _parse(text)
            return {n: sum(s.value for s in fams[n].samples if s.name == n + "_total") for n in want}

        # a router replica sends its counts when a choice ends, without waiting: they land within moments
        after = wait_for(lambda: (t := httpx.get(f"{base}/metrics", timeout=30).text) and counters(t) == want and t,
                         timeout=15)
        assert after, (counters(httpx.get(f"{base}/metrics", timeout=30).text), want)
        _check_families(after, len(specs), specs)
        reps = {(x.labels["deployment"], x.labels["state"]): x.value
                for x in _parse(after)["splitspec:replicas"].samples}
        assert reps[("Router", "RUNNING")] == reps[("Router", "TARGET")] == 2, reps
        assert reps[("Metrics", "RUNNING")] == 1, reps
        # Speculators' evaluation script reads the acceptance rate the responses report
        accepted, drafted = want["vllm:spec_decode_num_accepted_tokens"], want["vllm:spec_decode_num_draft_tokens"]
        got = _speculators_acceptance(before, after)
        assert got["acceptance_rate"] == round(accepted / drafted, 4)
        assert got["mean_accepted_tokens"] == round(1 + accepted / want["vllm:spec_decode_num_drafts"], 4)
        per_pos = [sum(s["accepted_per_pos"][i] for s in specs if len(s["accepted_per_pos"]) > i)
                   for i in range(max(4, *(len(s["accepted_per_pos"]) for s in specs)))]
        while len(per_pos) > 4 and not per_pos[-1]:  # /metrics has positions 0-3 (k), and any accepted beyond
            per_pos.pop()
        assert got["per_position_acceptance"] == [round(p / want["vllm:spec_decode_num_drafts"], 4) for p in per_pos]
        _check_per_request(results)
        # both router replicas served (Ray's port, which keeps its families, counts by replica)
        routers = wait_for(lambda: len({lab.get("replica") for n, lab, _ in scrape(ray_cluster)
                                        if n == "ray_splitspec_requests_total" and lab.get("application") == "observed"
                                        and lab.get("deployment") == "Router"}) >= 2)
        assert routers, {lab.get("replica") for n, lab, _ in scrape(ray_cluster) if n == "ray_splitspec_requests_total"}


def _check_families(text: str, choices: int, specs: list[dict]):
    fams = _parse(text)
    for name, kind in VLLM_FAMILIES.items():
        assert fams[name].type == kind, name
        extra = {"position"} if name == PER_POS[0] else {"le"} if kind == "histogram" else set()
        for s in fams[name].samples:
            if not s.name.endswith(("_sum", "_count")):
                assert set(s.labels) == {"model_name", "engine"} | extra, (name, s.labels)
            assert s.labels["model_name"] == "tiny"
    samples = {(s.name, s.labels.get("le")): s.value for f in fams.values() for s in f.samples}
    assert samples[("vllm:e2e_request_latency_seconds_count", None)] == choices
    assert samples[("vllm:time_to_first_token_seconds_count", None)] == choices
    steps = sum(s["steps"] for s in specs)  # one inter-token latency per step after each choice's first
    assert samples[("vllm:inter_token_latency_seconds_count", None)] == steps - choices
    assert samples[("vllm:num_requests_running", None)] == samples[("vllm:num_requests_waiting", None)] == 0
    buckets = [s.labels["le"] for s in fams["vllm:time_to_first_token_seconds"].samples if "le" in s.labels]
    assert buckets[0] == "0.001" and buckets[-1] == "+Inf"


def _check_per_request(results: list[dict]):
    from vllm.entrypoints.generate.base.protocol import SpeculativeDecodingMetrics

    keys = {n for n, f in SpeculativeDecodingMetrics.model_fields.items() if f.is_required()}
    for r in results:
        if r["n"] > 1:  # as vLLM: the figures of one sequence only
            assert r["metrics"] is None
            continue
        m, s = r["metrics"]["speculative_decoding"], r["specs"][0]
        assert set(m) == keys
        assert (m["num_spec_steps"], m["num_draft_tokens"], m["num_accepted_draft_tokens"]) == (
            s["num_drafts"], s["num_draft_tokens"], s["num_accepted_tokens"])
        assert sum(m["acceptance_histogram"]) == s["num_drafts"] and m["num_spec_tokens"] == s["k"]
        assert round(m["mean_acceptance_length"], 4) == s["mean_acceptance_length"]
        assert round(m["draft_acceptance_rate"], 4) == s["acceptance_rate"]
        # accepted at position i or beyond: the histogram's tail
        tails = [sum(m["acceptance_histogram"][i + 1:]) for i in range(len(s["accepted_per_pos"]))]
        assert tails == s["accepted_per_pos"]
