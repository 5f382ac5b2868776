"""Checks of the node: device nodes, and the directories mounted into containers."""

from __future__ import annotations

import functools
import glob
import os
import posixpath
import re
import stat
from pathlib import Path

import attrs

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
from pcc_plugin.kernel import BlockUse, sysfs
from pcc_plugin.resource import (
    DEVICE_WORDS,
    LOAD_SEV_GUEST,
    NOT_AN_SEV_SNP_NODE,
    START_PCC_SERVICE,
    DeviceNode,
    HostMount,
    ResourceSpec,
    host_owned,
    seen_from_here,
)
from pcc_plugin.sensitive import OPT_IN, is_within, normalised

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


HANDED_OUT_ANYWAY = (
    f"nothing, if it is the host's own; to hand it out all the same, set {OPT_IN} on the "
    "profile's entry (docs/profiles.md)"
)


def check_device(node: DeviceNode, host_root: str, load_driver: str = LOAD_DRIVER) -> Result:
    """`load_driver`: the fix when there is no such device. A block device the kernel says is
    the host's (a whole disk, or one holding a mounted filesystem) is refused, as the daemon
    refuses it, unless the entry opts in."""
    check = f"device {node.host_path}"
    wanted = DEVICE_WORDS[node.device_type]
    path = seen_from_here(host_root, node.host_path)
    block_use = functools.cache(lambda: BlockUse(host_root))
    if node.is_glob:
        matches = [match for match in sorted(glob.glob(path)) if _kind(match) == wanted]
        if not matches:
            return failed(
                check,
                f"nothing matching {path} is {wanted}",
                load_driver + _mounted_hint(host_root, node.host_path),
            )
        refused = [
            hazard
            for match in matches
            if (hazard := host_owned(node, match.removeprefix(host_root), host_root, block_use))
        ]
        found = f"{len(matches)} match, each {wanted}: {', '.join(matches)}"
        if not refused:
            return passed(check, found)
        offered = len(matches) - len(refused)
        result = warned if offered else failed
        return result(
            check,
            f"{found}; {offered} offered, the kernel says the others are the host's: "
            + "; ".join(refused),
            HANDED_OUT_ANYWAY,
        )
    problem = expect_kind(
        check,
        path,
        wanted,
        load_driver + _mounted_hint(host_root, node.host_path),
        f"something replaced the device node: remove {node.host_path} on the host and "
        "load its driver again (for /dev/sev-guest: modprobe -r sev-guest; modprobe sev-guest)",
    )
    if problem:
        return problem
    hazard = host_owned(node, node.host_path, host_root, block_use)
    if hazard:
        return failed(check, f"{hazard}: its devices are Unhealthy", HANDED_OUT_ANYWAY)
    return passed(check, f"{path} is {wanted}")


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


@attrs.frozen
class KernelDevice:
    """A device node the kernel names in sysfs (`numbers`, its major:minor there), and what
    the identity check says of it."""

    check: str
    numbers: str
    # "the sev-guest driver's", and why sysfs may not name it.
    owner: str
    unloaded: str
    what: str
    load: str
    wrong: str


SEV_GUEST = KernelDevice(
    "SEV-SNP guest device",
    "/sys/class/misc/sev-guest/dev",
    "the sev-guest driver's",
    "the sev-guest driver is not loaded",
    "the SEV-SNP guest device",
    f"{LOAD_SEV_GUEST}; {NOT_AN_SEV_SNP_NODE}",
    "give --pcc-device the sev-guest driver's device node (/dev/sev-guest on the host)",
)


def kernel_device(host_path: str) -> KernelDevice | None:
    """What the kernel calls the TEE device at `host_path`, by its name: the SEV-SNP and TDX
    guest devices (either TDX name: tdx_guest upstream, tdx-guest on older Intel kernels) and a
    TPM's resource manager."""
    name = posixpath.basename(host_path)
    if name == "sev-guest":
        return SEV_GUEST
    if name in ("tdx_guest", "tdx-guest"):
        return KernelDevice(
            "TDX guest device",
            f"/sys/class/misc/{name}/dev",
            f"the {name} driver's",
            f"the {name} driver is not loaded",
            "the TDX guest device",
            "on a TDX guest, load its tdx_guest driver (modprobe tdx_guest)",
            f"give the profile the {name} driver's device node (/dev/{name} on the host)",
        )
    if re.fullmatch(r"tpmrm[0-9]+", name):
        return KernelDevice(
            "TPM device",
            f"/sys/class/tpmrm/{name}/dev",
            "the kernel's TPM resource manager's",
            "no TPM 2.0 is bound to a driver",
            "a TPM 2.0's resource manager",
            "on a node with a vTPM, load its driver (modprobe tpm_crb, or tpm_tis)",
            f"give the profile the TPM's resource manager (/dev/{name} on the host)",
        )
    return None


def check_sev_guest(node: DeviceNode, host_root: str) -> Result:
    """The device is the one the SEV-SNP guest driver registered (sysfs names its numbers)."""
    return check_kernel_device(node.host_path, host_root, SEV_GUEST)


def check_kernel_device(host_path: str, host_root: str, device: KernelDevice) -> Result:
    """The device node at `host_path` is the one its driver registered: sysfs names its
    numbers. sysfs is not namespaced: a container's own /sys shows the host kernel's devices,
    so <--host-root>/sys is read only where the host's /sys is mounted there."""
    check = device.check
    path = seen_from_here(host_root, host_path)
    try:
        info = os.stat(path)
    except OSError:
        info = None
    if info is None or not stat.S_ISCHR(info.st_mode):
        return skipped(check, f"not checked until {path} is a character device")
    numbers = f"{os.major(info.st_rdev)}:{os.minor(info.st_rdev)}"
    sysfs_file = sysfs(host_root) + device.numbers.removeprefix("/sys")
    try:
        driver_numbers = Path(sysfs_file).read_text().strip()
    except FileNotFoundError:
        return warned(
            check,
            f"{sysfs_file} does not exist: {device.unloaded}, so nothing says "
            f"that {path} ({numbers}) is {device.what}",
            device.load,
        )
    except OSError as exc:
        return warned(check, f"cannot read {sysfs_file}: {exc.strerror}", AS_ROOT)
    if driver_numbers != numbers:
        return warned(
            check,
            f"{path} is device {numbers}, but {device.owner} is {driver_numbers} ({sysfs_file})",
            device.wrong,
        )
    return passed(check, f"{path} is {device.owner} device ({numbers})")


def check_pcc_node(spec: ResourceSpec, host_root: str) -> list[Result]:
    """The PCC profile's device and directory, and that the device is the SEV-SNP guest's."""
    (device,) = spec.device_nodes
    pcc_dir = spec.mounts[0]
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
