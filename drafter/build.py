"""The drafter engine of a drafter config: the one place the drafter pool, the in-process CLI and the
benchmarks build one, from its method's record (``drafter.registry``; each engine imported only when its
method is asked for)."""

from __future__ import annotations

from core.registry import load
from drafter.registry import method


def build_drafter(config):
    """The engine of ``config`` (any registered method's config class): ``Method.drafter(config)``."""
    return load(method(config.method).drafter)(config)
