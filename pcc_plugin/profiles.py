"""Resources from a YAML file (`--config`): validated whole at start, errors with key paths.

    mode: device-plugin                  # optional: or dra (docs/dra.md); --mode may say it too
    resources:
      - name: example.com/disk          # extended resource name, as kubelet checks it
        count: 1                         # shares per device (default 1)
        socketPrefix: disk               # optional; derived from the name
        devices:
          - hostPath: /dev/sd[b-d]       # a glob in the last component: one device per match
            permissions: rw              # any of r, w, m (default rw)
            type: block                  # char (default) or block
        mounts:
          - hostPath: /var/run/pcc
            containerPath: /var/run/pcc  # default: hostPath
            readOnly: false
        env:
          NAME: value
        onlyOn: tdx                      # optional: sev-snp, tdx or tpm; no devices elsewhere

The file is read as untrusted input, bounded in size and cost (`yaml_input`).
Imported only when `--config` is given, so the YAML parser costs nothing otherwise.
"""

from __future__ import annotations

import glob
import re
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any, NamedTuple, TypeVar

from pcc_plugin import yaml_input
from pcc_plugin.flags import MODES
from pcc_plugin.kernel import HARDWARE
from pcc_plugin.resource import (
    MAX_RESOURCE_COUNT,
    DeviceNode,
    DeviceType,
    HostMount,
    ResourceSpec,
    resource_name_problem,
)
from pcc_plugin.sensitive import OPT_IN, device_hazard, is_within, mount_hazard, normalised
from pcc_plugin.yaml_input import KeyProblem, child, shown_value

T = TypeVar("T")

_RESOURCE_KEYS = {"name", "count", "socketPrefix", "devices", "mounts", "env", "onlyOn"}
_DEVICE_KEYS = {"hostPath", "containerPath", "permissions", "type", OPT_IN}
_MOUNT_KEYS = {"hostPath", "containerPath", "readOnly", OPT_IN}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SOCKET_PREFIX = re.compile(r"[a-z0-9][a-z0-9.-]{0,19}")


class Profile(NamedTuple):
    """The resources a file describes, the hash of the bytes they were read from, and the mode
    it asks for (None: it does not say)."""

    specs: list[ResourceSpec]
    digest: str
    mode: str | None = None


class ProfileError(ValueError):
    """The file cannot be served; the message names the file, the key path and the problem."""


def _mapping(where: str, value: Any, keys: set[str], required: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise KeyProblem(where, f"must be a mapping, got {type(value).__name__}")
    unknown = sorted(set(value) - keys)
    if unknown:
        raise KeyProblem(child(where, unknown[0]), f"unknown key; known: {', '.join(sorted(keys))}")
    missing = sorted(required - set(value))
    if missing:
        raise KeyProblem(child(where, missing[0]), "is required")
    return value


def _list(where: str, value: Any, item: Callable[[str, Any], T]) -> tuple[T, ...]:
    if not isinstance(value, list):
        raise KeyProblem(where, f"must be a list, got {type(value).__name__}")
    return tuple(item(f"{where}[{index}]", entry) for index, entry in enumerate(value))


def _absolute_path(where: str, value: Any) -> str:
    """The path, normalised: what is checked is what is handed out."""
    if not isinstance(value, str) or not value.startswith("/"):
        raise KeyProblem(where, f"must be an absolute path, got {shown_value(value)}")
    return normalised(value)


def _boolean(where: str, entry: dict[str, Any], key: str) -> bool:
    value = entry.get(key, False)
    if not isinstance(value, bool):
        raise KeyProblem(f"{where}.{key}", f"must be true or false, got {shown_value(value)}")
    return value


def _sensitive_allowed(
    where: str, entry: dict[str, Any], hazard: str | None, kernel_decides: bool = False
) -> bool:
    """Whether the entry opts in to its sensitive host path; refuses it without the opt-in,
    and an opt-in that is not needed (it would let a later edit of the path pass unseen),
    unless the kernel decides once the device is there (`kernel_decides`: a block device)."""
    allowed = _boolean(where, entry, OPT_IN)
    if hazard and not allowed:
        raise KeyProblem(
            f"{where}.hostPath",
            f"{hazard}: refused unless this entry sets {OPT_IN}: true",
        )
    if allowed and not hazard and not kernel_decides:
        raise KeyProblem(
            f"{where}.{OPT_IN}", "hostPath is not a sensitive host path: remove the opt-in"
        )
    return allowed


def _device(where: str, value: Any) -> DeviceNode:
    entry = _mapping(where, value, _DEVICE_KEYS, {"hostPath"})
    host_path = _absolute_path(f"{where}.hostPath", entry["hostPath"])
    if glob.has_magic(str(PurePosixPath(host_path).parent)):
        raise KeyProblem(f"{where}.hostPath", "a glob may only be in the last path component")
    permissions = entry.get("permissions", "rw")
    if not isinstance(permissions, str) or not permissions or set(permissions) - set("rwm"):
        raise KeyProblem(
            f"{where}.permissions", f"must be made of r, w and m, got {shown_value(permissions)}"
        )
    device_type: DeviceType = entry.get("type", "char")
    if device_type not in ("char", "block"):
        raise KeyProblem(f"{where}.type", f"must be char or block, got {shown_value(device_type)}")
    allowed = _sensitive_allowed(where, entry, device_hazard(host_path), device_type == "block")
    if glob.has_magic(host_path):
        if "containerPath" in entry:
            raise KeyProblem(
                f"{where}.containerPath", "not allowed with a glob: each match keeps its path"
            )
        return DeviceNode(host_path, "", permissions, device_type, allowed)
    container_path = _absolute_path(f"{where}.containerPath", entry.get("containerPath", host_path))
    return DeviceNode(host_path, container_path, permissions, device_type, allowed)


def _mount(where: str, value: Any) -> HostMount:
    entry = _mapping(where, value, _MOUNT_KEYS, {"hostPath"})
    host_path = _absolute_path(f"{where}.hostPath", entry["hostPath"])
    container_path = _absolute_path(f"{where}.containerPath", entry.get("containerPath", host_path))
    read_only = _boolean(where, entry, "readOnly")
    allowed = _sensitive_allowed(where, entry, mount_hazard(host_path))
    if is_within(container_path, "/sys") and not allowed:
        raise KeyProblem(
            f"{where}.containerPath",
            f"{container_path} is inside /sys, where container runtimes cannot make a mount "
            "point (a container's /sys is read-only sysfs), so the container would not start: "
            f"give another path, e.g. /run/{container_path.rpartition('/')[2]}",
        )
    return HostMount(host_path, container_path, read_only, allow_sensitive=allowed)


def _env(where: str, value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict):
        raise KeyProblem(
            where, f"must be a mapping of names to strings, got {type(value).__name__}"
        )
    for name, text in value.items():
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise KeyProblem(child(where, name), "is not a valid environment variable name")
        if not isinstance(text, str):
            raise KeyProblem(
                child(where, name), f"must be a string, got {shown_value(text)} (quote it)"
            )
    return tuple(sorted(value.items()))


def _default_prefix(name: str) -> str:
    short = re.sub(r"[^a-z0-9.-]", "-", name.partition("/")[2].lower()).strip("-.")
    return short[:20].rstrip("-.") or "device"


def _resource(where: str, value: Any) -> ResourceSpec:
    entry = _mapping(where, value, _RESOURCE_KEYS, {"name"})
    name = entry["name"]
    if not isinstance(name, str):
        raise KeyProblem(f"{where}.name", f"must be a string, got {shown_value(name)}")
    problem = resource_name_problem(name)
    if problem:
        raise KeyProblem(
            f"{where}.name", f"{shown_value(name)} would be rejected by kubelet: {problem}"
        )
    count = entry.get("count", 1)
    if type(count) is not int or not 1 <= count <= MAX_RESOURCE_COUNT:
        raise KeyProblem(f"{where}.count", f"must be a whole number from 1 to {MAX_RESOURCE_COUNT}")
    prefix = entry.get("socketPrefix", _default_prefix(name))
    if not isinstance(prefix, str) or not _SOCKET_PREFIX.fullmatch(prefix):
        raise KeyProblem(
            f"{where}.socketPrefix", "must be 1-20 of a-z, 0-9, '.', '-', starting alphanumeric"
        )
    devices = _list(f"{where}.devices", entry.get("devices", []), _device)
    mounts = _list(f"{where}.mounts", entry.get("mounts", []), _mount)
    if not devices and not mounts:
        raise KeyProblem(where, "gives containers nothing: add devices or mounts")
    envs = _env(f"{where}.env", entry.get("env", {}))
    only_on = entry.get("onlyOn")
    if only_on is not None and only_on not in HARDWARE:
        raise KeyProblem(
            f"{where}.onlyOn", f"must be one of {', '.join(HARDWARE)}, got {shown_value(only_on)}"
        )
    return ResourceSpec(name, count, prefix, devices, mounts, envs, only_on)


def load(path: str) -> Profile:
    """Every resource in the file, validated whole, or ProfileError: one line naming the file,
    the key path (or line and column) and the problem.

    It reads the file and nothing else, and changes nothing: a reload may call it.
    """
    try:
        document = yaml_input.read_document(path)
    except yaml_input.InputError as exc:
        raise ProfileError(str(exc)) from None
    try:
        top = _mapping(yaml_input.ROOT, document.value, {"resources", "mode"}, {"resources"})
        mode = top.get("mode")
        if mode is not None and mode not in MODES:
            raise KeyProblem("mode", f"must be {' or '.join(MODES)}, got {shown_value(mode)}")
        specs = list(_list("resources", top["resources"], _resource))
        if not specs:
            raise KeyProblem("resources", "must list at least one resource")
        for kind, values in (
            ("name", [spec.name for spec in specs]),
            ("socketPrefix", [spec.socket_prefix for spec in specs]),
        ):
            for index, value in enumerate(values):
                if value in values[:index]:
                    raise KeyProblem(
                        f"resources[{index}].{kind}", f"{shown_value(value)} is used twice"
                    )
    except KeyProblem as exc:
        raise ProfileError(f"{path}: {exc}") from None
    return Profile(specs, document.digest, mode)
