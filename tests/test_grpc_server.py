"""The gRPC server in this process, checked from grpcio and raw sockets: teardown and limits.

Limits are made small here (monkeypatched) so that each is reached quickly; the waits are on
what a client sees (an answer, the end of its connection), never on the clock.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import random
import socket
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import h2.config
import h2.connection
import h2.events
import h2.frame_buffer
import h2.settings
import hpack
import hyperframe.frame
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from raw_clients import grpc_frame, request_headers

from pcc_plugin import _grpclib, bridge, grpc_server
from pcc_plugin.flags import Flags
from pcc_plugin.plugin import DevicePlugin
from pcc_plugin.registration import KubeletLink
from pcc_plugin.service import DevicePluginService
from pcc_plugin.sim import run_blocking
from pcc_plugin.sim._pb import deviceplugin_v1beta1_pb2 as pb
from pcc_plugin.stats import ResourceStats

Frame = hyperframe.frame.Frame

LIST_AND_WATCH = "/v1beta1.DevicePlugin/ListAndWatch"


@pytest.fixture
def socket_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="pcc-", dir="/tmp") as directory:
        yield Path(directory) / "plugin.sock"


@asynccontextmanager
async def serving(
    socket_path: Path, host_root: str = "", stats: ResourceStats | None = None
) -> AsyncIterator[grpc_server.Server]:
    """The PCC resource's service on `socket_path`, until the block ends (then torn down)."""
    plugin = DevicePlugin(Flags().pcc_resource(), host_root, stats or ResourceStats())
    service = DevicePluginService(plugin, KubeletLink(plugin.stats))
    server = grpc_server.Server(service.methods(), service.on_error)
    async with bridge.asyncio_loop(), trio.open_nursery() as nursery:
        listener, own = grpc_server.bind(socket_path)
        await nursery.start(grpc_server.serve, server, listener, socket_path, own)
        yield server
        nursery.cancel_scope.cancel()


def watch_in_thread(path: Path, outcome: queue.Queue[object]) -> grpc.Channel:
    channel = grpc.insecure_channel(f"unix://{path}")
    list_and_watch = channel.unary_stream(
        LIST_AND_WATCH,
        request_serializer=pb.Empty.SerializeToString,
        response_deserializer=pb.ListAndWatchResponse.FromString,
    )

    def run() -> None:
        try:
            for message in list_and_watch(pb.Empty()):
                outcome.put(len(message.devices))
        except grpc.RpcError as exc:
            outcome.put(exc.code())
        else:
            outcome.put("ended")

    threading.Thread(target=run, daemon=True).start()
    return channel


async def request_tasks() -> int:
    """The asyncio tasks serving requests now (the server's are named after our handler)."""

    async def count() -> int:
        return sum(
            1
            for task in asyncio.all_tasks()
            if getattr(task.get_coro(), "__qualname__", "") == "Server.handle"
        )

    return await bridge.call_asyncio(count)


async def test_teardown_closes_live_streams_waits_for_their_tasks_and_removes_the_socket(
    socket_path: Path,
) -> None:
    outcome: queue.Queue[object] = queue.Queue()
    get = functools.partial(trio.to_thread.run_sync, outcome.get, abandon_on_cancel=True)
    with trio.fail_after(10):
        async with bridge.asyncio_loop():
            async with serving(socket_path):
                channel = watch_in_thread(socket_path, outcome)
                assert await get() == 16
                assert await request_tasks() == 1
            # Nothing of the torn-down server outlives it.
            assert await request_tasks() == 0
        # The client sees the end at once instead of hanging on an open connection.
        assert await get() == grpc.StatusCode.UNAVAILABLE
        channel.close()
    assert not socket_path.exists()


async def test_teardown_leaves_a_socket_someone_else_replaced(socket_path: Path) -> None:
    with trio.fail_after(10):
        async with serving(socket_path):
            socket_path.unlink()
            socket_path.write_text("someone else's")
    assert socket_path.read_text() == "someone else's"


def connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(path))
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """Read until the server closes the connection (its SETTINGS frames come first)."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


async def test_a_silent_connection_is_closed_after_the_first_request_timeout(
    socket_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grpc_server, "FIRST_REQUEST_TIMEOUT", 0.2)
    with trio.fail_after(10):
        async with serving(socket_path) as server:
            with connect(socket_path) as silent:
                silent.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")  # a preface, then nothing
                assert await run_blocking(closed_by_server, silent)
            assert server.connections == []


async def test_a_connection_without_streams_is_closed_when_idle(
    socket_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grpc_server, "IDLE_TIMEOUT", 0.2)
    with trio.fail_after(10):
        async with serving(socket_path) as server:
            channel = grpc.insecure_channel(f"unix://{socket_path}")
            options = channel.unary_unary("/v1beta1.DevicePlugin/GetDevicePluginOptions")
            await run_blocking(options, b"", timeout=5)
            assert len(server.connections) == 1
            ended: queue.Queue[object] = queue.Queue()
            # The idle connection is closed; the channel reconnects for the next call.
            await trio.to_thread.run_sync(
                lambda: channel.subscribe(
                    lambda state: (
                        ended.put(state) if state == grpc.ChannelConnectivity.IDLE else None
                    )
                )
            )
            assert await trio.to_thread.run_sync(ended.get) == grpc.ChannelConnectivity.IDLE
            channel.close()


async def test_at_the_connection_limit_the_oldest_silent_one_makes_room(
    socket_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grpc_server, "MAX_CONNECTIONS", 3)
    with trio.fail_after(10):
        async with serving(socket_path):
            # Accepted in the order they connect, before the client below.
            silent = [connect(socket_path) for _ in range(3)]
            # A real client still gets through: the oldest silent connection is closed.
            outcome: queue.Queue[object] = queue.Queue()
            channel = watch_in_thread(socket_path, outcome)
            assert await trio.to_thread.run_sync(outcome.get) == 16
            assert await run_blocking(closed_by_server, silent[0])
            # Now every connection is either busy or newer: the next newcomer is refused.
            busy: list[grpc.Channel] = [channel]
            for _ in range(2):
                silent.pop().close()
                busy.append(watch_in_thread(socket_path, outcome))
                assert await trio.to_thread.run_sync(outcome.get) == 16
            with connect(socket_path) as refused:
                assert await run_blocking(closed_by_server, refused)
            for sock in silent:
                sock.close()
            for each in busy:
                each.close()


async def test_an_error_in_an_asyncio_callback_is_logged_and_contained(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """trio-asyncio's own handler would raise it into the loop, ending the daemon."""

    def broken() -> None:
        raise RuntimeError("a transport's bug")

    with trio.fail_after(10):
        async with bridge.asyncio_loop():

            async def schedule() -> None:
                loop = asyncio.get_running_loop()
                loop.call_soon(broken)
                # Callbacks run in order: once this one has, so has the broken one.
                after = loop.create_future()
                loop.call_soon(after.set_result, None)
                await after

            await bridge.call_asyncio(schedule)
    (record,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert "contained: the daemon goes on" in record.getMessage()
    assert record.exc_info is not None


ALLOCATE = "/v1beta1.DevicePlugin/Allocate"
ONE_SHARE = pb.AllocateRequest(
    container_requests=[pb.ContainerAllocateRequest(devices_ids=["pcc-0"])]
).SerializeToString()


def raw_calls(
    path: Path,
    requests: list[bytes],
    *,
    pieces: bool = False,
    one_by_one: bool = False,
    window: int | None = None,
    table_size: int | None = None,
) -> list[tuple[str, bytes]]:
    """Allocate calls over raw HTTP/2: (grpc-status, answer message) of each, in order.

    Every request goes out in one write, or with `pieces` as headers, then the message, then
    the end of the stream, each in a write of its own; `one_by_one`, each request in a write
    once the previous one is answered (from the third on, the server knows the header block
    and answers before grpclib reads the request); `window` is the client's initial
    stream window (how much of an answer it lets through before it reads); `table_size`, the
    HPACK table it lets the server's encoder keep (h2 raises if the server does not shrink it).
    """
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    if window is not None:
        client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
    if table_size is not None:
        client.update_settings({h2.settings.SettingCodes.HEADER_TABLE_SIZE: table_size})
    headers = request_headers(ALLOCATE)
    answers: dict[int, bytes] = {}
    statuses: dict[int, str] = {}
    with connect(path) as sock:
        for request in requests:
            stream = client.get_next_available_stream_id()
            answers[stream], statuses[stream] = b"", ""
            client.send_headers(stream, headers)
            if pieces:
                sock.sendall(client.data_to_send())
            if one_by_one:  # the stream ended by the DATA frame, as grpcio and grpc-go end it
                client.send_data(stream, grpc_frame(request), end_stream=True)
                read_answers(sock, client, answers, statuses)
                continue
            client.send_data(stream, grpc_frame(request))
            if pieces:
                sock.sendall(client.data_to_send())
            client.end_stream(stream)
            if pieces:
                sock.sendall(client.data_to_send())
        read_answers(sock, client, answers, statuses)
    return [(statuses[stream], answers[stream][5:]) for stream in answers]


def read_answers(
    sock: socket.socket,
    client: h2.connection.H2Connection,
    answers: dict[int, bytes],
    statuses: dict[int, str],
) -> None:
    """Send what the client has queued, then read until every stream has its grpc-status."""
    sock.sendall(client.data_to_send())
    while "" in statuses.values():
        data = sock.recv(65536)
        assert data, "the server closed the connection"
        for event in client.receive_data(data):
            if isinstance(event, h2.events.DataReceived):
                answers[event.stream_id] += event.data
                client.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.TrailersReceived | h2.events.ResponseReceived):
                for key, value in event.headers:
                    if key == b"grpc-status":
                        statuses[event.stream_id] = value.decode()
        sock.sendall(client.data_to_send())


@pytest.mark.parametrize(
    ("pieces", "one_by_one", "window"),
    [(False, False, None), (True, False, None), (False, True, None), (False, False, 16)],
    ids=[
        "whole: at once",
        "in pieces: as tasks",
        "one by one: before grpclib reads them",
        "larger than the client's window: as a task",
    ],
)
async def test_unary_calls_are_answered_alike_however_they_arrive(
    socket_path: Path, host: Path, pieces: bool, one_by_one: bool, window: int | None
) -> None:
    with trio.fail_after(10):
        async with serving(socket_path, str(host)):
            outcomes = await run_blocking(
                functools.partial(raw_calls, pieces=pieces, one_by_one=one_by_one, window=window),
                socket_path,
                [ONE_SHARE, b"\x0a\x07\x0a\x05pcc-1", ONE_SHARE, b"\x0a\x7f"],
            )
    (ok, message), second, third, (status, _) = outcomes
    assert ok == "0"
    (response,) = pb.AllocateResponse.FromString(message).container_responses
    assert [device.host_path for device in response.devices] == ["/dev/sev-guest"]
    assert second == third == outcomes[0]
    assert status == str(grpc.StatusCode.INVALID_ARGUMENT.value[0])


async def test_a_smaller_hpack_table_is_announced_before_the_next_answer(
    socket_path: Path, host: Path
) -> None:
    with trio.fail_after(10):
        async with serving(socket_path, str(host)):
            outcomes = await run_blocking(
                functools.partial(raw_calls, table_size=0), socket_path, [ONE_SHARE] * 3
            )
    assert [status for status, _ in outcomes] == ["0"] * 3
    assert outcomes[1:] == outcomes[:2]


def calls_past_the_window(path: Path, count: int) -> tuple[list[str], int]:
    """`count` Allocate calls, one after another. The client gives no window back until an
    answer cannot fit in what is left; that call's request goes with a PING, whose ACK, sent
    after whatever the server answers it, shows the answer held back (h2 raises
    FlowControlError if it came). Returns each call's grpc-status and how many were held."""
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    headers = request_headers(ALLOCATE)
    statuses: dict[int, str] = {}
    unacknowledged: dict[int, int] = {}
    held = 0

    def read_until(done: Callable[[list[h2.events.Event]], bool]) -> None:
        while True:
            data = sock.recv(65536)
            assert data, "the server closed the connection"
            events = client.receive_data(data)
            for event in events:
                if isinstance(event, h2.events.DataReceived):
                    unacknowledged[event.stream_id] = event.flow_controlled_length
                elif isinstance(event, h2.events.TrailersReceived):
                    statuses[event.stream_id] = dict(event.headers)[b"grpc-status"].decode()
            sock.sendall(client.data_to_send())
            if done(events):
                return

    def ping_acknowledged(events: list[h2.events.Event]) -> bool:
        return any(isinstance(event, h2.events.PingAckReceived) for event in events)

    def answered(stream: int, _: list[h2.events.Event]) -> bool:
        return stream in statuses

    with connect(path) as sock:
        for _ in range(count):
            stream = client.get_next_available_stream_id()
            client.send_headers(stream, headers)
            client.send_data(stream, grpc_frame(ONE_SHARE), end_stream=True)
            answer = max(unacknowledged.values(), default=0)
            if answer and 65_535 - sum(unacknowledged.values()) < answer:
                held += 1
                client.ping(b"held?...")
                sock.sendall(client.data_to_send())
                read_until(ping_acknowledged)
                assert stream not in statuses
                for acknowledged, size in unacknowledged.items():
                    client.acknowledge_received_data(size, acknowledged)
                unacknowledged.clear()
            sock.sendall(client.data_to_send())
            read_until(functools.partial(answered, stream))
    return list(statuses.values()), held


async def test_answers_past_the_clients_window_wait_for_it_and_none_overruns_it(
    socket_path: Path, host: Path
) -> None:
    # About 150 bytes an answer: 1,000 of them are twice the 64 KiB a connection starts with.
    stats = ResourceStats()
    with trio.fail_after(20):
        async with serving(socket_path, str(host), stats):
            statuses, held = await run_blocking(calls_past_the_window, socket_path, 1000)
    assert statuses == ["0"] * 1000
    assert held >= 1  # the window ran out at least once
    # A held answer was worked out before grpclib read its call: its method ran once.
    assert stats.allocations["ok"] == 1000


def test_remembered_header_blocks_decode_as_hpack_decodes_them() -> None:
    """A client's header blocks, some repeated, some adding to the table or resizing it, decode
    the same through the remembering decoder as through hpack's, which it must not outgrow."""
    choose = random.Random(7)
    encoder = hpack.Encoder()
    plain, remembering = hpack.Decoder(), _grpclib._RepeatingDecoder()
    remembered = 0
    for _ in range(3000):
        if choose.random() < 0.02:
            size = choose.choice([0, 128, 4096])
            encoder.header_table_size = size
            plain.header_table_size = remembering.header_table_size = size
        headers = [
            (":method", "POST"),
            (":path", choose.choice([ALLOCATE, LIST_AND_WATCH, "/v1beta1.DevicePlugin/x"])),
            ("content-type", "application/grpc"),
        ]
        if choose.random() < 0.1:
            headers.append(("grpc-timeout", f"{choose.randrange(100)}m"))
        block = encoder.encode(headers)
        remembered += block in {key[0] for key in remembering._known}
        assert remembering.decode(block, raw=True) == list(plain.decode(block, raw=True))
        assert len(remembering._known) <= _grpclib._KNOWN_BLOCKS
    assert remembered > 500  # and many blocks came from memory


def after_known_calls(
    path: Path, frames: Callable[[bytes, int], list[Frame | bytes]], streams_open: int = 0
) -> tuple[str, bool]:
    """Two Allocate calls, after which the server knows the header block of the next, and
    `streams_open` more begun but not ended; then the frames `frames(block, stream)` makes
    for the next stream, and a PING, in one write.

    What came of them: the grpc-status the stream was answered with ("reset" if reset, ""
    if the server closed the connection first), and whether the PING was answered (False:
    the connection was closed). Read until both came, or the connection's end.
    """
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    headers = request_headers(ALLOCATE)
    answers: dict[int, bytes] = {}
    statuses: dict[int, str] = {}
    with connect(path) as sock:
        for _ in range(2):
            stream = client.get_next_available_stream_id()
            answers[stream], statuses[stream] = b"", ""
            client.send_headers(stream, headers)
            client.send_data(stream, grpc_frame(ONE_SHARE), end_stream=True)
            read_answers(sock, client, answers, statuses)
        for _ in range(streams_open):
            client.send_headers(client.get_next_available_stream_id(), headers)
        if streams_open:  # read by the server before the crafted frames: a PING answered after
            client.ping(b"opened!!")
            sock.sendall(client.data_to_send())
            while not any(
                isinstance(event, h2.events.PingAckReceived)
                for event in client.receive_data(sock.recv(65536))
            ):
                pass
        block = client.encoder.encode(headers)
        stream = client.get_next_available_stream_id()
        ping = hyperframe.frame.PingFrame(0, opaque_data=b"crafted!")
        sock.sendall(
            b"".join(
                frame if isinstance(frame, bytes) else frame.serialize()
                for frame in [*frames(block, stream), ping]
            )
        )
        # Read past h2's client, which knows nothing of the crafted stream.
        incoming = h2.frame_buffer.FrameBuffer()
        incoming.max_frame_size = 16_384
        status, pinged = "", False
        while not (status and pinged) and (data := sock.recv(65536)):
            incoming.add_data(data)
            for frame in incoming:
                if isinstance(frame, hyperframe.frame.PingFrame):
                    pinged = "ACK" in frame.flags
                elif frame.stream_id != stream:
                    continue
                elif isinstance(frame, hyperframe.frame.RstStreamFrame):
                    status = "reset"
                elif isinstance(frame, hyperframe.frame.HeadersFrame):
                    for name, value in client.decoder.decode(frame.data, raw=True):
                        if name == b"grpc-status":
                            status = value.decode()
    return status, pinged


def _headers(block: bytes, stream: int, *flags: str) -> hyperframe.frame.HeadersFrame:
    return hyperframe.frame.HeadersFrame(stream, block, flags=["END_HEADERS", *flags])


def _data(stream: int, *flags: str, **fields: int) -> hyperframe.frame.DataFrame:
    return hyperframe.frame.DataFrame(stream, grpc_frame(ONE_SHARE), flags=flags, **fields)


def _frame_bytes(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return (
        len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload
    )


def _window_update(stream: int, increment: int) -> hyperframe.frame.WindowUpdateFrame:
    return hyperframe.frame.WindowUpdateFrame(stream, window_increment=increment)


def _call(block: bytes, stream: int, *between: Frame | bytes) -> list[Frame | bytes]:
    """A call's HEADERS, then `between`, then its DATA ending the stream."""
    return [_headers(block, stream), *between, _data(stream, "END_STREAM")]


class Crafted(NamedTuple):
    frames: Callable[[bytes, int], list[Frame | bytes]]  # of the header block and the stream
    outcome: tuple[str, bool]  # as `after_known_calls` gives it
    at_once: bool  # answered before grpclib reads it


CRAFTED = {
    "whole": Crafted(_call, ("0", True), at_once=True),
    "whole, a WINDOW_UPDATE of the stream between (grpcio)": Crafted(
        lambda block, stream: _call(block, stream, _window_update(stream, 5)),
        ("0", True), at_once=True,
    ),
    "whole, after a WINDOW_UPDATE and a PING of the connection (grpc-go)": Crafted(
        lambda block, stream: [
            _window_update(0, 75), hyperframe.frame.PingFrame(0, opaque_data=b"grpc-go!"),
            *_call(block, stream),
        ],
        ("0", True), at_once=True,
    ),
    # Answered before h2 reads the rest, which it reads as it would after any answer.
    "whole, then WINDOW_UPDATEs of the connection and the stream, and its reset": Crafted(
        lambda block, stream: [
            *_call(block, stream), _window_update(0, 75),
            _window_update(stream, 5), hyperframe.frame.RstStreamFrame(stream, error_code=8),
        ],
        ("0", True), at_once=True,
    ),
    "padded": Crafted(
        lambda block, stream: [
            _headers(block, stream), _data(stream, "END_STREAM", "PADDED", pad_length=3)
        ],
        ("0", True), at_once=False,
    ),
    "with priority": Crafted(
        lambda block, stream: [_headers(block, stream, "PRIORITY"), _data(stream, "END_STREAM")],
        ("0", True), at_once=False,
    ),
    "headers continued": Crafted(
        lambda block, stream: [
            hyperframe.frame.HeadersFrame(stream, block[:2]),
            hyperframe.frame.ContinuationFrame(stream, block[2:], flags=["END_HEADERS"]),
            _data(stream, "END_STREAM"),
        ],
        ("0", True), at_once=False,
    ),
    "ended by an empty DATA": Crafted(
        lambda block, stream: [
            _headers(block, stream), _data(stream),
            hyperframe.frame.DataFrame(stream, flags=["END_STREAM"]),
        ],
        ("0", True), at_once=False,
    ),
    "an even stream": Crafted(
        lambda block, stream: _call(block, stream + 1), ("", False), at_once=False
    ),
    "a stream used before": Crafted(
        lambda block, stream: _call(block, stream - 2), ("", False), at_once=False
    ),
    "DATA of another stream": Crafted(
        lambda block, stream: [_headers(block, stream), _data(stream + 2, "END_STREAM")],
        ("", False), at_once=False,
    ),
    "a zero window increment": Crafted(
        lambda block, stream: _call(block, stream, _window_update(stream, 0)),
        ("", False), at_once=False,
    ),
    "a window increment with the reserved bit set": Crafted(
        lambda block, stream: _call(
            block, stream, _frame_bytes(0x8, 0x0, stream, (2**31 + 5).to_bytes(4, "big"))
        ),
        ("", False), at_once=False,
    ),
    "a window past 2**31 - 1": Crafted(
        lambda block, stream: _call(block, stream, _window_update(stream, 2**31 - 1)),
        ("reset", True), at_once=False,
    ),
    "DATA past the frame size": Crafted(
        lambda block, stream: [
            _headers(block, stream),
            hyperframe.frame.DataFrame(stream, b"\0" * 16_385, flags=["END_STREAM"]),
        ],
        ("", False), at_once=False,
    ),
}  # fmt: skip


@pytest.mark.parametrize("crafted", [*CRAFTED, "past the stream limit"])
async def test_a_call_is_answered_before_grpclib_reads_it_only_as_h2_would_read_it(
    socket_path: Path,
    host: Path,
    crafted: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Calls in one read with a known header block are answered without h2's reading; any
    that h2 would read otherwise, or refuse, h2 reads (the outcomes are h2's, and no error
    of ours is logged)."""
    streams_open = 0
    if crafted == "past the stream limit":
        streams_open = grpc_server.MAX_STREAMS_PER_CONNECTION
        expected = CRAFTED["whole"]._replace(outcome=("", False), at_once=False)
    else:
        expected = CRAFTED[crafted]
    answered_at_once: list[bool] = []
    answer_at_once = grpc_server.Connection.answer_at_once

    def spy(connection: grpc_server.Connection, *request: Any) -> bool:
        answered_at_once.append(answer_at_once(connection, *request))
        return answered_at_once[-1]

    monkeypatch.setattr(grpc_server.Connection, "answer_at_once", spy)
    with trio.fail_after(10):
        async with serving(socket_path, str(host)):
            outcome = await run_blocking(
                after_known_calls, socket_path, expected.frames, streams_open
            )
    assert outcome == expected.outcome
    assert any(answered_at_once) == expected.at_once
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]


@st.composite
def frame_bytes(draw: st.DrawFn) -> bytes:
    """A call's frames (HEADERS ending the headers, WINDOW_UPDATEs of its stream, DATA ending
    it) and what follows, or any few frames; then maybe one byte changed, maybe cut short."""
    stream = draw(st.sampled_from([1, 3, 2**31 + 1]))
    if draw(st.booleans()):
        frames = _frame_bytes(0x1, 0x4, stream, draw(st.binary(max_size=20)))
        for _ in range(draw(st.integers(0, 2))):
            frames += _frame_bytes(0x8, 0x0, stream, draw(st.binary(min_size=4, max_size=4)))
        frames += _frame_bytes(0x0, 0x1, stream, draw(st.binary(max_size=20)))
    else:
        frames = b""
    for _ in range(draw(st.integers(0, 3))):
        kind, flags = draw(st.tuples(st.integers(0, 255), st.integers(0, 255)))
        frames += _frame_bytes(
            kind, flags, draw(st.integers(0, 2**32 - 1)), draw(st.binary(max_size=20))
        )
    if frames and draw(st.booleans()):
        at = draw(st.integers(0, len(frames) - 1))
        frames = frames[:at] + bytes((draw(st.integers(0, 255)),)) + frames[at + 1 :]
    return frames[: draw(st.integers(0, len(frames)))] if draw(st.booleans()) else frames


@settings(max_examples=300, deadline=None)
@given(frame_bytes())
def test_frames_read_before_h2_are_whole_and_inside_what_came(data: bytes) -> None:
    """Whatever came, the frames of a call are found only whole, within the bytes, or not at all."""
    start = _grpclib._first_headers(data)
    assert start == 0 or (start + 9 <= len(data) and data[start + 3] == 0x1)
    frames = _grpclib._request_frames(data)
    if frames is not None:
        stream_id, block, window_increment, body, size = frames
        assert 0 < size <= len(data)
        assert data[9 : 9 + len(block)] == block
        assert data[size - len(body) : size] == body
        assert 0 <= stream_id < 2**31
        assert window_increment >= 0
