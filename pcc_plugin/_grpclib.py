"""grpclib's private parts, used here and nowhere else.

The server runs grpclib's HTTP/2 protocol and its server-side stream on
connections it accepts itself, with request dispatch of its own; that takes
these pieces of grpclib 0.4 that are not its documented API:

- `grpclib.protocol.H2Protocol(handler, config, h2_config)` and its
  `processor.streams` (the open streams of a connection);
- `grpclib.protocol.Stream.recv_data(n)`, which raises AssertionError when the
  stream ends before `n` bytes came;
- `grpclib.server.Stream(...)`'s constructor and `grpclib.events._DispatchServerEvents`;
- `Configuration.__for_server__()`;
- feeding `H2Protocol.data_received` ourselves, with asyncio's transport
  paused for reading (it still writes and closes);
- to answer a unary call at once, in the call stack that read it: the
  stream's `buffer` (`_eof`, `_acked_size`, and `_unacked`, a queue of (data,
  size, ack_size)), `connection.ack` and `flush`, `connection.write_ready`,
  and the h2 connection under it (`Stream._h2_connection`);
- of that h2 connection, to frame a successful answer here: its queue of
  bytes to send (`_data_to_send`), `outbound_flow_control_window`, whether its
  encoder owes a table size update (`encoder.header_table.resized`), and the
  state machines of the connection and of the stream (`state_machine`,
  `streams[id].state_machine`, fed `ConnectionInputs` and `StreamInputs`);
  and its `decoder`, replaced by one that remembers repeated header blocks
  (`H2Protocol.connection._connection`).

tests/test_library_contracts.py pins the first five, so that an upgrade of
grpclib fails there and only there; tests/test_grpc_server.py pins the rest
with unary calls that arrive whole, in pieces, with answers larger than the
client's window, past its connection's window (a thousand calls on one
connection: more than it may hold open, unless h2 sees each stream end), and
after it shrinks the HPACK table, and with header blocks decoded both ways.
"""

from __future__ import annotations

import abc
import asyncio
import socket
from typing import Any

import grpclib.config
import grpclib.const
import grpclib.encoding.base
import grpclib.events
import grpclib.metadata
import grpclib.protocol
import grpclib.server
import h2.config
import h2.connection
import h2.settings
import h2.stream
import hpack

from pcc_plugin.bridge import call_asyncio

H2Stream = grpclib.protocol.Stream
AnswerStream = grpclib.server.Stream[Any, Any]
CONTENT_TYPE = "application/grpc+proto"
_ANSWER_HEADERS = [(":status", "200"), ("content-type", CONTENT_TYPE)]


class Handler(grpclib.protocol.AbstractHandler):
    """grpclib's request handler, told also when all the bytes of one read are processed."""

    @abc.abstractmethod
    def received(self) -> None: ...


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


# Header blocks a connection's decoder remembers (a client repeats a few, one per method).
_KNOWN_BLOCKS = 16


class _RepeatingDecoder(hpack.Decoder):
    """HPACK's decoder, remembering what header blocks of indexed fields only decode to.

    A client sends the same header block for every call of a method; once its fields are in
    the dynamic table, the block is one byte per field, an index with the high bit set. Such
    a block changes nothing in the table, so it decodes the same until one that is not such
    (a literal added to the table, a size update) or a new table size changes the table.
    """

    def __init__(self) -> None:
        super().__init__()
        self._known: dict[tuple[bytes, bool, int], list[Any]] = {}

    def decode(self, data: bytes, raw: bool = False) -> list[Any]:
        block = bytes(data)
        # Every byte 0x81 or more: one-byte indices only (an index of 127 or more ends with
        # a byte below 0x80, index 0 is 0x80 and an error).
        if not block or min(block) < 0x81:
            self._known.clear()
            return list(super().decode(block, raw))
        key = (block, raw, self.max_header_list_size)
        headers = self._known.get(key)
        if headers is None:
            headers = list(super().decode(block, raw))
            if len(self._known) >= _KNOWN_BLOCKS:
                self._known.clear()
            self._known[key] = headers
        return list(headers)

    @property
    def header_table_size(self) -> int:
        return self.header_table.maxsize

    @header_table_size.setter
    def header_table_size(self, value: int) -> None:
        self._known.clear()
        self.header_table.maxsize = value


class _Protocol(grpclib.protocol.H2Protocol):
    def __init__(self, handler: Handler, config: Any, h2_config: Any, max_streams: int) -> None:
        super().__init__(handler, config, h2_config)
        self._max_streams = max_streams

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        super().connection_made(transport)
        h2_connection = self.connection._connection
        decoder = _RepeatingDecoder()
        decoder.max_header_list_size = h2_connection.decoder.max_header_list_size
        h2_connection.decoder = decoder
        # Sent with the server's first SETTINGS, before any request can arrive.
        self.connection._connection.update_settings(
            {h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: self._max_streams}
        )
        self.connection.flush()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self.handler.received()  # type: ignore[attr-defined]


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
    transport, _ = await asyncio.get_running_loop().connect_accepted_socket(lambda: protocol, sock)
    # The caller reads, in trio, and hands the bytes to `feed`: asyncio's own reader went
    # through trio-asyncio's queue twice for every read. asyncio's transport writes.
    transport.pause_reading()
    return protocol


def feed(protocol: grpclib.protocol.H2Protocol, data: bytes) -> bool:
    """Bytes the peer sent, as asyncio's transport would hand them over; False once grpclib
    has closed the connection (a protocol error, say), when nothing more may be fed."""
    if protocol.connection.is_closing():
        return False
    protocol.data_received(data)
    return True


def ended(protocol: grpclib.protocol.H2Protocol, error: OSError | None) -> None:
    """The peer closed its end (`error` None) or the connection failed: close ours."""
    transport = protocol.transport  # type: ignore[attr-defined]
    if error is not None:
        transport.abort()
    elif not transport.is_closing():
        transport.close()


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


def can_send(stream: H2Stream) -> bool:
    """Whether the connection takes more to send now (grpclib's own writers wait until it does)."""
    return stream.connection.write_ready.is_set() and not stream.connection.is_closing()


def whole_body(stream: H2Stream) -> bytes | None:
    """The request's bytes, if the client has ended its stream and all of them are here.

    Only then are they taken out of grpclib's buffer, and acknowledged as its reader would.
    """
    buffer = stream.buffer
    if not buffer._eof or buffer._acked_size:
        return None
    queued = [buffer._unacked.get_nowait() for _ in range(buffer._unacked.qsize())]
    assert stream.id is not None
    stream.connection.ack(stream.id, sum(item.ack_size for item in queued))
    return b"".join(item.data for item in queued)


def _framed(answer: bytes) -> bytes:
    return b"\0" + len(answer).to_bytes(4, "big") + answer


def fits(stream: H2Stream, answer: bytes | None) -> bool:
    """Whether the answer can go in one DATA frame that the client's windows allow now."""
    if answer is None:
        return True
    assert stream.id is not None
    h2_connection = stream._h2_connection
    room = min(
        h2_connection.local_flow_control_window(stream.id), h2_connection.max_outbound_frame_size
    )
    return len(answer) + 5 <= room


# An answer's header blocks: `:status: 200` from HPACK's static table, content-type a literal
# not indexed (its name static index 31), and trailers of `grpc-status: 0`, a literal not
# indexed with its name. None touches either end's dynamic table, so each block is the same
# bytes on every stream and needs no encoder.
_ANSWER_HEADER_BLOCK = b"\x88\x0f\x10" + bytes([len(CONTENT_TYPE)]) + CONTENT_TYPE.encode()
_OK_TRAILER_BLOCK = b"\x00\x0bgrpc-status\x010"
_HEADERS, _DATA = 0x1, 0x0
_END_STREAM, _END_HEADERS = 0x1, 0x4


def _frame(kind: int, flags: int, stream_id: int, payload: bytes) -> bytes:
    return (
        len(payload).to_bytes(3, "big")
        + bytes((kind, flags))
        + stream_id.to_bytes(4, "big")
        + payload
    )


def answer_now(
    stream: H2Stream, status: grpclib.const.Status, message: str | None, answer: bytes | None
) -> None:
    """A unary call's whole answer, as grpclib's server stream would send it: headers, the
    message and trailers, or trailers only for an error. Queued until `flush`.

    A successful answer is framed here (h2 spends more on its three frames than the whole
    call costs elsewhere): h2's connection and stream are moved to the states its
    send_headers would leave them in, the message's size is taken from the connection's
    window as its send_data would, and the frames join its queue in their place.
    """
    assert stream.id is not None
    h2_connection = stream._h2_connection
    if (
        answer is not None
        and status is grpclib.const.Status.OK
        and message is None
        and not h2_connection.encoder.header_table.resized
    ):
        h2_stream = h2_connection.streams[stream.id]
        h2_connection.state_machine.process_input(h2.connection.ConnectionInputs.SEND_HEADERS)
        h2_stream.state_machine.process_input(h2.stream.StreamInputs.SEND_HEADERS)
        h2_stream.state_machine.process_input(h2.stream.StreamInputs.SEND_END_STREAM)
        body = _framed(answer)
        h2_connection._data_to_send += (
            _frame(_HEADERS, _END_HEADERS, stream.id, _ANSWER_HEADER_BLOCK)
            + _frame(_DATA, 0, stream.id, body)
            + _frame(_HEADERS, _END_HEADERS | _END_STREAM, stream.id, _OK_TRAILER_BLOCK)
        )
        h2_connection.outbound_flow_control_window -= len(body)
        return
    # Errors, and answers while h2 owes a table size update at the start of the next
    # header block: h2 frames it all.
    trailers = [("grpc-status", str(status.value))]
    if message is not None:
        trailers.append(("grpc-message", grpclib.metadata.encode_grpc_message(message)))
    if answer is None:
        h2_connection.send_headers(stream.id, _ANSWER_HEADERS + trailers, end_stream=True)
    else:
        h2_connection.send_headers(stream.id, _ANSWER_HEADERS)
        h2_connection.send_data(stream.id, _framed(answer))
        h2_connection.send_headers(stream.id, trailers, end_stream=True)


def flush(stream: H2Stream) -> None:
    """Write what is queued on the stream's connection."""
    if not stream.connection.is_closing():
        stream.connection.flush()
