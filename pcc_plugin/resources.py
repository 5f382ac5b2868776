"""What one extended resource hands to containers, and whether the node can serve it now."""

from __future__ import annotations

import os
import re
import stat
from typing import Literal

import attrs

from pcc_plugin.config import CONTAINER_DEVICE_PATH, CONTAINER_PCC_PATH, Config

DeviceType = Literal["char", "block"]
_DEVICE_TEST = {"char": stat.S_ISCHR, "block": stat.S_ISBLK}
_DEVICE_WORDS = {"char": "a character device", "block": "a block device"}


@attrs.frozen
class DeviceNode:
    host_path: str
    container_path: str
    permissions: str = "rw"
    device_type: DeviceType = "char"


@attrs.frozen
class HostMount:
    host_path: str
    container_path: str
    read_only: bool = False
    # Named in the detect error, e.g. "socket path" for the PCC directory.
    label: str = "mount"


@attrs.frozen
class ResourceSpec:
    name: str
    count: int
    socket_prefix: str = attrs.field(
        validator=attrs.validators.matches_re(r"[a-z0-9][a-z0-9.-]{0,19}")
    )
    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[HostMount, ...] = ()
    envs: tuple[tuple[str, str], ...] = ()

    def host_paths(self) -> list[str]:
        return [node.host_path for node in self.device_nodes] + [
            mount.host_path for mount in self.mounts
        ]

    def is_own_socket(self, name: str) -> bool:
        pattern = rf"{re.escape(self.socket_prefix)}-\d+-[0-9a-f]+-\d+\.sock"
        return re.fullmatch(pattern, name) is not None


def pcc_resource(config: Config) -> ResourceSpec:
    """The PCC profile: one SEV-SNP guest device and the PCC socket directory, shared."""
    return ResourceSpec(
        name=config.resource_name,
        count=config.resource_count,
        socket_prefix="pcc",
        device_nodes=(DeviceNode(config.pcc_device, CONTAINER_DEVICE_PATH, "rw", "char"),),
        mounts=(HostMount(config.pcc_socket_path, CONTAINER_PCC_PATH, False, "socket path"),),
    )


def seen_from_here(host_root: str, host_path: str) -> str:
    """Where a host path is visible to this process (under --host-root)."""
    return host_root + host_path


def watched_paths(spec: ResourceSpec, host_root: str) -> list[str]:
    return [seen_from_here(host_root, path) for path in spec.host_paths()]


def health_problem(spec: ResourceSpec, host_root: str) -> str | None:
    """Why the node cannot serve `spec` now, in the words operators search for, or None."""
    for node in spec.device_nodes:
        path = seen_from_here(host_root, node.host_path)
        try:
            mode = os.stat(path).st_mode
        except OSError as exc:
            return f"detect device {path} failed: {exc.strerror}"
        if not _DEVICE_TEST[node.device_type](mode):
            return f"detect device {path} failed: not {_DEVICE_WORDS[node.device_type]}"
    for mount in spec.mounts:
        path = seen_from_here(host_root, mount.host_path)
        try:
            mode = os.stat(path).st_mode
        except OSError as exc:
            return f"detect {mount.label} {path} failed: {exc.strerror}"
        if not stat.S_ISDIR(mode):
            return f"detect {mount.label} {path} failed: not a directory"
    return None
