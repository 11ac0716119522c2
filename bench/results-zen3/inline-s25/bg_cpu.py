"""CPU time of every process while the shipped app (fixed k = 4, float32, pinned) sits idle, then while
one client streams requests back to back: who spends the two cores besides the engines."""
import json, os, sys, time
from pathlib import Path
import httpx
from transformers import AutoTokenizer
from bench.common import TARGET, app_args, complete, completion_body, load_prompts, serving

TICK = os.sysconf("SC_CLK_TCK")

def snap():
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            st = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:90]
        except OSError:
            continue
        out[int(p)] = (cmd, (int(st[11]) + int(st[12])) / TICK)
    return out

def diff(a, b, wall):
    rows = []
    for pid, (cmd, t) in b.items():
        d = t - a.get(pid, (cmd, 0.0))[1]
        if d > 0.005 * wall:
            rows.append((round(100 * d / wall, 1), pid, cmd))
    return sorted(rows, reverse=True)

prompts = load_prompts(5, AutoTokenizer.from_pretrained(TARGET))
res = {}
with serving({"k4": app_args(1, "fixed", 4, dtype="float32")}, 1) as urls, httpx.Client(timeout=600) as client:
    url = urls["k4"]
    complete(client, url, completion_body(prompts[0][1], 16, 0.0, 7, 4))
    time.sleep(5)
    a, t0 = snap(), time.time(); time.sleep(30); b = snap()
    res["idle_percent_of_a_core"] = diff(a, b, time.time() - t0)
    a, t0, n = snap(), time.time(), 0
    for rep in range(2):
        for _, ids in prompts:
            _, k, _, _ = complete(client, url, completion_body(ids, 256, 0.0, 7, 4)); n += k
    b = snap(); wall = time.time() - t0
    res["busy_percent_of_a_core"] = diff(a, b, wall)
    res["busy_wall_s"], res["busy_tokens"] = round(wall, 2), n
print(json.dumps(res, indent=1))
Path(sys.argv[1]).write_text(json.dumps(res, indent=1))
