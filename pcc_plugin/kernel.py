"""What the host's kernel says of the node, never a device's name alone: which confidential
computing hardware it has (`missing_hardware`), and which block devices hold the host
(`BlockUse`).

sysfs and procfs show the host kernel in any container (neither is namespaced for what is read
here), so both are read in this container unless the host's are mounted under --host-root
(`sysfs`, `procfs`). configfs and securityfs, mounted on the host's /sys, are not in a
container's own /sys: their paths are read under --host-root only.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterator

SEV_SNP, TDX, TPM = "sev-snp", "tdx", "tpm"
HARDWARE = (SEV_SNP, TDX, TPM)
# What the kernel says of a node that has each: "the kernel says the node <...>".
NODE_HAS = {SEV_SNP: "is an SEV-SNP guest", TDX: "is a TDX guest", TPM: "has a TPM"}
# What makes the device of each appear where the kernel says the node has it.
LOAD = {
    SEV_SNP: "modprobe sev-guest",
    TDX: "modprobe tdx_guest",
    TPM: "modprobe tpm_crb, or tpm_tis",
}
# Linux registers this platform device only when it runs as an SEV-SNP guest, with or without
# the sev-guest driver (arch/x86/coco/sev).
SEV_SNP_GUEST = "/sys/bus/platform/devices/sev-guest"
# The CPU flag Linux sets at boot in a TDX guest (X86_FEATURE_TDX_GUEST), which also loads the
# tdx_guest driver.
TDX_CPU_FLAG = "tdx_guest"
CPUINFO = "/proc/cpuinfo"
# A TPM the kernel's TPM driver has bound, real or virtual; its boot event log (securityfs).
TPM_CHIP = "/sys/class/tpm/tpm0"
TPM_EVENT_LOG = "/sys/kernel/security/tpm0"
# configfs-tsm's report directory (Linux 6.7+), there once the tsm_report module is.
TSM_REPORT = "/sys/kernel/config/tsm/report"
# Filesystems whose kernel drivers list each mounted device in sysfs (/sys/fs/<type>/<device>);
# btrfs lists them as /sys/fs/btrfs/<fsid>/devices/<device>.
_FS_LISTING_DEVICES = ("ext4", "xfs", "f2fs", "erofs", "nilfs2")
# Holders stack a few deep (a partition, LVM, dm-crypt, RAID): past this, something is wrong.
_MAX_DEPTH = 8


def sysfs(host_root: str) -> str:
    """Where the host kernel's sysfs is read: `<host-root>/sys` where the host's whole /sys is
    mounted (manifests/overlays/dra mounts it), else this container's own /sys."""
    mounted = host_root + "/sys"
    return mounted if host_root and os.path.isdir(mounted + "/devices") else "/sys"


def procfs(host_root: str) -> str:
    """Where the host kernel's procfs is read: `<host-root>/proc` if there is one, else /proc."""
    mounted = host_root + "/proc"
    return mounted if host_root and os.path.isdir(mounted) else "/proc"


def _under(root: str, path: str, top: str) -> str:
    """`path` (which starts with `top`, /sys or /proc) as read under `root`."""
    return root + path.removeprefix(top)


def cpu_flags(host_root: str) -> set[str] | None:
    """The first CPU's flags in /proc/cpuinfo (x86 only has them), or None if unreadable."""
    try:
        with open(_under(procfs(host_root), CPUINFO, "/proc"), encoding="utf-8") as cpuinfo:
            # Only the first CPU's block is read: each further one costs the kernel work.
            for line in cpuinfo:
                key, colon, value = line.partition(":")
                if colon and key.strip() == "flags":
                    return set(value.split())
                if not line.strip():
                    break
    except OSError:
        return None
    return set()


def missing_hardware(kind: str, host_root: str) -> str | None:
    """Why the kernel says the node has no `kind` (one of HARDWARE), or None when it has one."""
    if kind == SEV_SNP:
        where = _under(sysfs(host_root), SEV_SNP_GUEST, "/sys")
        if os.path.lexists(where):
            return None
        return f"the kernel registered no SEV-SNP guest platform device ({where} is missing)"
    if kind == TDX:
        where = _under(procfs(host_root), CPUINFO, "/proc")
        flags = cpu_flags(host_root)
        if flags is None:
            return f"{where} cannot be read, so nothing says the node is a TDX guest"
        if TDX_CPU_FLAG in flags:
            return None
        return f"the kernel's CPU flags ({where}) have no {TDX_CPU_FLAG}"
    if kind == TPM:
        where = _under(sysfs(host_root), TPM_CHIP, "/sys")
        if os.path.lexists(where):
            return None
        return f"the kernel has bound no TPM ({where} is missing)"
    raise ValueError(f"unknown hardware {kind!r}")


def _names(directory: str) -> list[str]:
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return []


class BlockUse:
    """The host's block devices in use, as the kernel says, read once: each device holding a
    mounted filesystem or swap space. Make one for each look at a resource's devices."""

    def __init__(self, host_root: str) -> None:
        self.sysfs = sysfs(host_root)
        procs = procfs(host_root)
        # Kernel name (sda1, dm-0) -> how it is used: "is mounted at /", after the name.
        self.used: dict[str, str] = {}
        for fs_type in _FS_LISTING_DEVICES:
            listing = f"{self.sysfs}/fs/{fs_type}"
            for name in _names(listing):
                # /sys/fs/ext4 also holds `features`, /sys/fs/xfs `stats`: not devices.
                if os.path.isdir(f"{self.sysfs}/class/block/{name}"):
                    self._use(name, f"is mounted as {fs_type} ({listing}/{name})")
        for fsid in _names(f"{self.sysfs}/fs/btrfs"):
            listing = f"{self.sysfs}/fs/btrfs/{fsid}/devices"
            for name in _names(listing):
                self._use(name, f"is mounted as btrfs ({listing}/{name})")
        # This container's mounts only: the host's own are not visible here, but those the
        # DaemonSet mounts from it are (the filesystem that holds kubelet's directory).
        mountinfo = procs + "/self/mountinfo"
        for line in _file_lines(mountinfo):
            fields = line.split(" ")
            mounted = self.name_of(fields[2]) if len(fields) > 4 else None
            if mounted:
                self._use(mounted, f"is mounted at {unescape(fields[4])} ({mountinfo})")
        swaps = procs + "/swaps"
        for line in _file_lines(swaps)[1:]:
            path = unescape(line.split(maxsplit=1)[0]) if line.strip() else ""
            if path.startswith("/dev/"):
                self._use(posixpath.basename(path), f"is swap space ({swaps})")

    def _use(self, name: str, how: str) -> None:
        self.used.setdefault(name, how)

    def name_of(self, numbers: str) -> str | None:
        """The kernel's name of the block device `major:minor`, or None if it lists none."""
        try:
            real = os.path.realpath(f"{self.sysfs}/dev/block/{numbers}", strict=True)
        except OSError:
            return None
        return posixpath.basename(real)

    def hazard(self, host_path: str, device: int) -> str | None:
        """What handing out the block device at `host_path` (its st_rdev `device`) would give a
        container of the host, or None: a device holding a mounted filesystem or swap space,
        itself or through a partition of it or the device-mapper or RAID devices built on it;
        else a whole disk. A device-mapper or multipath device that nothing is mounted from,
        or an unused partition, is neither."""
        numbers = f"{os.major(device)}:{os.minor(device)}"
        entry = f"{self.sysfs}/dev/block/{numbers}"
        if self.name_of(numbers) is None:
            return f"{host_path} is a block device ({numbers}) the kernel does not list ({entry})"
        real = os.path.realpath(entry)
        for path in _stack(real):
            how = self.used.get(path[-1])
            if how is not None:
                # sda holds sda2, which holds dm-0, which is mounted at / (...)
                chain = " holds ".join([path[0], *(f"{name}, which" for name in path[1:])])
                return f"{host_path} is in use by the host: {chain} {how}"
        if not os.path.exists(real + "/partition") and os.path.lexists(real + "/device"):
            return f"{host_path} is a whole disk of the host ({entry} is the disk, not a partition)"
        return None


def _stack(real: str) -> Iterator[list[str]]:
    """The device at sysfs directory `real` and every device built on it (its partitions and
    holders, and theirs), each as the names from it up to that device."""
    seen = {real}
    todo = [(real, [posixpath.basename(real)])]
    while todo:
        directory, path = todo.pop(0)
        yield path
        if len(path) > _MAX_DEPTH:
            continue
        above = [
            os.path.join(directory, name)
            for name in _names(directory)
            if os.path.exists(os.path.join(directory, name, "partition"))
        ]
        above += [
            os.path.realpath(os.path.join(directory, "holders", name))
            for name in _names(directory + "/holders")
        ]
        for upper in above:
            if upper not in seen:
                seen.add(upper)
                todo.append((upper, [*path, posixpath.basename(upper)]))


def _file_lines(path: str) -> list[str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as text:
            return text.read().splitlines()
    except OSError:
        return []


def unescape(field: str) -> str:
    """A path as mountinfo and /proc/swaps write it: space, tab, newline and \\ as octal."""
    return re.sub(r"\\([0-7]{3})", lambda octal: chr(int(octal.group(1), 8)), field)
