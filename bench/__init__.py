"""Benchmarks: single-stream latency against the peers, where a speculative step's time
goes, throughput and latency under load, and cost per million tokens.

Each scenario is a CLI (``python -m bench.latency`` ... ``python -m bench.report``) that
writes ``<out>/<scenario>.json``; ``bench.report`` renders them all into ``report.md``,
``results.json`` and PNG plots. ``make bench`` runs everything at the documented sizes.
"""
