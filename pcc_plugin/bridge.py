"""The one place where trio meets asyncio: grpclib runs on an asyncio loop inside trio.

trio-asyncio runs that loop as part of trio's run. This module is the only one
that imports trio_asyncio; the gRPC server and clients await asyncio code
through `call_asyncio` and run trio code from asyncio through `call_trio`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, ParamSpec, TypeVar

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


async def call_trio(function: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """Await trio code from asyncio."""
    return await trio_asyncio.trio_as_aio(function)(*args)
