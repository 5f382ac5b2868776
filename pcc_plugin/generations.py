"""The skeleton both modes stand on: one resource, served one generation after another.

A generation serves kubelet on fresh sockets (the device plugin's one, or the DRA driver's
two) until it is cancelled: kubelet restarted, a socket gone, a fault. Every end goes through
`Generation.restart`, which keeps the first reason given. Whatever kubelet does is answered at
once; only the plugin's own faults (a socket it cannot serve, a refused Register) wait,
`RETRY_FIRST` doubling to `RETRY_CAP`, jittered, and only when they come back to back. A bug
(an unexpected exception) restarts the resource alone after `BUG_RESTART_FIRST`, doubling to
`BUG_RESTART_CAP`. Both backoffs forget once the resource has been ready for `STABLE_AFTER`.
The tree: pcc_plugin/supervisor.py; each mode: `Mode`, below.
"""

from __future__ import annotations

import errno
import logging
import random
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Protocol

import attrs
import trio
from asyncinotify import Inotify

from pcc_plugin.errors import FatalError
from pcc_plugin.inotify import open_inotify, wait_for_directory
from pcc_plugin.klog import V1
from pcc_plugin.state import ResourceState

log = logging.getLogger(__name__)

RETRY_FIRST = 0.02
RETRY_CAP = 5.0
BUG_RESTART_FIRST = 1.0
BUG_RESTART_CAP = 60.0
STABLE_AFTER = 10.0


@attrs.define
class Backoff:
    """Capped exponential backoff with jitter, so plugins do not retry in step.

    Each delay is a random part, from `least` to all, of its ceiling (`first`, doubling to
    `cap`). The first delay is 0 when `immediate_first`: an isolated fault is acted on at
    once, and only faults back to back wait. `reset` forgets them.
    """

    first: float = RETRY_FIRST
    cap: float = RETRY_CAP
    immediate_first: bool = False
    least: float = 0.5
    rng: random.Random = attrs.Factory(random.Random)
    attempt: int = 0

    def next_delay(self) -> float:
        attempt = self.attempt
        self.attempt += 1
        if self.immediate_first:
            if attempt == 0:
                return 0.0
            attempt -= 1
        ceiling = min(self.cap, self.first * 2.0**attempt)
        jitter: float = self.rng.uniform(self.least, 1.0)
        return ceiling * jitter

    def reset(self) -> None:
        self.attempt = 0


@attrs.define
class Outage:
    """A peer failing across retries (kubelet, the API server): said at --v=1 while it is
    younger than `grace`, then as an error at most once per `repeat`, and once when it is over.

    The lines go to the caller's `logger`; they are formats: `quiet` of {problem}, `loud` of
    {problem} and {seconds}, `back` of {seconds}.
    """

    logger: logging.Logger
    quiet: str
    loud: str
    back: str
    grace: float = 0.0
    repeat: float = 60.0
    since: float | None = None
    reported_at: float | None = None

    def failed(self, problem: str) -> None:
        now = trio.current_time()
        self.since = now if self.since is None else self.since
        if now - self.since < self.grace:
            self.logger.log(V1, "%s", self.quiet.format(problem=problem), stacklevel=2)
            return
        due = self.reported_at is None or now - self.reported_at >= self.repeat
        self.reported_at = now if due else self.reported_at
        self.logger.log(logging.ERROR if due else V1, "%s",
                        self.loud.format(problem=problem, seconds=now - self.since),
                        stacklevel=2)  # fmt: skip

    def over(self) -> None:
        if self.since is not None and self.reported_at is not None:
            seconds = trio.current_time() - self.since
            self.logger.info("%s", self.back.format(seconds=seconds), stacklevel=2)
        self.since = self.reported_at = None


@attrs.define(eq=False)
class Generation:
    """One generation: why it began, its nursery (whose cancellation ends it), its resource's
    inotify instance, and why it ended."""

    nursery: trio.Nursery
    cause: str
    inotify: Inotify
    reason: str | None = None
    fault: bool = False

    def restart(self, reason: str) -> None:
        """End this generation; the first reason given is the one kept."""
        if self.reason is None:
            self.reason = reason
        self.nursery.cancel_scope.cancel()


# Starts a generation's tasks in its nursery; OSError if its sockets cannot be served.
ServeGeneration = Callable[[Generation], Awaitable[None]]


class Mode(Protocol):
    """What the skeleton needs of a mode (plugin.DevicePluginMode, dra.driver.DraMode): each
    is built from the configuration alone, and `supervise_resource` runs it."""

    state: ResourceState
    # Kubelet's directory the generation's sockets go in: waited for before each generation.
    directory: Path
    # The flags that name the directories it writes, for an error's fix.
    directory_flags: str
    # What a generation serves, as log lines name it.
    server: str

    def running(self) -> AbstractAsyncContextManager[ServeGeneration]:
        """The resource's own tasks beside its generations (the inventory's watch; the DRA
        driver's API client and publisher), for as long as the block runs; what it hands
        over serves each generation with what they made."""


async def supervise_resource(mode: Mode) -> None:
    """Serve one resource; if it fails, restart it alone so the others keep serving.

    Only a bug gets here (faults of the node are handled where they happen): it is logged
    with its traceback.
    """
    backoff = Backoff(first=BUG_RESTART_FIRST, cap=BUG_RESTART_CAP)
    while True:
        try:
            async with mode.running() as serve_generation:
                await serve_generations(mode, serve_generation, backoff)
        except Exception as exc:
            fatal, _ = exc.split(FatalError) if isinstance(exc, ExceptionGroup) else (None, None)
            if fatal is not None or isinstance(exc, FatalError):
                raise
            delay = backoff.next_delay()
            log.exception("%s failed; restarting it in %.1f s", mode.state.name, delay)
            await trio.sleep(delay)


async def serve_generations(
    mode: Mode, serve_generation: ServeGeneration, bug_backoff: Backoff
) -> None:
    """One generation after another. Faults back to back wait, an isolated one does not.

    The inotify instance lasts as long as this does: closing one that has a watch returns only
    once the kernel has torn the watch down (`open_inotify`), which the end of a generation
    would wait out, and a kubelet restart, which ends a generation, is when every millisecond
    counts.
    """
    restarts = Backoff(immediate_first=True)
    cause = "start"
    vanished_before = False
    async with open_inotify() as inotify:
        while True:
            mode.state.directory_awaited(mode.directory)
            await wait_for_directory(mode.directory)
            mode.state.generation_started()
            async with trio.open_nursery() as nursery:
                generation = Generation(nursery, cause, inotify)
                try:
                    await serve_generation(generation)
                except OSError as exc:
                    vanished_before = _cannot_serve(mode, generation, exc, vanished_before)
                else:
                    vanished_before = False
                    problem = mode.state.serving()
                    if problem is not None:
                        log.info("Serving in %s again, after: %s", mode.directory, problem)
                    nursery.start_soon(forget_faults_when_stable, mode.state, restarts, bug_backoff)
            cause = generation.reason or "cancelled"
            log.log(V1, "Restarting %s: %s", mode.server, cause)
            delay = restarts.next_delay() if generation.fault else 0.0
            mode.state.generation_ended(cause, delay)
            if delay:
                await trio.sleep(delay)


def _cannot_serve(
    mode: Mode, generation: Generation, error: OSError, vanished_before: bool
) -> bool:
    """A fault of the plugin's own, said once however often it is retried; kubelet's
    directory gone is not one. Returns whether a file vanished under the generation."""
    vanished = isinstance(error, FileNotFoundError | NotADirectoryError)
    if vanished and not mode.directory.is_dir():
        generation.restart(f"{mode.directory} disappeared")
        return False
    # The directory, not the socket's name: each retry has a fresh name, and the same
    # problem is said once.
    where = Path(error.filename).parent if error.filename else mode.directory
    problem = f"cannot serve in {where}: [Errno {error.errno}] {error.strerror}"
    generation.restart(problem)
    if vanished and not vanished_before:
        # Kubelet deletes every file in its directory when it starts, ours while we bind
        # and rename it too now and then: routine, not a fault to wait after, unless it
        # happens again at once.
        log.log(V1, "%s (a kubelet restart's wipe of the directory, as it was served); "
                "serving again", problem)  # fmt: skip
        return True
    generation.fault = True
    if mode.state.cannot_serve(problem):
        log.error("%s; retrying; fix: %s", problem, _fix(error, mode))
    return vanished


def _fix(error: OSError, mode: Mode) -> str:
    """What to do about a directory the daemon cannot serve in, on a node and elsewhere."""
    elsewhere = f"not on a node, give {mode.directory_flags} a directory you can write"
    if error.errno == errno.EROFS:
        return f"mount it read-write (on a node: the DaemonSet's hostPath is); {elsewhere}"
    if error.errno == errno.ENOSPC:
        return f"free space on its filesystem; {elsewhere}"
    if error.errno in (errno.EACCES, errno.EPERM):
        return (
            "run the daemon as UID 0 with kubelet's directory mounted read-write (the DaemonSet "
            "as shipped; with SELinux, the directory needs the container_device_plugin_t type, "
            f"docs/deploy.md); {elsewhere}"
        )
    return f"check the directory on the node; {elsewhere}"


async def forget_faults_when_stable(state: ResourceState, *backoffs: Backoff) -> None:
    """Once the resource has been ready for STABLE_AFTER without a break, the faults before
    are forgotten."""
    while True:
        while state.not_ready_reason() is not None:
            await state.next_change().wait()
        with trio.move_on_after(STABLE_AFTER):
            while state.not_ready_reason() is None:
                await state.next_change().wait()
            continue
        for backoff in backoffs:
            backoff.reset()
        return
