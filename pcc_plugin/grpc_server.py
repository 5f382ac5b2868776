"""A gRPC server on a unix socket that no client can take down or stall.

grpclib speaks gRPC (HTTP/2, headers, grpc-timeout, trailers; UNIMPLEMENTED for unknown
paths); this module gives it what a daemon that any neighbour can reach needs beyond that.
trio accepts the connections (`trio.serve_listeners`, which waits out running out of
descriptors) and serves each as a task of the socket's nursery: cancelling that nursery
closes every connection, cancels every call and waits for them (`teardown_grace` at most),
so nothing of a generation outlives it. A call runs as an asyncio task that grpclib starts;
`CONNECTION` tells it which connection it came on.

The limits are a `Limits` the server is given (limits.py; the README's "Limits" says what
each guards against; connection_cap.py, which connection makes room). A client's mistake is
answered with a status that names it; a method's unexpected error is logged with its
traceback, counted, and answered INTERNAL.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import errno
import functools
import inspect
import itertools
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import grpclib.const
import grpclib.exceptions
import grpclib.server
import trio

from pcc_plugin import _grpclib
from pcc_plugin.bridge import call_asyncio
from pcc_plugin.connection_cap import ConnectionCap
from pcc_plugin.fs import Identity, identity
from pcc_plugin.klog import V1
from pcc_plugin.limits import DEFAULT, Limits

log = logging.getLogger(__name__)

Status = grpclib.const.Status
GRPCError = grpclib.exceptions.GRPCError

# What every HTTP/2 client sends first (RFC 9113, 3.4).
PREFACE_BYTES = len(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
# A socket bound but not yet renamed into place: `.<8 hex>.new.sock`.
STAGED_SUFFIX = ".new.sock"

# Set while grpclib reads a connection's bytes, so the calls it starts know their connection.
CONNECTION: contextvars.ContextVar[Connection] = contextvars.ContextVar("connection")


@attrs.define(eq=False)
class Call:
    """One gRPC call, as a method sees it: read the request, send answers."""

    server: Server
    connection: Connection
    _stream: _grpclib.ServerStream
    path: str

    async def receive(self) -> bytes:
        """The request message (empty bytes for an absent one), read within the limits."""
        limits = self.server.limits
        async with _deadline(limits.receive_timeout, "the request did not arrive"):
            prefix = await _grpclib.receive_exactly(self._stream, 5)
            if not prefix:
                return b""
            size = _message_size(prefix, limits.message_bytes)
            with self.server.reserve(size):
                return await _grpclib.receive_exactly(self._stream, size)

    async def send(self, payload: bytes) -> None:
        await self._stream.send_message(payload)


def _message_size(prefix: bytes, most: int) -> int:
    """The size a gRPC message prefix announces, if within the limits; else GRPCError."""
    if prefix[0] not in (0, 1):
        raise GRPCError(Status.INVALID_ARGUMENT, "malformed message prefix")
    if prefix[0] == 1:
        raise GRPCError(
            Status.UNIMPLEMENTED,
            "compressed messages are not accepted: this server offers no compression",
        )
    size = int.from_bytes(prefix[1:5], "big")
    if size > most:
        raise GRPCError(
            Status.RESOURCE_EXHAUSTED,
            f"a message of {size} bytes is larger than the {most} accepted",
        )
    return size


# A unary method answers the request message with the response message, or raises GRPCError;
# one that must wait (on the API server) answers with an awaitable, within the unary timeout.
Answer = Callable[[bytes, Call], bytes | Awaitable[bytes]]
# A server-streaming method reads its request and sends its answers through the Call.
Stream = Callable[[Call], Awaitable[None]]


@attrs.frozen
class MethodSpec:
    answer: Answer | None = None
    stream: Stream | None = None


@contextlib.asynccontextmanager
async def _deadline(seconds: float | None, what: str) -> AsyncIterator[None]:
    """asyncio.timeout, ending in DEADLINE_EXCEEDED that says what was late."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        raise GRPCError(Status.DEADLINE_EXCEEDED, f"{what} in time") from None


class Connection(asyncio.Protocol):
    """One client connection, from its admission to its teardown: its trio task (`serve`)
    admits it, hands its socket to asyncio with grpclib's protocol inside this one, closes it
    when silent or idle, and on the way out closes it and waits for its calls (asyncio tasks).
    """

    _numbers = itertools.count(1)

    def __init__(self, server: Server) -> None:
        self.server = server
        self.number = next(self._numbers)
        self.requests = 0
        # Bytes received, counted up to the HTTP/2 preface.
        self.received = 0
        self.last_active = trio.current_time()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        # grpclib's protocol, from the set-up on; asyncio calls none before.
        self._grpc = asyncio.Protocol()
        self._calls: set[asyncio.Task[Any]] = set()
        self._changed = trio.Event()
        # Whether the watch waits for the open calls to end: only then does the last one's
        # end wake it (waking trio costs a thread switch; most calls need not).
        self._awaiting_calls = False

    def __repr__(self) -> str:
        return f"connection {self.number}"

    @property
    def sent_request(self) -> bool:
        return self.requests > 0

    @property
    def open_calls(self) -> int:
        return len(self._calls)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # trio's side: the connection's task, and its close from outside (the connection cap)

    async def serve(self, listener: Listener, stream: trio.SocketStream) -> None:
        """Serve the connection until it ends or must be closed; never raises."""
        server = self.server
        # asyncio's transport owns the socket from here.
        sock = socket.socket(fileno=stream.socket.detach())
        if not server.cap.admit(self):
            sock.close()
            listener.next_one()
            return
        try:
            try:
                await call_asyncio(self._set_up, sock)
            finally:
                listener.next_one()
            await self._watch()
        except OSError as exc:
            log.log(V1, "%s failed: %s", self, exc)
        except Exception as exc:
            # A bug, contained to this connection: the server goes on.
            server.on_error("connection", exc)
        finally:
            server.cap.leave(self)
            server.on_close(self)
            with trio.CancelScope(shield=True), trio.move_on_after(server.limits.teardown_grace):
                if self.transport is None:
                    sock.close()
                self.close()
                if self._calls:
                    await call_asyncio(asyncio.wait, list(self._calls))

    async def _set_up(self, sock: socket.socket) -> None:
        """Run grpclib's protocol on the connection, unless it was closed meanwhile."""
        if self.closed:
            return
        self._grpc = _grpclib.protocol(self.server.grpc())
        await asyncio.get_running_loop().connect_accepted_socket(lambda: self, sock)

    async def _watch(self) -> None:
        """Until the connection closes, or must be closed for silence or idleness."""
        limits = self.server.limits

        def started() -> bool:
            # A wrong preface, grpclib closes the connection on.
            greeted = self.received >= PREFACE_BYTES
            return greeted if limits.idle_client else self.sent_request

        with trio.move_on_after(limits.first_request_timeout):
            while not started() and not self.closed:
                await self._changed.wait()
        if not started():
            if not self.closed:
                log.log(V1, "Closing %s: no %s within %g s", self,
                        "HTTP/2 preface" if limits.idle_client else "request",
                        limits.first_request_timeout)  # fmt: skip
            return
        if limits.idle_client:
            while not self.closed:
                await self._changed.wait()
            return
        while not self.closed:
            if self._calls:
                await self._calls_ended()
                continue
            idle_until = self.last_active + limits.idle_timeout
            if trio.current_time() >= idle_until:
                log.log(V1, "Closing %s: idle for %g s", self, limits.idle_timeout)
                return
            with trio.move_on_at(idle_until):
                await self._changed.wait()

    async def _calls_ended(self) -> None:
        """Until no call is open, or the close."""
        self._awaiting_calls = True
        try:
            while self._calls and not self.closed:
                await self._changed.wait()
        finally:
            self._awaiting_calls = False

    def close(self) -> None:
        """Close the connection now: its calls are cancelled, its streams end."""
        if self.transport is not None:
            self.transport.abort()
        for task in self._calls:
            task.cancel()
        self.closed = True
        self._notify()

    # asyncio's side: the protocol, grpclib's inside it; and each call's start and end

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._grpc.connection_made(transport)
        if self.closed:
            transport.abort()  # closed while it was being set up

    def data_received(self, data: bytes) -> None:
        if self.received < PREFACE_BYTES:
            self.received += len(data)
            if self.received >= PREFACE_BYTES:
                self._notify()
        token = CONNECTION.set(self)
        try:
            self._grpc.data_received(data)
        finally:
            CONNECTION.reset(token)

    def eof_received(self) -> bool | None:
        return self._grpc.eof_received()

    def pause_writing(self) -> None:
        self._grpc.pause_writing()

    def resume_writing(self) -> None:
        self._grpc.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._grpc.connection_lost(exc)
        self.closed = True
        self._notify()

    def call_began(self, task: asyncio.Task[Any]) -> None:
        self.requests += 1
        self._calls.add(task)
        if self.requests == 1:
            self._notify()  # from now on the idle timeout applies

    def call_ended(self, task: asyncio.Task[Any]) -> None:
        self._calls.discard(task)
        self.last_active = trio.current_time()
        if self._awaiting_calls and not self._calls:
            self._notify()


class Listener(trio.abc.Listener[trio.SocketStream]):
    """The socket, as trio.serve_listeners accepts from it.

    It accepts a connection only once the one before it is set up (or refused), so a flood
    is accepted no faster than it is dealt with, and holds no more descriptors than the
    connections served. Closed, it removes its file first if that is still ours: a socket
    that takes no connections is stale to whoever looks (another instance).
    """

    def __init__(self, sock: socket.socket, path: Path, own: Identity) -> None:
        self._listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))
        self._path = path
        self._own = own
        self._ready = trio.Event()
        self._ready.set()

    async def accept(self) -> trio.SocketStream:
        await self._ready.wait()
        stream = await self._listener.accept()
        self._ready = trio.Event()
        return stream

    def next_one(self) -> None:
        """The last connection accepted is dealt with: accept the next."""
        self._ready.set()

    async def aclose(self) -> None:
        # The name first: whoever finds the file finds it listening.
        if identity(self._path) == self._own:
            try:
                os.unlink(self._path)
            except OSError as exc:
                log.log(V1, "Cannot remove %s: %s", self._path, exc.strerror)
        await self._listener.aclose()


# Told of a bug: where (a method's path, or "connection") and the exception.
OnError = Callable[[str, BaseException], None]


class Server:
    """Serves `methods` (path -> MethodSpec) on a listening unix socket, within `limits`.

    With `limits.idle_client` the client connects and then may call nothing for long (kubelet
    dials a DRA socket when the driver registers, calls only when a pod needs a claim, and
    takes the connection's close for the driver going away); its connection is kept open from
    the HTTP/2 preface on.
    """

    def __init__(
        self,
        methods: Mapping[str, MethodSpec],
        on_error: OnError,
        on_close: Callable[[Connection], None] = lambda _: None,
        *,
        limits: Limits = DEFAULT,
    ) -> None:
        self.methods = methods
        self.on_error = on_error
        self.on_close = on_close
        self.limits = limits
        # Bytes of large messages being read at once, across every connection.
        self.large_in_use = 0
        self.cap: ConnectionCap[Connection] = ConnectionCap(limits.connections, "connections", log)
        self._grpc: grpclib.server.Server | None = None

    @contextlib.contextmanager
    def reserve(self, size: int) -> Iterator[None]:
        """Room to read a message of `size` bytes, if a large one fits in the budget."""
        window = self.limits.window
        size = size if size > window else 0
        if self.large_in_use + size > self.limits.large_message_budget:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"busy reading other large messages; retry, or send less than {window} bytes",
            )
        self.large_in_use += size
        try:
            yield
        finally:
            self.large_in_use -= size

    async def serve(
        self, path: Path, *, task_status: trio.TaskStatus[Identity] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve at `path` (OSError as `bind` raises it) until cancelled; then close every
        connection and the socket, and remove its file if still ours. Hands back the identity
        of the file once listening."""
        sock, own = bind(path, self.limits.backlog)
        listener = Listener(sock, path, own)
        try:
            self._grpc = _grpclib.server(
                {
                    name: (functools.partial(self._serve_call, name, spec), spec.stream is not None)
                    for name, spec in self.methods.items()
                },
                _unknown_method,
                self.limits.window,
            )
            handler = functools.partial(self._serve_connection, listener)
            async with trio.open_nursery() as nursery:
                await nursery.start(trio.serve_listeners, handler, [listener])
                task_status.started(own)
        finally:
            with trio.CancelScope(shield=True):
                await listener.aclose()

    def grpc(self) -> grpclib.server.Server:
        """grpclib's server, whose protocol each connection runs (made as the socket is)."""
        assert self._grpc is not None
        return self._grpc

    async def _serve_connection(self, listener: Listener, stream: trio.SocketStream) -> None:
        await Connection(self).serve(listener, stream)

    # asyncio: one call

    async def _serve_call(self, path: str, spec: MethodSpec, stream: _grpclib.ServerStream) -> None:
        """One call of a method; GRPCError tells grpclib the status to answer."""
        connection = CONNECTION.get()
        task = asyncio.current_task()
        assert task is not None
        connection.call_began(task)
        try:
            most = self.limits.calls_per_connection
            if connection.open_calls > most:
                raise GRPCError(
                    Status.RESOURCE_EXHAUSTED, f"more than {most} calls at once on one connection"
                )
            call = Call(self, connection, stream, path)
            try:
                if spec.stream is not None:
                    await spec.stream(call)
                else:
                    assert spec.answer is not None
                    async with _deadline(self.limits.unary_timeout, "the call was not answered"):
                        answer = spec.answer(await call.receive(), call)
                        if inspect.isawaitable(answer):
                            answer = await answer
                        await call.send(answer)
            except _grpclib.StreamEnded as exc:
                raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from None
            except (GRPCError, OSError, grpclib.exceptions.StreamTerminatedError):
                raise  # an answer, or the client went away
            except Exception as exc:
                self.on_error(path, exc)
                raise GRPCError(Status.INTERNAL, f"internal error: {type(exc).__name__}") from None
        finally:
            connection.call_ended(task)


async def _unknown_method(path: str, stream: _grpclib.ServerStream) -> None:
    # grpc-message travels in a trailer that clients cap at 8 KiB.
    raise GRPCError(Status.UNIMPLEMENTED, f"unknown method {path[:512]!r}")


# The socket


def bind(path: Path, backlog: int = DEFAULT.backlog) -> tuple[socket.socket, Identity]:
    """A listening unix socket at `path`, and the identity of its file.

    Bound under a temporary name and renamed into place once listening, so
    that whoever sees it appear (another instance, kubelet) can connect at
    once. Raises OSError (PermissionError, FileNotFoundError, ...); nothing is
    left open or behind on failure.
    """
    staged = path.with_name(f".{os.urandom(4).hex()}{STAGED_SUFFIX}")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        listener.setblocking(False)
        listener.bind(os.fspath(staged))
        try:
            listener.listen(backlog)
            os.rename(staged, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(staged)
            raise
        own = identity(path)
        if own is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), os.fspath(path))
    except BaseException:
        listener.close()
        raise
    return listener, own
