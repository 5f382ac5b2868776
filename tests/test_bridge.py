"""bridge.run: trio as a guest of asyncio's loop; awaiting, cancelling and cleaning up across."""

from __future__ import annotations

import asyncio
import gc
import logging
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio
import trio.testing

from pcc_plugin import bridge, grpc_server
from pcc_plugin.dra import claims
from pcc_plugin.dra.checkpoint import Checkpoint
from pcc_plugin.dra.health import HealthFeed, health_methods
from pcc_plugin.dra.service import dra_methods
from pcc_plugin.dra.sockets import DRA_V1
from pcc_plugin.inventory import Inventory
from pcc_plugin.resource import Device, pcc_resource
from pcc_plugin.sim import run_blocking
from pcc_plugin.sim._pb import dra_health_v1_pb2, dra_v1_pb2
from pcc_plugin.state import ResourceState

pytestmark = pytest.mark.asyncio_host


async def test_each_side_awaits_the_other_and_gets_its_result_or_its_error() -> None:
    async def in_asyncio(value: int) -> int:
        await asyncio.sleep(0)
        assert asyncio.current_task() is not None
        return value + 1

    async def in_trio(value: int) -> int:
        await trio.lowlevel.checkpoint()
        return value * 2

    async def asyncio_calls_trio(value: int) -> int:
        return await bridge.call_trio(in_trio, value)

    async def broken() -> None:
        raise KeyError("asyncio's")

    async def broken_in_trio() -> None:
        raise KeyError("trio's")

    async def asyncio_calls_broken_trio() -> None:
        await bridge.call_trio(broken_in_trio)

    with trio.fail_after(10):
        assert await bridge.call_asyncio(in_asyncio, 1) == 2
        assert await bridge.call_asyncio(asyncio_calls_trio, 3) == 6
        with pytest.raises(KeyError, match="asyncio's"):
            await bridge.call_asyncio(broken)
        with pytest.raises(KeyError, match="trio's"):
            await bridge.call_asyncio(asyncio_calls_broken_trio)


async def test_cancelled_from_trio_the_asyncio_task_is_cancelled_and_waited_for() -> None:
    seen: list[str] = []

    async def holds() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            seen.append("cancelled")
            await asyncio.sleep(0.01)  # its clean-up awaits too
            seen.append("cleaned up")
            raise

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(bridge.call_asyncio, holds)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
    assert seen == ["cancelled", "cleaned up"]


async def test_what_an_asyncio_task_raises_as_trio_cancels_it_is_not_reported_as_lost(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """grpclib's client raises StreamTerminatedError, not CancelledError, when its connection
    is lost as it is cancelled: asyncio would log it as never retrieved when the task goes."""

    async def fails_as_it_is_cancelled() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise ConnectionResetError("lost as it was cancelled") from None

    async def fails_as_trio_cancels(scope: trio.CancelScope) -> None:
        # Ends before trio's side runs again, which then finds it done, and is cancelled.
        scope.cancel()
        raise ConnectionResetError("lost as trio cancelled the call")

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(bridge.call_asyncio, fails_as_it_is_cancelled)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
        with trio.CancelScope() as scope:
            await bridge.call_asyncio(fails_as_trio_cancels, scope)
    assert scope.cancelled_caught
    gc.collect()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_cancelled_from_asyncio_the_trio_task_is_cancelled_and_waited_for() -> None:
    seen: list[str] = []
    started = trio.Event()

    async def holds() -> None:
        try:
            started.set()
            await trio.sleep_forever()
        except trio.Cancelled:
            seen.append("cancelled")
            with trio.CancelScope(shield=True):
                await trio.sleep(0.01)
            seen.append("cleaned up")
            raise

    async def calls_and_is_cancelled() -> str:
        task = asyncio.create_task(bridge.call_trio(holds))
        await bridge.call_trio(started.wait)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return f"cancelled after {seen}"
        return "not cancelled"

    with trio.fail_after(10):
        assert await bridge.call_asyncio(calls_and_is_cancelled) == (
            "cancelled after ['cancelled', 'cleaned up']"
        )


async def test_a_task_cancelled_on_the_asyncio_side_is_an_error_for_trio() -> None:
    async def cancels_itself() -> None:
        task = asyncio.current_task()
        assert task is not None
        task.cancel()
        await asyncio.sleep(0)

    with trio.fail_after(10), pytest.raises(RuntimeError, match="cancelled on the asyncio side"):
        await bridge.call_asyncio(cancels_itself)


async def test_an_asyncio_callback_wakes_a_waiting_trio_task_at_once() -> None:
    """What grpc_server's connections and KubeletLink rely on: an asyncio callback sets a
    trio.Event directly, and the trio task waiting on it runs without any trio timer due
    (trio is asleep in its I/O wait with no deadline: the wake-up must cut it short)."""
    event = trio.Event()

    async def later() -> None:
        asyncio.get_running_loop().call_later(0.05, event.set)

    with trio.fail_after(10):
        await bridge.call_asyncio(later)
        await event.wait()


def test_run_returns_the_result_and_leaves_no_asyncio_task_behind(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Tasks still running when trio's run ends are a bug: cancelled, waited for, logged."""
    seen: list[str] = []

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            seen.append("cancelled")

    # Held, as a task must be: one only its own cycle refers to may be collected at any time.
    held: list[asyncio.Task[None]] = []

    async def main() -> str:
        held.append(asyncio.get_running_loop().create_task(forever()))
        await trio.lowlevel.checkpoint()
        return "done"

    assert bridge.run(main) == "done"
    assert seen == ["cancelled"]
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == bridge.log.name]
    assert len(said) == 1, said
    assert said[0][0] == logging.ERROR
    assert "outlived the daemon's run" in said[0][1]


def test_run_raises_what_the_trio_function_raised() -> None:
    async def main() -> None:
        raise LookupError("from trio")

    with pytest.raises(LookupError, match="from trio"):
        bridge.run(main)


def test_run_takes_a_clock_for_trio_only() -> None:
    """pytest-trio passes its clocks to the runner: trio's time jumps, asyncio's does not."""

    async def main() -> float:
        await trio.sleep(3600)
        return trio.current_time()

    assert bridge.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) >= 3600


class Crossings(trio.abc.Instrument):
    """Tasks started across the bridge: trio tasks in its portal (`call_trio`), asyncio tasks
    awaiting trio's calls (`call_asyncio`) counted by the loop's task factory."""

    def __init__(self) -> None:
        self.into_trio = 0
        self.into_asyncio = 0

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        nursery = task.parent_nursery
        if nursery is not None and nursery.parent_task.name.endswith("bridge._with_portal"):
            self.into_trio += 1

    def factory(self, loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> Any:
        if getattr(coro, "__qualname__", "") == "_awaited":
            self.into_asyncio += 1
        return asyncio.Task(coro, loop=loop, **kwargs)


async def test_a_dra_call_crosses_once_each_way_and_a_health_report_once(
    tmp_path: Path, host: Path
) -> None:
    """NodePrepareResources: asyncio (grpclib) to trio and back with the answer, nothing more;
    a health report: trio to asyncio (grpclib's send) and back. Over a real socket, kubelet's
    side in grpcio."""
    spec = pcc_resource("tke.cloud.tencent.com/pcc-device", 4, "/dev/sev-guest", "/var/run/pcc")
    state = ResourceState(spec.name, needs_stream=False)

    async def get_claim(namespace: str, name: str) -> dict[str, Any]:
        result = {"request": "pcc", "driver": "pcc.example.com", "pool": "node", "device": name}
        return {"metadata": {"uid": f"uid-{name}"},
                "status": {"allocation": {"devices": {"results": [result]}}}}  # fmt: skip

    preparer = claims.Preparer(
        "pcc.example.com", "node", Inventory(spec, str(host), state), state,
        Checkpoint(tmp_path / "state", "pcc.example.com"), tmp_path / "cdi", "owner", get_claim,
    )  # fmt: skip
    (tmp_path / "state").mkdir()
    feed = HealthFeed("node")
    devices = (Device("pcc-0", "pcc", spec.device_nodes, None),)
    feed.update(devices)
    server = grpc_server.Server(
        {**dra_methods(preparer), **health_methods(feed)}, state.handler_failed
    )
    path = tmp_path / "dra.sock"
    crossings = Crossings()
    loop = asyncio.get_running_loop()
    channel = grpc.insecure_channel(f"unix://{path}")
    prepare = channel.unary_unary(
        DRA_V1 + "NodePrepareResources",
        request_serializer=dra_v1_pb2.NodePrepareResourcesRequest.SerializeToString,
        response_deserializer=dra_v1_pb2.NodePrepareResourcesResponse.FromString,
    )
    watch = channel.unary_stream(
        "/v1.DRAResourceHealth/NodeWatchResources",
        request_serializer=dra_health_v1_pb2.NodeWatchResourcesRequest.SerializeToString,
        response_deserializer=dra_health_v1_pb2.NodeWatchResourcesResponse.FromString,
    )

    def prepared(name: str) -> str:
        claim = dra_v1_pb2.Claim(namespace="default", name=name, uid=f"uid-{name}")
        answer = prepare(dra_v1_pb2.NodePrepareResourcesRequest(claims=[claim]), timeout=10)
        return str(answer.claims[f"uid-{name}"].error)

    trio.lowlevel.add_instrument(crossings)
    loop.set_task_factory(crossings.factory)
    try:
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                await nursery.start(server.serve, path)
                reports = watch(dra_health_v1_pb2.NodeWatchResourcesRequest())
                assert await run_blocking(prepared, "pcc-0") == ""  # the connection is up
                assert len((await run_blocking(next, reports)).devices) == 1
                crossings.into_trio = crossings.into_asyncio = 0
                assert await run_blocking(prepared, "pcc-1") == ""
                assert (crossings.into_trio, crossings.into_asyncio) == (1, 0)
                feed.update((*devices, Device("pcc-1", "pcc", spec.device_nodes, None)))
                assert len((await run_blocking(next, reports)).devices) == 2
                assert (crossings.into_trio, crossings.into_asyncio) == (1, 1)
                reports.cancel()
                nursery.cancel_scope.cancel()
    finally:
        loop.set_task_factory(None)
        trio.lowlevel.remove_instrument(crossings)
        channel.close()
