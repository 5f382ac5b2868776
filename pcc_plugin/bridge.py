"""The one place where trio meets asyncio: grpclib runs on an asyncio loop inside trio.

trio-asyncio runs that loop as part of trio's run, on the same thread. This
module is the only one that imports trio_asyncio; trio code awaits asyncio code
through `call_asyncio`, and asyncio code (a gRPC call) awaits trio code (the API
client) through `call_trio`. Events need no bridge: asyncio callbacks may set a
trio.Event, and trio code may set an asyncio.Event, on this one thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, ParamSpec, TypeVar

import trio_asyncio

log = logging.getLogger(__name__)

_Params = ParamSpec("_Params")
_Result = TypeVar("_Result")


@asynccontextmanager
async def asyncio_loop() -> AsyncIterator[None]:
    """The single asyncio loop of the process; grpclib objects exist only inside it.

    An error in an asyncio callback (a transport's, a forgotten task's) is
    logged and contained. trio-asyncio's default would raise it into the
    loop's nursery, and so end the daemon.
    """
    async with trio_asyncio.open_loop() as loop:
        loop.set_exception_handler(_log_and_contain)
        yield


def _log_and_contain(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    error = context.get("exception")
    message = context.get("message") or "error in the asyncio loop"
    log.error("%s (contained: the daemon goes on)", message, exc_info=error)


async def call_asyncio(
    function: Callable[_Params, Awaitable[_Result]], *args: _Params.args, **kwargs: _Params.kwargs
) -> _Result:
    """Await asyncio code from trio (cancellation crosses over both ways)."""
    result: _Result = await trio_asyncio.aio_as_trio(function)(*args, **kwargs)
    return result


async def call_trio(
    function: Callable[_Params, Awaitable[_Result]], *args: _Params.args, **kwargs: _Params.kwargs
) -> _Result:
    """Await trio code from asyncio (cancellation crosses over both ways)."""
    result: _Result = await trio_asyncio.trio_as_aio(function)(*args, **kwargs)
    return result
