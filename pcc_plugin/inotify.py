"""inotify, driven by trio: open an instance, wait for events, wait for a directory.

asyncinotify's async API needs asyncio's loop, so trio waits for the fd to be
readable and then drains every pending event: a kubelet restart arrives as
several events in one read, and missing the last one (kubelet.sock created)
would leave the node at 0 allocatable.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio
from asyncinotify import Event, InitFlags, Inotify, Mask

from pcc_plugin.errors import FatalError
from pcc_plugin.fs import nearest_existing_dir

log = logging.getLogger(__name__)

DIR_GONE = Mask.DELETE_SELF | Mask.MOVE_SELF | Mask.IGNORED | Mask.UNMOUNT
APPEARED = Mask.CREATE | Mask.MOVED_TO
VANISHED = Mask.DELETE | Mask.MOVED_FROM


@asynccontextmanager
async def open_inotify() -> AsyncIterator[Inotify]:
    """An inotify instance, closed on a worker thread: closing one returns only once the kernel
    has torn its watches down, a grace period of some milliseconds (5 ms here, 20 and more
    under load), which would stall both loops; the instances a stop closes together wait out
    their grace periods side by side."""
    try:
        # asyncinotify's InitFlags.NONBLOCK is really O_CLOEXEC: without a true
        # O_NONBLOCK, draining an empty queue would block the whole trio thread.
        inotify = Inotify(flags=InitFlags.CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.EMFILE:
            raise FatalError(
                "cannot create an inotify instance: the per-user limit is reached; "
                "raise it with sysctl fs.inotify.max_user_instances"
            ) from None
        raise
    try:
        yield inotify
    finally:
        trio.lowlevel.notify_closing(inotify.fd)
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(inotify.close)


async def next_events(inotify: Inotify) -> list[Event]:
    """Wait for events, then return all that are pending."""
    await trio.lowlevel.wait_readable(inotify.fd)
    return pending_events(inotify)


def pending_events(inotify: Inotify) -> list[Event]:
    """The events that are pending now, if any."""
    events: list[Event] = []
    while True:
        try:
            event = inotify.sync_get()
        except BlockingIOError:
            return events
        if event is not None:
            events.append(event)


async def wait_for_directory(path: Path) -> None:
    """Return once `path` is a directory, watching its nearest existing ancestor meanwhile.

    Says what it waits for, and says it again when that changes (a file appears there).
    """
    announced_file: bool | None = None
    # Looked up before any inotify is opened: the directory is there at every kubelet restart.
    while (seen := _look(path))[0] != path:
        ancestor, is_file = seen
        if is_file != announced_file:
            if is_file:
                log.warning("Waiting for %s to be a directory: it is a file now", path)
            else:
                log.info("Waiting for %s to be created (kubelet creates it at start)", path)
            announced_file = is_file
        async with open_inotify() as inotify:
            try:
                inotify.add_watch(ancestor, APPEARED | DIR_GONE | Mask.ONLYDIR)
            except (FileNotFoundError, NotADirectoryError):
                continue
            # Watch first, then look: whatever is created after this is an event.
            if _look(path) != seen:
                continue
            await next_events(inotify)


def _look(path: Path) -> tuple[Path, bool]:
    """The nearest existing directory of `path` (`path` once it is one), and whether something
    that is not a directory stands at `path`."""
    ancestor = nearest_existing_dir(path)
    return ancestor, ancestor != path and path.exists()
