"""Benchmarks: eight tools (``python -m bench.<tool>``, each a ``make bench-<tool>`` target) and the libraries they
share; docs/benchmarks.md. ``make bench PUBLISH=1`` writes ``bench/results/<machine>/``, else ``build/bench/``."""
