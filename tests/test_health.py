"""Device health follows the node: event-driven, both ways, also through a bind mount."""

from __future__ import annotations

import shutil
import subprocess
import sys

import grpc
import pytest
import trio
from daemon_support import RESOURCE, log_line, serving
from metrics_support import get, metrics_port

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


@pytest.mark.parametrize("late", [["pcc dir"], ["device"], ["device", "pcc dir"]])
async def test_a_device_or_pcc_dir_that_comes_up_late_is_waited_for_then_served(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon, late: list[str]
) -> None:
    """A node whose PCC service or sev-guest driver comes up after the daemon: no exit (no
    CrashLoopBackOff), nothing registered, one line per missing path with its fix and the path
    on /readyz; once everything is in place, registered at once, without a restart."""
    paths = {"device": fake_node.device, "pcc dir": fake_node.pcc_dir}
    fixes = {"device": "load its sev-guest driver", "pcc dir": "start the PCC service"}
    for what in late:
        paths[what].unlink() if what == "device" else paths[what].rmdir()
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        port = await metrics_port(daemon)
        for what in late:
            path = paths[what]
            line = await log_line(daemon, f"waiting for {path} before serving: ")
            assert f"{path} failed: No such file or directory; check " in line
            assert fixes[what] in line
            assert line.startswith("W")
            status, _, body = await get(port, "/readyz")
            assert status == 503
            assert f"{RESOURCE}: waiting for {path} (detect " in body
            assert kubelet.registrations == []
            if what == "device":
                path.symlink_to("/dev/null")
            else:
                path.mkdir()
        await serving(kubelet)
        in_place = await log_line(daemon, f"{paths[late[-1]]} is in place after ")
        assert in_place.startswith("I")
        # Logged in the step that marks the resource registered: /readyz is 200 from then on.
        await log_line(daemon, "Registered device plugin with Kubelet")
        assert (await get(port, "/readyz"))[0] == 200
        assert len(kubelet.registrations) == 1
        assert daemon.proc.poll() is None
        assert daemon.log_text().count("waiting for ") == len(late)


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
