"""Resources from a YAML file (`--config`): validated whole at start, errors with key paths.

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

Imported only when `--config` is given, so the YAML parser costs nothing otherwise.
"""

from __future__ import annotations

import glob
import re
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any, TypeVar

import yaml

from pcc_plugin.resource import (
    MAX_RESOURCE_COUNT,
    DeviceNode,
    DeviceType,
    HostMount,
    ResourceSpec,
    resource_name_problem,
)

T = TypeVar("T")

_RESOURCE_KEYS = {"name", "count", "socketPrefix", "devices", "mounts", "env"}
_DEVICE_KEYS = {"hostPath", "containerPath", "permissions", "type"}
_MOUNT_KEYS = {"hostPath", "containerPath", "readOnly"}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SOCKET_PREFIX = re.compile(r"[a-z0-9][a-z0-9.-]{0,19}")


class ProfileError(ValueError):
    """The file cannot be served; the message names the file, the key path and the problem."""


class _Invalid(Exception):
    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")


def _mapping(where: str, value: Any, keys: set[str], required: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Invalid(where, f"must be a mapping, got {type(value).__name__}")
    unknown = sorted(set(value) - keys)
    if unknown:
        raise _Invalid(f"{where}.{unknown[0]}", f"unknown key; known: {', '.join(sorted(keys))}")
    missing = sorted(required - set(value))
    if missing:
        raise _Invalid(f"{where}.{missing[0]}", "is required")
    return value


def _list(where: str, value: Any, item: Callable[[str, Any], T]) -> tuple[T, ...]:
    if not isinstance(value, list):
        raise _Invalid(where, f"must be a list, got {type(value).__name__}")
    return tuple(item(f"{where}[{index}]", entry) for index, entry in enumerate(value))


def _absolute_path(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise _Invalid(where, f"must be an absolute path, got {value!r}")
    return value


def _device(where: str, value: Any) -> DeviceNode:
    entry = _mapping(where, value, _DEVICE_KEYS, {"hostPath"})
    host_path = _absolute_path(f"{where}.hostPath", entry["hostPath"])
    if glob.has_magic(str(PurePosixPath(host_path).parent)):
        raise _Invalid(f"{where}.hostPath", "a glob may only be in the last path component")
    permissions = entry.get("permissions", "rw")
    if not isinstance(permissions, str) or not permissions or set(permissions) - set("rwm"):
        raise _Invalid(f"{where}.permissions", f"must be made of r, w and m, got {permissions!r}")
    device_type: DeviceType = entry.get("type", "char")
    if device_type not in ("char", "block"):
        raise _Invalid(f"{where}.type", f"must be char or block, got {device_type!r}")
    if glob.has_magic(host_path):
        if "containerPath" in entry:
            raise _Invalid(
                f"{where}.containerPath", "not allowed with a glob: each match keeps its path"
            )
        return DeviceNode(host_path, "", permissions, device_type)
    container_path = _absolute_path(f"{where}.containerPath", entry.get("containerPath", host_path))
    return DeviceNode(host_path, container_path, permissions, device_type)


def _mount(where: str, value: Any) -> HostMount:
    entry = _mapping(where, value, _MOUNT_KEYS, {"hostPath"})
    host_path = _absolute_path(f"{where}.hostPath", entry["hostPath"])
    container_path = _absolute_path(f"{where}.containerPath", entry.get("containerPath", host_path))
    read_only = entry.get("readOnly", False)
    if not isinstance(read_only, bool):
        raise _Invalid(f"{where}.readOnly", f"must be true or false, got {read_only!r}")
    return HostMount(host_path, container_path, read_only)


def _env(where: str, value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict):
        raise _Invalid(where, f"must be a mapping of names to strings, got {type(value).__name__}")
    for name, text in value.items():
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise _Invalid(f"{where}.{name}", "is not a valid environment variable name")
        if not isinstance(text, str):
            raise _Invalid(f"{where}.{name}", f"must be a string, got {text!r} (quote it)")
    return tuple(sorted(value.items()))


def _default_prefix(name: str) -> str:
    short = re.sub(r"[^a-z0-9.-]", "-", name.partition("/")[2].lower()).strip("-.")
    return short[:20].rstrip("-.") or "device"


def _resource(where: str, value: Any) -> ResourceSpec:
    entry = _mapping(where, value, _RESOURCE_KEYS, {"name"})
    name = entry["name"]
    if not isinstance(name, str):
        raise _Invalid(f"{where}.name", f"must be a string, got {name!r}")
    problem = resource_name_problem(name)
    if problem:
        raise _Invalid(f"{where}.name", f"{name!r} would be rejected by kubelet: {problem}")
    count = entry.get("count", 1)
    if (
        not isinstance(count, int)
        or isinstance(count, bool)
        or not 1 <= count <= MAX_RESOURCE_COUNT
    ):
        raise _Invalid(f"{where}.count", f"must be a whole number from 1 to {MAX_RESOURCE_COUNT}")
    prefix = entry.get("socketPrefix", _default_prefix(name))
    if not isinstance(prefix, str) or not _SOCKET_PREFIX.fullmatch(prefix):
        raise _Invalid(
            f"{where}.socketPrefix", "must be 1-20 of a-z, 0-9, '.', '-', starting alphanumeric"
        )
    devices = _list(f"{where}.devices", entry.get("devices", []), _device)
    mounts = _list(f"{where}.mounts", entry.get("mounts", []), _mount)
    if not devices and not mounts:
        raise _Invalid(where, "gives containers nothing: add devices or mounts")
    envs = _env(f"{where}.env", entry.get("env", {}))
    return ResourceSpec(name, count, prefix, devices, mounts, envs)


def load(path: str) -> list[ResourceSpec]:
    """Every resource in the file, or ProfileError naming the file, the key path and the problem."""
    try:
        with open(path, encoding="utf-8") as file:
            document = yaml.safe_load(file)
    except OSError as exc:
        raise ProfileError(f"--config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ProfileError(f"{path}: not valid YAML{at}: {getattr(exc, 'problem', exc)}") from None
    try:
        top = _mapping("(top level)", document, {"resources"}, {"resources"})
        specs = list(_list("resources", top["resources"], _resource))
        if not specs:
            raise _Invalid("resources", "must list at least one resource")
        for kind, values in (
            ("name", [spec.name for spec in specs]),
            ("socketPrefix", [spec.socket_prefix for spec in specs]),
        ):
            for index, value in enumerate(values):
                if value in values[:index]:
                    raise _Invalid(f"resources[{index}].{kind}", f"{value!r} is used twice")
    except _Invalid as exc:
        raise ProfileError(f"{path}: {exc}") from None
    return specs
