"""What the node has of one resource now, kept in step with it by inotify: both modes' view.

The device nodes and mount sources are watched through their parent directories, because a
bind mount of a single file or directory pins the old inode and never shows a re-created
one; the parents are mounted from the host instead. Nothing polls.
"""

from __future__ import annotations

import fnmatch
import glob
import logging
import time
from collections.abc import Callable
from pathlib import Path

import trio
from asyncinotify import Mask

from pcc_plugin.fs import nearest_existing_dir
from pcc_plugin.inotify import next_events, open_inotify
from pcc_plugin.resource import (
    Device,
    DeviceNode,
    ResourceSpec,
    not_on_node,
    seen_from_here,
    start_problem,
    take_inventory,
)
from pcc_plugin.sensitive import OPT_IN, device_hazard, mount_hazard
from pcc_plugin.state import ResourceState

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


class Inventory:
    """One resource's devices as the node has them, looked at again by `refresh`; each change
    goes to `on_change` (the mode's publisher: the device list kubelet streams, or the
    ResourceSlices), the first look included.

    With `wait_at_start`, a resource is not served until its fixed device nodes and mount
    sources are all in place once (`in_place`): a node whose device or PCC directory comes up
    after the daemon starts is waited for, said once in the log and on /readyz, instead of
    being served as unhealthy. After that, a path that goes makes the devices unhealthy.
    """

    def __init__(
        self,
        spec: ResourceSpec,
        host_root: str,
        state: ResourceState,
        on_change: Callable[[tuple[Device, ...]], None] = lambda _: None,
        *,
        wait_at_start: bool = True,
    ) -> None:
        self.spec = spec
        self.host_root = host_root
        self._state = state
        self._on_change = on_change
        # Glob matches seen so far: a gone one stays listed, unhealthy.
        self._seen: dict[str, DeviceNode] = {}
        # Glob matches the kernel says are the host's, and why: each said once while it is.
        self._refused: dict[str, str] = {}
        self.devices: tuple[Device, ...] = ()
        # Whether the node was looked at: the first look is passed on even if it finds nothing.
        self._looked = False
        self._by_id: dict[str, Device] = {}
        # In UTF-8 bytes: a longer ID names no device.
        self.longest_id = 0
        self.in_place = trio.Event()
        if not wait_at_start:
            self.in_place.set()
        self._missing: str | None = None
        self._waiting_since = 0.0
        for hazard in opted_in(spec):
            log.warning("%s: %s; containers get it: its entry sets %s", spec.name, hazard, OPT_IN)
        self.refresh()

    def get(self, device_id: str) -> Device | None:
        return self._by_id.get(device_id)

    def refresh(self) -> None:
        """Look at the node again; on any change say why, and pass the whole list on."""
        if not self.in_place.is_set() and not self._arrived():
            return
        refused: dict[str, str] = {}
        devices = take_inventory(self.spec, self.host_root, self._seen, refused)
        for host_path, hazard in refused.items():
            if self._refused.get(host_path) != hazard:
                log.warning(
                    "%s: not offering %s: %s; its entry may set %s (docs/profiles.md)",
                    self.spec.name, host_path, hazard, OPT_IN,
                )  # fmt: skip
        self._refused = refused
        if self._looked and devices == self.devices:
            return
        before = _describe(self.devices) if self._looked and self.devices else None
        self._looked = True
        self.devices = devices
        self._by_id = {device.id: device for device in devices}
        self.longest_id = max((len(device.id.encode()) for device in devices), default=0)
        self._state.devices_seen(devices)
        now = _describe(devices, not_on_node(self.spec, self.host_root) if not devices else None)
        if now != before:
            unhealthy = self._state.unhealthy_devices
            log.log(logging.WARNING if unhealthy else logging.INFO, "%s: %s", self.spec.name, now)
        self._on_change(devices)

    def _arrived(self) -> bool:
        """Whether every fixed path is in place now; until then, what is missing is said once
        each time it changes."""
        missing = start_problem(self.spec, self.host_root)
        if missing is None:
            if self._missing is not None:
                log.info("%s: %s is in place after %.3f s of waiting; serving", self.spec.name,
                         self._missing, time.monotonic() - self._waiting_since)  # fmt: skip
                self._state.paths_in_place()
            self.in_place.set()
            return True
        if missing.path != self._missing:
            if self._missing is None:
                self._waiting_since = time.monotonic()
            self._missing = missing.path
            log.warning("%s: waiting for %s before serving: %s", self.spec.name, missing.path,
                        missing.message)  # fmt: skip
            self._state.path_awaited(missing.path, missing.problem)
        return False


def opted_in(spec: ResourceSpec) -> list[str]:
    """What each entry of `spec` that opted in hands out: the log says so at start."""
    hazards: list[str | None] = [
        device_hazard(node.host_path)
        or f"{node.host_path} is handed out even where the kernel says it is a whole disk or "
        "holds the host's mounted filesystems or swap"
        for node in spec.device_nodes
        if node.allow_sensitive
    ]
    hazards += [mount_hazard(mount.host_path) for mount in spec.mounts if mount.allow_sensitive]
    return [hazard for hazard in hazards if hazard]


def _describe(devices: tuple[Device, ...], absent: str | None = None) -> str:
    if absent:
        return f"not on this node, no devices: {absent}"
    problems = sorted({device.problem for device in devices if device.problem})
    unhealthy = sum(1 for device in devices if device.problem)
    if not unhealthy:
        return f"all {len(devices)} devices Healthy"
    if unhealthy == len(devices) and len(problems) == 1:
        return f"every device is Unhealthy: {problems[0]}"
    return f"{unhealthy} of {len(devices)} devices Unhealthy: {'; '.join(problems)}"


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
    inventory: Inventory, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Keep `inventory` in step with its device nodes and mount sources.

    Started after the first look. Each round watches first and looks second,
    so a change between two rounds is never missed.
    """
    paths = [
        Path(seen_from_here(inventory.host_root, path)) for path in inventory.spec.host_paths()
    ]
    started = False
    while True:
        async with open_inotify() as inotify:
            directories, patterns = _watch_plan(paths)
            try:
                for directory in directories:
                    inotify.add_watch(directory, _CHANGES)
            except (FileNotFoundError, NotADirectoryError):
                continue  # removed between the look and the watch: look again
            inventory.refresh()
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
