"""A gRPC server on a unix socket that no client can take down or stall.

It accepts connections itself, in trio, and runs grpclib's HTTP/2 protocol on
each; every connection is a task of the nursery that serves the socket, so
cancelling that nursery closes every connection, cancels every request and
waits for them (at most `TEARDOWN_GRACE`), and nothing of a generation outlives it.

Limits (README, "Limits"), each against one way a neighbour can hurt us:

- `MAX_CONNECTIONS` at once. Kubelet holds one; tools a few more. When the
  limit is reached, the oldest connection that has not yet sent a request is
  closed to make room (kubelet sends its request at once), else the newcomer.
- A connection must send the HTTP/2 preface and a request within
  `FIRST_REQUEST_TIMEOUT`, and is closed after `IDLE_TIMEOUT` without an open
  stream (kubelet's always has its ListAndWatch stream).
- `accept()` failing for lack of descriptors or memory is waited out and retried.
- A message may have at most `MAX_MESSAGE_BYTES` (gRPC's and kubelet's
  default); a larger one is refused from its 5-byte prefix, before any of it is
  read, with RESOURCE_EXHAUSTED, and its stream is reset. Flow-control windows
  of `WINDOW` bytes stop a peer from pushing more than that ahead of us.
  Messages larger than `WINDOW` share a budget of `LARGE_MESSAGE_BUDGET` bytes.
- A request must arrive whole within `RECEIVE_TIMEOUT`; a unary call must be
  answered within `UNARY_TIMEOUT` (or the client's shorter deadline).
- Nothing a client sends is answered UNKNOWN; a handler's unexpected error is
  logged with its traceback, counted, and answered INTERNAL.

A unary call whose whole request came in the bytes just read (kubelet's always
do) is answered at once, in the same callback, with one write: no task, no
timer, nothing to wait for, so none of the limits above has anything to bound.
When the call's frames are whole in those bytes, its header block one the
connection sent before (kubelet's Allocate from its third on, grpcio's alike),
it is answered before h2 and grpclib read them. Any other call runs as an
asyncio task of its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

import attrs
import grpclib.const
import grpclib.exceptions
import trio

from pcc_plugin import _grpclib
from pcc_plugin.bridge import call_asyncio
from pcc_plugin.fs import Identity, identity
from pcc_plugin.klog import V1, BurstLog

log = logging.getLogger(__name__)

Status = grpclib.const.Status
GRPCError = grpclib.exceptions.GRPCError

MAX_CONNECTIONS = 32
MAX_STREAMS_PER_CONNECTION = 32
FIRST_REQUEST_TIMEOUT = 5.0
IDLE_TIMEOUT = 60.0
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
WINDOW = 65_535
LARGE_MESSAGE_BUDGET = 8 * 1024 * 1024
RECEIVE_TIMEOUT = 10.0
UNARY_TIMEOUT = 30.0
BACKLOG = 64
# A socket bound but not yet renamed into place: `.<8 hex>.new.sock`.
STAGED_SUFFIX = ".new.sock"
# accept() failed for lack of descriptors or memory: what frees them takes a moment.
ACCEPT_RETRY = 0.1
TEARDOWN_GRACE = 1.0
RESOURCE_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_GRPC_TIMEOUT_UNITS = {"H": 3600.0, "M": 60.0, "S": 1.0, "m": 1e-3, "u": 1e-6, "n": 1e-9}


class Call:
    """One gRPC call, as a method sees it: read the request, send answers.

    A unary call answered before grpclib read it has no stream (`stream` None): its method
    is given the request message and returns the answer.
    """

    def __init__(
        self, server: Server, connection: Connection, stream: _grpclib.H2Stream | None, path: str
    ) -> None:
        self.server = server
        self.connection = connection
        self.path = path
        self._stream = stream
        self._answer: _grpclib.AnswerStream | None = None

    async def receive(self) -> bytes:
        """The request message (empty bytes for an absent one), read within the limits above."""
        assert self._stream is not None
        async with _deadline(RECEIVE_TIMEOUT, "the request did not arrive"):
            prefix = await _grpclib.receive_exactly(self._stream, 5)
            if not prefix:
                return b""
            size = _message_size(prefix)
            with self.server.budget.reserve(size):
                return await _grpclib.receive_exactly(self._stream, size)

    async def send(self, payload: bytes) -> None:
        await self._answer_stream().send_message(payload)

    async def finish(self, status: Status, message: str | None) -> None:
        await self._answer_stream().send_trailing_metadata(
            status=status, status_message=_trailer_message(message)
        )

    def _answer_stream(self) -> _grpclib.AnswerStream:
        assert self._stream is not None
        if self._answer is None:
            self._answer = _grpclib.answer_stream(
                self._stream, self.path, self.server.methods[self.path].streaming
            )
        return self._answer


def _message_size(prefix: bytes) -> int:
    """The size a gRPC message prefix announces, if within the limits; else GRPCError."""
    if prefix[0] not in (0, 1):
        raise GRPCError(Status.INVALID_ARGUMENT, "malformed message prefix")
    if prefix[0] == 1:
        raise GRPCError(
            Status.UNIMPLEMENTED,
            "compressed messages are not accepted: this server offers no compression",
        )
    size = int.from_bytes(prefix[1:5], "big")
    if size > MAX_MESSAGE_BYTES:
        raise GRPCError(
            Status.RESOURCE_EXHAUSTED,
            f"a message of {size} bytes is larger than the {MAX_MESSAGE_BYTES} accepted",
        )
    return size


def _whole_message(body: bytes) -> bytes:
    """The request message of a request body that is all here (as `Call.receive` reads it)."""
    if not body:
        return b""
    if len(body) < 5:
        raise _grpclib.StreamEnded("the stream ended before the 5 bytes announced")
    size = _message_size(body)
    if len(body) < 5 + size:
        raise _grpclib.StreamEnded(f"the stream ended before the {size} bytes announced")
    return body[5 : 5 + size]


# A unary method answers the request message with the response message, or raises GRPCError.
Answer = Callable[[bytes, Call], bytes]
# A unary call's status, its message, and its answer (None unless OK).
Outcome = tuple[Status, str | None, bytes | None]
# A server-streaming method reads its request and sends its answers through the Call.
Stream = Callable[[Call], Awaitable[None]]


@attrs.frozen
class MethodSpec:
    answer: Answer | None = None
    stream: Stream | None = None

    @property
    def streaming(self) -> bool:
        return self.stream is not None


@attrs.define
class LargeMessageBudget:
    """Bytes of large messages being read at once, across every connection."""

    limit: int = LARGE_MESSAGE_BUDGET
    in_use: int = 0

    def reserve(self, size: int) -> _Reservation:
        return _Reservation(self, size if size > WINDOW else 0)


@attrs.define
class _Reservation:
    budget: LargeMessageBudget
    size: int

    def __enter__(self) -> None:
        if self.budget.in_use + self.size > self.budget.limit:
            raise GRPCError(
                Status.RESOURCE_EXHAUSTED,
                f"busy reading other large messages; retry, or send less than {WINDOW} bytes",
            )
        self.budget.in_use += self.size

    def __exit__(self, *_: object) -> None:
        self.budget.in_use -= self.size


@contextlib.asynccontextmanager
async def _deadline(seconds: float | None, what: str) -> AsyncIterator[None]:
    """asyncio.timeout, ending in DEADLINE_EXCEEDED that says what was late."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        raise GRPCError(Status.DEADLINE_EXCEEDED, f"{what} in time") from None


class Connection(_grpclib.Handler):
    """One client connection: its requests run as asyncio tasks owned by it.

    grpclib's protocol calls `accept` for each request, `cancel` when the
    client resets a stream and `close` when the connection is lost. The
    connection's trio task (`Server.serve_connection`) waits on `changed`,
    which the first request, the end of a request task and the close set; a
    later request only records when it came (`last_active`): waking that task
    for each would cost every call a trip through trio's scheduler.
    """

    _numbers = itertools.count(1)

    def __init__(self, server: Server, sock: socket.socket) -> None:
        self.server = server
        self.sock = sock
        self.number = next(self._numbers)
        self.accepted_at = self.last_active = trio.current_time()
        self.requests = 0
        self.closed = False
        self.protocol: Any = None
        self._arrived: list[tuple[_grpclib.H2Stream, list[tuple[str, str]], Callable[[], Any]]] = []
        self._answered_at_once = 0
        # The outcome of a call answered before grpclib read it, when the answer did not fit
        # the client's windows: grpclib reads the call in the same callback, and it is sent
        # the way of such answers (`Server.dispatch`), its method not called twice.
        self._kept: tuple[int, Outcome] | None = None
        self._tasks: dict[_grpclib.H2Stream, asyncio.Task[None]] = {}
        self._changed = trio.Event()

    def __repr__(self) -> str:
        return f"connection {self.number}"

    @property
    def open_streams(self) -> int:
        return len(self._tasks)

    async def changed(self) -> None:
        """Until the first request, a request task's end, or the close."""
        await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # grpclib's side (asyncio)

    def accept(
        self,
        stream: _grpclib.H2Stream,
        headers: list[tuple[str, str]],
        release_stream: Callable[[], Any],
    ) -> None:
        # Dispatched in `received`, once the rest of the bytes read with it (the request's
        # DATA, as a rule) have been processed too.
        self.requests += 1
        self._arrived.append((stream, headers, release_stream))

    def answer_at_once(self, protocol: Any, request: _grpclib.WholeRequest) -> bool:
        path = request.fields.get(":path", "")
        method = self.server.methods.get(path)
        if self.closed or method is None or method.answer is None:
            return False
        outcome = self.server.outcome(
            Call(self.server, self, None, path), request.fields, request.body
        )
        status, message, answer = outcome
        if _grpclib.answer_unread(protocol, request, status, _trailer_message(message), answer):
            self.requests += 1
            self._answered_at_once += 1
            return True
        self._kept = (request.stream_id, outcome)
        return False

    def kept_outcome(self, stream_id: int | None) -> Outcome | None:
        if self._kept is None or self._kept[0] != stream_id:
            return None
        outcome, self._kept = self._kept[1], None
        return outcome

    def received(self) -> None:
        """The bytes just read have been processed: dispatch the requests they began."""
        arrived, self._arrived = self._arrived, []
        for stream, headers, release_stream in arrived:
            if self.closed or not stream.closable:
                release_stream()  # reset or gone with its connection: nothing to answer
            else:
                self.server.dispatch(self, stream, dict(headers), release_stream)
        self._kept = None
        answered = len(arrived) + self._answered_at_once
        self._answered_at_once = 0
        if answered:
            self.last_active = trio.current_time()
            if self.requests == answered:
                self._notify()  # the first: from now on the idle timeout applies

    def start(self, stream: _grpclib.H2Stream, request: Coroutine[Any, Any, None]) -> None:
        """Run a request as an asyncio task of this connection."""
        task = asyncio.get_running_loop().create_task(request)
        self._tasks[stream] = task
        task.add_done_callback(lambda _: self._finished(stream))

    def _finished(self, stream: _grpclib.H2Stream) -> None:
        self._tasks.pop(stream, None)
        self.last_active = trio.current_time()
        self._notify()

    def cancel(self, stream: _grpclib.H2Stream) -> None:
        task = self._tasks.get(stream)
        if task is not None:
            task.cancel()

    def close(self) -> None:
        self.closed = True
        for _, _, release_stream in self._arrived:
            release_stream()
        self._arrived.clear()
        for task in self._tasks.values():
            task.cancel()
        self._notify()

    # our side (trio)

    def shut(self) -> None:
        """Close the connection: its requests are cancelled, its streams end."""
        if self.protocol is not None:
            self.protocol.connection.close()
        else:
            self.sock.close()  # never handed to grpclib, or its setup failed
        self.close()

    async def wait_finished(self) -> None:
        tasks = list(self._tasks.values())
        if tasks:
            await call_asyncio(asyncio.wait, tasks)


# Told of a bug: where (a method's path, or "connection") and the exception.
OnError = Callable[[str, BaseException], None]


class Server:
    """Serves `methods` (path -> MethodSpec) on a listening unix socket."""

    def __init__(
        self,
        methods: Mapping[str, MethodSpec],
        on_error: OnError,
        on_close: Callable[[Connection], None] = lambda _: None,
    ) -> None:
        self.methods = methods
        self.on_error = on_error
        self.on_close = on_close
        self.budget = LargeMessageBudget()
        self.connections: list[Connection] = []
        self._refused = BurstLog(log, logging.WARNING)
        self._accept_failed = BurstLog(log, logging.WARNING)

    async def serve(
        self,
        listener: socket.socket,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Accept and serve connections until cancelled, then close every one."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                sock = await self._accept(listener)
                if sock is not None:
                    connection = Connection(self, sock)
                    self.connections.append(connection)
                    await nursery.start(self.serve_connection, connection)

    async def _accept(self, listener: socket.socket) -> socket.socket | None:
        await trio.lowlevel.wait_readable(listener)
        try:
            sock, _ = listener.accept()
        except BlockingIOError:
            return None
        except OSError as exc:
            if exc.errno in RESOURCE_ERRORS:
                self._accept_failed.log(
                    "Cannot accept connections on %s: %s; retrying",
                    listener.getsockname(),
                    os.strerror(exc.errno or 0),
                )
                await trio.sleep(ACCEPT_RETRY)
                return None
            if exc.errno == errno.ECONNABORTED:
                return None
            raise
        if len(self.connections) < MAX_CONNECTIONS:
            return sock
        waiting = [c for c in self.connections if not c.requests and not c.closed]
        if waiting:
            victim = min(waiting, key=lambda connection: connection.accepted_at)
            self._refused.log(
                "%d connections open, the limit: closing the oldest that sent no request",
                len(self.connections),
            )
            victim.shut()
            return sock
        self._refused.log(
            "%d connections open, the limit, each busy: refusing new ones", len(self.connections)
        )
        sock.close()
        return None

    async def serve_connection(
        self,
        connection: Connection,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Set the connection up, then serve it until it ends; never raises.

        Started once set up: the accept loop waits for that, so a flood is
        accepted no faster than connections are set up.
        """
        try:
            try:
                connection.sock.setblocking(False)
                # asyncio's transport writes and closes the socket; this task reads a
                # duplicate of it, which keeps the connection open until it is closed.
                reader = connection.sock.dup()
                try:
                    connection.protocol = await _grpclib.accept(
                        connection.sock, connection, WINDOW, MAX_STREAMS_PER_CONNECTION
                    )
                except BaseException:
                    reader.close()
                    raise
            finally:
                task_status.started()
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._read, connection, reader)
                    await self._watch(connection)
                    nursery.cancel_scope.cancel()
            finally:
                trio.lowlevel.notify_closing(reader)
                reader.close()
        except OSError as exc:
            log.log(V1, "%s failed: %s", connection, exc)
        except Exception as exc:
            # A bug, contained to this connection: the server goes on.
            self.on_error("connection", exc)
        finally:
            self.connections.remove(connection)
            self.on_close(connection)
            with trio.CancelScope(shield=True), trio.move_on_after(TEARDOWN_GRACE):
                connection.shut()
                await connection.wait_finished()
            # grpclib's protocol and this connection refer to each other: without this,
            # a flood's connections would wait for a full garbage collection to be freed.
            connection.protocol = None

    async def _read(self, connection: Connection, reader: socket.socket) -> None:
        """Hand the connection's bytes to grpclib's protocol as they come, until it ends."""
        while True:
            await trio.lowlevel.wait_readable(reader)
            try:
                data = reader.recv(WINDOW)
            except BlockingIOError:
                continue
            except OSError as exc:
                _grpclib.ended(connection.protocol, exc)
                return
            if not data:
                _grpclib.ended(connection.protocol, None)
                return
            if not _grpclib.feed(connection.protocol, data):
                return

    async def _watch(self, connection: Connection) -> None:
        """Until the connection closes, or must be closed for silence or idleness."""
        with trio.move_on_after(FIRST_REQUEST_TIMEOUT):
            while not connection.requests and not connection.closed:
                await connection.changed()
        if not connection.requests:
            if not connection.closed:
                log.log(V1, "Closing %s: no request within %g s", connection,
                        FIRST_REQUEST_TIMEOUT)  # fmt: skip
            return
        while not connection.closed:
            if connection.open_streams:
                await connection.changed()
                continue
            idle_until = connection.last_active + IDLE_TIMEOUT
            if trio.current_time() >= idle_until:
                log.log(V1, "Closing %s: idle for %g s", connection, IDLE_TIMEOUT)
                return
            with trio.move_on_at(idle_until):
                await connection.changed()

    # asyncio: one request

    def dispatch(
        self,
        connection: Connection,
        stream: _grpclib.H2Stream,
        fields: dict[str, str],
        release_stream: Callable[[], Any],
    ) -> None:
        """Answer a unary call now if its whole request is here, else start it as a task."""
        path = fields.get(":path", "")
        method = self.methods.get(path)
        body = None
        if method is not None and method.answer is not None and _grpclib.can_send(stream):
            body = _grpclib.whole_body(stream)
        if body is None:
            connection.start(stream, self.handle(connection, stream, fields, release_stream))
            return
        call = Call(self, connection, stream, path)
        try:
            status, message, answer = connection.kept_outcome(stream.id) or self.outcome(
                call, fields, body
            )
            if _grpclib.fits(stream, answer):
                _grpclib.answer_now(stream, status, _trailer_message(message), answer)
            else:
                # Larger than what the client lets us send now: grpclib waits for its window.
                later = self._answer_later(call, status, message, answer, release_stream)
                connection.start(stream, later)
                return
        except Exception as exc:
            self.on_error(path, exc)
        release_stream()

    async def _answer_later(
        self,
        call: Call,
        status: Status,
        message: str | None,
        answer: bytes | None,
        release_stream: Callable[[], Any],
    ) -> None:
        try:
            async with _deadline(UNARY_TIMEOUT, "the answer could not be sent"):
                if answer is not None:
                    await call.send(answer)
                await call.finish(status, message)
        except (OSError, GRPCError, grpclib.exceptions.StreamTerminatedError):
            pass  # the client went away, or would not read
        finally:
            release_stream()

    def outcome(self, call: Call, fields: Mapping[str, str], body: bytes) -> Outcome:
        """The outcome of a unary call whose request body is all here."""
        problem = _header_problem(fields, self.methods)
        if problem is not None:
            return *problem, None
        try:
            data = _whole_message(body)
        except (GRPCError, _grpclib.StreamEnded) as exc:
            return *_failure(exc), None
        return self._answer(call, data)

    def _answer(self, call: Call, data: bytes) -> Outcome:
        """Status, message and answer of a unary method for its request message."""
        answer = self.methods[call.path].answer
        assert answer is not None
        try:
            return Status.OK, None, answer(data, call)
        except GRPCError as exc:
            return exc.status, exc.message, None
        except Exception as exc:
            self.on_error(call.path, exc)
            return Status.INTERNAL, f"internal error: {type(exc).__name__}", None

    async def handle(
        self,
        connection: Connection,
        stream: _grpclib.H2Stream,
        fields: dict[str, str],
        release_stream: Callable[[], Any],
    ) -> None:
        path = fields.get(":path", "")
        call = Call(self, connection, stream, path)
        try:
            problem = _header_problem(fields, self.methods)
            if problem is not None:
                await call.finish(*problem)
                return
            method = self.methods[path]
            timeout = _client_timeout(fields)
            if not method.streaming:
                timeout = min(timeout or UNARY_TIMEOUT, UNARY_TIMEOUT)
            status, message = Status.OK, None
            try:
                async with _deadline(timeout, "the call was not answered"):
                    if method.stream is not None:
                        await method.stream(call)
                    else:
                        status, message, answer = self._answer(call, await call.receive())
                        if answer is not None:
                            await call.send(answer)
            except (GRPCError, _grpclib.StreamEnded) as exc:
                status, message = _failure(exc)
            except Exception as exc:
                self.on_error(path, exc)
                status, message = Status.INTERNAL, f"internal error: {type(exc).__name__}"
            if stream.closable:
                await call.finish(status, message)
        except (OSError, grpclib.exceptions.StreamTerminatedError, _grpclib.StreamEnded):
            pass  # the client went away mid-answer
        except GRPCError:
            pass  # the trailers could not be sent: the stream is already gone
        except Exception as exc:
            self.on_error(path, exc)
        finally:
            release_stream()


def _failure(exc: GRPCError | _grpclib.StreamEnded) -> tuple[Status, str | None]:
    if isinstance(exc, GRPCError):
        return exc.status, exc.message
    return Status.INVALID_ARGUMENT, str(exc)


def _trailer_message(message: str | None) -> str | None:
    # grpc-message travels in a trailer that clients cap at 8 KiB.
    return None if message is None else message[:1024]


def _header_problem(
    fields: Mapping[str, str], methods: Mapping[str, MethodSpec]
) -> tuple[Status, str] | None:
    if fields.get(":method") != "POST":
        return Status.INVALID_ARGUMENT, "gRPC requests use POST"
    content_type = fields.get("content-type", "")
    if content_type.partition("+")[::2] not in (
        ("application/grpc", ""),
        ("application/grpc", "proto"),
    ):
        return (
            Status.INVALID_ARGUMENT,
            f"content-type {content_type[:64]!r} is not application/grpc",
        )
    if fields.get(":path") not in methods:
        return Status.UNIMPLEMENTED, f"no method {fields.get(':path', '')[:128]!r} here"
    timeout = fields.get("grpc-timeout")
    if timeout is not None and _parse_timeout(timeout) is None:
        return Status.INVALID_ARGUMENT, f"grpc-timeout {timeout[:16]!r} is malformed"
    return None


def _parse_timeout(text: str) -> float | None:
    value, unit = text[:-1], text[-1:]
    if not value.isdigit() or len(value) > 8 or unit not in _GRPC_TIMEOUT_UNITS:
        return None
    return int(value) * _GRPC_TIMEOUT_UNITS[unit]


def _client_timeout(fields: Mapping[str, str]) -> float | None:
    text = fields.get("grpc-timeout")
    return None if text is None else _parse_timeout(text)


# The socket


def bind(path: Path) -> tuple[socket.socket, Identity]:
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
            listener.listen(BACKLOG)
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


async def serve(
    server: Server,
    listener: socket.socket,
    path: Path,
    own: Identity,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve on `listener` until cancelled; then close it and remove its file if still ours."""
    try:
        await server.serve(listener, task_status=task_status)
    finally:
        trio.lowlevel.notify_closing(listener)
        listener.close()
        if identity(path) == own:
            try:
                os.unlink(path)
            except OSError as exc:
                log.log(V1, "Cannot remove %s: %s", path, exc.strerror)
