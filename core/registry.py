"""Records looked up by name (drafter methods in ``drafter.registry``, verifier backends in ``core.backends``),
each naming its code by ``"module:attribute"`` paths that are imported only when asked for."""

from __future__ import annotations

import importlib


class Registry(dict):
    """Records by their ``name``, each registered once; ``kind`` names them in errors."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind

    def register(self, record):
        """Add a record (a name is registered once)."""
        if record.name in self:
            raise ValueError(f"{self.kind} {record.name!r} is registered twice")
        self[record.name] = record
        return record

    def named(self, name: str):
        """The record of ``name``; ``ValueError`` naming the registered ones for an unknown name."""
        try:
            return self[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}: one of {', '.join(self)}") from None


def check_paths(record, fields: tuple[str, ...], form: str = "module:attribute") -> None:
    """Each of ``record``'s ``fields`` that is set must be a ``"module:attribute"`` path."""
    for name in fields:
        path = getattr(record, name)
        if path is not None and ":" not in path:
            raise ValueError(f"{type(record).__name__} {record.name!r}: {name} {path!r} is not '{form}'")


def load(path: str):
    """The attribute ``"module:attr"`` names (the module imported now, only when asked for)."""
    module, _, attr = path.partition(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
