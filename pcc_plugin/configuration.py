"""The running configuration: which resources are served, from which file, and its reloads.

With `--config`, the file is read again when it changes (a ConfigMap volume
swaps its `..data` symlink; an editor renames or rewrites the file) and on
SIGHUP. A new file is validated whole before anything changes; if it is
invalid, one error line says why and the running configuration keeps serving.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import attrs
import trio
from asyncinotify import Mask

from pcc_plugin.inotify import DIR_GONE, next_events, open_inotify, wait_for_directory
from pcc_plugin.resource import ResourceSpec

log = logging.getLogger(__name__)

# kubelet's atomic writer: the file is a symlink into `..data`, itself a symlink
# replaced by a rename when the ConfigMap changes.
CONFIGMAP_DATA = "..data"
_CHANGED = Mask.CLOSE_WRITE | Mask.MOVED_TO | Mask.CREATE | Mask.DELETE | Mask.ATTRIB


@attrs.define
class Configuration:
    """What runs now. `generation` counts applied configurations, the first being 1."""

    specs: list[ResourceSpec]
    path: Path | None
    digest: str
    generation: int = 1
    last_reload_failed: bool = False


async def watch_config_file(
    path: Path,
    changed: trio.MemorySendChannel[str],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Send a reason on `changed` whenever the file at `path` may have changed.

    Watches its directory, not the file: ConfigMap updates and editors
    replace the file (or the symlink above it) rather than write into it.
    """
    names = {path.name, CONFIGMAP_DATA}
    started = False
    while True:
        await wait_for_directory(path.parent)
        with open_inotify() as inotify:
            try:
                inotify.add_watch(path.parent, _CHANGED | DIR_GONE | Mask.ONLYDIR)
            except (FileNotFoundError, NotADirectoryError):
                continue
            if not started:
                task_status.started()
                started = True
            else:
                # The directory came back: what is in it now may be new.
                _request(changed, f"{path.parent} was created again")
            while True:
                events = await next_events(inotify)
                if any(event.name is not None and str(event.name) in names for event in events):
                    _request(changed, f"{path} changed")
                if any(event.mask & DIR_GONE for event in events):
                    break


def _request(changed: trio.MemorySendChannel[str], reason: str) -> None:
    # Already pending: that reload will read the file as it is then.
    with contextlib.suppress(trio.WouldBlock):
        changed.send_nowait(reason)
