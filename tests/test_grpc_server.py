"""grpclib under trio-asyncio, checked from grpcio: teardown really ends client streams."""

from __future__ import annotations

import functools
import queue
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import trio

from pcc_plugin import bridge, grpc_server
from pcc_plugin.flags import Flags
from pcc_plugin.plugin import DeviceFeed, DevicePlugin
from pcc_plugin.sim._pb import deviceplugin_v1beta1_pb2 as pb
from pcc_plugin.stats import ResourceStats


@pytest.fixture
def socket_path() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="pcc-", dir="/tmp") as directory:
        yield Path(directory) / "plugin.sock"


def watch_in_thread(path: Path, outcome: queue.Queue[object]) -> grpc.Channel:
    channel = grpc.insecure_channel(f"unix://{path}")
    list_and_watch = channel.unary_stream(
        "/v1beta1.DevicePlugin/ListAndWatch",
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


async def test_teardown_closes_live_streams_and_removes_the_socket(socket_path: Path) -> None:
    plugin = DevicePlugin(Flags().pcc_resource(), "", ResourceStats())
    outcome: queue.Queue[object] = queue.Queue()
    get = functools.partial(trio.to_thread.run_sync, outcome.get, abandon_on_cancel=True)
    with trio.fail_after(10):
        async with bridge.asyncio_loop(), trio.open_nursery() as nursery:
            await nursery.start(grpc_server.serve, plugin, plugin.feed.stream, socket_path)
            channel = watch_in_thread(socket_path, outcome)
            assert await get() == 16
            nursery.cancel_scope.cancel()
        # The client sees the end at once instead of hanging on an open connection.
        assert await get() == grpc.StatusCode.UNAVAILABLE
        channel.close()
    assert not socket_path.exists()


async def test_teardown_leaves_a_socket_someone_else_replaced(socket_path: Path) -> None:
    plugin = DevicePlugin(Flags().pcc_resource(), "", ResourceStats())
    with trio.fail_after(10):
        async with bridge.asyncio_loop(), trio.open_nursery() as nursery:
            await nursery.start(grpc_server.serve, plugin, DeviceFeed(b"").stream, socket_path)
            socket_path.unlink()
            socket_path.write_text("someone else's")
            nursery.cancel_scope.cancel()
    assert socket_path.read_text() == "someone else's"
