"""Every way a pod attests, served by the real daemon to the simulated kubelet: a mixed pool's
resources offered only where the node's kernel says it has the hardware (SEV-SNP, TDX under
either device name, a vTPM with its event log), configfs-tsm beside /dev/sev-guest, and block
devices the kernel says are the host's left out of a profile's glob."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
import trio
from daemon_support import log_line
from kernel_support import DISK, VIRTUAL, Sysfs, as_tdx_node_with_a_vtpm

from pcc_plugin.configuration import ConfigError, read
from pcc_plugin.flags import parse
from pcc_plugin.inventory import opted_in
from pcc_plugin.profiles import load
from pcc_plugin.resource import start_problem
from pcc_plugin.sim import FakeNode, SimKubelet, StartDaemon, run_blocking

ROOT = Path(__file__).resolve().parent.parent
MIXED_POOL = ROOT / "manifests" / "overlays" / "mixed-pool" / "profiles.yaml"
PCC = "tke.cloud.tencent.com/pcc-device"
TDX = "tke.cloud.tencent.com/tdx-guest"
VTPM = "tke.cloud.tencent.com/vtpm"


def registered(kubelet: SimKubelet, *names: str) -> bool:
    """Each resource registered, and kubelet's stream to it open."""
    accepted = {r.resource_name for r in kubelet.registrations if r.accepted}
    return all(name in accepted and kubelet.stream_open(name) for name in names)


async def test_a_mixed_pool_on_an_sev_snp_node_offers_only_the_pcc_device(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    """Nothing of TDX or a vTPM is advertised or Unhealthy there: each lists no devices."""
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args(), f"--config={MIXED_POOL}")
        await run_blocking(kubelet.wait_for, lambda: registered(kubelet, PCC, TDX, VTPM), 15.0)
        await run_blocking(kubelet.wait_for, lambda: len(kubelet.devices(PCC)) == 16, 10.0)
        assert set(kubelet.devices(PCC).values()) == {"Healthy"}
        assert kubelet.devices(TDX) == {}
        assert kubelet.devices(VTPM) == {}
        await log_line(
            daemon,
            f"{TDX}: not on this node, no devices: the kernel's CPU flags "
            f"({fake_node.host_root}/proc/cpuinfo) have no tdx_guest",
        )
        await log_line(
            daemon,
            f"{VTPM}: not on this node, no devices: the kernel has bound no TPM "
            f"({fake_node.host_root}/sys/class/tpm/tpm0 is missing)",
        )
        assert await run_blocking(daemon.terminate) == 0
    assert "Unhealthy" not in daemon.log_text()


async def test_a_mixed_pool_on_a_tdx_node_with_a_vtpm(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    """The TDX device under the name the kernel gave it, and the vTPM with its event log,
    read-only, where containers look for it; no PCC device, though /var/run/pcc is there."""
    as_tdx_node_with_a_vtpm(fake_node, device="tdx-guest")
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args(), f"--config={MIXED_POOL}")
        await run_blocking(kubelet.wait_for, lambda: registered(kubelet, PCC, TDX, VTPM), 15.0)
        await run_blocking(kubelet.wait_for, lambda: len(kubelet.devices(VTPM)) == 16, 10.0)
        assert kubelet.devices(TDX) == {f"tdx-guest-{i}": "Healthy" for i in range(16)}
        assert kubelet.devices(PCC) == {}
        response = await run_blocking(kubelet.allocate, TDX, [["tdx-guest-3"]])
        (container,) = response.container_responses
        assert [(d.host_path, d.container_path, d.permissions) for d in container.devices] == [
            ("/dev/tdx-guest", "/dev/tdx-guest", "rw")
        ]
        response = await run_blocking(kubelet.allocate, VTPM, [["vtpm-0"]])
        (container,) = response.container_responses
        assert [(d.host_path, d.container_path) for d in container.devices] == [
            ("/dev/tpmrm0", "/dev/tpmrm0")
        ]
        assert [(m.host_path, m.container_path, m.read_only) for m in container.mounts] == [
            ("/sys/kernel/security/tpm0", "/run/cc-device-plugin", True)
        ]
        await log_line(
            daemon,
            f"{PCC}: not on this node, no devices: the kernel registered no SEV-SNP guest "
            "platform device",
        )
        # The event log's directory going (the TPM unbound) makes the vTPM's shares unhealthy.
        shutil.rmtree(fake_node.host_root / "sys" / "kernel" / "security" / "tpm0")
        await run_blocking(
            kubelet.wait_for,
            lambda: set(kubelet.devices(VTPM).values()) == {"Unhealthy"},
            10.0,
        )
        assert await run_blocking(daemon.terminate) == 0


async def test_a_tdx_node_waits_for_its_device_under_either_name(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    """The kernel says the node is a TDX guest: a missing device is a driver not loaded (yet),
    waited for and said, as /dev/sev-guest is on an SEV-SNP guest; not another TEE's node."""
    as_tdx_node_with_a_vtpm(fake_node)
    (fake_node.host_root / "dev" / "tdx_guest").unlink()
    tdx_only = fake_node.root / "tdx.yaml"
    tdx_only.write_text((ROOT / "docs" / "examples" / "tdx.yaml").read_text())
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args(), f"--config={tdx_only}")
        pattern = f"{fake_node.host_root}/dev/tdx[-_]guest"
        await log_line(
            daemon,
            f"{TDX}: waiting for {pattern} before serving: detect device {pattern} failed: "
            "nothing matches, though the kernel says the node is a TDX guest; check "
            "/dev/tdx[-_]guest on the node: load its driver (modprobe tdx_guest)",
        )
        assert not registered(kubelet, TDX)
        (fake_node.host_root / "dev" / "tdx_guest").symlink_to("/dev/null")
        await run_blocking(kubelet.wait_for, lambda: registered(kubelet, TDX), 10.0)
        await run_blocking(kubelet.wait_for, lambda: len(kubelet.devices(TDX)) == 16, 10.0)
        assert set(kubelet.devices(TDX)) == {f"tdx_guest-{i}" for i in range(16)}
        assert await run_blocking(daemon.terminate) == 0


async def test_configfs_tsm_beside_the_sev_guest_device(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    """--tsm-report: each container also gets the report directory, read-write, at
    /run/tsm/report; the directory gone, every share is unhealthy and says why."""
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args(), "--tsm-report")
        await run_blocking(kubelet.wait_for, lambda: registered(kubelet, PCC), 10.0)
        response = await run_blocking(kubelet.allocate, PCC, [["pcc-0"]])
        (container,) = response.container_responses
        assert [(m.host_path, m.container_path, m.read_only) for m in container.mounts] == [
            ("/var/run/pcc", "/var/run/pcc", False),
            ("/sys/kernel/config/tsm/report", "/run/tsm/report", False),
        ]
        os.rmdir(fake_node.host_root / "sys" / "kernel" / "config" / "tsm" / "report")
        await run_blocking(
            kubelet.wait_for, lambda: set(kubelet.devices(PCC).values()) == {"Unhealthy"}, 10.0
        )
        await log_line(
            daemon,
            f"every device is Unhealthy: detect TSM report "
            f"{fake_node.host_root}/sys/kernel/config/tsm/report failed: No such file or directory",
        )
        assert await run_blocking(daemon.terminate) == 0


async def test_a_glob_leaves_out_the_block_devices_the_kernel_says_are_the_hosts(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    """docs/examples/power-block.yaml on a host whose root filesystem is on LVM: /dev/dm-*
    matches the root volume and a multipath LUN; only the LUN is offered, without an opt-in."""
    node = Sysfs(fake_node.host_root)
    sda2 = node.block(f"{DISK}/sda/sda2", "8:2", partition=True)
    node.holds(sda2, node.block(f"{VIRTUAL}/dm-0", "253:0"))
    node.mounted("xfs", "dm-0")
    node.block(f"{VIRTUAL}/dm-3", "253:3")
    for name, numbers in (("dm-0", (253, 0)), ("dm-3", (253, 3))):
        try:
            os.mknod(fake_node.host_root / "dev" / name, 0o600 | stat.S_IFBLK, os.makedev(*numbers))
        except PermissionError:
            pytest.skip("needs CAP_MKNOD to make a block device node")
    power = ROOT / "docs" / "examples" / "power-block.yaml"
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args(), f"--config={power}")
        await run_blocking(
            kubelet.wait_for, lambda: registered(kubelet, "power.example.com/block"), 10.0
        )
        assert kubelet.devices("power.example.com/block") == {"dm-3-0": "Healthy"}
        await log_line(
            daemon,
            "power.example.com/block: not offering /dev/dm-0: /dev/dm-0 is in use by the host: "
            f"dm-0 is mounted as xfs ({fake_node.host_root}/sys/fs/xfs/dm-0); its entry may set "
            "allowSensitiveHostPath (docs/profiles.md)",
        )
        assert await run_blocking(daemon.terminate) == 0


def test_the_pcc_profile_with_tsm_report_waits_for_its_directory(fake_node: FakeNode) -> None:
    """As for its device: the line names the directory and what the node needs."""
    config, _ = parse([*fake_node.daemon_args(), "--tsm-report"], "p", "", "")
    spec = config.pcc_resource()
    assert start_problem(spec, str(fake_node.host_root)) is None
    report = fake_node.host_root / "sys" / "kernel" / "config" / "tsm" / "report"
    report.rmdir()
    missing = start_problem(spec, str(fake_node.host_root))
    assert missing is not None
    assert missing.path == str(report)
    assert missing.message == (
        f"detect TSM report {report} failed: No such file or directory; check "
        "/sys/kernel/config/tsm/report on the node: configfs-tsm needs Linux 6.7 or later with "
        "configfs mounted at /sys/kernel/config (mount -t configfs none /sys/kernel/config) and "
        "the TEE's guest driver loaded; or run without --tsm-report"
    )
    # Without --tsm-report the directory is not needed.
    without = parse(fake_node.daemon_args(), "p", "", "")[0].pcc_resource()
    assert start_problem(without, str(fake_node.host_root)) is None


def test_tsm_report_with_a_config_file_is_a_usage_error(tmp_path: Path) -> None:
    """The file's mounts say what containers get: the flag would be silently ignored."""
    config, _ = parse(["--tsm-report", f"--config={MIXED_POOL}"], "p", "", "")
    with pytest.raises(ConfigError) as error:
        read(config)
    assert str(error.value) == (
        f"--tsm-report: not used with --config: give the resources of {MIXED_POOL} a mount of "
        "/sys/kernel/config/tsm/report instead"
    )
    assert error.value.see == "docs/profiles.md"


def test_a_block_entry_that_opts_in_is_a_warning_at_start(tmp_path: Path) -> None:
    path = tmp_path / "profiles.yaml"
    path.write_text(
        "resources: [{name: a.example.com/disk, devices: "
        "[{hostPath: /dev/nvme*n1, type: block, allowSensitiveHostPath: true}]}]"
    )
    (spec,) = load(str(path)).specs
    assert opted_in(spec) == [
        "/dev/nvme*n1 is handed out even where the kernel says it is a whole disk or holds the "
        "host's mounted filesystems or swap"
    ]
