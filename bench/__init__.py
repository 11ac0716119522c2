"""Benchmarks: the engines' forward, single-stream latency against the peers, where a speculative
step's time goes, throughput and latency under load, cost per million tokens, and the studies
behind the defaults (policy replay, pre-drafting, predicted outputs, co-runners, vLLM).

Each tool is a CLI (``python -m bench.<tool>``, a ``make bench-<tool>`` target) that writes
``<out>/<scenario>.json``, ``<out>`` being ``build/bench/`` unless told; ``bench.report``
renders the ``make bench`` scenarios into ``report.md``, ``results.json``, ``meta.json`` and PNG
plots. ``make bench PUBLISH=1`` writes to ``bench/results/<machine>/`` instead, the one current
report per machine kind (``bench.common.machine_slug``). ``common`` and ``inproc`` are the
libraries the tools share; ``gpu`` runs on a GPU machine with torch and transformers alone.
"""
