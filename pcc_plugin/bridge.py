"""The one place where trio meets asyncio: grpclib runs on an asyncio loop inside trio.

trio-asyncio runs that loop as part of trio's run, on the same thread. This
module is the only one that imports trio_asyncio; trio code awaits asyncio code
through `call_asyncio`. The other way needs no bridge: asyncio callbacks may
set a trio.Event, and trio code may set an asyncio.Event, on this one thread.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import ParamSpec, TypeVar

import trio_asyncio

_Params = ParamSpec("_Params")
_Result = TypeVar("_Result")


@asynccontextmanager
async def asyncio_loop() -> AsyncIterator[None]:
    """The single asyncio loop of the process; grpclib objects exist only inside it."""
    async with trio_asyncio.open_loop():
        yield


async def call_asyncio(
    function: Callable[_Params, Awaitable[_Result]], *args: _Params.args, **kwargs: _Params.kwargs
) -> _Result:
    """Await asyncio code from trio (cancellation crosses over both ways)."""
    result: _Result = await trio_asyncio.aio_as_trio(function)(*args, **kwargs)
    return result
