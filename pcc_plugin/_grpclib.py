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
  (`H2Protocol.connection._connection`);
- of that h2 connection, to answer a call before grpclib reads it (h2's and
  grpclib's reading of a call cost more than the rest of it): its frame buffer
  (`incoming_buffer`: `_data`, `_headers_buffer`, `_preamble_len`), the
  settings and windows its own checks read (`local_settings`,
  `remote_settings`, `highest_inbound_stream_id`, `max_inbound_frame_size`,
  `inbound_flow_control_window`, `open_inbound_streams`), `_begin_new_stream`,
  `_inbound_flow_control_window_manager.window_consumed`, and a stream's
  `receive_window_update` and `receive_data`.

tests/test_library_contracts.py pins the first five, so that an upgrade of
grpclib fails there and only there; tests/test_grpc_server.py pins the rest
with unary calls that arrive whole, in pieces, one by one, with answers larger
than the client's window, past its connection's window (a thousand calls on one
connection: more than it may hold open, unless h2 sees each stream end), and
after it shrinks the HPACK table, with header blocks decoded both ways, and
with calls crafted to be read before grpclib reads them or not (each outcome
h2's own).
"""

from __future__ import annotations

import abc
import asyncio
import socket
from collections.abc import Mapping
from typing import Any, NamedTuple

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


class WholeRequest(NamedTuple):
    """A call that came whole in one read: a new stream's HEADERS, WINDOW_UPDATEs of the
    stream, and one DATA frame ending it."""

    stream_id: int
    fields: Mapping[str, str]
    window_increment: int  # what the client's WINDOW_UPDATEs of the stream added to its window
    body: bytes  # the DATA frame's payload: the call's length-prefixed messages
    size: int  # of the bytes read, how many are these frames (h2 reads the rest)


class Handler(grpclib.protocol.AbstractHandler):
    """grpclib's request handler, offered also a call that came whole in one read before
    grpclib reads it, and told when all the bytes of one read are processed."""

    @abc.abstractmethod
    def answer_at_once(self, protocol: grpclib.protocol.H2Protocol, request: WholeRequest) -> bool:
        """True if answered; False for grpclib to read it."""

    @abc.abstractmethod
    def received(self) -> None:
        """Answers queued by then are written in one write, once it returns."""


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
        self._fields: dict[tuple[bytes, bool, int], Mapping[str, str] | None] = {}

    def decode(self, data: bytes, raw: bool = False) -> list[Any]:
        block = bytes(data)
        # Every byte 0x81 or more: one-byte indices only (an index of 127 or more ends with
        # a byte below 0x80, index 0 is 0x80 and an error).
        if not block or min(block) < 0x81:
            self._forget()
            return list(super().decode(block, raw))
        key = (block, raw, self.max_header_list_size)
        headers = self._known.get(key)
        if headers is None:
            headers = list(super().decode(block, raw))
            if len(self._known) >= _KNOWN_BLOCKS:
                self._forget()
            self._known[key] = headers
        return list(headers)

    def known_fields(self, block: bytes) -> Mapping[str, str] | None:
        """The fields a block decoded to before as h2 decodes them, if it decodes the same
        again (and changes nothing); None if not known, or not ASCII as h2 requires."""
        key = (block, True, self.max_header_list_size)
        if key in self._fields:
            return self._fields[key]
        headers = self._known.get(key)
        if headers is None:
            return None
        try:
            fields: Mapping[str, str] | None = {
                name.decode("ascii"): value.decode("ascii") for name, value in headers
            }
        except UnicodeDecodeError:
            fields = None
        self._fields[key] = fields
        return fields

    def _forget(self) -> None:
        self._known.clear()
        self._fields.clear()

    @property
    def header_table_size(self) -> int:
        return self.header_table.maxsize

    @header_table_size.setter
    def header_table_size(self, value: int) -> None:
        self._forget()
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
        start = _request_start(self.connection._connection, data)
        for part in (data[:start], data[start:]) if start else (data,):
            self._read(part)
        self.handler.received()  # type: ignore[attr-defined]
        _flush(self)  # the answers given at once, in one write

    def _read(self, data: bytes) -> None:
        if self.connection.is_closing():
            return  # h2 refused what came before
        request = _whole_request(self.connection, data)
        if request is None or not self.handler.answer_at_once(self, request):  # type: ignore[attr-defined]
            super().data_received(data)
        elif request.size < len(data):
            super().data_received(data[request.size :])


def _request_start(h2_connection: h2.connection.H2Connection, data: bytes) -> int:
    """Where the first HEADERS frame in these bytes begins, if whole frames come before it
    (grpc-go sends a WINDOW_UPDATE and a PING before a call's frames): h2 reads those first.
    """
    buffer = h2_connection.incoming_buffer
    if buffer._data or buffer._preamble_len:
        return 0
    return _first_headers(data)


def _first_headers(data: bytes) -> int:
    """Where the first HEADERS frame begins, past whole frames; 0 if none does."""
    at = 0
    while at + 9 <= len(data) and data[at + 3] != _HEADERS:
        at += 9 + int.from_bytes(data[at : at + 3], "big")
    return at if at + 9 <= len(data) else 0


def _whole_request(connection: grpclib.protocol.Connection, data: bytes) -> WholeRequest | None:
    """The call these bytes begin with, if they begin with a new stream's HEADERS with a
    header block decoded before, WINDOW_UPDATEs of that stream (grpcio sends one), and one
    DATA frame ending the stream, all as h2 would accept them.

    Anything else (a frame begun in an earlier read, padding, priority, CONTINUATION, a
    flow-control or stream-count violation, a connection going away), h2 reads.
    """
    if not _writable(connection):
        return None
    h2_connection = connection._connection
    buffer = h2_connection.incoming_buffer
    if (
        buffer._data
        or buffer._headers_buffer
        or buffer._preamble_len
        or h2_connection.state_machine.state is not h2.connection.ConnectionState.SERVER_OPEN
    ):
        return None
    frames = _request_frames(data)
    if frames is None:
        return None
    stream_id, block, window_increment, body, size = frames
    if (
        stream_id % 2 == 0
        or stream_id <= h2_connection.highest_inbound_stream_id
        or max(len(block), len(body)) > h2_connection.max_inbound_frame_size
        or len(body) > h2_connection.inbound_flow_control_window
        or len(body) > h2_connection.local_settings.initial_window_size
        or h2_connection.remote_settings.initial_window_size + window_increment > _MAX_WINDOW
        or h2_connection.open_inbound_streams >= h2_connection.local_settings.max_concurrent_streams
    ):
        return None
    decoder = h2_connection.decoder
    assert isinstance(decoder, _RepeatingDecoder)
    fields = decoder.known_fields(block)
    if fields is None or "content-length" in fields or ":status" in fields:
        return None
    return WholeRequest(stream_id, fields, window_increment, body, size)


def _request_frames(data: bytes) -> tuple[int, bytes, int, bytes, int] | None:
    """Stream, header block, window increments, DATA payload and the size of the frames, if
    the bytes begin with such frames."""
    if data[3:5] != _HEADERS_NOT_ENDING:
        return None
    stream_id = _stream_of(data, 0)
    at = 9 + int.from_bytes(data[:3], "big")
    block = data[9:at]
    window_increment = 0
    while data[at + 3 : at + 4] == _WINDOW_UPDATE_TYPE:
        increment = int.from_bytes(data[at + 9 : at + 13], "big")
        if data[at : at + 3] != _WINDOW_UPDATE_SIZE or _stream_of(data, at) != stream_id:
            return None
        if not 1 <= increment <= _MAX_WINDOW:
            return None  # a protocol error (the reserved bit counts here), h2's to answer
        window_increment += increment
        at += 13
    end = at + 9 + int.from_bytes(data[at : at + 3], "big")
    if (
        data[at + 3 : at + 5] != _DATA_ENDING
        or _stream_of(data, at) != stream_id
        or end > len(data)
    ):
        return None
    return stream_id, block, window_increment, data[at + 9 : end], end


def _stream_of(data: bytes, frame_at: int) -> int:
    return int.from_bytes(data[frame_at + 5 : frame_at + 9], "big") & _STREAM_ID_BITS


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
    return _writable(stream.connection)


def _writable(connection: grpclib.protocol.Connection) -> bool:
    return connection.write_ready.is_set() and not connection.is_closing()


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
# A request's frames: type and flags of its HEADERS and DATA (no padding, no priority), type
# and size of a WINDOW_UPDATE; the stream ID's bits (the top one is reserved, and ignored in
# an ID, not in a window increment); the largest window.
_HEADERS_NOT_ENDING = bytes((_HEADERS, _END_HEADERS))
_DATA_ENDING = bytes((_DATA, _END_STREAM))
_WINDOW_UPDATE_TYPE, _WINDOW_UPDATE_SIZE = b"\x08", b"\0\0\4"
_STREAM_ID_BITS = 0x7FFF_FFFF
_MAX_WINDOW = 2**31 - 1


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
    message and trailers, or trailers only for an error; written once the bytes that
    brought the call are processed."""
    assert stream.id is not None
    _queue_answer(stream._h2_connection, stream.id, status, message, answer)


def answer_unread(
    protocol: grpclib.protocol.H2Protocol,
    request: WholeRequest,
    status: grpclib.const.Status,
    message: str | None,
    answer: bytes | None,
) -> bool:
    """`answer_now` for a call that grpclib has not read, if the answer fits the client's
    windows now; else False, and nothing has changed.

    h2 is moved to where reading the request would have left it (the stream opened and
    half closed, its bytes taken from both windows and acknowledged as grpclib's reader
    would), without the frame parsing, events and streams of h2's and grpclib's reading,
    which cost more than the rest of the call.
    """
    h2_connection = protocol.connection._connection
    if answer is not None:
        room = min(
            h2_connection.outbound_flow_control_window,
            h2_connection.remote_settings.initial_window_size + request.window_increment,
            h2_connection.max_outbound_frame_size,
        )
        if len(answer) + 5 > room:
            return False
    h2_connection.state_machine.process_input(h2.connection.ConnectionInputs.RECV_HEADERS)
    h2_stream = h2_connection._begin_new_stream(
        request.stream_id, h2.connection.AllowedStreamIDs.ODD
    )
    h2_stream.state_machine.process_input(h2.stream.StreamInputs.RECV_HEADERS)
    if request.window_increment:
        h2_connection.state_machine.process_input(h2.connection.ConnectionInputs.RECV_WINDOW_UPDATE)
        h2_stream.receive_window_update(request.window_increment)
    h2_connection.state_machine.process_input(h2.connection.ConnectionInputs.RECV_DATA)
    size = len(request.body)
    h2_connection._inbound_flow_control_window_manager.window_consumed(size)
    h2_stream.receive_data(request.body, True, size)
    if size:
        h2_connection.acknowledge_received_data(size, request.stream_id)
    _queue_answer(h2_connection, request.stream_id, status, message, answer)
    return True


def _queue_answer(
    h2_connection: h2.connection.H2Connection,
    stream_id: int,
    status: grpclib.const.Status,
    message: str | None,
    answer: bytes | None,
) -> None:
    """A successful answer is framed here (h2 spends more on its three frames than the whole
    call costs elsewhere): h2's connection and stream are moved to the states its
    send_headers would leave them in, the message's size is taken from the connection's
    window as its send_data would, and the frames join its queue in their place.
    """
    if (
        answer is not None
        and status is grpclib.const.Status.OK
        and message is None
        and not h2_connection.encoder.header_table.resized
    ):
        h2_stream = h2_connection.streams[stream_id]
        h2_connection.state_machine.process_input(h2.connection.ConnectionInputs.SEND_HEADERS)
        h2_stream.state_machine.process_input(h2.stream.StreamInputs.SEND_HEADERS)
        h2_stream.state_machine.process_input(h2.stream.StreamInputs.SEND_END_STREAM)
        body = _framed(answer)
        h2_connection._data_to_send += (
            _frame(_HEADERS, _END_HEADERS, stream_id, _ANSWER_HEADER_BLOCK)
            + _frame(_DATA, 0, stream_id, body)
            + _frame(_HEADERS, _END_HEADERS | _END_STREAM, stream_id, _OK_TRAILER_BLOCK)
        )
        h2_connection.outbound_flow_control_window -= len(body)
        return
    # Errors, and answers while h2 owes a table size update at the start of the next
    # header block: h2 frames it all.
    trailers = [("grpc-status", str(status.value))]
    if message is not None:
        trailers.append(("grpc-message", grpclib.metadata.encode_grpc_message(message)))
    if answer is None:
        h2_connection.send_headers(stream_id, _ANSWER_HEADERS + trailers, end_stream=True)
    else:
        h2_connection.send_headers(stream_id, _ANSWER_HEADERS)
        h2_connection.send_data(stream_id, _framed(answer))
        h2_connection.send_headers(stream_id, trailers, end_stream=True)


def _flush(protocol: grpclib.protocol.H2Protocol) -> None:
    """Write what is queued on the connection."""
    if not protocol.connection.is_closing():
        protocol.connection.flush()
