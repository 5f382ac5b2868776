"""Checks of the node: device nodes, and the directories mounted into containers."""

from __future__ import annotations

import glob
import os
import posixpath
import stat
from pathlib import Path

from pcc_plugin.doctor.mountinfo import mount_of
from pcc_plugin.doctor.report import (
    AS_ROOT,
    Result,
    expect_kind,
    failed,
    kind,
    passed,
    skipped,
    warned,
)
from pcc_plugin.resource import (
    DEVICE_WORDS,
    LOAD_SEV_GUEST,
    NOT_AN_SEV_SNP_NODE,
    START_PCC_SERVICE,
    DeviceNode,
    HostMount,
    ResourceSpec,
    seen_from_here,
)
from pcc_plugin.sensitive import is_within, normalised

RIGHT_PATH = "give the daemon and the doctor the right path"
# A profile's device or directory that is missing; the PCC profile's have fixes of their own.
LOAD_DRIVER = f"load its driver on the host, or {RIGHT_PATH}"
START_OWNER = f"start what creates it on the host, or {RIGHT_PATH}"
PCC_DEVICE_MISSING = f"{LOAD_SEV_GUEST}; {NOT_AN_SEV_SNP_NODE}; or {RIGHT_PATH}"
PCC_DIR_MISSING = f"{START_PCC_SERVICE}; or {RIGHT_PATH}"


def _mounted_hint(host_root: str, host_path: str) -> str:
    if not host_root:
        return ""
    parent = os.path.dirname(host_path)
    return f"; with --host-root, the host's {parent} must be mounted at {host_root}{parent}"


def check_device(node: DeviceNode, host_root: str, load_driver: str = LOAD_DRIVER) -> Result:
    """`load_driver`: the fix when there is no such device."""
    check = f"device {node.host_path}"
    wanted = DEVICE_WORDS[node.device_type]
    path = seen_from_here(host_root, node.host_path)
    if node.is_glob:
        matches = [match for match in sorted(glob.glob(path)) if _kind(match) == wanted]
        if not matches:
            return failed(
                check,
                f"nothing matching {path} is {wanted}",
                load_driver + _mounted_hint(host_root, node.host_path),
            )
        return passed(check, f"{len(matches)} match, each {wanted}: {', '.join(matches)}")
    problem = expect_kind(
        check,
        path,
        wanted,
        load_driver + _mounted_hint(host_root, node.host_path),
        f"something replaced the device node: remove {node.host_path} on the host and "
        "load its driver again (for /dev/sev-guest: modprobe -r sev-guest; modprobe sev-guest)",
    )
    return problem or passed(check, f"{path} is {wanted}")


def _kind(path: str) -> str | None:
    try:
        return kind(os.stat(path).st_mode)
    except OSError:
        return None


def _writable(check: str, mount: HostMount, path: str, host_root: str) -> Result:
    if os.access(path, os.W_OK | os.X_OK):
        return passed(check, f"{path} is a writable directory")
    where = mount_of(path)
    if where is not None and where.fs_read_only:
        return failed(
            check,
            f"{path} is on a read-only filesystem ({where.fs_type} at {where.point})",
            f"remount that filesystem read-write on the host, or move {mount.host_path} "
            "to one that is",
        )
    if where is not None and where.read_only:
        if host_root and is_within(where.point, host_root):
            # The pod sees the host through read-only mounts on purpose; kubelet
            # mounts the host's directory into containers read-write.
            return passed(
                check,
                f"{path} is a directory on a read-write filesystem "
                f"(read-only here only through this container's mount at {where.point})",
            )
        return failed(
            check,
            f"{path} is on a read-only mount at {where.point}",
            f"remount it read-write (mount -o remount,bind,rw {where.point})",
        )
    mode = stat.S_IMODE(os.stat(path).st_mode)
    return failed(
        check,
        f"{path} (mode {mode:04o}) is not writable for uid {os.geteuid()}",
        f"give its owner write permission on the host (chmod u+w {mount.host_path}); " + AS_ROOT,
    )


def check_mount(mount: HostMount, host_root: str, create: str = START_OWNER) -> Result:
    """`create`: the fix when there is no such directory."""
    check = f"{mount.label} {mount.host_path}"
    path = seen_from_here(host_root, mount.host_path)
    problem = expect_kind(
        check,
        path,
        "a directory",
        create + _mounted_hint(host_root, mount.host_path),
        f"make {mount.host_path} a directory on the host",
    )
    if problem:
        return problem
    if mount.read_only:
        return passed(check, f"{path} is a directory")
    return _writable(check, mount, path, host_root)


def through_symlink(result: Result, host_path: str, host_root: str, fix: str) -> Result:
    """A passing check becomes a WARN when the path is a symlink: containers get where it
    leads, and under --host-root an absolute target is followed in this container instead."""
    path = seen_from_here(host_root, host_path)
    if result.status != "PASS" or not os.path.islink(path):
        return result
    target = os.readlink(path)
    leads_to = normalised(posixpath.join(posixpath.dirname(host_path), target))
    return warned(
        result.check,
        f"{result.detail}, but a symlink to {target}: containers get {leads_to}",
        fix,
    )


SEV_GUEST_SYSFS = "/sys/class/misc/sev-guest/dev"


def check_sev_guest(node: DeviceNode, host_root: str) -> Result:
    """The device is the one the SEV-SNP guest driver registered (sysfs names its numbers)."""
    check = "SEV-SNP guest device"
    path = seen_from_here(host_root, node.host_path)
    try:
        info = os.stat(path)
    except OSError:
        info = None
    if info is None or not stat.S_ISCHR(info.st_mode):
        return skipped(check, f"not checked until {path} is a character device")
    numbers = f"{os.major(info.st_rdev)}:{os.minor(info.st_rdev)}"
    # sysfs is not namespaced: a container's own /sys shows the host kernel's devices, so
    # <--host-root>/sys is read only where the host's /sys is mounted there.
    sysfs = host_root + "/sys" if host_root and os.path.isdir(host_root + "/sys") else "/sys"
    sysfs_file = sysfs + SEV_GUEST_SYSFS.removeprefix("/sys")
    try:
        driver_numbers = Path(sysfs_file).read_text().strip()
    except FileNotFoundError:
        return warned(
            check,
            f"{sysfs_file} does not exist: the sev-guest driver is not loaded, so nothing says "
            f"that {path} ({numbers}) is the SEV-SNP guest device",
            f"{LOAD_SEV_GUEST}; {NOT_AN_SEV_SNP_NODE}",
        )
    except OSError as exc:
        return warned(check, f"cannot read {sysfs_file}: {exc.strerror}", AS_ROOT)
    if driver_numbers != numbers:
        return warned(
            check,
            f"{path} is device {numbers}, but the sev-guest driver's is {driver_numbers} "
            f"({sysfs_file})",
            "give --pcc-device the sev-guest driver's device node (/dev/sev-guest on the host)",
        )
    return passed(check, f"{path} is the sev-guest driver's device ({numbers})")


def check_pcc_node(spec: ResourceSpec, host_root: str) -> list[Result]:
    """The PCC profile's device and directory, and that the device is the SEV-SNP guest's."""
    (device,) = spec.device_nodes
    (pcc_dir,) = spec.mounts
    return [
        through_symlink(
            check_device(device, host_root, PCC_DEVICE_MISSING),
            device.host_path,
            host_root,
            f"make {device.host_path} the device node itself (the sev-guest driver creates it), "
            "or give --pcc-device the node it leads to",
        ),
        check_sev_guest(device, host_root),
        through_symlink(
            check_mount(pcc_dir, host_root, PCC_DIR_MISSING),
            pcc_dir.host_path,
            host_root,
            "give --pcc-socket-path the directory it leads to, so that the daemon checks and "
            "watches the directory containers get",
        ),
    ]
