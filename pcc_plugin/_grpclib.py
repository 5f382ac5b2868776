"""grpclib's private parts, used here and nowhere else.

The server runs grpclib's HTTP/2 protocol and its server-side stream on
connections it accepts itself, with request dispatch of its own; that takes
these pieces of grpclib 0.4 that are not its documented API:

- `grpclib.protocol.H2Protocol(handler, config, h2_config)` and its
  `processor.streams` (the open streams of a connection);
- `grpclib.protocol.Stream.recv_data(n)`, which raises AssertionError when the
  stream ends before `n` bytes came;
- `grpclib.server.Stream(...)`'s constructor and `grpclib.events._DispatchServerEvents`;
- `Configuration.__for_server__()`.

tests/test_library_contracts.py pins each of them, so that an upgrade of
grpclib fails there and only there.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import grpclib.config
import grpclib.const
import grpclib.encoding.base
import grpclib.events
import grpclib.protocol
import grpclib.server
import h2.config
import h2.settings

from pcc_plugin.bridge import call_asyncio

H2Stream = grpclib.protocol.Stream
AnswerStream = grpclib.server.Stream[Any, Any]
Handler = grpclib.protocol.AbstractHandler


class StreamEnded(Exception):
    """The peer ended its stream before the bytes a message announced."""


class PassThroughCodec(grpclib.encoding.base.CodecBase):
    """Messages are bytes both ways: requests are read and answers encoded by our own code."""

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        assert isinstance(message, bytes), type(message)
        return message

    def decode(self, data: bytes, message_type: Any) -> Any:
        return data


_DISPATCH = grpclib.events._DispatchServerEvents()
_CODEC = PassThroughCodec()


class _Protocol(grpclib.protocol.H2Protocol):
    def __init__(self, handler: Handler, config: Any, h2_config: Any, max_streams: int) -> None:
        super().__init__(handler, config, h2_config)
        self._max_streams = max_streams

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        # Sent with the server's first SETTINGS, before any request can arrive.
        self.connection._connection.update_settings(
            {h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: self._max_streams}
        )
        self.connection.flush()


async def open_connection(
    sock: socket.socket, handler: Handler, window: int, max_streams: int
) -> grpclib.protocol.H2Protocol:
    """Run grpclib's HTTP/2 protocol on an accepted socket, requests going to `handler`.

    `window` bounds how much a peer may send before we have read it, per
    stream and per connection; `max_streams` bounds its concurrent streams.
    """
    config = grpclib.config.Configuration(
        http2_connection_window_size=window, http2_stream_window_size=window
    ).__for_server__()
    h2_config = h2.config.H2Configuration(
        client_side=False,
        header_encoding="ascii",
        validate_inbound_headers=False,
        validate_outbound_headers=False,
        normalize_inbound_headers=False,
        normalize_outbound_headers=False,
    )
    protocol = _Protocol(handler, config, h2_config, max_streams)
    await asyncio.get_running_loop().connect_accepted_socket(lambda: protocol, sock)
    return protocol


async def accept(
    sock: socket.socket, handler: Handler, window: int, max_streams: int
) -> grpclib.protocol.H2Protocol:
    """`open_connection`, called from trio."""
    return await call_asyncio(open_connection, sock, handler, window, max_streams)


def open_streams(protocol: grpclib.protocol.H2Protocol) -> int:
    return len(protocol.processor.streams)


async def receive_exactly(stream: H2Stream, size: int) -> bytes:
    """`size` bytes of the request, b"" if the stream ended before any; else StreamEnded."""
    try:
        return await stream.recv_data(size)
    except AssertionError:
        raise StreamEnded(f"the stream ended before the {size} bytes announced") from None


def answer_stream(stream: H2Stream, path: str, server_streaming: bool) -> AnswerStream:
    """grpclib's server-side stream for answering: initial metadata, messages, trailers."""
    cardinality = (
        grpclib.const.Cardinality.UNARY_STREAM
        if server_streaming
        else grpclib.const.Cardinality.UNARY_UNARY
    )
    return grpclib.server.Stream(
        stream,
        path,
        cardinality,
        bytes,
        bytes,
        codec=_CODEC,
        status_details_codec=None,
        dispatch=_DISPATCH,
    )
