"""The Grafana dashboard's queries against a real Prometheus (Debian's ``prometheus``) scraping the served
app with the repo's scrape config: every panel's PromQL returns data."""

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.test_metrics_cancel import wait_for

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "configs" / "grafana" / "splitspec.json"
SCRAPE_CONFIG = ROOT / "configs" / "prometheus.yml"


def panel_queries() -> list[tuple[str, str, str]]:
    """(panel title, legend, PromQL) for every target of every panel."""
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t.get("legendFormat", ""), t["expr"]) for p in dash["panels"] for t in p["targets"]]


def test_every_panel_reads_a_family_the_app_exports():
    """Each panel's expressions name only families served on /metrics or Ray's port (``ray_`` + the name)."""
    import re

    from deployments import vllm_metrics as vm

    ours = {*vm.ALL_COUNTERS, vm.PER_POS[0], *vm.SPLITSPEC_LABELED, *vm.GAUGES, *vm.ALL_HISTOGRAMS,
            "splitspec:replicas"}
    rays = {"splitspec_queue_length", "splitspec_batch_latency_s"}  # deployments.metrics, names checked below
    queries = panel_queries()
    assert len({t for t, _, _ in queries}) >= 15
    for title, _, expr in queries:
        names = set(re.findall(r"(?:vllm|splitspec|ray_splitspec):?[a-z0-9_:]*(?=[{\[)\s]|$)", expr))
        assert names, (title, expr)
        for name in names:
            bare = re.sub(r"_(total|bucket|sum|count)$", "", name)
            assert bare in ours or bare.removeprefix("ray_") in rays, (title, name)
    src = (ROOT / "deployments" / "metrics.py").read_text()
    assert all(f'"{n}"' in src for n in rays)


def _config(tmp_path: Path, app: str, ray_metrics: str) -> Path:
    """The repo's scrape config, pointed at this test's app and Ray port, scraped every second. Ray's
    service-discovery file lives in the machine's /tmp/ray, which other Ray sessions on this machine
    rewrite: the test names its own Ray port instead."""
    cfg = yaml.safe_load(SCRAPE_CONFIG.read_text())
    cfg["global"].update(scrape_interval="1s", evaluation_interval="1s")
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    jobs["splitspec"]["static_configs"] = [{"targets": [app]}]
    jobs["ray"].pop("file_sd_configs")
    jobs["ray"]["static_configs"] = [{"targets": [ray_metrics]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _traffic(base: str, stop: threading.Event):
    from openai import OpenAI

    client, i = OpenAI(base_url=f"{base}/v1", api_key="none", timeout=120), 0
    while not stop.is_set():
        common = {"model": "tiny", "max_tokens": 16 + i % 4 * 8, "temperature": (0.0, 0.7, 1.0)[i % 3], "seed": i,
                  "extra_body": {"ignore_eos": True}}
        if i % 2:
            client.chat.completions.create(messages=[{"role": "user", "content": f"count to {i}"}], **common)
        else:
            for _ in client.completions.create(prompt=f"def g{i}(y):", stream=True, **common):
                pass
        i += 1


@pytest.mark.long
def test_every_panel_returns_data_from_prometheus(serve_app, ray_cluster, tmp_path):
    from bench.common import free_port

    prometheus = shutil.which("prometheus")
    assert prometheus, "the long tier needs Prometheus: apt-get install prometheus (Debian's package)"
    base = serve_app[0]
    app = base.removeprefix("http://")
    ray_metrics = ray_cluster.removeprefix("http://").removesuffix("/metrics")
    port = free_port()
    proc = subprocess.Popen([prometheus, f"--config.file={_config(tmp_path, app, ray_metrics)}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("w"))
    stop = threading.Event()
    sender = threading.Thread(target=_traffic, args=(base, stop), daemon=True)
    try:
        api = f"http://127.0.0.1:{port}/api/v1"
        assert wait_for(lambda: _up(api), timeout=60), (tmp_path / "prometheus.log").read_text()[-2000:]
        start = time.time()
        sender.start()
        time.sleep(25)  # a few scrapes of traffic: every rate() over its 1 m window has two samples or more
        empty = [(title, legend, expr) for title, legend, expr in panel_queries() if not _has_data(api, expr)]
        assert not empty, empty
        if os.environ.get("SPLITSPEC_DASHBOARD_PNG"):  # the picture in docs/serving.md, from these queries
            _plot(api, start, time.time(), Path(os.environ["SPLITSPEC_DASHBOARD_PNG"]))
    finally:
        stop.set()
        proc.terminate()
        proc.wait(timeout=30)
        sender.join(timeout=120)


def _up(api: str) -> bool:
    try:
        r = httpx.get(f"{api}/query", params={"query": "up"}, timeout=5).json()
    except httpx.HTTPError:
        return False
    ups = {s["metric"]["job"]: s["value"][1] for s in r["data"]["result"]}
    return ups.get("splitspec") == "1" and ups.get("ray") == "1"


def _has_data(api: str, expr: str) -> bool:
    """The expression returns at least one series with a number (not NaN: a quantile or ratio over no traffic)."""
    r = httpx.get(f"{api}/query", params={"query": expr}, timeout=10).json()
    assert r["status"] == "success", (expr, r)
    return any(s["value"][1] not in ("NaN", "+Inf", "-Inf") for s in r["data"]["result"])


def _plot(api: str, start: float, end: float, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main = ["Requests running and waiting", "Time to first token", "Inter-token latency (per step)",
            "Acceptance per position", "k played (steps per second by k)",
            "Pool utilisation (engine busy seconds per second)"]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    for ax, title in zip(axes.flat, main):
        for t, legend, expr in panel_queries():
            if t != title:
                continue
            r = httpx.get(f"{api}/query_range", params={"query": expr, "start": start, "end": end, "step": 1},
                          timeout=10).json()
            for s in r["data"]["result"]:
                label = legend.replace("{{", "{").replace("}}", "}").format(**s["metric"]) if "{{" in legend else legend
                xs = [float(x) - start for x, _ in s["values"]]
                ax.plot(xs, [float(v) for _, v in s["values"]], label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
