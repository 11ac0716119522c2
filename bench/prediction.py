"""Predicted outputs served: chat requests with the client's ``prediction`` against the same
requests without one, one stream, greedy, the shipped pair.

The edit scenario Predicted Outputs exists for: the client knows most of the answer. For each
prompt the plain response is generated first; then the same request runs with no prediction, with
that response as the prediction (exact), with one line in four of it changed (edited), and with an
unrelated text (wrong), interleaved, the order rotated per repeat. The served app runs the shipped
default policy. Outputs must equal the plain response (the lossless guarantee); ms/token are
medians of paired ratios against no prediction.

    python -m bench.prediction [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from bench.common import (
    BENCH_DTYPE,
    DEFAULT_OUT,
    TARGET,
    app_args,
    environment,
    load_prompts,
    log,
    serving,
    set_threads,
    speculation,
    write_json,
)

VARIANTS = ("none", "exact", "edited", "wrong")


def edited(text: str) -> str:
    """One line in four changed (a name appended), as an edit request would change them."""
    lines = text.split("\n")
    return "\n".join(line + " edited" if i % 4 == 1 else line for i, line in enumerate(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default=BENCH_DTYPE)
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    import httpx
    from transformers import AutoTokenizer

    set_threads(args.threads)
    tok = AutoTokenizer.from_pretrained(TARGET)
    prompts = [text for text, _ in load_prompts(args.prompts, tok)]
    wrong = "import os\nimport sys\n\n\ndef main():\n    return 0\n" * 8
    rows = {v: [] for v in VARIANTS}
    mismatches = 0
    with serving({"default": app_args(args.threads, "adaptive", dtype=args.dtype)}, args.threads) as urls, \
            httpx.Client(timeout=600) as client:
        url = urls["default"] + "/v1/chat/completions"

        def chat(text, prediction=None):
            body = {"model": "tiny-code", "messages": [{"role": "user", "content": text}], "temperature": 0,
                    "max_tokens": args.max_tokens, "ignore_eos": True}
            if prediction is not None:
                body["prediction"] = {"type": "content", "content": prediction}
            t0 = time.perf_counter()
            r = client.post(url, json=body)
            dt = time.perf_counter() - t0
            r.raise_for_status()
            data = r.json()
            return dt, data

        plain = [chat(p)[1]["choices"][0]["message"]["content"] for p in prompts]  # (also warms the app)
        predictions = {"none": [None] * len(prompts), "exact": plain, "edited": [edited(t) for t in plain],
                       "wrong": [wrong] * len(prompts)}
        for r in range(args.repeats):
            for i, p in enumerate(prompts):
                order = VARIANTS[r % 4:] + VARIANTS[:r % 4]
                for v in order:
                    dt, data = chat(p, predictions[v][i])
                    out = data["choices"][0]["message"]["content"]
                    mismatches += out != plain[i]
                    n = data["usage"]["completion_tokens"]
                    details = data["usage"].get("completion_tokens_details") or {}
                    spec = speculation(data) or {}
                    rows[v].append({"prompt": i, "repeat": r, "ms_per_token": 1000 * dt / n, "tokens": n,
                                    "accepted_prediction_tokens": details.get("accepted_prediction_tokens"),
                                    "rejected_prediction_tokens": details.get("rejected_prediction_tokens"),
                                    "mean_acceptance_length": spec.get("mean_acceptance_length")})
    summary = {}
    for v in VARIANTS:
        ratio = statistics.median(a["ms_per_token"] / b["ms_per_token"] for a, b in zip(rows[v], rows["none"]))
        acc = [x["accepted_prediction_tokens"] for x in rows[v] if x["accepted_prediction_tokens"] is not None]
        rej = [x["rejected_prediction_tokens"] for x in rows[v] if x["rejected_prediction_tokens"] is not None]
        summary[v] = {"ms_per_token": round(statistics.median(x["ms_per_token"] for x in rows[v]), 3),
                      "vs_none": round(ratio, 3),
                      "accepted_prediction_tokens": round(statistics.mean(acc), 1) if acc else None,
                      "rejected_prediction_tokens": round(statistics.mean(rej), 1) if rej else None}
        log(f"{v:7s} {summary[v]}")
    log(f"outputs different from the plain response: {mismatches}")
    write_json(Path(args.out), "prediction", {"summary": summary, "mismatches": mismatches, "rows": rows,
                                                     "args": vars(args), "environment": environment(args.threads)})
    return 1 if mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
