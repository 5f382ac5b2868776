"""Kubelet's device-plugin directory: our socket names in it, and what happens to it.

Kubelet deletes every socket there when it restarts and then creates a new
kubelet.sock; the watcher below turns those events into a restart of the
current generation.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

import trio
from asyncinotify import Event, Inotify, Mask

from pcc_plugin.fs import Identity, connect_error, identity
from pcc_plugin.inotify import APPEARED, DIR_GONE, VANISHED, next_events, pending_events
from pcc_plugin.klog import V1

log = logging.getLogger(__name__)

KUBELET_SOCKET = "kubelet.sock"
KUBELET_RESTARTED = "kubelet restarted"
# Our socket gone from its place (kubelet deletes every socket there when it restarts).
REMOVED = "was removed"


# Pods of a DaemonSet often share a PID (1) across a rolling update; a random token per
# process keeps two instances from ever choosing the same name, and lets this one know its own.
_PROCESS_TOKEN = os.urandom(3).hex()
# One count for the process: a resource that a reload starts again never takes a name that
# its previous run, still stopping, serves.
_socket_numbers = itertools.count()


def process_token() -> str:
    """`<pid>-<token>`: this process's own, unlike any other instance's."""
    return f"{os.getpid()}-{_PROCESS_TOKEN}"


class SocketNames:
    """Fresh socket names, `<prefix>-<pid>-<token>-<n>.sock`."""

    def __init__(self, prefix: str) -> None:
        # What this process's sockets of `prefix` start with, whichever run of it serves them.
        self.stem = f"{prefix}-{process_token()}"

    def __next__(self) -> str:
        return f"{self.stem}-{next(_socket_numbers)}.sock"


def is_own_socket(prefix: str, name: str) -> bool:
    """Whether `name` is one of the names SocketNames gives for `prefix`, by any instance."""
    pattern = rf"{re.escape(prefix)}-\d+-[0-9a-f]+-\d+\.sock"
    return re.fullmatch(pattern, name) is not None


def accepts_connections(path: Path) -> bool:
    # Anything but a refusal or a vanished file: assume alive and keep it.
    return not isinstance(connect_error(path), ConnectionRefusedError | FileNotFoundError)


def own_sockets(plugin_dir: Path, prefix: str, keep: str) -> list[Path]:
    """The sockets of this naming in `plugin_dir`, of any instance, but `keep`."""
    return [
        plugin_dir / entry.name
        for entry in os.scandir(plugin_dir)
        if entry.name != keep and is_own_socket(prefix, entry.name)
    ]


def remove_stale_sockets(paths: Iterable[Path], stem: str = "") -> None:
    """Remove each of `paths` that is a socket nothing serves any more (its instance was
    killed); leave those that are served, by another instance or, named `<stem>-...`, by this
    one's previous run (a reload restarted the resource: it removes its socket as it stops)."""
    for path in paths:
        try:
            if not stat.S_ISSOCK(path.lstat().st_mode):
                continue
        except FileNotFoundError:
            continue
        if accepts_connections(path):
            mine = stem and path.name.startswith(stem + "-")
            log.log(V1, "Leaving %s: %s", path,
                    "this instance's previous socket, closing" if mine
                    else "another instance serves it")  # fmt: skip
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        log.info("Removed stale socket %s", path)


def restart_reason(
    events: list[Event],
    plugin_dir: Path,
    endpoint: str,
    own: Identity,
    kubelet_seen: Identity | None = None,
) -> str | None:
    """Why a batch of events calls for a restart, or None; logs what it sees.

    Our socket is known by its identity, not its name: deleted, or replaced by
    a file or by someone else's socket, it is no longer ours to serve on. Events
    that came before the generation looked (`kubelet_seen`, the kubelet.sock it
    saw then) are no kubelet restart for the kubelet.sock it saw.
    """
    kubelet_socket = plugin_dir / KUBELET_SOCKET
    names: dict[str, Mask] = {}
    for event in events:
        if event.name is not None:
            names[str(event.name)] = names.get(str(event.name), Mask(0)) | event.mask
    if any(event.mask & DIR_GONE for event in events) or not plugin_dir.is_dir():
        log.warning("inotify: %s was removed, waiting for it to come back.", plugin_dir)
        return "device-plugin directory removed"
    if any(event.mask & Mask.Q_OVERFLOW for event in events):
        log.warning("inotify: event queue overflowed, restarting to resynchronise.")
        return "inotify queue overflow"
    # Anything new at kubelet.sock restarts, so the registration looks at it
    # afresh (and reports a file that is not a socket); gone again: nothing.
    if names.get(KUBELET_SOCKET, Mask(0)) & APPEARED:
        now = identity(kubelet_socket)
        if now is not None and now != kubelet_seen:
            log.info("inotify: %s created, restarting.", kubelet_socket)
            return KUBELET_RESTARTED
    if endpoint in names:
        reason = own_socket_problem(plugin_dir / endpoint, own)
        if reason:
            # Kubelet deletes every socket in its directory when it restarts: routine. A file
            # put in our socket's place is not.
            level = logging.INFO if reason == REMOVED else logging.WARNING
            log.log(level, "inotify: own socket %s %s, restarting.", plugin_dir / endpoint, reason)
            return f"own socket {reason}"
    if names.get(KUBELET_SOCKET, Mask(0)) & VANISHED:
        log.log(V1, "inotify: %s removed; waiting for kubelet to create it.", kubelet_socket)
    return None


def own_socket_problem(path: Path, own: Identity) -> str | None:
    now = identity(path)
    if now == own:
        return None
    return REMOVED if now is None else "was replaced by another file"


async def watch_plugin_dir(
    inotify: Inotify,
    plugin_dir: Path,
    endpoint: str,
    own: Identity,
    restart: Callable[[str], None],
    appeared: Callable[[list[str]], None],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Call `restart(reason)` when kubelet restarts, our socket goes, or the directory goes;
    tell `appeared` the names of the files that appear meanwhile.

    `inotify` outlives the generation (see `generations.serve_generations`): events of the
    directory that came between generations are read here too. Started once
    the watch is in place and our socket was seen still ours, so whatever happens
    after that is seen. Events are hints: the state is looked up again before
    acting on them.
    """
    try:
        inotify.add_watch(plugin_dir, APPEARED | VANISHED | DIR_GONE | Mask.ONLYDIR)
    except (FileNotFoundError, NotADirectoryError):
        task_status.started()
        restart(f"{plugin_dir} disappeared")
        return
    task_status.started()
    # Watch first, then look: a change before the watch is caught here. The events that came
    # before are read with the look: they restart this generation only if they still hold,
    # and start no follower (those instances came before this one registered).
    kubelet_seen = identity(plugin_dir / KUBELET_SOCKET)
    problem = own_socket_problem(plugin_dir / endpoint, own)
    reason = f"own socket {problem}" if problem else None
    reason = reason or restart_reason(
        pending_events(inotify), plugin_dir, endpoint, own, kubelet_seen
    )
    if reason:
        restart(reason)
    # From here on, a kubelet.sock that appears is a restart whatever its identity: inode
    # numbers are reused, and change times count in the kernel's clock ticks.
    while True:
        events = await next_events(inotify)
        reason = restart_reason(events, plugin_dir, endpoint, own)
        if reason:
            restart(reason)
        else:
            appeared([str(e.name) for e in events if e.name is not None and e.mask & APPEARED])
