"""Fake sysfs and procfs trees laid out as Linux lays out its own, for tests of what the
kernel says of a node (pcc_plugin.kernel): block devices, and the hardware of a TEE."""

from __future__ import annotations

import os
from pathlib import Path

from pcc_plugin.kernel import BlockUse
from pcc_plugin.sim import FakeNode

DISK = "devices/pci0000:00/0000:00:05.0/virtio2/block"
VIRTUAL = "devices/virtual/block"


class Sysfs:
    """A fake /sys (under `host/sys`, with devices/ so that it stands for the host's whole sysfs)
    and /proc, with block devices laid out as the kernel lays them out."""

    def __init__(self, host: Path) -> None:
        self.host = host
        self.root = host / "sys"
        (self.root / "devices").mkdir(parents=True, exist_ok=True)
        (host / "proc" / "self").mkdir(parents=True, exist_ok=True)

    def block(
        self, where: str, numbers: str, *, disk: bool = False, partition: bool = False
    ) -> Path:
        """A block device's directory at `where` (below /sys), listed as `numbers` in
        /sys/dev/block and by name in /sys/class/block; a disk has a `device` link (its
        hardware), a partition a `partition` file."""
        directory = self.root / where
        directory.mkdir(parents=True)
        (directory / "dev").write_text(f"{numbers}\n")
        (directory / "holders").mkdir()
        if disk:
            (directory / "device").symlink_to("../../../virtio2")
        if partition:
            (directory / "partition").write_text("1\n")
        for listing, name in (("dev/block", numbers), ("class/block", directory.name)):
            (self.root / listing).mkdir(parents=True, exist_ok=True)
            (self.root / listing / name).symlink_to(os.path.relpath(directory, self.root / listing))
        return directory

    def holds(self, lower: Path, upper: Path) -> None:
        """`upper` (a device-mapper or RAID device) is built on `lower`."""
        (lower / "holders" / upper.name).symlink_to(os.path.relpath(upper, lower / "holders"))
        (upper / "slaves").mkdir(exist_ok=True)
        (upper / "slaves" / lower.name).symlink_to(os.path.relpath(lower, upper / "slaves"))

    def mounted(self, fs_type: str, name: str) -> None:
        """A filesystem of `fs_type` mounted from `name`, as its driver lists it."""
        (self.root / "fs" / fs_type / name).mkdir(parents=True)

    def hazard(self, numbers: str, host_path: str = "/dev/x") -> str | None:
        major, minor = map(int, numbers.split(":"))
        return BlockUse(str(self.host)).hazard(host_path, os.makedev(major, minor))

    def tdx_guest(self) -> None:
        """The kernel's CPU flags of a TDX guest (it sets tdx_guest at boot)."""
        (self.host / "proc" / "cpuinfo").write_text(
            "processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu vme tdx_guest\n\n"
        )


def as_tdx_node_with_a_vtpm(node: FakeNode, device: str = "tdx_guest") -> None:
    """The fake SEV-SNP node made a TDX guest with a vTPM, as cloud TDX VMs are: no SEV-SNP
    platform device; the tdx_guest CPU flag; the TDX device and the TPM's resource manager (both
    symlinks to /dev/null, character devices), the TPM bound, and its event log."""
    host = node.host_root
    os.rmdir(host / "sys" / "bus" / "platform" / "devices" / "sev-guest")
    Sysfs(host).tdx_guest()
    node.device.unlink()
    (host / "dev" / device).symlink_to("/dev/null")
    (host / "dev" / "tpmrm0").symlink_to("/dev/null")
    (host / "sys" / "class" / "tpm" / "tpm0").mkdir(parents=True)
    (host / "sys" / "kernel" / "security" / "tpm0").mkdir(parents=True)
    (host / "sys" / "kernel" / "security" / "tpm0" / "binary_bios_measurements").write_bytes(b"\0")
