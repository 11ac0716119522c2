"""The direct verifier -> drafter channel: one persistent TCP connection from a verifier replica
to each drafter replica it drafts on, beside Serve's handles.

Why: every speculative step of a sequence makes one drafter call, on the critical path when no
pre-draft holds. A Serve handle call between replicas costs milliseconds (routing, the actor
call, the replica's request machinery), as much as a small model's verify forward; a frame on
an open connection costs a fraction of that (docs/decisions/0003-direct-drafter-channel.md).

How it keeps Serve's guarantees: a sequence's first drafter call goes through the Serve handle,
so Serve's router (cache affinity, load, replica health) still places the sequence. The replica
that answers returns its ``Endpoint``; the verifier binds the sequence to it, and its later calls
go down the connection to the same engine batcher as the handle's calls (so batching, queue
bounds and autoscaling load are unchanged). A connection that breaks or cannot be opened
unbinds its sequences, which fall back to the handle; a replica that was replaced answers
``cache_miss`` and the loop resends, as with any replica change.

Frames: a 4-byte big-endian length, then a pickle, between processes of one Ray cluster (Ray
itself pickles every call; same trust boundary). A connection starts with the replica's random
token, which travels only through Serve, so nothing else on the network can call the engine.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import pickle
import secrets
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)
_LEN = struct.Struct(">I")
MAX_FRAME = 256 * 2**20  # a frame larger than this is a protocol error, not a payload
CANCEL = "__cancel__"  # a frame (call id, CANCEL, ()) stops that call on the replica
HANDSHAKE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Endpoint:
    """Where a drafter replica listens, and the token a connection must open with."""

    host: str
    port: int
    token: bytes
    replica: str = ""  # Serve's replica id, for logs and metrics


async def _read(reader: asyncio.StreamReader):
    (n,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if n > MAX_FRAME:
        raise ConnectionError(f"frame of {n} bytes")
    return pickle.loads(await reader.readexactly(n))


def _frame(obj) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(data)) + data


class ChannelServer:
    """The drafter replica's side: answers ``(call id, method, args)`` frames with
    ``(call id, ok, result or exception)``, each call in a task of its own (calls of many
    sequences share the engine's batches)."""

    def __init__(self, methods: dict[str, Callable[..., Awaitable]], replica: str = ""):
        self.methods = methods
        self.replica = replica
        self.token = secrets.token_bytes(16)
        self.server: asyncio.base_events.Server | None = None
        self.endpoint: Endpoint | None = None
        self._starting: asyncio.Lock | None = None

    async def start(self, host: str) -> Endpoint:
        """Listen on ``host`` (an ephemeral port) on the running event loop, once."""
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self.server is None:
                self.server = await asyncio.start_server(self._serve, host, 0)
                port = self.server.sockets[0].getsockname()[1]
                self.endpoint = Endpoint(host, port, self.token, self.replica)
                log.info("drafter channel listening on %s:%d", host, port)
        return self.endpoint

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        tasks: dict[int, asyncio.Task] = {}
        try:
            token = await asyncio.wait_for(reader.readexactly(len(self.token)), HANDSHAKE_TIMEOUT_S)
            if not secrets.compare_digest(token, self.token):
                return
            while True:
                call_id, name, args = await _read(reader)
                if name == CANCEL:  # the caller gave up on the call: stop it (queued work is skipped)
                    task = tasks.get(call_id)
                    if task is not None:
                        task.cancel()
                    continue
                task = tasks[call_id] = asyncio.create_task(self._answer(writer, call_id, name, args))
                task.add_done_callback(lambda _, c=call_id: tasks.pop(c, None))
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, OSError):
            pass  # the verifier went away: its calls' results have nowhere to go
        finally:
            for t in list(tasks.values()):
                t.cancel()
            writer.close()

    async def _answer(self, writer: asyncio.StreamWriter, call_id: int, method: str, args: tuple):
        try:
            out = (call_id, True, await self.methods[method](*args))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the caller gets the error, as from a Serve call
            out = (call_id, False, e)
        try:
            frame = _frame(out)
        except Exception as e:  # noqa: BLE001 - an unpicklable exception still answers the call
            frame = _frame((call_id, False, RuntimeError(repr(e))))
        writer.write(frame)
        await writer.drain()

    def close(self):
        if self.server is not None:
            self.server.close()


def _keepalive(writer: asyncio.StreamWriter) -> None:
    """TCP keepalive after 10 s idle, 3 probes 5 s apart: a replica whose node vanished (no RST)
    breaks the connection in about 25 s instead of the kernel's hours."""
    import socket

    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.writer = writer
        self.pending: dict[int, asyncio.Future] = {}
        self.ids = itertools.count()
        self.reader_task = asyncio.create_task(self._read(reader))

    async def _read(self, reader):
        err: BaseException = ConnectionError("drafter channel closed")
        try:
            while True:
                call_id, ok, value = await _read(reader)
                fut = self.pending.pop(call_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(value) if ok else fut.set_exception(value)
        except Exception as e:  # noqa: BLE001 - closed, or a frame that does not unpickle here: the calls fall back
            err = ConnectionError(f"drafter channel closed: {e!r}")
        finally:
            self.close(err)

    @property
    def alive(self) -> bool:
        return not self.reader_task.done()

    async def call(self, method: str, args: tuple):
        call_id = next(self.ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending[call_id] = fut
        try:
            self.writer.write(_frame((call_id, method, args)))
            return await fut
        except asyncio.CancelledError:
            if not self.writer.is_closing():  # the replica stops it too (or skips it while queued)
                self.writer.write(_frame((call_id, CANCEL, ())))
            raise
        finally:
            self.pending.pop(call_id, None)  # a cancelled call's answer is dropped when it comes

    def close(self, err: BaseException | None = None):
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(err or ConnectionError("drafter channel closed"))
        self.pending.clear()
        self.writer.close()
        if not self.reader_task.done() and self.reader_task is not asyncio.current_task():
            self.reader_task.cancel()


class ChannelClient:
    """The verifier replica's side: one connection per drafter endpoint, opened on first use."""

    def __init__(self, connect_timeout_s: float = 1.0):
        self.connect_timeout_s = connect_timeout_s
        self._conns: dict[Endpoint, _Connection] = {}
        self._opening: dict[Endpoint, asyncio.Future] = {}

    async def _connection(self, ep: Endpoint) -> _Connection:
        conn = self._conns.get(ep)
        if conn is not None and conn.alive:
            return conn
        opening = self._opening.get(ep)
        if opening is None:  # concurrent sequences bound to one replica open one connection
            opening = self._opening[ep] = asyncio.ensure_future(self._open(ep))
            opening.add_done_callback(lambda _: self._opening.pop(ep, None))
        return await asyncio.shield(opening)

    async def _open(self, ep: Endpoint) -> _Connection:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(ep.host, ep.port), self.connect_timeout_s)
        _keepalive(writer)
        writer.write(ep.token)
        conn = self._conns[ep] = _Connection(reader, writer)
        return conn

    async def call(self, ep: Endpoint, method: str, *args):
        """Raises ``ConnectionError`` (or ``OSError``/``TimeoutError`` while connecting) when the
        replica cannot be reached: the caller falls back to Serve."""
        return await (await self._connection(ep)).call(method, args)

    def close(self):
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
