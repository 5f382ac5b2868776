"""What the daemon relies on in its libraries beyond their documented API, pinned here.

An upgrade of grpclib, h2 or trio-asyncio that changes one of these fails in this file first,
and pcc_plugin/_grpclib.py (or bridge.py) is the one place to mend.
"""

from __future__ import annotations

import asyncio
import inspect
import socket

import grpclib.config
import grpclib.const
import grpclib.events
import grpclib.protocol
import grpclib.server
import h2.settings
import pytest
import trio
import trio_asyncio

from pcc_plugin import _grpclib, bridge


def test_grpclib_server_configuration_takes_window_sizes_and_has_server_defaults() -> None:
    config = grpclib.config.Configuration(
        http2_connection_window_size=65_535, http2_stream_window_size=65_535
    ).__for_server__()
    assert config.http2_connection_window_size == 65_535
    assert config.http2_stream_window_size == 65_535


def test_grpclib_protocol_and_server_stream_signatures() -> None:
    protocol = inspect.signature(grpclib.protocol.H2Protocol.__init__)
    assert list(protocol.parameters)[1:] == ["handler", "config", "h2_config"]
    stream = inspect.signature(grpclib.server.Stream.__init__)
    assert list(stream.parameters)[1:6] == [
        "stream", "method_name", "cardinality", "recv_type", "send_type",
    ]  # fmt: skip
    assert {"codec", "status_details_codec", "dispatch"} <= set(stream.parameters)
    assert isinstance(grpclib.events._DispatchServerEvents(), object)
    handler = grpclib.protocol.AbstractHandler
    assert {"accept", "cancel", "close"} <= set(handler.__abstractmethods__)


async def test_an_accepted_connection_runs_grpclib_and_counts_its_streams() -> None:
    """open_connection: the protocol and its `processor.streams`, on a socket pair."""
    accepted: list[object] = []

    class Recorder(_grpclib.Handler):
        def accept(self, stream: object, headers: object, release_stream: object) -> None:
            accepted.append(headers)

        def cancel(self, stream: object) -> None:
            pass

        def close(self) -> None:
            pass

        def answer_at_once(self, protocol: object, request: object) -> bool:
            return False

        def received(self) -> None:
            pass

    server_side, client_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with client_side, trio.fail_after(10):
        async with bridge.asyncio_loop():
            protocol = await _grpclib.accept(server_side, Recorder(), 65_535, 7)
            assert _grpclib.open_streams(protocol) == 0
            # The server speaks first: its SETTINGS, with our stream limit in them.
            client_side.settimeout(5)
            settings = await trio.to_thread.run_sync(client_side.recv, 65536)
            max_streams = h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS
            assert max_streams.to_bytes(2, "big") + (7).to_bytes(4, "big") in settings
            protocol.connection.close()


async def test_receive_exactly_maps_a_short_stream_to_stream_ended() -> None:
    """grpclib's buffer raises AssertionError when the stream ends before `n` bytes."""

    async def short() -> None:
        buffer = grpclib.protocol.Buffer(lambda size: None)
        buffer.add(b"ab", 2)
        buffer.eof()
        stream = grpclib.protocol.Stream.__new__(grpclib.protocol.Stream)
        stream.buffer = buffer
        with pytest.raises(_grpclib.StreamEnded):
            await _grpclib.receive_exactly(stream, 5)

    with trio.fail_after(10):
        async with bridge.asyncio_loop():
            await bridge.call_asyncio(short)


async def test_trio_asyncio_raises_an_asyncio_callbacks_error_unless_handled() -> None:
    """Why bridge.asyncio_loop sets its own exception handler."""

    def broken() -> None:
        raise RuntimeError("boom")

    async def run_a_loop_with_a_broken_callback() -> None:
        async with trio_asyncio.open_loop() as loop:
            loop.call_soon(broken)
            await trio.sleep_forever()

    with pytest.raises(BaseExceptionGroup) as raised, trio.fail_after(10):
        await run_a_loop_with_a_broken_callback()
    assert raised.group_contains(RuntimeError, match="boom")


def test_cardinalities_used_for_answers_exist() -> None:
    assert grpclib.const.Cardinality.UNARY_UNARY.server_streaming is False
    assert grpclib.const.Cardinality.UNARY_STREAM.server_streaming is True


def test_asyncio_has_timeout_and_connect_accepted_socket() -> None:
    assert hasattr(asyncio, "timeout")
    assert hasattr(asyncio.AbstractEventLoop, "connect_accepted_socket")
