"""Clients that send what a careless or hostile neighbour might: raw HTTP/2 frames, raw HTTP.

grpcio only sends well-formed gRPC; these put arbitrary bytes in a gRPC DATA frame (a
truncated message, a compressed flag, a length that promises more than follows) and report
what the server answered. They are blocking: call them through ``run_blocking``.
"""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import attrs
import h2.config
import h2.connection
import h2.events
import h2.exceptions


@attrs.frozen
class Outcome:
    """How a call ended: its grpc-status and message, or the stream reset with no status."""

    status: int | None
    message: str
    reset: bool = False


def grpc_frame(payload: bytes, *, compressed: bool = False, length: int | None = None) -> bytes:
    """A gRPC length-prefixed message; `length` may lie about the payload's size."""
    size = len(payload) if length is None else length
    return struct.pack(">?I", compressed, size) + payload


def request_headers(path: str, extra: list[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
    """A gRPC request's headers as grpcio sends them, then `extra`."""
    return [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", path),
        (":authority", "localhost"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
        *(extra or []),
    ]


def call(
    socket_path: Path,
    path: str,
    body: bytes,
    *,
    end_stream: bool = True,
    headers: list[tuple[str, str]] | None = None,
    timeout: float = 10.0,
) -> Outcome:
    """One request with `body` as its raw DATA; the server's answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        # Blocking: a unix socket's connect waits for room in a full backlog (a timeout would
        # make it fail at once with EAGAIN).
        sock.connect(str(socket_path))
        sock.settimeout(timeout)
        return call_on(sock, path, body, end_stream=end_stream, headers=headers)


def call_on(
    sock: socket.socket,
    path: str,
    body: bytes,
    *,
    end_stream: bool = True,
    headers: list[tuple[str, str]] | None = None,
) -> Outcome:
    """`call` on a connected socket."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    stream_id = connection.get_next_available_stream_id()
    connection.send_headers(stream_id, request_headers(path, headers))
    sock.sendall(connection.data_to_send())
    # As fast as the server's flow control allows, until it answers (it may refuse early).
    return _send_and_answer(sock, connection, stream_id, body, end_stream)


def _send_and_answer(
    sock: socket.socket,
    connection: h2.connection.H2Connection,
    stream_id: int,
    body: bytes,
    end_stream: bool,
) -> Outcome:
    sent = 0
    while sent < len(body):
        window = min(
            connection.local_flow_control_window(stream_id), connection.max_outbound_frame_size
        )
        if window > 0:
            chunk = body[sent : sent + window]
            connection.send_data(stream_id, chunk)
            sent += len(chunk)
            sock.sendall(connection.data_to_send())
            continue
        answer = _read_events(sock, connection, stream_id, {})
        if answer is not None:
            return answer
    if end_stream:
        connection.end_stream(stream_id)
        sock.sendall(connection.data_to_send())
    return _outcome(sock, connection, stream_id)


def _outcome(
    sock: socket.socket, connection: h2.connection.H2Connection, stream_id: int
) -> Outcome:
    fields: dict[str, str] = {}
    while True:
        answer = _read_events(sock, connection, stream_id, fields)
        if answer is not None:
            return answer


def _read_events(
    sock: socket.socket,
    connection: h2.connection.H2Connection,
    stream_id: int,
    fields: dict[str, str],
) -> Outcome | None:
    """One read's events: the call's outcome if they end it, else None (a window update...)."""
    try:
        data = sock.recv(65536)
    except ConnectionResetError:
        return Outcome(None, "connection reset", reset=True)
    if not data:
        return Outcome(None, "connection closed", reset=True)
    try:
        events = connection.receive_data(data)
    except h2.exceptions.ProtocolError as exc:
        return Outcome(None, f"protocol error: {exc}", reset=True)
    sock.sendall(connection.data_to_send())
    for event in events:
        if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
            fields.update((key.decode(), value.decode()) for key, value in event.headers)
            if "grpc-status" in fields:
                return Outcome(int(fields["grpc-status"]), fields.get("grpc-message", ""))
        if isinstance(event, h2.events.DataReceived):
            connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        if isinstance(event, h2.events.StreamReset) and event.stream_id == stream_id:
            return Outcome(None, f"stream reset, error code {event.error_code}", reset=True)
        if isinstance(event, h2.events.ConnectionTerminated):
            return Outcome(None, "connection terminated (GOAWAY)", reset=True)
    return None


def connect(path: Path) -> socket.socket:
    """A unix socket connection that sends nothing by itself."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(path))
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """Read until the server closes the connection (its SETTINGS frames come first); False if
    it is still open after the socket's timeout."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def http_get(host: str, port: int, request: bytes, timeout: float = 10.0) -> bytes:
    """Send raw bytes to an HTTP port; everything it answers until it closes."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def reset_after(sock: socket.socket) -> None:
    """Close with SO_LINGER(1, 0): the peer gets a TCP RST instead of a FIN."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
