"""grpclib beyond its documented API: four names, three for a bound grpclib cannot keep, one
to know a failure of its client that would otherwise look like a bug of ours.

grpclib 0.4 serves only connections that asyncio accepts for it, answers a call to an unknown
method without naming it, and reads a request message whole, at whatever size its prefix
declares, before the codec sees any of it. The daemon's limits (README, "Limits") need each
otherwise, and get it here, and nowhere else:

- `Server._protocol_factory`: grpclib's HTTP/2 protocol for a connection the daemon accepted
  itself, so that it can cap connections and give each its deadlines;
- `Server._mapping`: the method table, given a fallback that answers an unknown path
  UNIMPLEMENTED, naming it (grpclib says only "Method not found");
- `Stream._stream`: the call's HTTP/2 stream, whose `recv_data(n)` reads exactly n bytes of
  the request, so that the 5-byte prefix is read and checked before the message behind it;
- `_transport`, in a client's AttributeError: a connection the peer closed between its set-up
  and the call's first stream (a kubelet going down as the plugin registers) fails so, not
  with a connection error; `lost_before_the_call` tells it apart from any other.

tests/test_library_contracts.py pins all four, and pyproject.toml allows only the grpclib
versions it passes on. Everything else (HTTP/2, headers, grpc-timeout, trailers) is grpclib's
public server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import grpclib.config
import grpclib.const
import grpclib.encoding.base
import grpclib.server

ServerStream = grpclib.server.Stream[bytes, bytes]
# A method as grpclib calls it: given the call's stream, it reads the request and answers.
MethodFunc = Callable[[ServerStream], Any]


class StreamEnded(Exception):
    """The client ended its stream before the bytes a message announced."""


class _PassThrough(grpclib.encoding.base.CodecBase):
    """Messages cross as bytes both ways: the service reads and writes them itself."""

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        assert isinstance(message, bytes), type(message)
        return message

    def decode(self, data: bytes, message_type: Any) -> Any:
        return data


def _handler(func: MethodFunc, server_streaming: bool) -> grpclib.const.Handler:
    cardinality = (
        grpclib.const.Cardinality.UNARY_STREAM
        if server_streaming
        else grpclib.const.Cardinality.UNARY_UNARY
    )
    return grpclib.const.Handler(func, cardinality, bytes, bytes)


class _Methods(dict[str, grpclib.const.Handler]):
    """grpclib's method table, looked up with `get`: any other path gets `unknown`."""

    def __init__(
        self,
        methods: Mapping[str, grpclib.const.Handler],
        unknown: Callable[[str, ServerStream], Any],
    ) -> None:
        super().__init__(methods)
        self._unknown = unknown

    def get(self, path: str, default: Any = None) -> grpclib.const.Handler:
        method = super().get(path)
        if method is None:
            return _handler(lambda stream: self._unknown(path, stream), False)
        return method


def server(
    methods: Mapping[str, tuple[MethodFunc, bool]],
    unknown: Callable[[str, ServerStream], Any],
    window: int,
) -> grpclib.server.Server:
    """grpclib's server for `methods` (path -> (function, server-streaming)), messages as
    bytes, flow-control windows of `window` bytes; a call to any other path goes to
    `unknown(path, stream)`. Made inside the asyncio loop."""
    table = {path: _handler(func, streaming) for path, (func, streaming) in methods.items()}
    config = grpclib.config.Configuration(
        http2_connection_window_size=window, http2_stream_window_size=window
    )
    grpc = grpclib.server.Server([], codec=_PassThrough(), config=config)
    grpc._mapping = _Methods(table, unknown)
    return grpc


def protocol(grpc: grpclib.server.Server) -> asyncio.Protocol:
    """grpclib's protocol for one new connection of `grpc`."""
    return grpc._protocol_factory()


async def receive_exactly(stream: ServerStream, size: int) -> bytes:
    """`size` bytes of the request, b"" if the client ended its stream before any; else
    StreamEnded. Each chunk is acknowledged to the client as it is taken."""
    try:
        return await stream._stream.recv_data(size)
    except AssertionError:
        # grpclib's buffer says so when the stream ended short of `size`.
        raise StreamEnded(f"the stream ended before the {size} bytes announced") from None


def lost_before_the_call(error: AttributeError) -> bool:
    """Whether grpclib's client raised `error` for a connection lost before the call began
    (it deletes a closed connection's transport, then reads it to open the stream)."""
    return error.name == "_transport"
