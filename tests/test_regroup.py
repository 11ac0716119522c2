"""Regrouping in the verifier's continuous batcher: the next batch waits briefly for the callers of the
last one that come straight back, so a split batch merges again (docs/decisions/0031-regrouping.md)."""

import asyncio
import time
from types import SimpleNamespace

from deployments.batcher import ContinuousBatcher
from tests.test_batcher import item


def _decode(regroup: float, steps: int = 30):
    """Sequences decoding plain on a batcher (a batch costs 5 ms + 1 ms a sequence): one starts alone (its
    prompt's prefill), 15 join while it runs, and each sequence queues its next step as soon as its last
    returns. -> the sizes of the batches run."""
    sizes = []

    def run(items):
        sizes.append(len(items))
        time.sleep(0.005 + 0.001 * len(items))
        return [i.name for i in items]

    async def seq(b, name, delay):
        await asyncio.sleep(delay)
        for _ in range(steps):
            await b.submit([item(name)])
            await asyncio.sleep(0)  # (the caller's own work between steps: a few turns of the event loop)
            await asyncio.sleep(0)

    async def main():
        b = ContinuousBatcher(run, 32, 100, key=lambda i: i.seq_id, regroup=regroup)
        await asyncio.gather(seq(b, "s0", 0), *(seq(b, f"s{i}", 0.002) for i in range(1, 16)))
        return b

    return sizes, asyncio.run(main())


def test_a_split_batch_of_decoding_sequences_merges_again():
    """Without regrouping, the lone first sequence and the 15 that joined while it ran take turns to the
    end (each waits out the other's batch); with it, the next batch waits for the last one's callers (up
    to a quarter of its time) and the 16 decode as one batch."""
    split, _ = _decode(0.0)
    assert split.count(16) == 0 and split.count(1) >= 25, split
    merged, b = _decode(0.25)
    assert merged.count(16) >= 27, merged
    assert b.regroups["batches"] >= 1 and b.regroups["timeouts"] <= 2, b.regroups
    assert len(merged) < len(split) - 20


def test_regrouping_waits_for_no_caller_that_ended():
    """A sequence that ended (``arrived``, as its replica's release says) is not waited for, and one that
    does not come back costs the next batch at most its share of time."""
    async def main():
        def run(items):
            time.sleep(0.02)
            return [i.name for i in items]

        b = ContinuousBatcher(run, 8, 100, key=lambda i: i.seq_id, regroup=0.25)
        await asyncio.gather(b.submit([item("a")]), b.submit([item("b")]))
        b.arrived(["a"])  # a ended; b comes back
        t0 = time.perf_counter()
        await b.submit([item("b")])
        fast = time.perf_counter() - t0
        await asyncio.sleep(0.01)  # (past the share of time b's batch is waited on)
        await asyncio.gather(b.submit([item("c")]), b.submit([item("d")]))
        t0 = time.perf_counter()
        await b.submit([item("c")])  # d never comes back: the batch waits at most 5 ms for it
        return fast, time.perf_counter() - t0, b.regroups

    fast, slow, regroups = asyncio.run(main())
    assert fast < 0.02 + 0.004 and slow < 0.02 + 0.005 + 0.004, (fast, slow)
    assert regroups["timeouts"] == 1, regroups


def _plain(name):
    return SimpleNamespace(name=name, seq_id=name, drafts=[])


def _speculating(name):
    return SimpleNamespace(name=name, seq_id=name, drafts=[1, 2])


def _drafts_none(i) -> bool:
    return not i.drafts


def test_regrouping_waits_only_for_callers_that_call_again_at_once():
    """``at_once`` names the items whose callers come straight back (a verifier's plain steps); a caller
    whose item speculated may wait on a draft first, and the next batch does not wait for it."""
    def run(items):
        time.sleep(0.02)
        return [i.name for i in items]

    async def main():
        b = ContinuousBatcher(run, 8, 100, key=lambda i: i.seq_id, regroup=0.25, at_once=_drafts_none)
        await asyncio.gather(b.submit([_plain("p")]), b.submit([_speculating("s")]))
        t0 = time.perf_counter()
        await b.submit([_plain("p")])  # s is drafting: not waited for
        return time.perf_counter() - t0, b.regroups

    took, regroups = asyncio.run(main())
    assert took < 0.024, took
    assert regroups["timeouts"] == 0, regroups
