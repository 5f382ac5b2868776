"""What the daemon relies on in its libraries beyond their documented API, pinned here.

pcc_plugin/_grpclib.py names four private parts of grpclib (`Server._protocol_factory`,
`Server._mapping`, `Stream._stream`, and `_transport` in its client's AttributeError); an
upgrade that changes one fails in this file first.
The last test pins what grpc_server.CONNECTION relies on in asyncio.
"""

from __future__ import annotations

import asyncio
import contextvars
import socket
import struct
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import grpclib.client
import grpclib.const
import grpclib.encoding.proto
import grpclib.exceptions
import pytest
import trio
from raw_clients import Outcome, call_on, grpc_frame

from pcc_plugin import _grpclib, bridge
from pcc_plugin._proto.v1beta1 import Empty

GRPCError = grpclib.exceptions.GRPCError
Status = grpclib.const.Status
ECHO = "/test.Service/Echo"
UNIMPLEMENTED, RESOURCE_EXHAUSTED, INVALID_ARGUMENT = 12, 8, 3

pytestmark = pytest.mark.asyncio_host

Method = Callable[[_grpclib.ServerStream], Coroutine[Any, Any, None]]


async def echo(stream: _grpclib.ServerStream) -> None:
    prefix = await _grpclib.receive_exactly(stream, 5)
    await stream.send_message(await _grpclib.receive_exactly(stream, prefix[4]))


async def unknown(path: str, stream: _grpclib.ServerStream) -> None:
    raise GRPCError(Status.UNIMPLEMENTED, f"no {path}")


async def one_call(method: Method, path: str, body: bytes, *, end_stream: bool = True) -> Outcome:
    """`method` served at ECHO by grpclib on one end of a socket pair; a raw HTTP/2 call to
    `path` from the other."""
    server_side, client_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    client_side.settimeout(5)
    with client_side:
        grpc = _grpclib.server({ECHO: (method, False)}, unknown, 65_535)
        transport, _ = await bridge.call_asyncio(
            asyncio.get_running_loop().connect_accepted_socket,
            lambda: _grpclib.protocol(grpc),
            server_side,
        )
        try:
            return await trio.to_thread.run_sync(
                lambda: call_on(client_side, path, body, end_stream=end_stream)
            )
        finally:
            transport.abort()


async def test_grpclib_serves_a_connection_it_did_not_accept() -> None:
    """`Server._protocol_factory`, with grpclib's codec given our bytes both ways."""
    with trio.fail_after(10):
        outcome = await one_call(echo, ECHO, grpc_frame(b"\x04\x00\x00\x00\x03abc"))
    assert outcome == Outcome(0, "")


@pytest.mark.parametrize("path", ["/test.Service/Nope", "/test.Service/Echo/../Nope", "nope"])
async def test_an_unknown_path_goes_to_the_fallback_which_knows_it(path: str) -> None:
    """`Server._mapping`: grpclib looks methods up with its `get`."""
    with trio.fail_after(10):
        outcome = await one_call(echo, path, grpc_frame(b""))
    assert outcome == Outcome(UNIMPLEMENTED, f"no {path}")


async def test_the_prefix_is_read_without_waiting_for_the_message() -> None:
    """`Stream._stream.recv_data`: five bytes come back once five are there, while the
    client still has a megabyte to send (grpclib's own reader would wait for all of it)."""

    async def refuse(stream: _grpclib.ServerStream) -> None:
        prefix = await _grpclib.receive_exactly(stream, 5)
        raise GRPCError(Status.RESOURCE_EXHAUSTED, f"declared {int.from_bytes(prefix[1:])}")

    declared = struct.pack(">?I", False, 1 << 20) + b"only this"
    with trio.fail_after(10):
        outcome = await one_call(refuse, ECHO, declared, end_stream=False)
    assert outcome == Outcome(RESOURCE_EXHAUSTED, f"declared {1 << 20}")


async def test_a_stream_that_ends_short_is_stream_ended() -> None:
    """`recv_data` raises AssertionError when the stream ends before `n` bytes came."""

    async def read_too_much(stream: _grpclib.ServerStream) -> None:
        try:
            await _grpclib.receive_exactly(stream, 100)
        except _grpclib.StreamEnded as exc:
            raise GRPCError(Status.INVALID_ARGUMENT, str(exc)) from None

    with trio.fail_after(10):
        outcome = await one_call(read_too_much, ECHO, b"\0" * 10)
    assert outcome == Outcome(INVALID_ARGUMENT, "the stream ended before the 100 bytes announced")


async def test_grpclibs_client_fails_on_a_closed_connection_only_in_ways_we_know(
    closing_socket: Path,
) -> None:
    """Each call to a server that closes at once fails with a connection error, or with the
    AttributeError `lost_before_the_call` knows (grpclib 0.4: about half of them)."""
    failures: list[Exception] = []
    with trio.fail_after(60):
        for _ in range(50):
            channel = grpclib.client.Channel(
                path=str(closing_socket), codec=grpclib.encoding.proto.ProtoCodec()
            )
            method = grpclib.client.UnaryUnaryMethod(channel, ECHO, Empty, Empty)
            try:
                await bridge.call_asyncio(method, Empty(), timeout=5)
            except (AttributeError, OSError, grpclib.exceptions.StreamTerminatedError,
                    grpclib.exceptions.ProtocolError) as error:  # fmt: skip
                failures.append(error)
            finally:
                channel.close()
    assert len(failures) == 50, "a server that closes at once answered"
    unknown = [
        error
        for error in failures
        if isinstance(error, AttributeError) and not _grpclib.lost_before_the_call(error)
    ]
    assert unknown == []


async def test_a_task_started_in_a_callback_keeps_the_callbacks_context() -> None:
    """grpc_server.CONNECTION: a call's task, started while grpclib reads its connection's
    bytes, sees the connection set there (asyncio copies the context into a new task)."""
    current: contextvars.ContextVar[str] = contextvars.ContextVar("current")

    async def started_in_a_callback() -> str:
        async def read() -> str:
            return current.get("unset")

        token = current.set("this connection")
        try:
            task = asyncio.get_running_loop().create_task(read())
        finally:
            current.reset(token)
        return await task

    with trio.fail_after(10):
        assert await bridge.call_asyncio(started_in_a_callback) == "this connection"
