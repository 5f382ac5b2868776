"""CDI specs: one file per resource in --cdi-spec-dir, for runtimes that inject devices by name.

The files follow CDI spec version 0.6.0 (dots in the class name, spec and
device annotations), which containerd 1.7+ and CRI-O 1.28+ read. A file's
name depends only on the resource, so a restarted or newer instance rewrites
the same file; it is written to a temporary name and renamed, so a runtime
never reads half a spec.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from pcc_plugin.resource import Device, ResourceSpec

log = logging.getLogger(__name__)

CDI_VERSION = "0.6.0"
# Marks the specs this plugin wrote, so it removes only its own.
MANAGED_BY = "pcc-device-plugin.tke.cloud.tencent.com/managed"


def spec_path(directory: Path, resource_name: str) -> Path:
    vendor, _, device_class = resource_name.partition("/")
    return directory / f"{vendor}-{device_class}.json"


def qualified_names(spec: ResourceSpec, devices: list[Device]) -> list[str]:
    groups = dict.fromkeys(device.group for device in devices)
    return [f"{spec.name}={group}" for group in groups]


def _edits(spec: ResourceSpec, device: Device) -> dict[str, Any]:
    edits: dict[str, Any] = {
        "deviceNodes": [
            {
                "path": node.container_path,
                "hostPath": node.host_path,
                "permissions": node.permissions,
            }
            for node in device.nodes
        ]
    }
    if spec.mounts:
        edits["mounts"] = [
            {
                "hostPath": mount.host_path,
                "containerPath": mount.container_path,
                "options": ["rbind", "ro" if mount.read_only else "rw"],
            }
            for mount in spec.mounts
        ]
    if spec.envs:
        edits["env"] = [f"{key}={value}" for key, value in spec.envs]
    return edits


def build_spec(spec: ResourceSpec, devices: tuple[Device, ...]) -> dict[str, Any]:
    by_name = {device.group: device for device in devices if device.healthy}
    return {
        "cdiVersion": CDI_VERSION,
        "kind": spec.name,
        "annotations": {MANAGED_BY: "true"},
        "devices": [
            {"name": name, "containerEdits": _edits(spec, device)}
            for name, device in sorted(by_name.items())
        ],
    }


def write_spec(directory: Path, spec: ResourceSpec, devices: tuple[Device, ...]) -> None:
    path = spec_path(directory, spec.name)
    content = json.dumps(build_spec(spec, devices), indent=2, sort_keys=True) + "\n"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", dir=directory, prefix=".pcc-", suffix=".tmp", delete=False
        ) as temporary:
            temporary.write(content)
        os.chmod(temporary.name, 0o644)
        os.replace(temporary.name, path)
    except OSError as exc:
        log.error("Cannot write CDI spec %s: %s; containers get devices without CDI", path, exc)
        return
    log.debug("Wrote CDI spec %s", path)


def remove_departed_specs(directory: Path, resource_names: set[str]) -> None:
    """Remove specs this plugin wrote for resources no longer configured; leave the rest."""
    keep = {spec_path(directory, name) for name in resource_names}
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        if path in keep:
            continue
        try:
            managed = json.loads(path.read_text()).get("annotations", {}).get(MANAGED_BY)
        except (OSError, ValueError, AttributeError):
            continue
        if managed == "true":
            path.unlink(missing_ok=True)
            log.info("Removed CDI spec %s: its resource is no longer configured", path)
