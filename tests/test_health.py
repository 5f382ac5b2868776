"""Device health follows the node: event-driven, both ways, also through a bind mount."""

from __future__ import annotations

import shutil
import subprocess
import sys

import grpc
import pytest
import trio
from daemon_support import RESOURCE, log_line, serving

from pcc_plugin.sim import Daemon, FakeNode, SimKubelet, StartDaemon, run_blocking


async def devices_become(kubelet: SimKubelet, health: str) -> None:
    def all_are() -> bool:
        devices = kubelet.devices(RESOURCE)
        return len(devices) == 16 and set(devices.values()) == {health}

    await run_blocking(kubelet.wait_for, all_are, 10.0)


async def allocate_status(kubelet: SimKubelet) -> tuple[grpc.StatusCode, str]:
    try:
        await run_blocking(kubelet.allocate, RESOURCE, [["pcc-0"]])
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


async def test_device_going_and_coming_back(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args())
        await serving(kubelet)
        fake_node.device.unlink()
        await devices_become(kubelet, "Unhealthy")
        await log_line(daemon, "every device is Unhealthy: detect device")
        code, details = await allocate_status(kubelet)
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert f"detect device {fake_node.device} failed" in details
        fake_node.device.symlink_to("/dev/null")
        await devices_become(kubelet, "Healthy")
        await log_line(daemon, "all 16 devices Healthy", count=2)
        assert await allocate_status(kubelet) == (grpc.StatusCode.OK, "")
        # Replaced by something that is not a character device.
        fake_node.device.unlink()
        fake_node.device.write_text("")
        await devices_become(kubelet, "Unhealthy")
        await log_line(daemon, "not a character device")


async def test_pcc_dir_going_and_coming_back(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args())
        await serving(kubelet)
        fake_node.pcc_dir.rmdir()
        await devices_become(kubelet, "Unhealthy")
        await log_line(daemon, f"detect socket path {fake_node.pcc_dir} failed")
        fake_node.pcc_dir.mkdir()
        await devices_become(kubelet, "Healthy")


async def test_whole_parent_directory_removed_and_recreated(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(30):
        start_daemon(*fake_node.daemon_args())
        await serving(kubelet)
        shutil.rmtree(fake_node.host_root / "var")
        await devices_become(kubelet, "Unhealthy")
        # Recreated step by step, as a node's tmpfs is at boot.
        (fake_node.host_root / "var" / "run").mkdir(parents=True)
        fake_node.pcc_dir.mkdir()
        await devices_become(kubelet, "Healthy")


async def test_pre_start_check_is_offered_and_checks_the_node(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(30):
        start_daemon(*fake_node.daemon_args(), "--pre-start-check")
        await serving(kubelet)
        (registration,) = kubelet.registrations
        assert registration.options is not None
        assert registration.options.pre_start_required
        await run_blocking(kubelet.pre_start_container, RESOURCE, ["pcc-0"])
        fake_node.pcc_dir.rmdir()
        with pytest.raises(grpc.RpcError) as failure:
            await run_blocking(kubelet.pre_start_container, RESOURCE, ["pcc-0"])
        assert failure.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "detect socket path" in (failure.value.details() or "")


def _can_unshare_mounts() -> bool:
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False, timeout=10)
    return probe.returncode == 0


@pytest.mark.skipif(
    shutil.which("unshare") is None or not _can_unshare_mounts(),
    reason="needs root and unshare -m for a private mount namespace",
)
async def test_health_through_a_bind_mounted_parent_directory(
    kubelet: SimKubelet, fake_node: FakeNode
) -> None:
    """As in the pod: the host's /dev is bind-mounted at <host-root>/dev."""
    real_dev = fake_node.root / "real-dev"
    real_dev.mkdir()
    (real_dev / "sev-guest").symlink_to("/dev/null")
    fake_node.device.unlink()
    mounted_dev = fake_node.host_root / "dev"
    script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    argv = [
        "unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh",
        str(real_dev), str(mounted_dev), sys.executable, "-m", "pcc_plugin",
        *fake_node.daemon_args(),
    ]  # fmt: skip
    daemon = Daemon(argv, fake_node.root / "daemon-unshare.log")
    try:
        with trio.fail_after(30):
            await serving(kubelet)
            # Changes on the "host" side only; the plugin sees them through its mount.
            (real_dev / "sev-guest").unlink()
            await devices_become(kubelet, "Unhealthy")
            (real_dev / "sev-guest").symlink_to("/dev/null")
            await devices_become(kubelet, "Healthy")
    finally:
        daemon.close()
        print(daemon.log_text())
