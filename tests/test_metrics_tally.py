"""Metric calls off the per-step path: counters summed per stream item (``Tally``), gauges set only
when their value changes. Ray's metric objects are replaced by a recorder of the calls they get."""

import pytest

import deployments.metrics as dm
from deployments.metrics import Tally


class Recorder:
    """Stands in for Ray's metric export: every ``inc``/``set`` call, in order."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, name):
        rec = self

        class Metric:
            def inc(self, value=1, tags=None):
                rec.calls.append(("inc", name, value, tags))

            def set(self, value, tags=None):
                rec.calls.append(("set", name, value, tags))

            def observe(self, value, tags=None):
                rec.calls.append(("observe", name, value, tags))

        return Metric()


@pytest.fixture
def sink(monkeypatch):
    import deployments.server

    rec = Recorder()
    for module in (dm, deployments.server):  # (the server module holds its own reference)
        monkeypatch.setattr(module, "metrics", lambda: rec)
    return rec


def test_a_tally_sends_one_sum_per_counter_and_tag_set(sink):
    t = Tally()
    for k, accepted in ((4, 2), (4, 4), (2, 0)):  # three steps of one stream item
        t.inc("num_drafts")
        t.inc("num_draft_tokens", k)
        for pos in range(accepted):
            t.inc("num_accepted_tokens_per_pos", tags={"position": str(pos)})
    assert sink.calls == []  # nothing is sent before the flush
    t.flush(5.0)
    assert sorted(sink.calls, key=str) == sorted([
        ("inc", "num_drafts", 3, None), ("inc", "num_draft_tokens", 10, None),
        ("inc", "num_accepted_tokens_per_pos", 2, {"position": "0"}),
        ("inc", "num_accepted_tokens_per_pos", 2, {"position": "1"}),
        ("inc", "num_accepted_tokens_per_pos", 1, {"position": "2"}),
        ("inc", "num_accepted_tokens_per_pos", 1, {"position": "3"})], key=str)
    assert t.flushed_at == 5.0
    t.flush(6.0)  # sent once: a second flush has nothing to send
    assert len(sink.calls) == 6


def test_a_replica_sets_a_gauge_only_when_its_value_changes(sink):
    from deployments.server import EngineServer

    class Engine:
        cached = 0

        def num_cached(self):
            return self.cached

        def run(self, requests):
            return requests

    eng = Engine()
    srv = EngineServer(eng, eng.run, 8, 100)
    for cached in (1, 1, 1, 2, 2, 0):
        eng.cached = cached
        srv._on_batch(1, 0.01)
    sets = [(name, value) for op, name, value, _ in sink.calls if op == "set"]
    assert sets == [("queue", 0), ("cached_seqs", 1), ("cached_seqs", 2), ("cached_seqs", 0)]
