"""How the router's failover (``deployments.generation.Generation``) treats a broken verifier stream: a replica
that died is resumed elsewhere, an error of the code itself fails the request at once. The verifier handle here
is a stand-in for Serve's streaming handle (the real failover, with replicas killed, is in tests/test_pools.py)."""

import asyncio
import time

import pytest

from configs import SamplingParams
from core.sequence import Sequence


class _Stream:
    def __init__(self, error):
        self.error = error

    def __aiter__(self):
        return self

    async def __anext__(self):
        raise self.error

    def cancel(self):
        pass


class _Handle:
    """``options(stream=True).speculate.remote(...)`` as Serve's handle offers it; each call's stream raises the
    next of ``errors``."""

    def __init__(self, errors):
        self.errors, self.opened = list(errors), 0
        self.speculate = self
        self.release = self

    def options(self, **_):
        return self

    def remote(self, *args, **kwargs):
        if args and isinstance(args[0], list) and not kwargs:  # release([seq_id])
            return None
        self.opened += 1
        return _Stream(self.errors.pop(0))


def _generation(handle, retry_s=120.0):
    from deployments.generation import Call, Generation

    params = SamplingParams(temperature=0, max_tokens=4)
    seq = Sequence([1, 2, 3], params, 0, None, set(), 1000, seq_id="s")
    call = Call([1, 2, 3], params, 0, 1000, None, "fixed")
    return Generation((None, handle), seq, call, retry_s)


async def _drain(gen):
    return [out async for out in gen.steps()]


@pytest.mark.parametrize("error", [TypeError("speculate() got an unexpected keyword argument 'cache_salt'"),
                                   AttributeError("'NoneType' object has no attribute 'tokens'")])
def test_an_error_of_the_code_fails_at_once_instead_of_resuming_until_the_retry_window_ends(error):
    handle = _Handle([error] * 100)
    t0 = time.monotonic()
    with pytest.raises(type(error)):
        asyncio.run(_drain(_generation(handle)))
    assert handle.opened == 1 and time.monotonic() - t0 < 5


def test_a_broken_stream_is_resumed_on_another_replica_until_the_code_fails():
    handle = _Handle([RuntimeError("the replica died"), RuntimeError("the replica died"), NameError("x")])
    with pytest.raises(NameError):
        asyncio.run(_drain(_generation(handle)))
    assert handle.opened == 3  # resumed twice, then failed at once
