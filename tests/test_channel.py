"""The direct verifier -> drafter channel (core/channel.py), on a real TCP connection to a
real DrafterServer with the tiny drafter engine; no cluster (the served fallback when a drafter
replica dies is covered by tests/test_pools.py, whose app uses this transport by default)."""

import asyncio

import pytest

from core.protocol import DraftRequest


def _requests(tok_ids, k=4, n=1):
    from configs import SamplingParams

    return [DraftRequest(seq_id=f"s{i}", start=0, prefix=None, new_tokens=list(tok_ids[i:]) + [3, 4, 5], k=k,
                         sampling=SamplingParams(temperature=0.8), seed=7, full=True) for i in range(n)]


@pytest.fixture
def drafter_server(tiny_engines):
    from deployments.drafter import DrafterServer

    _, _, _, drafter = tiny_engines
    return DrafterServer({}, engine=drafter)


def test_calls_down_the_channel_equal_calls_through_the_server(drafter_server):
    from core.channel import ChannelClient

    async def main():
        reqs = _requests([5, 6, 7, 8, 9, 10], n=3)
        direct = await drafter_server.propose([r for r in reqs])
        for s in ("s0", "s1", "s2"):
            drafter_server.engine.release(s)
        first, ep = await drafter_server.propose_bound(reqs[:1])
        assert ep is not None and ep.port > 0
        assert first[0].tokens == direct[0].tokens
        client = ChannelClient()
        try:
            # several sequences at once share the engine's batches
            got = await asyncio.gather(*(client.call(ep, "propose", [r]) for r in reqs))
            assert [g[0].tokens for g in got] == [p.tokens for p in direct]
            assert [g[0].probs.ids for g in got] == [p.probs.ids for p in direct]
            assert drafter_server.batcher.max_seen >= 2
            # the engine's errors come back as the same exception, and the connection stays up
            with pytest.raises(KeyError):
                await client.call(ep, "no_such_method")
            assert await client.call(ep, "release", ["s0", "s1", "s2"]) == 3
        finally:
            client.close()
            drafter_server.channel.close()

    asyncio.run(main())


def test_a_wrong_token_or_a_closed_replica_is_a_connection_error(drafter_server):
    from dataclasses import replace

    from core.channel import ChannelClient

    async def main():
        ep = await drafter_server.endpoint()
        client = ChannelClient()
        with pytest.raises(ConnectionError):
            await client.call(replace(ep, token=b"x" * len(ep.token)), "propose", _requests([5, 6, 7]))
        assert (await client.call(ep, "propose", _requests([5, 6, 7])))[0].tokens
        drafter_server.channel.close()
        for conn in list(client._conns.values()):  # the replica's process ends: its connections close
            conn.writer.transport.abort()
        await asyncio.sleep(0.05)
        with pytest.raises(OSError):  # refused: the caller falls back to Serve
            await client.call(ep, "propose", _requests([5, 6, 7]))
        client.close()

    asyncio.run(main())


def test_a_cancelled_call_leaves_the_connection_usable(drafter_server):
    from core.channel import ChannelClient

    async def main():
        ep = await drafter_server.endpoint()
        client = ChannelClient()
        task = asyncio.ensure_future(client.call(ep, "propose", _requests([5, 6, 7], k=8)))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        got = await client.call(ep, "propose", _requests([5, 6, 7, 8], k=2))
        assert len(got[0].tokens) == 2
        client.close()
        drafter_server.channel.close()

    asyncio.run(main())


def test_a_cancelled_call_is_cancelled_on_the_replica_too():
    """The caller's cancellation travels as a frame: the replica stops the call (a drafter's queued
    work is then skipped by its batcher) instead of computing an answer nobody reads."""
    from core.channel import ChannelClient, ChannelServer

    async def main():
        started, stopped = asyncio.Event(), asyncio.Event()

        async def slow():
            started.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                stopped.set()
                raise

        server = ChannelServer({"slow": slow})
        ep = await server.start("127.0.0.1")
        client = ChannelClient()
        task = asyncio.ensure_future(client.call(ep, "slow"))
        await asyncio.wait_for(started.wait(), 5)
        task.cancel()
        await asyncio.wait_for(stopped.wait(), 5)
        client.close()
        server.close()

    asyncio.run(main())


def test_a_failing_drafter_replica_is_avoided_by_its_own_breaker(drafter_server, tiny_engines):
    """Per drafter replica: a replica whose channel fails gets no direct calls while its breaker is
    open (Serve's router places the sequences meanwhile, speculation goes on), the back-off doubles
    when the probe after it fails again."""
    from deployments import drafter_link as vmod
    from deployments.verifier import VerifierServer

    _, _, ver, _ = tiny_engines

    from tests.helpers import LocalHandle

    async def main():  # (Serve's drafter handle: every call answered by the drafter server, with its endpoint)
        server = VerifierServer({}, engine=ver, drafter=LocalHandle(drafter_server))
        req = _requests([5, 6, 7, 8])
        await server._propose(req)  # through Serve: binds the sequence to the replica
        ep = server._bound["s0"]
        assert (await server._propose(req))[0].tokens and server.drafter_calls["direct"] == 1
        drafter_server.channel.close()  # the replica's channel dies (the replica still answers Serve)
        server.channel.close()  # (and the open connection with it)
        assert (await server._propose(req))[0].tokens  # falls back, speculation goes on
        assert server.drafter_calls["fallback"] == 1 and "s0" not in server._bound
        breaker = server._breakers[ep]
        assert breaker.open(vmod.time.monotonic()) and breaker.backoff_s == vmod.CHANNEL_DOWN_S
        await server._propose(req)  # Serve answers; the replica is not bound while its breaker is open
        assert "s0" not in server._bound and server.drafter_calls["serve"] == 3
        # the back-off expired: the next Serve answer binds it again (a probe)
        breaker.down_until = vmod.time.monotonic()
        await server._propose(req)
        assert server._bound["s0"] == ep
        await server._propose(req)  # the probe fails: twice the back-off
        assert server._breakers[ep] is breaker and breaker.backoff_s == 2 * vmod.CHANNEL_DOWN_S
        assert "s0" not in server._bound
        server.channel.close()

    asyncio.run(main())


def test_a_call_a_step_waits_on_drafts_on_the_event_loop_and_a_pre_draft_on_the_engine_thread(drafter_server):
    """A draft the verify waits on runs inline when the drafter's engine is idle (no thread hop), with the same
    drafts and q as through the engine's thread; a pre-draft tree always goes through the thread, where its
    ``narrow`` can reach it while it runs."""
    from dataclasses import replace

    b = drafter_server.batcher

    async def main():
        threaded = await b.submit(_requests([5, 6, 7, 8, 9, 10]))
        drafter_server.engine.release("s0")
        before = b.inline_batches
        inline = await drafter_server.propose(_requests([5, 6, 7, 8, 9, 10]))
        assert b.inline_batches == before + 1
        assert inline[0].tokens == threaded[0].tokens and inline[0].probs.ids == threaded[0].probs.ids
        drafter_server.engine.release("s0")
        (tree,) = _requests([5, 6, 7, 8, 9, 10])
        await drafter_server.propose([replace(tree, branches=[(len(tree.new_tokens), 11)])])
        assert b.inline_batches == before + 1

    asyncio.run(main())
