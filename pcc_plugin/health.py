"""Event-driven device health: inotify on the parent directories, no polling.

The device node and the PCC directory are watched through their parents
because a bind mount of a single file or directory pins the old inode and
never shows a re-created one; the parents are mounted from the host instead.
"""

from __future__ import annotations

import fnmatch
import glob
import logging
from pathlib import Path

import trio
from asyncinotify import Mask

from pcc_plugin.fs import nearest_existing_dir
from pcc_plugin.inotify import next_events, open_inotify
from pcc_plugin.plugin import DevicePlugin
from pcc_plugin.resource import watched_paths

log = logging.getLogger(__name__)

_CHANGES = (
    Mask.CREATE
    | Mask.DELETE
    | Mask.MOVED_FROM
    | Mask.MOVED_TO
    | Mask.ATTRIB
    | Mask.DELETE_SELF
    | Mask.MOVE_SELF
    | Mask.ONLYDIR
)
_ANY_NAME = Mask.DELETE_SELF | Mask.MOVE_SELF | Mask.IGNORED | Mask.Q_OVERFLOW | Mask.UNMOUNT


def _watch_plan(paths: list[Path]) -> tuple[set[Path], list[str]]:
    """The directories to watch, and name patterns of the entries in them that matter.

    A path's parent is watched; while the parent is missing, the nearest
    existing ancestor is, for the entry on the way down. A glob's last
    component is itself a pattern.
    """
    directories: set[Path] = set()
    patterns: list[str] = []
    for path in paths:
        directory = nearest_existing_dir(path.parent)
        directories.add(directory)
        if directory == path.parent:
            name = path.name
            patterns.append(name if glob.has_magic(name) else glob.escape(name))
        else:
            patterns.append(glob.escape(path.relative_to(directory).parts[0]))
    return directories, patterns


async def watch_health(
    plugin: DevicePlugin,
    host_root: str,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Keep `plugin`'s devices in step with its device nodes and mount sources.

    Started after the first look. Each round watches first and looks second,
    so a change between two rounds is never missed.
    """
    paths = [Path(path) for path in watched_paths(plugin.spec, host_root)]
    started = False
    while True:
        with open_inotify() as inotify:
            directories, patterns = _watch_plan(paths)
            try:
                for directory in directories:
                    inotify.add_watch(directory, _CHANGES)
            except (FileNotFoundError, NotADirectoryError):
                continue  # removed between the look and the watch: look again
            plugin.refresh()
            if not started:
                task_status.started()
                started = True
            while True:
                events = await next_events(inotify)
                # Other entries of /dev come and go all the time: only ours matter.
                if any(
                    event.mask & _ANY_NAME
                    or (
                        event.name is not None
                        and any(fnmatch.fnmatchcase(str(event.name), p) for p in patterns)
                    )
                    for event in events
                ):
                    break
