"""A simulated kubelet on grpcio, a fake node and a daemon runner, for tests and the demo."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import trio

from pcc_plugin.sim.daemon import Daemon, StartDaemon, unneeded_imports
from pcc_plugin.sim.kubelet import SimKubelet
from pcc_plugin.sim.node import FakeNode
from pcc_plugin.sim.state import NoPluginError, PluginOptions, Registration

__all__ = [
    "Daemon",
    "FakeNode",
    "NoPluginError",
    "PluginOptions",
    "Registration",
    "SimKubelet",
    "StartDaemon",
    "run_blocking",
    "unneeded_imports",
]

_Params = ParamSpec("_Params")
_Result = TypeVar("_Result")


async def run_blocking(
    function: Callable[_Params, _Result], *args: _Params.args, **kwargs: _Params.kwargs
) -> _Result:
    """Run the simulators' blocking ``function`` in a worker thread, abandoned if the caller
    is cancelled: give the blocking call a timeout of its own, as the thread runs on until it
    returns."""
    return await trio.to_thread.run_sync(
        functools.partial(function, *args, **kwargs), abandon_on_cancel=True
    )
