"""The gRPC server in this process, checked from grpcio and raw sockets: teardown and limits.

Limits are made small here (monkeypatched) so that each is reached quickly; the waits are on
what a client sees (an answer, the end of its connection), never on the clock.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import socket
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
import trio

from pcc_plugin import bridge, grpc_server
from pcc_plugin.flags import Flags
from pcc_plugin.plugin import DevicePlugin
from pcc_plugin.registration import KubeletLink
from pcc_plugin.service import DevicePluginService
from pcc_plugin.sim import run_blocking
from pcc_plugin.sim._pb import deviceplugin_v1beta1_pb2 as pb
from pcc_plugin.stats import ResourceStats

LIST_AND_WATCH = "/v1beta1.DevicePlugin/ListAndWatch"


@pytest.fixture
def socket_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="pcc-", dir="/tmp") as directory:
        yield Path(directory) / "plugin.sock"


@asynccontextmanager
async def serving(socket_path: Path) -> AsyncIterator[grpc_server.Server]:
    """The PCC resource's service on `socket_path`, until the block ends (then torn down)."""
    plugin = DevicePlugin(Flags().pcc_resource(), "", ResourceStats())
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
