"""The gRPC server in this process, checked from grpcio and raw sockets: teardown and limits.

Limits are made small here (monkeypatched) so that each is reached quickly; the waits are on
what a client sees (an answer, the end of its connection), never on the clock.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import socket
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import grpc
import h2.config
import h2.connection
import h2.events
import h2.frame_buffer
import h2.settings
import hyperframe.frame
import pytest
import trio
from raw_clients import call, closed_by_server, connect, grpc_frame, request_headers

from pcc_plugin import bridge, grpc_server
from pcc_plugin.flags import Flags
from pcc_plugin.limits import DEFAULT, DRA_SOCKET, Limits
from pcc_plugin.service import DevicePlugin
from pcc_plugin.sim import run_blocking
from pcc_plugin.sim._pb import deviceplugin_v1beta1_pb2 as pb
from pcc_plugin.state import ResourceState

Frame = hyperframe.frame.Frame

LIST_AND_WATCH = "/v1beta1.DevicePlugin/ListAndWatch"

pytestmark = pytest.mark.asyncio_host


@pytest.fixture
def socket_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="pcc-", dir="/tmp") as directory:
        yield Path(directory) / "plugin.sock"


@asynccontextmanager
async def serving(
    socket_path: Path,
    host_root: str | None = None,
    stats: ResourceState | None = None,
    limits: Limits = DEFAULT,
) -> AsyncIterator[grpc_server.Server]:
    """The PCC resource's service on `socket_path`, until the block ends (then torn down); by
    default for a host beside the socket that has the device and the PCC directory."""
    if host_root is None:
        host = socket_path.parent / "host"
        (host / "dev").mkdir(parents=True)
        (host / "dev" / "sev-guest").symlink_to("/dev/null")
        (host / "var" / "run" / "pcc").mkdir(parents=True)
        host_root = str(host)
    plugin = DevicePlugin(Flags().pcc_resource(), host_root, stats or ResourceState("x"))
    methods = plugin.methods()
    server = grpc_server.Server(methods, plugin.state.handler_failed, limits=limits)
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve, socket_path)
        yield server
        nursery.cancel_scope.cancel()


def watch_in_thread(path: Path, outcome: queue.Queue[object]) -> grpc.Channel:
    # A connection of its own: grpcio would share one among channels to the same socket.
    channel = grpc.insecure_channel(f"unix://{path}", [("grpc.use_local_subchannel_pool", 1)])
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
    """The asyncio tasks serving calls now (grpclib's request_handler, each)."""

    async def count() -> int:
        return sum(
            1
            for task in asyncio.all_tasks()
            if getattr(task.get_coro(), "__qualname__", "") == "request_handler"
        )

    return await bridge.call_asyncio(count)


async def test_teardown_closes_live_streams_waits_for_their_tasks_and_removes_the_socket(
    socket_path: Path,
) -> None:
    outcome: queue.Queue[object] = queue.Queue()
    get = functools.partial(trio.to_thread.run_sync, outcome.get, abandon_on_cancel=True)
    with trio.fail_after(10):
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


async def test_a_silent_connection_is_closed_after_the_first_request_timeout(
    socket_path: Path,
) -> None:
    with trio.fail_after(10):
        async with serving(socket_path, limits=Limits(first_request_timeout=0.2)) as server:
            with connect(socket_path) as silent:
                silent.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")  # a preface, then nothing
                assert await run_blocking(closed_by_server, silent)
            assert server.cap.open == []


async def test_a_connection_without_streams_is_closed_when_idle(socket_path: Path) -> None:
    with trio.fail_after(10):
        async with serving(socket_path, limits=Limits(idle_timeout=0.2)) as server:
            channel = grpc.insecure_channel(f"unix://{socket_path}")
            options = channel.unary_unary("/v1beta1.DevicePlugin/GetDevicePluginOptions")
            await run_blocking(options, b"", timeout=5)
            assert len(server.cap.open) == 1
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


async def test_an_idle_client_keeps_its_connection_from_the_preface_on(
    socket_path: Path,
) -> None:
    """Kubelet dials a DRA socket when the driver registers and calls only when a pod needs a
    claim; a close is to kubelet the driver going away. On a real cluster the DRA socket
    closed kubelet's connection after 5 s without a call, and kubelet dialled again, every
    5 s. A connection that never sends the HTTP/2 preface is still closed."""
    limits = attrs.evolve(DRA_SOCKET, first_request_timeout=0.2, idle_timeout=0.2)
    with trio.fail_after(10):
        async with serving(socket_path, limits=limits) as server:
            states: queue.Queue[grpc.ChannelConnectivity] = queue.Queue()
            kubelet = grpc.insecure_channel(f"unix://{socket_path}")
            kubelet.subscribe(states.put, try_to_connect=True)
            while await run_blocking(states.get, timeout=5) != grpc.ChannelConnectivity.READY:
                pass
            # Connected after kubelet: its deadline comes later, and it has no preface.
            with connect(socket_path) as silent:
                assert await run_blocking(closed_by_server, silent)
            (kept,) = server.cap.open
            assert states.empty(), "kubelet's connection changed state"
            options = kubelet.unary_unary("/v1beta1.DevicePlugin/GetDevicePluginOptions")
            await run_blocking(options, b"", timeout=5)
            assert server.cap.open == [kept]
            assert kept.requests == 1
            kubelet.close()


async def test_at_the_connection_limit_the_oldest_silent_one_makes_room(
    socket_path: Path,
) -> None:
    # Silence is never what closes one here: only the cap does.
    limits = Limits(connections=3, first_request_timeout=60.0)
    with trio.fail_after(10):
        async with serving(socket_path, limits=limits) as server:
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
            assert [connection.requests for connection in server.cap.open] == [1, 1, 1]
            for sock in silent:
                sock.close()
            for each in busy:
                each.close()


async def test_an_error_in_an_asyncio_callback_is_logged_and_contained(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken() -> None:
        raise RuntimeError("a transport's bug")

    async def schedule() -> None:
        loop = asyncio.get_running_loop()
        loop.call_soon(broken)
        # Callbacks run in order: once this one has, so has the broken one.
        after = loop.create_future()
        loop.call_soon(after.set_result, None)
        await after

    with trio.fail_after(10):
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
) -> list[tuple[str, bytes]]:
    """Allocate calls over raw HTTP/2: (grpc-status, answer message) of each, in order.

    Every request goes out in one write, or with `pieces` as headers, then the message, then
    the end of the stream, each in a write of its own; `one_by_one`, each request in a write
    once the previous one is answered; `window` is the client's initial stream window (how
    much of an answer it lets through before it reads).
    """
    client = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    client.initiate_connection()
    if window is not None:
        client.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
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
    ids=["in one write", "in pieces", "one by one", "larger than the client's window"],
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
    stats = ResourceState("x")
    with trio.fail_after(20):
        async with serving(socket_path, str(host), stats):
            statuses, held = await run_blocking(calls_past_the_window, socket_path, 1000)
    assert statuses == ["0"] * 1000
    assert held >= 1  # the window ran out at least once
    assert stats.allocations["ok"] == 1000


UNKNOWN_PATHS = ["/v1beta1.DevicePlugin/Nope", "/v1beta1.DevicePlugin/Allocate/../Nope", "Nope"]


@pytest.mark.parametrize("path", UNKNOWN_PATHS)
async def test_an_unknown_method_is_unimplemented_at_once_naming_its_path(
    socket_path: Path, host: Path, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    with trio.fail_after(10):
        async with serving(socket_path, str(host)):
            outcome = await run_blocking(call, socket_path, path, grpc_frame(b""))
            if path.startswith("/"):  # grpcio sends only paths of that form
                channel = grpc.insecure_channel(f"unix://{socket_path}")
                with pytest.raises(grpc.RpcError) as raised:
                    await run_blocking(channel.unary_unary(path), b"", timeout=5)
                channel.close()
                assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
                assert path in raised.value.details()
    assert outcome.status == grpc.StatusCode.UNIMPLEMENTED.value[0]
    assert path in outcome.message
    assert not [record for record in caplog.records if record.levelno >= logging.WARNING]


async def test_calls_past_the_limit_of_one_connection_are_refused(socket_path: Path) -> None:
    with trio.fail_after(10):
        async with serving(socket_path, limits=Limits(calls_per_connection=2)):
            # grpcio's streams on one channel share its one connection.
            channel = grpc.insecure_channel(f"unix://{socket_path}")
            list_and_watch = channel.unary_stream(
                LIST_AND_WATCH,
                request_serializer=pb.Empty.SerializeToString,
                response_deserializer=pb.ListAndWatchResponse.FromString,
            )
            streams = []
            for _ in range(2):
                streams.append(list_and_watch(pb.Empty()))
                assert len((await run_blocking(next, streams[-1])).devices) == 16
            with pytest.raises(grpc.RpcError) as raised:
                await run_blocking(next, list_and_watch(pb.Empty()))
            assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            # Those already open go on; one that ends makes room.
            streams.pop().cancel()
            assert len((await run_blocking(next, list_and_watch(pb.Empty()))).devices) == 16
            channel.close()
