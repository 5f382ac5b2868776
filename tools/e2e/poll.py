"""Waiting on state nobody announces: kubelet's APIs and containerd's tasks have no watch.

:func:`wait_for` asks again every 50 ms until the answer is there or the time is up; the time it
returns is when the answer was seen, so figures are late by at most one interval plus one call.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

T = TypeVar("T")
INTERVAL = 0.05


class Unavailable(Exception):
    """The API does not answer (yet): the daemon is starting or stopped."""


async def wait_for(
    what: str, probe: Callable[[], Awaitable[T | None]], within: float
) -> tuple[T, float]:
    """Call `probe` until it returns something other than None: (that, CLOCK_BOOTTIME then).

    `Unavailable` counts as "not yet". After `within` seconds, AssertionError saying `what`.
    """
    last = "no answer yet"
    try:
        with trio.fail_after(within):
            while True:
                try:
                    found = await probe()
                except Unavailable as error:
                    last = str(error)
                else:
                    if found is not None:
                        return found, time.clock_gettime(time.CLOCK_BOOTTIME)
                    last = "not yet"
                await trio.sleep(INTERVAL)
    except trio.TooSlowError:
        raise AssertionError(f"{what}: not within {within:.0f} s ({last})") from None
