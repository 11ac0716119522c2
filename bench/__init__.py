"""Benchmarks: single-stream latency against the peers and where a served step's time goes
(``latency``, ``breakdown``), throughput under load (``load``), paired A/B of two versions (``ab``),
acceptance on a workload (``acceptance``), the deployment planner (``plan``), vLLM beside splitspec
(``vllm``), the GPU kit (``gpu``) and the report (``report``, with cost per million tokens).

Each tool is a CLI (``python -m bench.<tool>``, a ``make bench-<tool>`` target, docs/benchmarks.md)
that writes ``<out>/<scenario>.json``, ``<out>`` being ``build/bench/`` unless told; ``make bench
PUBLISH=1`` writes to ``bench/results/<machine>/``, the one current report per machine kind.
``client`` (the scenario and the HTTP client), ``common``, ``inproc`` and ``workloads`` are the
libraries the tools share; ``gpu`` runs on a GPU machine with torch and transformers alone.
"""
