"""The one place where trio meets asyncio: trio runs as a guest of an asyncio loop, one thread.

grpclib speaks gRPC on asyncio; trio supervises everything. `run` starts an asyncio loop on
this thread and trio inside it in guest mode (`trio.lowlevel.start_guest_run`): asyncio is the
host and waits for I/O on this thread; trio's scheduler runs here too, between asyncio's
callbacks, and only trio's own wait for I/O happens on a helper thread while trio is idle.
Both loops' code runs on this one thread, never at once, so (as trio documents for guest
mode) each may call the other's synchronous API directly: an asyncio callback sets a
trio.Event or reads trio.current_time(), trio code sets an asyncio.Event or creates an asyncio
task. Only awaiting crosses through here: `call_asyncio` from trio, `call_trio` from asyncio,
each passing cancellation on and waiting until the other side has finished.

Why this, measured when it was chosen (`git show fcdcbe9:bench/bridge_candidates.py`, its
figures in that commit's BENCHMARKS.md, "The bridge"): trio-asyncio 0.16, which ran asyncio's
loop as trio tasks, does not import on Python 3.14 (it subclasses asyncio classes 3.14 removed)
and keeps cancelled asyncio timers, waking for each. The other public way, an asyncio loop on a
thread of its own, measured the same as guest mode (CPU per call and per kubelet dial-back
within the runs' noise, both idle at 0), but would make every asyncio callback that touches
trio's state (a connection's close, kubelet's stream opening, a counter) a message between
threads and each such state a data race to guard. Guest mode needs neither, runs grpclib on
asyncio's own loop at asyncio's speed, and uses only public API of both libraries. Its one
cost, a thread switch each time trio wakes from idle (150 to 200 µs of CPU in those runs), is
kept off the per-call path: asyncio code wakes trio only for what trio must act on (a
connection closed, a stream opened), not for every call.

An error in an asyncio callback (a transport's, a forgotten task's) is logged and contained;
asyncio tasks still running when trio's run ends are cancelled and waited for (a bug: each one
is logged), so nothing outlives `run`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

import trio

if TYPE_CHECKING:
    from outcome import Outcome

log = logging.getLogger(__name__)

_Params = ParamSpec("_Params")
_Result = TypeVar("_Result")

# Where asyncio code starts the trio tasks it awaits (`call_trio`); open for the whole run.
_PORTAL: trio.lowlevel.RunVar[trio.Nursery] = trio.lowlevel.RunVar("bridge_portal")


def run(
    async_fn: Callable[..., Awaitable[_Result]],
    *args: object,
    clock: trio.abc.Clock | None = None,
    instruments: Sequence[trio.abc.Instrument] = (),
) -> _Result:
    """`trio.run(async_fn, *args)`, with an asyncio loop on this thread for grpclib.

    Takes trio.run's `clock` and `instruments` (pytest-trio passes them: tests that serve gRPC
    in their own process run with `@pytest.mark.trio(run=bridge.run)`).
    """
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(_log_and_contain)
    ended: list[Outcome[_Result]] = []

    def done(result: Outcome[_Result]) -> None:
        ended.append(result)
        loop.stop()

    start = functools.partial(
        trio.lowlevel.start_guest_run, _with_portal, async_fn, args,
        run_sync_soon_threadsafe=loop.call_soon_threadsafe,
        run_sync_soon_not_threadsafe=loop.call_soon,
        done_callback=done, clock=clock, instruments=instruments,
    )  # fmt: skip
    try:
        loop.call_soon(start)
        loop.run_forever()
        _finish(loop)
    finally:
        loop.close()
    return ended[0].unwrap()


async def _with_portal(
    async_fn: Callable[..., Awaitable[_Result]], args: tuple[Any, ...]
) -> _Result:
    # What `async_fn` raises leaves as trio.run would raise it, not in the portal's group.
    failure: BaseException | None = None
    async with trio.open_nursery() as portal:
        _PORTAL.set(portal)
        try:
            result = await async_fn(*args)
        except BaseException as exc:
            failure = exc
        portal.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return result


def _finish(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what asyncio still runs once trio's run has ended (each one a bug), and wait."""
    left = asyncio.all_tasks(loop)
    for task in left:
        log.error("An asyncio task outlived the daemon's run, cancelled: %r", task)
        task.cancel()
    if left:
        loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.run_until_complete(loop.shutdown_default_executor())


def _log_and_contain(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    error = context.get("exception")
    message = context.get("message") or "error in the asyncio loop"
    log.error("%s (contained: the daemon goes on)", message, exc_info=error)


async def call_asyncio(
    function: Callable[_Params, Awaitable[_Result]], *args: _Params.args, **kwargs: _Params.kwargs
) -> _Result:
    """Await asyncio code from trio, as an asyncio task. Cancelled from trio, the task is
    cancelled and waited for; cancelled from asyncio's side, RuntimeError says so."""
    task = asyncio.get_running_loop().create_task(_awaited(function(*args, **kwargs)))
    finished = trio.Event()
    task.add_done_callback(lambda _: finished.set())
    try:
        await finished.wait()
    finally:
        if not task.done():
            task.cancel()
            with trio.CancelScope(shield=True):
                await finished.wait()
        # Left for trio's cancellation, what the task ended with (grpclib's client: its
        # connection lost, as it was cancelled or just before) is moot; unread, asyncio would
        # log it as never retrieved.
        if not task.cancelled():
            task.exception()
    if task.cancelled():
        raise RuntimeError(f"{function!r} was cancelled on the asyncio side")
    return task.result()


async def _awaited(awaitable: Awaitable[_Result]) -> _Result:
    return await awaitable


async def call_trio(
    function: Callable[_Params, Awaitable[_Result]], *args: _Params.args, **kwargs: _Params.kwargs
) -> _Result:
    """Await trio code from asyncio, as a trio task of the run. Cancelled from asyncio, the
    trio task is cancelled and waited for; one the run cancels raises CancelledError here."""
    loop = asyncio.get_running_loop()
    answer: asyncio.Future[_Result] = loop.create_future()
    finished = loop.create_future()
    scope = trio.CancelScope()

    async def in_trio() -> None:
        # `answer` is cancelled with the asyncio task that awaits it: answer only if it waits.
        try:
            with scope:
                try:
                    result = await function(*args, **kwargs)
                except Exception as exc:
                    if not answer.done():
                        answer.set_exception(exc)
                else:
                    if not answer.done():
                        answer.set_result(result)
        finally:
            answer.cancel()
            finished.set_result(None)

    _PORTAL.get().start_soon(in_trio, name=getattr(function, "__qualname__", repr(function)))
    try:
        return await answer
    finally:
        if not finished.done():
            scope.cancel()
            await asyncio.shield(finished)
