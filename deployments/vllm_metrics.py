"""vLLM's metric families on the HTTP port's ``GET /metrics``, in vLLM's names, types, buckets and labels.

Dashboards, alerts and Speculators' evaluation scripts read a vLLM server's ``/metrics``
(``vllm:spec_decode_*``, ``vllm:time_to_first_token_seconds`` ...). The router replicas measure
what they serve (``ChoiceMeter``: one per choice, which is one engine request in vLLM's terms)
and send the sums (``Delta``) to one ``MetricsHub`` replica, which adds them up: a request runs
on one router replica, so each figure is counted once whatever the number of replicas, and any
replica's ``/metrics`` shows the deployment's totals. A router without a hub (built outside
Serve) keeps its own. Ray's metrics port keeps the ``ray_*`` families (``deployments.metrics``).

Definitions copied from vLLM 0.32 (``vllm/v1/metrics/loggers.py``, ``vllm/v1/spec_decode/metrics.py``,
``vllm/v1/metrics/buckets.py``); ``tests/test_vllm_metrics.py`` checks them against the installed vLLM.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import dataclass, field

LABELS = ("model_name", "engine")  # vLLM's; the engine is "0", as a server with one engine core

TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)

COUNTERS = {
    "vllm:spec_decode_num_drafts": "Number of spec decoding drafts.",
    "vllm:spec_decode_num_draft_tokens": "Number of draft tokens.",
    "vllm:spec_decode_num_accepted_tokens": "Number of accepted tokens.",
    "vllm:prompt_tokens": "Number of prefill tokens processed.",
    "vllm:generation_tokens": "Number of generation tokens processed.",
    "vllm:prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
}
PER_POS = ("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.")
HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": ("Histogram of time to first token in seconds.", TIME_TO_FIRST_TOKEN_BUCKETS),
    "vllm:inter_token_latency_seconds": ("Histogram of inter-token latency in seconds.", INTER_TOKEN_LATENCY_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS),
}
GAUGES = {
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
}
# splitspec's own, beside vLLM's: what the two pools did for the router's steps (same labels)
SPLITSPEC_COUNTERS = {"splitspec:degraded_steps": "Steps decoded without speculation because no drafter answered."}
SPLITSPEC_LABELED = {  # name -> (documentation, label)
    "splitspec:steps_by_k": ("Steps by the number of drafts the policy played (0: a plain step).", "k"),
    "splitspec:pre_drafts": ("Pre-drafted blocks by outcome (hit: used; miss: discarded).", "outcome"),
}
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
STEP_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SPLITSPEC_HISTOGRAMS = {
    "splitspec:verify_batch_size": ("Sequences in the verify batch of a step.", BATCH_BUCKETS),
    "splitspec:draft_seconds": ("Drafting on a speculative step's critical path (drafter pool: queue, transport and "
                                "engine; 0 on a pre-draft hit).", STEP_SECONDS_BUCKETS),
    "splitspec:draft_engine_seconds": ("Of a speculative step's drafting, the time in the drafter engine.",
                                       STEP_SECONDS_BUCKETS),
    "splitspec:verify_forward_seconds": ("The verify forward pass of a step (verifier pool).", STEP_SECONDS_BUCKETS),
}
ALL_COUNTERS = {**COUNTERS, **SPLITSPEC_COUNTERS}
ALL_HISTOGRAMS = {**HISTOGRAMS, **SPLITSPEC_HISTOGRAMS}
FLUSH_INTERVAL_S = 1.0  # a router sends its sums when a choice ends, and at most this often in between


@dataclass
class Delta:
    """Counts one router replica measured since it last sent them: counter increments, accepted
    tokens by draft position, histogram observations binned (one count per bucket, +Inf last, and
    the sum), and its gauges now (``seq`` orders its sends: the latest gauges stand)."""

    counters: dict[str, float] = field(default_factory=dict)
    per_pos: dict[int, int] = field(default_factory=dict)
    labeled: dict[tuple[str, str], int] = field(default_factory=dict)  # (name, label value) -> increment
    hist: dict[str, list] = field(default_factory=dict)  # name -> [counts per bucket..., sum]
    gauges: dict[str, int] = field(default_factory=dict)
    replica: str = ""
    seq: int = 0

    def inc(self, name: str, value: float = 1):
        self.counters[name] = self.counters.get(name, 0) + value

    def inc_labeled(self, name: str, label: str):
        self.labeled[name, label] = self.labeled.get((name, label), 0) + 1

    def observe(self, name: str, value: float):
        buckets = ALL_HISTOGRAMS[name][1]
        row = self.hist.setdefault(name, [0] * (len(buckets) + 2))
        row[bisect_left(buckets, value)] += 1  # the first bucket b with value <= b (+Inf past the last)
        row[-1] += value

    def empty(self) -> bool:
        return not (self.counters or self.per_pos or self.hist or self.labeled)


class MetricsState:
    """The deployment's totals: every router replica's deltas added, the latest gauges per replica summed."""

    def __init__(self, model_name: str, num_speculative_tokens: int = 0):
        self.model_name = model_name
        self.counters = dict.fromkeys(ALL_COUNTERS, 0.0)
        self.per_pos = dict.fromkeys(range(num_speculative_tokens), 0)  # as vLLM: every position from the start
        self.labeled: dict[tuple[str, str], int] = {("splitspec:pre_drafts", o): 0 for o in ("hit", "miss")}
        self.hist = {name: [0] * (len(b) + 2) for name, (_, b) in ALL_HISTOGRAMS.items()}
        self.replicas: dict[str, dict[str, int]] = {}  # deployment -> replica state -> count (set by the hub)
        self.gauges: dict[str, tuple[int, dict]] = {}  # replica -> (seq, gauges)

    def add(self, d: Delta):
        for name, v in d.counters.items():
            self.counters[name] += v
        for pos, v in d.per_pos.items():
            self.per_pos[pos] = self.per_pos.get(pos, 0) + v
        for key, v in d.labeled.items():
            self.labeled[key] = self.labeled.get(key, 0) + v
        for name, row in d.hist.items():
            self.hist[name] = [a + b for a, b in zip(self.hist[name], row)]
        if d.seq >= self.gauges.get(d.replica, (-1, {}))[0]:
            self.gauges[d.replica] = (d.seq, d.gauges)

    def exposition(self) -> bytes:
        """Prometheus' text format (version 0.0.4), as vLLM's ``/metrics`` writes it."""
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        return generate_latest(registry)


class _Collector:
    def __init__(self, state: MetricsState):
        self.state = state

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
        from prometheus_client.utils import floatToGoString

        s, lv = self.state, [self.state.model_name, "0"]
        for name, doc in GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=LABELS)
            g.add_metric(lv, sum(v.get(name, 0) for _, v in s.gauges.values()))
            yield g
        for name, doc in ALL_COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=LABELS)
            c.add_metric(lv, s.counters[name])
            yield c
        c = CounterMetricFamily(*PER_POS, labels=(*LABELS, "position"))
        for pos, v in sorted(s.per_pos.items()):
            c.add_metric([*lv, str(pos)], v)
        yield c
        for name, (doc, label) in SPLITSPEC_LABELED.items():
            c = CounterMetricFamily(name, doc, labels=(*LABELS, label))
            for (n, value), v in sorted(s.labeled.items()):
                if n == name:
                    c.add_metric([*lv, value], v)
            yield c
        g = GaugeMetricFamily("splitspec:replicas", "Replicas per deployment (pool) by state, as Serve reports them; "
                              "state TARGET: the number Serve's autoscaler aims at.",
                              labels=(*LABELS, "deployment", "state"))
        for dep, states in sorted(s.replicas.items()):
            for state, n in sorted(states.items()):
                g.add_metric([*lv, dep, state], n)
        yield g
        for name, (doc, bounds) in ALL_HISTOGRAMS.items():
            h, row, acc, cum = HistogramMetricFamily(name, doc, labels=LABELS), s.hist[name], 0, []
            for b, n in zip((*bounds, float("inf")), row[:-1]):
                acc += n
                cum.append((floatToGoString(b), acc))
            h.add_metric(lv, cum, sum_value=row[-1])
            yield h


class MetricsHub:
    """The Serve deployment that adds up the router replicas' deltas (one replica)."""

    def __init__(self, model_name: str, num_speculative_tokens: int = 0):
        self.state = MetricsState(model_name, num_speculative_tokens)

    def record(self, delta: Delta):
        self.state.add(delta)

    def exposition(self) -> bytes:
        self.state.replicas, live = serve_replicas()
        if live:  # a router replica that died left its last gauges: they go with it
            self.state.gauges = {r: g for r, g in self.state.gauges.items() if r in live}
        return self.state.exposition()


def serve_replicas() -> tuple[dict[str, dict[str, int]], set[str]]:
    """This app's deployments: replicas by state, and ``"TARGET"``, the number Serve (its autoscaler)
    aims at, from Serve's controller; and the ids of the replicas not stopped (nothing outside Serve)."""
    try:
        from ray import serve
        from ray.serve.context import _get_global_client

        app = serve.get_replica_context().app_name
        deps = _get_global_client().get_serve_details()["applications"][app]["deployments"]
        out, live = {}, set()
        for name, d in deps.items():
            states = out.setdefault(name, {"TARGET": d["target_num_replicas"]})
            for r in d["replicas"]:
                states[r["state"]] = states.get(r["state"], 0) + 1
                if r["state"] != "STOPPING":
                    live.add(r["replica_id"])
        return out, live
    except Exception:  # noqa: BLE001 - not in a Serve replica, or the controller is away: no replica figures
        return {}, set()


class Exporter:
    """A router replica's side: its choices' counts, sent to the hub (or kept, without one)."""

    def __init__(self, model_name: str, num_speculative_tokens: int, hub=None, replica: str = ""):
        self.hub, self.replica = hub, replica
        self.local = MetricsState(model_name, num_speculative_tokens) if hub is None else None
        self.delta, self.seq, self.flushed_at = Delta(), 0, 0.0
        self.running = self.waiting = 0

    def choice(self, prompt_len: int) -> ChoiceMeter:
        return ChoiceMeter(self, prompt_len)

    def flush(self, force: bool = False):
        now = time.monotonic()
        if not force and now - self.flushed_at < FLUSH_INTERVAL_S:
            return
        self.flushed_at, self.seq = now, self.seq + 1
        d, self.delta = self.delta, Delta()
        d.replica, d.seq = self.replica, self.seq
        d.gauges = {"vllm:num_requests_running": self.running, "vllm:num_requests_waiting": self.waiting}
        if self.local is not None:
            self.local.add(d)
            return
        try:
            self.hub.record.remote(d)  # fire and forget: deltas add up in any order
        except Exception:  # noqa: BLE001 - the hub is restarting: these counts are lost, requests are not
            pass

    async def exposition(self) -> bytes:
        self.flush(force=True)
        if self.local is not None:
            return self.local.exposition()
        return await self.hub.exposition.remote()


class ChoiceMeter:
    """One choice (vLLM: one engine request): waiting until its first token, then running; its
    tokens, speculative steps, time to first token, inter-token latencies and end-to-end time."""

    def __init__(self, exporter: Exporter, prompt_len: int):
        self.x, self.prompt_len = exporter, prompt_len
        self.t0, self.first, self.ended = time.perf_counter(), True, False
        exporter.waiting += 1

    def step(self, info, new_tokens: int, wall_s: float):
        """A step applied (``core.protocol.StepInfo``): ``new_tokens`` emitted, ``wall_s`` as the router saw it."""
        d, k, accepted = self.x.delta, info.k, info.accepted
        self.pools(info)
        if self.first:  # the prompt is processed: the choice runs (vLLM counts prompt tokens at prefill)
            self.first = False
            self.x.waiting -= 1
            self.x.running += 1
            d.inc("vllm:prompt_tokens", self.prompt_len)
            d.inc("vllm:prefix_cache_queries", self.prompt_len)
            d.inc("vllm:prefix_cache_hits", info.cached_tokens)  # read from the verifier's prefix cache
            d.observe("vllm:time_to_first_token_seconds", time.perf_counter() - self.t0)
        else:  # as vLLM: one inter-token latency per engine step, whatever the tokens it emitted
            d.observe("vllm:inter_token_latency_seconds", wall_s)
        d.inc("vllm:generation_tokens", new_tokens)
        if k:
            d.inc("vllm:spec_decode_num_drafts")
            d.inc("vllm:spec_decode_num_draft_tokens", k)
            d.inc("vllm:spec_decode_num_accepted_tokens", accepted)
            for pos in range(accepted):
                d.per_pos[pos] = d.per_pos.get(pos, 0) + 1

    def pools(self, info):
        """splitspec's own: what the policy played and what each pool took."""
        d = self.x.delta
        d.inc_labeled("splitspec:steps_by_k", str(info.k))
        d.observe("splitspec:verify_batch_size", info.batch_size)
        d.observe("splitspec:verify_forward_seconds", info.forward_s)
        if info.degraded:
            d.inc("splitspec:degraded_steps")
        if info.pre_draft is not None:
            d.inc_labeled("splitspec:pre_drafts", info.pre_draft)
        if info.k:
            d.observe("splitspec:draft_seconds", info.draft_s)
            d.observe("splitspec:draft_engine_seconds", info.draft_engine_s)

    def end(self):
        if self.ended:
            return
        self.ended = True
        if self.first:
            self.x.waiting -= 1
        else:
            self.x.running -= 1
            self.x.delta.observe("vllm:e2e_request_latency_seconds", time.perf_counter() - self.t0)
        self.x.flush(force=True)
