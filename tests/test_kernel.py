"""What the kernel says of a node, read from fake sysfs and procfs trees laid out as Linux lays
out its own: the confidential-computing hardware, and the block devices that hold the host."""

from __future__ import annotations

from pathlib import Path

import pytest
from kernel_support import DISK, VIRTUAL, Sysfs

from pcc_plugin.kernel import SEV_SNP, TDX, TPM, missing_hardware, procfs, sysfs


@pytest.fixture
def node(tmp_path: Path) -> Sysfs:
    return Sysfs(tmp_path)


def test_a_tree_without_devices_is_not_the_hosts_sysfs(tmp_path: Path) -> None:
    """The DaemonSet mounts /sys/kernel/config or security under /host/sys: that is no sysfs."""
    (tmp_path / "sys" / "kernel" / "config").mkdir(parents=True)
    assert sysfs(str(tmp_path)) == "/sys"
    assert procfs(str(tmp_path)) == "/proc"
    (tmp_path / "sys" / "devices").mkdir()
    (tmp_path / "proc").mkdir()
    assert sysfs(str(tmp_path)) == f"{tmp_path}/sys"
    assert procfs(str(tmp_path)) == f"{tmp_path}/proc"
    assert sysfs("") == "/sys"


def test_the_hardware_is_what_the_kernel_registered(node: Sysfs) -> None:
    host = str(node.host)
    assert missing_hardware(SEV_SNP, host) == (
        "the kernel registered no SEV-SNP guest platform device "
        f"({host}/sys/bus/platform/devices/sev-guest is missing)"
    )
    (node.root / "bus" / "platform" / "devices").mkdir(parents=True)
    # A link to the device's directory, as the platform bus lists its devices.
    (node.root / "bus" / "platform" / "devices" / "sev-guest").symlink_to(
        "../../../devices/platform/sev-guest"
    )
    assert missing_hardware(SEV_SNP, host) is None

    assert missing_hardware(TDX, host) == (
        f"{host}/proc/cpuinfo cannot be read, so nothing says the node is a TDX guest"
    )
    cpuinfo = node.host / "proc" / "cpuinfo"
    # Only the first CPU's flags are read.
    cpuinfo.write_text(
        "processor\t: 0\nflags\t\t: fpu vme\n\nprocessor\t: 1\nflags\t\t: tdx_guest\n"
    )
    assert (
        missing_hardware(TDX, host)
        == f"the kernel's CPU flags ({host}/proc/cpuinfo) have no tdx_guest"
    )
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu vme tdx_guest tsc_reliable\n\n")
    assert missing_hardware(TDX, host) is None

    assert missing_hardware(TPM, host) == (
        f"the kernel has bound no TPM ({host}/sys/class/tpm/tpm0 is missing)"
    )
    (node.root / "class" / "tpm" / "tpm0").mkdir(parents=True)
    assert missing_hardware(TPM, host) is None


def test_a_whole_disk_and_its_unused_partition(node: Sysfs) -> None:
    vda = node.block(f"{DISK}/vda", "254:0", disk=True)
    node.block(f"{DISK}/vda/vda1", "254:1", partition=True)
    assert node.hazard("254:0", "/dev/vda") == (
        f"/dev/vda is a whole disk of the host ({node.root}/dev/block/254:0 is the disk, not a "
        "partition)"
    )
    assert node.hazard("254:1", "/dev/vda1") is None
    assert vda.is_dir()


def test_a_mounted_partition_and_the_disk_that_holds_it(node: Sysfs) -> None:
    node.block(f"{DISK}/vda", "254:0", disk=True)
    node.block(f"{DISK}/vda/vda1", "254:1", partition=True)
    node.mounted("ext4", "vda1")
    # ext4 lists its features beside its devices: not a device.
    node.mounted("ext4", "features")
    listing = f"{node.root}/fs/ext4/vda1"
    assert node.hazard("254:1", "/dev/vda1") == (
        f"/dev/vda1 is in use by the host: vda1 is mounted as ext4 ({listing})"
    )
    assert node.hazard("254:0", "/dev/vda") == (
        f"/dev/vda is in use by the host: vda holds vda1, which is mounted as ext4 ({listing})"
    )


def test_the_root_volume_on_lvm_and_what_it_is_built_on(node: Sysfs) -> None:
    """/dev/dm-* on such a host matches the root filesystem's logical volume."""
    sda = node.block("devices/pci0000:00/0000:00:10.0/host0/block/sda", "8:0", disk=True)
    sda2 = node.block("devices/pci0000:00/0000:00:10.0/host0/block/sda/sda2", "8:2", partition=True)
    root = node.block(f"{VIRTUAL}/dm-0", "253:0")
    node.holds(sda2, root)
    # This container's root filesystem is an overlay (0:x, no block device); kubelet's
    # directory, mounted into it from the host, is on the root volume.
    (node.host / "proc" / "self" / "mountinfo").write_text(
        "2300 2200 0:345 / / rw,relatime - overlay overlay rw\n"
        "2310 2300 253:0 /var/lib/kubelet/device-plugins /var/lib/kubelet/device-plugins "
        "rw,relatime - xfs /dev/mapper/vg-root rw\n"
    )
    mountinfo = f"{node.host}/proc/self/mountinfo"
    assert node.hazard("253:0", "/dev/dm-0") == (
        "/dev/dm-0 is in use by the host: dm-0 is mounted at /var/lib/kubelet/device-plugins "
        f"({mountinfo})"
    )
    assert node.hazard("8:2", "/dev/sda2") == (
        "/dev/sda2 is in use by the host: sda2 holds dm-0, which is mounted at "
        f"/var/lib/kubelet/device-plugins ({mountinfo})"
    )
    disk = node.hazard("8:0", "/dev/sda")
    assert disk is not None
    assert disk.startswith(
        "/dev/sda is in use by the host: sda holds sda2, which holds dm-0, which is mounted at "
    )
    assert sda.is_dir()


def test_a_multipath_device_nothing_is_mounted_from_is_not_the_hosts(node: Sysfs) -> None:
    """IBM Power's protected LUNs (docs/examples/power-block.yaml): dm devices on two paths."""
    mpath = node.block(f"{VIRTUAL}/dm-3", "253:3")
    (mpath / "dm").mkdir()
    (mpath / "dm" / "uuid").write_text("mpath-36005076303ffd4b1000000000000010a\n")
    for name, numbers in (("sdb", "8:16"), ("sdc", "8:32")):
        path = node.block(f"devices/pci0000:00/0000:00:10.0/host1/block/{name}", numbers, disk=True)
        node.holds(path, mpath)
    assert node.hazard("253:3", "/dev/dm-3") is None
    # Each path itself is a whole disk: handing one out would bypass multipath.
    assert node.hazard("8:16", "/dev/sdb") == (
        f"/dev/sdb is a whole disk of the host ({node.root}/dev/block/8:16 is the disk, not a "
        "partition)"
    )


def test_swap_space_and_btrfs(node: Sysfs) -> None:
    node.block(f"{VIRTUAL}/zram0", "252:0")
    node.block(f"{DISK}/vdb", "254:16", disk=True)
    node.block(f"{VIRTUAL}/loop0", "7:0")
    (node.host / "proc" / "swaps").write_text(
        "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
        "/dev/zram0                              partition\t4194300\t\t0\t\t100\n"
        "/var/swap\\040file                       file\t\t1048572\t\t0\t\t-2\n"
    )
    devices = node.root / "fs" / "btrfs" / "5f7a4c1e-0d2b-4a5e-9d0c-3f1b2a6e7c88" / "devices"
    devices.mkdir(parents=True)
    (devices / "vdb").symlink_to(f"../../../../{DISK}/vdb")
    assert node.hazard("252:0", "/dev/zram0") == (
        f"/dev/zram0 is in use by the host: zram0 is swap space ({node.host}/proc/swaps)"
    )
    assert node.hazard("254:16", "/dev/vdb") == (
        f"/dev/vdb is in use by the host: vdb is mounted as btrfs ({devices}/vdb)"
    )
    assert node.hazard("7:0", "/dev/loop0") is None


def test_a_block_device_the_kernel_does_not_list_is_refused(node: Sysfs) -> None:
    assert node.hazard("259:7", "/dev/nvme9n1") == (
        f"/dev/nvme9n1 is a block device (259:7) the kernel does not list "
        f"({node.root}/dev/block/259:7)"
    )


def test_holders_that_loop_end(node: Sysfs) -> None:
    """A sysfs that should not be (each holds the other) is walked once."""
    first = node.block(f"{VIRTUAL}/dm-1", "253:1")
    second = node.block(f"{VIRTUAL}/dm-2", "253:2")
    node.holds(first, second)
    node.holds(second, first)
    assert node.hazard("253:1") is None
