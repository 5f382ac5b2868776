"""inotify, driven by trio: wait for a directory, and watch kubelet's socket directory.

asyncinotify's async API needs asyncio's loop, so trio waits for the fd to be
readable and then drains every pending event: a kubelet restart arrives as
several events in one read, and missing the last one (kubelet.sock created)
would leave the node at 0 allocatable.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import trio
from asyncinotify import Event, InitFlags, Inotify, Mask

from pcc_plugin.config import KUBELET_SOCKET
from pcc_plugin.klog import V1

log = logging.getLogger(__name__)


class FatalError(Exception):
    """The daemon cannot go on; the message says what to fix."""


_DIR_GONE = Mask.DELETE_SELF | Mask.MOVE_SELF | Mask.IGNORED | Mask.UNMOUNT
_APPEARED = Mask.CREATE | Mask.MOVED_TO
_VANISHED = Mask.DELETE | Mask.MOVED_FROM


@contextmanager
def open_inotify() -> Iterator[Inotify]:
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
        inotify.close()


async def next_events(inotify: Inotify) -> list[Event]:
    """Wait for events, then return all that are pending."""
    await trio.lowlevel.wait_readable(inotify.fd)
    events: list[Event] = []
    while True:
        try:
            event = inotify.sync_get()
        except BlockingIOError:
            return events
        if event is not None:
            events.append(event)


def is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def connect_error(path: Path) -> OSError | None:
    """Why the unix socket at `path` takes no connections, or None when something listens."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(str(path))
        except BlockingIOError:
            # A full backlog: something listens, just busily.
            return None
        except OSError as exc:
            return exc
    return None


def nearest_existing_dir(path: Path) -> Path:
    while not path.is_dir():
        path = path.parent
    return path


async def wait_for_directory(path: Path) -> None:
    """Return once `path` is a directory, watching its nearest existing ancestor meanwhile."""
    announced = False
    while True:
        with open_inotify() as inotify:
            ancestor = nearest_existing_dir(path)
            if ancestor == path:
                return
            if not announced:
                log.info("Waiting for %s to be created (kubelet creates it at start)", path)
                announced = True
            try:
                inotify.add_watch(ancestor, _APPEARED | _DIR_GONE | Mask.ONLYDIR)
            except (FileNotFoundError, NotADirectoryError):
                continue
            # Watch first, then look: whatever is created after this is an event.
            if nearest_existing_dir(path) != ancestor:
                continue
            await next_events(inotify)


def restart_reason(events: list[Event], plugin_dir: Path, endpoint: str) -> str | None:
    """Why a batch of events calls for a restart, or None; logs what it sees."""
    kubelet_socket = plugin_dir / KUBELET_SOCKET
    names: dict[str, Mask] = {}
    for event in events:
        if event.name is not None:
            names[str(event.name)] = names.get(str(event.name), Mask(0)) | event.mask
    if any(event.mask & _DIR_GONE for event in events) or not plugin_dir.is_dir():
        log.warning("inotify: %s was removed, waiting for it to come back.", plugin_dir)
        return "device-plugin directory removed"
    if any(event.mask & Mask.Q_OVERFLOW for event in events):
        log.warning("inotify: event queue overflowed, restarting to resynchronise.")
        return "inotify queue overflow"
    # Anything new at kubelet.sock restarts, so the registration looks at it
    # afresh (and reports a file that is not a socket); gone again: nothing.
    if names.get(KUBELET_SOCKET, Mask(0)) & _APPEARED and kubelet_socket.exists():
        log.info("inotify: %s created, restarting.", kubelet_socket)
        return "kubelet restarted"
    own_socket = plugin_dir / endpoint
    if names.get(endpoint, Mask(0)) & _VANISHED and not own_socket.exists():
        log.warning("inotify: own socket %s was removed, restarting.", own_socket)
        return "own socket removed"
    if names.get(KUBELET_SOCKET, Mask(0)) & _VANISHED:
        log.log(V1, "inotify: %s removed; waiting for kubelet to create it.", kubelet_socket)
    return None


async def watch_plugin_dir(
    plugin_dir: Path,
    endpoint: str,
    restart: Callable[[str], None],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Call `restart(reason)` when kubelet restarts, our socket goes, or the directory goes.

    Started once the watch is in place, so whatever happens after that is seen.
    Events are hints: the state is looked up again before acting on them.
    """
    with open_inotify() as inotify:
        try:
            inotify.add_watch(plugin_dir, _APPEARED | _VANISHED | _DIR_GONE | Mask.ONLYDIR)
        except (FileNotFoundError, NotADirectoryError):
            task_status.started()
            restart(f"{plugin_dir} disappeared")
            return
        task_status.started()
        while True:
            reason = restart_reason(await next_events(inotify), plugin_dir, endpoint)
            if reason:
                restart(reason)
