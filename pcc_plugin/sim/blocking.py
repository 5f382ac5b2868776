"""Calling the simulator's blocking helpers from trio tests."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import trio

_Params = ParamSpec("_Params")
_Result = TypeVar("_Result")


async def run_blocking(
    function: Callable[_Params, _Result], *args: _Params.args, **kwargs: _Params.kwargs
) -> _Result:
    """Run ``function`` in a worker thread, abandoned if the caller is cancelled.

    Give the blocking call a timeout of its own: an abandoned thread runs on until it returns.
    """
    return await trio.to_thread.run_sync(
        functools.partial(function, *args, **kwargs), abandon_on_cancel=True
    )
