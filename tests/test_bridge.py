"""bridge.run: trio as a guest of asyncio's loop; awaiting, cancelling and cleaning up across."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest
import trio
import trio.testing

from pcc_plugin import bridge

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

    async def main() -> str:
        asyncio.get_running_loop().create_task(forever())
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
