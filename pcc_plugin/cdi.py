"""CDI specs: one file per resource in --cdi-spec-dir, for runtimes that inject devices by name.

The files follow CDI spec version 0.6.0 (dots in the class name, spec and
device annotations), which containerd 1.7+ and CRI-O 1.28+ read. A file's
name depends only on the resource, so a restarted or newer instance rewrites
the same file; it is written to a temporary name and renamed, so a runtime
never reads half a spec.

Each spec names the instance that wrote it (--instance-name). An instance
rewrites only its own specs (and those of versions without instance names,
which it takes over), and removes only its own: two instances that share the
directory never touch each other's. The old and new pods of one DaemonSet
share a name, and write the same content.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from pcc_plugin.klog import V1
from pcc_plugin.resource import Device, ResourceSpec

log = logging.getLogger(__name__)

CDI_VERSION = "0.6.0"
# The instance that wrote the spec.
OWNER = "pcc-device-plugin.tke.cloud.tencent.com/instance"
# How versions without instance names marked their specs; such a spec is rewritten by the
# instance that serves its resource, and removed by none.
MANAGED_BY = "pcc-device-plugin.tke.cloud.tencent.com/managed"
_BEFORE_INSTANCE_NAMES = ""


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


def build_spec(kind: str, spec: ResourceSpec, devices: dict[str, Device], owner: str) -> Any:
    """A spec of `kind` (`vendor/class`), each of `devices` by its name."""
    return {
        "cdiVersion": CDI_VERSION,
        "kind": kind,
        "annotations": {OWNER: owner},
        "devices": [
            {"name": name, "containerEdits": _edits(spec, device)}
            for name, device in sorted(devices.items())
        ],
    }


def write_spec(
    directory: Path, spec: ResourceSpec, devices: tuple[Device, ...], owner: str
) -> str | None:
    """Write the resource's spec as instance `owner`; None when written, else why not (one
    line). A spec file of another instance, or not of this plugin, is left as it is."""
    path = spec_path(directory, spec.name)
    healthy = {device.group: device for device in devices if device.healthy}
    try:
        problem = _write(path, build_spec(spec.name, spec, healthy, owner), owner)
    except OSError as exc:
        return f"Cannot write CDI spec {path}: {exc}; containers get devices without CDI"
    if problem:
        return f"{problem}: {spec.name} is served without CDI; {_FIX}"
    return None


def _write(
    path: Path, document: dict[str, Any], owner: str, any_instance: bool = False
) -> str | None:
    """Put `document` at `path` whole, unless another owner's file is there (then say whose;
    with `any_instance`, only a file not of this plugin stays); OSError when the directory
    cannot take it."""
    content = json.dumps(document, indent=2, sort_keys=True) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(
        "w", dir=path.parent, prefix=".pcc-", suffix=".tmp", delete=False
    ) as temporary:
        temporary.write(content)
    try:
        os.chmod(temporary.name, 0o644)
        problem = _put(Path(temporary.name), path, owner, any_instance)
    finally:
        Path(temporary.name).unlink(missing_ok=True)
    if problem is None:
        log.debug("Wrote CDI spec %s", path)
    return problem


# DRA mode: one spec per prepared claim, kind `<driver>/claim`, one device named by the claim's
# UID; every share of a claim brings the same device node and mounts. The file's name is the
# driver's and the claim's, so a spec there of another instance name is this driver's too (its
# --instance-name changed since): rewritten and removed as its own. It also records the claim
# as the checkpoint does (`CLAIM_RECORD`, JSON), from which an unreadable checkpoint is rebuilt.
CLAIM_CLASS = "claim"
CLAIM_RECORD = "pcc-device-plugin.tke.cloud.tencent.com/claim"


def claim_spec_path(directory: Path, driver: str, claim_uid: str) -> Path:
    return directory / f"{driver}-{CLAIM_CLASS}_{claim_uid}.json"


def claim_device_id(driver: str, claim_uid: str) -> str:
    """The fully qualified CDI device a prepared claim's containers get."""
    return f"{driver}/{CLAIM_CLASS}={claim_uid}"


def write_claim_spec(
    directory: Path,
    driver: str,
    claim_uid: str,
    spec: ResourceSpec,
    device: Device,
    owner: str,
    record: dict[str, Any],
) -> None:
    """Write the spec of a prepared claim (`record`, as the checkpoint has it) as instance
    `owner`; OSError or CdiConflict if not."""
    path = claim_spec_path(directory, driver, claim_uid)
    document = build_spec(f"{driver}/{CLAIM_CLASS}", spec, {claim_uid: device}, owner)
    document["annotations"][CLAIM_RECORD] = json.dumps(record, sort_keys=True)
    problem = _write(path, document, owner, any_instance=True)
    if problem:
        raise CdiConflict(problem)


def claim_records(directory: Path, driver: str) -> dict[str, Any]:
    """The claims recorded in this driver's claim specs, by UID (each as `write_claim_spec`
    was given it); specs that record none are left out."""
    found = {}
    for path in sorted(directory.glob(f"{driver}-{CLAIM_CLASS}_*.json")):
        uid = path.name.removeprefix(f"{driver}-{CLAIM_CLASS}_").removesuffix(".json")
        try:
            document = json.loads(path.read_bytes())
            found[uid] = json.loads(document["annotations"][CLAIM_RECORD])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def remove_claim_spec(
    directory: Path, driver: str, claim_uid: str, owner: str, any_instance: bool = False
) -> None:
    """Remove the spec of an unprepared claim if this instance wrote it (with `any_instance`,
    if any instance of this plugin did: the driver prepared the claim); OSError if it
    cannot."""
    path = claim_spec_path(directory, driver, claim_uid)
    try:
        holder = _owner_of(path)
    except FileNotFoundError:
        return
    if holder == owner or (any_instance and holder is not None):
        path.unlink(missing_ok=True)


class CdiConflict(Exception):
    """A file of another instance, or not of this plugin, stands where a spec goes."""


_FIX = (
    "give each instance sharing --cdi-spec-dir its own resources, or remove the file if nothing "
    "needs it, then restart this instance"
)


def _put(temporary: Path, path: Path, owner: str, any_instance: bool) -> str | None:
    """Move `temporary` to `path` unless another owner's file is there (with `any_instance`:
    a file not of this plugin); else say whose it is."""
    while True:
        try:
            holder = _owner_of(path)
        except FileNotFoundError:
            try:
                # A link, not a rename: it never replaces a file another instance just made.
                os.link(temporary, path)
                return None
            except FileExistsError:
                continue
        if holder in (owner, _BEFORE_INSTANCE_NAMES) or (any_instance and holder is not None):
            os.replace(temporary, path)
            return None
        if holder is None:
            return f"CDI spec {path} was not written by pcc-device-plugin"
        return f"CDI spec {path} belongs to instance {holder!r}, not to this instance {owner!r}"


def _owner_of(path: Path) -> str | None:
    """The instance that wrote the spec at `path`, _BEFORE_INSTANCE_NAMES for a version without
    instance names, None if this plugin did not write it; FileNotFoundError if there is none."""
    try:
        document = json.loads(path.read_bytes())
    except ValueError:
        return None
    annotations = document.get("annotations") if isinstance(document, dict) else None
    if not isinstance(annotations, dict):
        return None
    owner = annotations.get(OWNER)
    if isinstance(owner, str) and owner:
        return owner
    return _BEFORE_INSTANCE_NAMES if annotations.get(MANAGED_BY) == "true" else None


def remove_departed_specs(directory: Path, resource_names: set[str], owner: str) -> None:
    """Remove the specs instance `owner` wrote for resources it no longer serves; leave the rest."""
    keep = {spec_path(directory, name) for name in resource_names}
    for path in sorted(directory.glob("*.json")) if directory.is_dir() else []:
        if path in keep:
            continue
        try:
            holder = _owner_of(path)
        except OSError:
            continue
        if holder == owner:
            path.unlink(missing_ok=True)
            log.info("Removed CDI spec %s: instance %r no longer serves its resource", path, owner)
        elif holder == _BEFORE_INSTANCE_NAMES:
            log.log(
                V1,
                "Leaving CDI spec %s: written before instance names, so it may be another "
                "instance's; remove it if no instance serves its resource",
                path,
            )
