"""`pcc-device-plugin doctor` on healthy and broken fake nodes, run as operators run it."""

from __future__ import annotations

import errno
import functools
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import attrs
import pytest
import trio
from dra_support import DRIVER, DraNode, registered
from kernel_support import VIRTUAL, Sysfs, as_tdx_node_with_a_vtpm

from pcc_plugin.doctor.attestation import check_tsm_report
from pcc_plugin.doctor.config import check_config
from pcc_plugin.doctor.node import check_device, check_pcc_node
from pcc_plugin.doctor.report import Result
from pcc_plugin.flags import Flags
from pcc_plugin.profiles import load
from pcc_plugin.resource import DeviceNode
from pcc_plugin.sim import Daemon, FakeNode, SimKubelet, StartDaemon, run_blocking

ROOT = Path(__file__).resolve().parent.parent
RESOURCE = "tke.cloud.tencent.com/pcc-device"
DEVICE = "device /dev/sev-guest"
SEV_SNP = "SEV-SNP guest device"
PCC_DIR = "socket path /var/run/pcc"
PLUGIN_DIR = "device-plugin dir"
KUBELET = "kubelet"
PLUGIN = f"plugin {RESOURCE}"
READYZ = "readyz"
CHECKS = [DEVICE, SEV_SNP, PCC_DIR, PLUGIN_DIR, KUBELET, PLUGIN, READYZ]  # no --config
# The fake node's device is a symlink to /dev/null, and its sysfs names no sev-guest device: on
# a healthy fake node these two checks warn, and every other passes.
FAKE_NODE_WARNS = {DEVICE, SEV_SNP}


@attrs.frozen
class Report:
    code: int
    stdout: str
    stderr: str

    @property
    def lines(self) -> dict[str, str]:
        """Each check's line, by check name: `<STATUS>  <check>: <detail>[; fix: <fix>]`."""
        found = {}
        for line in self.stdout.splitlines():
            status, _, rest = line.partition("  ")
            if status in ("PASS", "WARN", "FAIL", "SKIP"):
                found[rest.split(": ", 1)[0]] = line
        return found

    @property
    def statuses(self) -> dict[str, str]:
        return {check: line.split("  ", 1)[0] for check, line in self.lines.items()}

    @property
    def unlike_a_healthy_fake_node(self) -> set[str]:
        """The checks whose status is not the one they have on a healthy fake node."""
        return {
            check
            for check, status in self.statuses.items()
            if status != ("WARN" if check in FAKE_NODE_WARNS else "PASS")
        }


async def run_doctor(*args: str, wrapper: Sequence[str] = ()) -> Report:
    argv = [*wrapper, sys.executable, "-m", "pcc_plugin", "doctor", *args]
    with trio.fail_after(30):
        done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    report = Report(done.returncode, done.stdout.decode(), done.stderr.decode())
    print(f"--- doctor exit {report.code}\n{report.stdout}{report.stderr}")
    return report


@attrs.frozen
class Node:
    """A fake node with the simulated kubelet and the daemon serving it."""

    fake: FakeNode
    kubelet: SimKubelet
    daemon: Daemon
    # The daemon's flags, with the metrics port it really listens on.
    args: list[str]


async def start_node(
    fake_node: FakeNode, kubelet: SimKubelet, start_daemon: StartDaemon, *extra: str
) -> Node:
    daemon = start_daemon(*fake_node.daemon_args(), *extra)
    args = [*fake_node.daemon_args(), *extra]
    if "--metrics-bind-address=" not in extra:
        line = await run_blocking(daemon.wait_for_log, "Serving /metrics", 10.0)
        args.append(f"--metrics-bind-address=127.0.0.1:{line.rsplit(' ', 1)[1]}")
    await run_blocking(daemon.wait_for_log, "Registered device plugin with Kubelet", 10.0)
    await run_blocking(kubelet.wait_for, lambda: kubelet.stream_open(RESOURCE), 10.0)
    return Node(fake_node, kubelet, daemon, args)


@pytest.fixture
async def node(fake_node: FakeNode, kubelet: SimKubelet, start_daemon: StartDaemon) -> Node:
    with trio.fail_after(20):
        return await start_node(fake_node, kubelet, start_daemon)


async def test_a_healthy_node_passes_every_check_without_disturbing_the_daemon(
    node: Node,
) -> None:
    with trio.fail_after(30):
        registers = node.kubelet.register_calls
        report = await run_doctor(*node.args)
        assert report.code == 0
        assert list(report.lines) == CHECKS
        assert report.unlike_a_healthy_fake_node == set()
        host = node.fake.host_root
        assert report.lines[DEVICE] == (
            f"WARN  {DEVICE}: {host}/dev/sev-guest is a character device, but a symlink to "
            "/dev/null: containers get /dev/null; fix: make /dev/sev-guest the device node "
            "itself (the sev-guest driver creates it), or give --pcc-device the node it leads to"
        )
        assert report.lines[SEV_SNP] == (
            f"WARN  {SEV_SNP}: {host}/sys/class/misc/sev-guest/dev does not exist: the "
            f"sev-guest driver is not loaded, so nothing says that {host}/dev/sev-guest (1:3) is "
            "the SEV-SNP guest device; fix: on an SEV-SNP guest, load its sev-guest driver "
            "(modprobe sev-guest); a node that is not one has no PCC device: remove its label "
            "tke.cloud.tencent.com/pcc-device-plugin"
        )
        assert report.stdout.splitlines()[-1] == "5 passed, 2 warned, 0 failed, 0 skipped."
        assert report.stderr == ""
        assert "lists 16 devices, 16 Healthy" in report.lines[PLUGIN]
        assert "UNIMPLEMENTED" in report.lines[KUBELET]
        # The doctor's stream is seen, and not taken for kubelet's.
        await run_blocking(node.daemon.wait_for_log, "ListAndWatch stream opened", 10.0, count=2)
        assert node.daemon.log_text().count("(kubelet's)") == 1
        assert node.kubelet.register_calls == registers
        assert node.kubelet.stream_open(RESOURCE)


async def devices_become(node: Node, health: str) -> None:
    def all_are() -> bool:
        return set(node.kubelet.devices(RESOURCE).values()) == {health}

    await run_blocking(node.kubelet.wait_for, all_are, 10.0)


async def remove_device(node: Node) -> None:
    node.fake.device.unlink()
    await devices_become(node, "Unhealthy")


async def replace_device_with_a_file(node: Node) -> None:
    node.fake.device.unlink()
    node.fake.device.write_text("")
    await devices_become(node, "Unhealthy")


async def remove_pcc_dir(node: Node) -> None:
    node.fake.pcc_dir.rmdir()
    await devices_become(node, "Unhealthy")


async def remove_plugin_dir(node: Node) -> None:
    await run_blocking(node.kubelet.stop)
    # Moved away in one step: the daemon may be serving a fresh socket in it meanwhile.
    shutil.rmtree(node.fake.plugin_dir.rename(node.fake.plugin_dir.with_name("removed")))
    await run_blocking(node.daemon.wait_for_log, "to be created", 10.0)


async def stop_kubelet(node: Node) -> None:
    await run_blocking(node.kubelet.stop)
    await run_blocking(node.daemon.wait_for_log, "Waiting for kubelet", 10.0)


async def make_kubelet_sock_a_file(node: Node) -> None:
    await run_blocking(node.kubelet.stop)
    await run_blocking(node.daemon.wait_for_log, "Waiting for kubelet", 10.0)
    (node.fake.plugin_dir / "kubelet.sock").write_text("")
    # What /readyz says once the daemon has looked at it (the doctor asks it).
    await run_blocking(node.daemon.wait_for_log, "is not a socket", 10.0)


async def leave_a_dead_kubelet_sock(node: Node) -> None:
    await run_blocking(node.kubelet.stop)
    # Bound, never listening, closed: the file stays, as a crashed kubelet leaves it.
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(node.fake.plugin_dir / "kubelet.sock"))
    await run_blocking(node.daemon.wait_for_log, "Kubelet is not reachable yet", 10.0)


async def stop_daemon(node: Node) -> None:
    assert await run_blocking(node.daemon.terminate) == 0


async def kill_daemon(node: Node) -> None:
    assert await run_blocking(node.daemon.terminate, signal.SIGKILL) == -signal.SIGKILL


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        pytest.param(
            remove_device,
            {
                DEVICE: [
                    "host/dev/sev-guest does not exist",
                    "modprobe sev-guest",
                    "remove its label tke.cloud.tencent.com/pcc-device-plugin",
                ],
                SEV_SNP: ["SKIP", "not checked until", "is a character device"],
                PLUGIN: ["16 devices, 0 Healthy; expected every one Healthy", "'Unhealthy'"],
            },
            id="device missing",
        ),
        pytest.param(
            replace_device_with_a_file,
            {
                DEVICE: ["is a regular file, not a character device", "modprobe -r sev-guest"],
                SEV_SNP: ["SKIP"],
                PLUGIN: ["0 Healthy"],
            },
            id="device not a character device",
        ),
        pytest.param(
            remove_pcc_dir,
            {
                PCC_DIR: ["host/var/run/pcc does not exist", "start the PCC service"],
                PLUGIN: ["0 Healthy"],
            },
            id="PCC dir missing",
        ),
        pytest.param(
            remove_plugin_dir,
            {
                PLUGIN_DIR: ["device-plugins does not exist", "kubelet creates it at start"],
                KUBELET: ["SKIP", "not checked until", "device-plugins exists"],
                PLUGIN: ["SKIP"],
                READYZ: ["answers 503", "to be created"],
            },
            id="device-plugin dir missing",
        ),
        pytest.param(
            stop_kubelet,
            {
                KUBELET: ["kubelet.sock does not exist", "systemctl status kubelet"],
                PLUGIN: ["SKIP", "not checked until kubelet answers"],
                READYZ: ["answers 503", "waiting for kubelet"],
            },
            id="kubelet.sock missing",
        ),
        pytest.param(
            make_kubelet_sock_a_file,
            {
                KUBELET: ["is a regular file, not a socket", "rm "],
                PLUGIN: ["SKIP"],
                READYZ: ["answers 503", "waiting for kubelet"],
            },
            id="kubelet.sock a regular file",
        ),
        pytest.param(
            leave_a_dead_kubelet_sock,
            {
                KUBELET: ["nothing listens on", "systemctl restart kubelet"],
                PLUGIN: ["SKIP"],
                READYZ: ["answers 503", "registration failed"],
            },
            id="kubelet.sock left behind",
        ),
        pytest.param(
            stop_daemon,
            {
                PLUGIN: ["takes connections;", "start the daemon"],
                READYZ: ["Connection refused", "the daemon is not running"],
            },
            id="daemon stopped",
        ),
        pytest.param(
            kill_daemon,
            {
                PLUGIN: ["(1 stale, left by a daemon that was killed)", "--previous"],
                READYZ: ["Connection refused"],
            },
            id="daemon killed",
        ),
    ],
)
async def test_a_broken_node_fails_the_checks_it_should_with_their_fixes(
    node: Node, damage: Callable[[Node], Awaitable[None]], expected: dict[str, list[str]]
) -> None:
    with trio.fail_after(30):
        await damage(node)
        registers = node.kubelet.register_calls
        report = await run_doctor(*node.args)
        assert node.kubelet.register_calls == registers
    assert report.code == 1
    assert report.stderr == ""
    assert list(report.lines) == CHECKS
    assert report.unlike_a_healthy_fake_node == set(expected)
    for check, texts in expected.items():
        line = report.lines[check]
        if report.statuses[check] == "FAIL":
            assert "; fix: " in line
        for text in texts:
            assert text in line


async def test_a_wrong_resource_count_fails_the_plugin_check(node: Node) -> None:
    with trio.fail_after(30):
        report = await run_doctor(*node.args, "--resource-count=8")
    assert report.code == 1
    assert report.unlike_a_healthy_fake_node == {PLUGIN}
    assert "lists 16 devices, 16 Healthy; expected 8 devices" in report.lines[PLUGIN]
    assert "fix: give the doctor the daemon's flags" in report.lines[PLUGIN]


async def test_a_pre_start_check_mismatch_fails_the_plugin_check(node: Node) -> None:
    with trio.fail_after(30):
        report = await run_doctor(*node.args, "--pre-start-check")
    assert report.code == 1
    assert "the daemon runs without --pre-start-check" in report.lines[PLUGIN]


async def test_readyz_is_skipped_when_metrics_are_off(
    fake_node: FakeNode, kubelet: SimKubelet, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(30):
        node = await start_node(fake_node, kubelet, start_daemon, "--metrics-bind-address=")
        report = await run_doctor(*node.args)
    assert report.code == 0
    assert report.statuses[READYZ] == "SKIP"
    assert "metrics and probes are off" in report.lines[READYZ]
    assert report.stdout.splitlines()[-1] == "4 passed, 2 warned, 0 failed, 1 skipped."


async def test_with_a_config_file_every_resource_is_checked(
    fake_node: FakeNode, kubelet: SimKubelet, start_daemon: StartDaemon
) -> None:
    vfio = fake_node.host_root / "dev" / "vfio"
    vfio.mkdir()
    for group in ("3", "7"):
        (vfio / group).symlink_to("/dev/null")
    config = fake_node.root / "resources.yaml"
    config.write_text(
        "resources:\n"
        "  - {name: example.com/pcc, count: 2, devices: [{hostPath: /dev/sev-guest}],\n"
        "     mounts: [{hostPath: /var/run/pcc}]}\n"
        '  - {name: example.com/vfio, devices: [{hostPath: "/dev/vfio/[0-9]*"}]}\n'
    )
    args = [*fake_node.daemon_args(), f"--config={config}"]
    # Several Python processes start one after another here: 60 s for a loaded machine.
    with trio.fail_after(60):
        daemon = start_daemon(*args)
        port = (await run_blocking(daemon.wait_for_log, "Serving /metrics", 10.0)).rsplit(" ")[-1]
        args.append(f"--metrics-bind-address=127.0.0.1:{port}")
        await run_blocking(daemon.wait_for_log, "Registered device plugin", 10.0, count=2)
        await run_blocking(
            kubelet.wait_for,
            lambda: (
                kubelet.stream_open("example.com/pcc") and kubelet.stream_open("example.com/vfio")
            ),
            10.0,
        )
        healthy = await run_doctor(*args)
        (vfio / "7").unlink()
        await run_blocking(
            kubelet.wait_for, lambda: "Unhealthy" in kubelet.devices("example.com/vfio").values()
        )
        one_gone = await run_doctor(*args)
        # The file changed to something the daemon refuses: so does the doctor, and says why.
        config.write_text("resources: []\n")
        await run_blocking(daemon.wait_for_log, "Configuration not reloaded", 10.0)
        refused = await run_doctor(*args)
    assert healthy.code == 0
    assert list(healthy.lines) == [
        "device /dev/sev-guest",
        SEV_SNP,
        "mount /var/run/pcc",
        "device /dev/vfio/[0-9]*",
        PLUGIN_DIR,
        KUBELET,
        "plugin example.com/pcc",
        "plugin example.com/vfio",
        READYZ,
        "config",
    ]
    assert healthy.lines["config"].startswith(f"PASS  config: the daemon runs {config} as it is")
    assert refused.code == 1
    assert refused.statuses["config"] == "FAIL"
    assert "resources: must list at least one resource" in refused.lines["config"]
    assert "the daemon keeps running the configuration it had" in refused.lines["config"]
    assert refused.statuses[READYZ] == "PASS"
    assert "2 match, each a character device" in healthy.lines["device /dev/vfio/[0-9]*"]
    assert "lists 2 devices, 2 Healthy" in healthy.lines["plugin example.com/pcc"]
    assert "lists 2 devices, 2 Healthy" in healthy.lines["plugin example.com/vfio"]
    assert one_gone.code == 1
    assert {check for check, status in one_gone.statuses.items() if status == "FAIL"} == {
        "plugin example.com/vfio"
    }
    # This machine is no SEV-SNP guest: nothing says the device is its driver's.
    assert healthy.statuses[SEV_SNP] == "WARN"
    assert (
        "lists 2 devices, 1 Healthy; expected 1 device; expected every one Healthy"
        in (one_gone.lines["plugin example.com/vfio"])
    )


# A PCC directory that is not writable. As root, mode bits alone do not stop the doctor: drop
# its capabilities (as the hardened overlay does) or make the directory read-only by mounting.


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
async def test_pcc_dir_without_write_permission_fails_for_root_without_capabilities(
    node: Node,
) -> None:
    node.fake.pcc_dir.chmod(0o555)
    without_capabilities = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"]
    report = await run_doctor(*node.args, wrapper=without_capabilities)
    assert report.code == 1
    assert report.unlike_a_healthy_fake_node == {PCC_DIR}
    assert "(mode 0555) is not writable for uid 0" in report.lines[PCC_DIR]
    assert "chmod u+w /var/run/pcc" in report.lines[PCC_DIR]


def _can_unshare_mounts() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False, timeout=10)
    return probe.returncode == 0


needs_mount_namespace = pytest.mark.skipif(
    not _can_unshare_mounts(), reason="needs root and unshare -m for a private mount namespace"
)


def in_mount_namespace(script: str) -> list[str]:
    """Run `script` in a private mount namespace, then the command after it."""
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", f'{script} && exec "$@"', "sh"]


@needs_mount_namespace
async def test_pcc_dir_on_a_read_only_filesystem_fails(node: Node) -> None:
    read_only_tmpfs = f"mount -t tmpfs -o ro tmpfs {node.fake.pcc_dir}"
    report = await run_doctor(*node.args, wrapper=in_mount_namespace(read_only_tmpfs))
    assert report.code == 1
    assert report.unlike_a_healthy_fake_node == {PCC_DIR}
    assert f"is on a read-only filesystem (tmpfs at {node.fake.pcc_dir})" in report.lines[PCC_DIR]


def read_only_bind(directory: str) -> str:
    return f"mount --bind {directory} {directory} && mount -o remount,bind,ro {directory}"


@needs_mount_namespace
async def test_pcc_dir_seen_read_only_through_the_pods_mount_passes(node: Node) -> None:
    """The manifests mount the host's /var/run read-only at /host/var/run, on purpose."""
    var_run = node.fake.host_root / "var" / "run"
    report = await run_doctor(*node.args, wrapper=in_mount_namespace(read_only_bind(str(var_run))))
    assert report.code == 0
    assert (
        f"read-only here only through this container's mount at {var_run}"
        in (report.lines[PCC_DIR])
    )


@needs_mount_namespace
async def test_pcc_dir_on_a_read_only_mount_of_the_node_itself_fails(node: Node) -> None:
    """Without --host-root the doctor looks at the node's own mounts: read-only is read-only."""
    var_run = node.fake.host_root / "var" / "run"
    on_the_node = [
        *node.args,
        "--host-root=",
        f"--pcc-device={node.fake.device}",
        f"--pcc-socket-path={node.fake.pcc_dir}",
    ]
    report = await run_doctor(
        *on_the_node, wrapper=in_mount_namespace(read_only_bind(str(var_run)))
    )
    assert report.code == 1
    pcc_dir = f"socket path {node.fake.pcc_dir}"
    assert report.statuses[pcc_dir] == "FAIL"
    assert f"is on a read-only mount at {var_run}" in report.lines[pcc_dir]
    assert "mount -o remount,bind,rw" in report.lines[pcc_dir]


REGISTRY_DIR = "plugin registry dir"
DRA_DRIVER = f"DRA driver {DRIVER}"


async def test_in_dra_mode_the_driver_is_checked_instead_of_the_device_plugin(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(60):
        daemon = start_daemon(*dra_node.daemon_args())
        line = await run_blocking(daemon.wait_for_log, "Serving /metrics", 10.0)
        await registered(dra_node)
        args = [
            *dra_node.daemon_args(),
            f"--metrics-bind-address=127.0.0.1:{line.rsplit(' ', 1)[1]}",
        ]
        report = await run_doctor(*args)
        assert report.code == 0, report.stdout
        # No device-plugin directory or kubelet.sock: the DRA mode needs neither.
        assert list(report.lines) == [DEVICE, SEV_SNP, PCC_DIR, REGISTRY_DIR, DRA_DRIVER, READYZ]
        assert report.unlike_a_healthy_fake_node == set()
        (instance,) = dra_node.kubelet.instances(DRIVER)
        assert report.lines[DRA_DRIVER].endswith(
            f"answers for {DRIVER} (v1.DRAPlugin, v1beta1.DRAPlugin, v1.DRAResourceHealth, "
            f"v1alpha1.DRAResourceHealth); its DRA socket {instance.endpoint} answers"
        )

        # Killed: its sockets are left behind, and answer nothing.
        assert await run_blocking(daemon.terminate, signal.SIGKILL) == -signal.SIGKILL
        report = await run_doctor(*args)
        assert report.code == 1
        assert report.statuses[DRA_DRIVER] == "FAIL"
        assert report.lines[DRA_DRIVER] == (
            f"FAIL  {DRA_DRIVER}: no registration socket in {dra_node.registry} answers GetInfo "
            f"for {DRIVER}; fix: start the daemon with --mode=dra, or see why it stopped "
            "(kubectl -n kube-system logs <the plugin's pod on this node> --previous); give the "
            "doctor the daemon's flags"
        )

        dra_node.registry.rename(dra_node.registry.with_name("elsewhere"))
        report = await run_doctor(*args)
        assert report.statuses[REGISTRY_DIR] == "FAIL"
        assert report.statuses[DRA_DRIVER] == "SKIP"


async def test_usage_errors_and_help() -> None:
    with trio.fail_after(30):
        bad = await run_doctor("--resource-count=0")
        helped = await run_doctor("--help")
    assert bad.code == 2
    assert bad.stderr.count("\n") == 1
    assert "--resource-count" in bad.stderr
    assert helped.code == 0
    assert helped.stdout.startswith("usage: pcc-device-plugin doctor ")


# The SEV-SNP guest device and symlinks, checked on a host tree (tests/conftest.py's `host`):
# its device is a symlink to /dev/null (1:3), its PCC directory a directory.


def pcc_node_checks(host: Path) -> dict[str, Result]:
    return {result.check: result for result in check_pcc_node(Flags().pcc_resource(), str(host))}


def name_sev_guest(host: Path, numbers: str) -> None:
    # With devices/, the tree stands for the host's whole sysfs (pcc_plugin.kernel.sysfs).
    (host / "sys" / "devices").mkdir(parents=True)
    (host / "sys" / "class" / "misc" / "sev-guest").mkdir(parents=True)
    (host / "sys" / "class" / "misc" / "sev-guest" / "dev").write_text(f"{numbers}\n")


def test_the_device_that_sysfs_names_passes(host: Path) -> None:
    name_sev_guest(host, "1:3")
    result = pcc_node_checks(host)[SEV_SNP]
    assert result == Result(
        "PASS", SEV_SNP, f"{host}/dev/sev-guest is the sev-guest driver's device (1:3)"
    )


def test_a_node_without_the_device_or_the_pcc_directory_gets_the_docs_fixes(host: Path) -> None:
    """Not an SEV-SNP node (remove the label), or its driver is not loaded; the PCC service
    makes its directory, and one made by hand would hide a node whose service does not run."""
    (host / "dev" / "sev-guest").unlink()
    (host / "var" / "run" / "pcc").rmdir()
    checks = pcc_node_checks(host)
    assert checks[DEVICE].line() == (
        f"FAIL  {DEVICE}: {host}/dev/sev-guest does not exist; fix: on an SEV-SNP guest, load "
        "its sev-guest driver (modprobe sev-guest); a node that is not one has no PCC device: "
        "remove its label tke.cloud.tencent.com/pcc-device-plugin; or give the daemon and the "
        f"doctor the right path; with --host-root, the host's /dev must be mounted at {host}/dev"
    )
    assert checks[PCC_DIR].line() == (
        f"FAIL  {PCC_DIR}: {host}/var/run/pcc does not exist; fix: start the PCC service on the "
        "node, which creates the directory; never create it by hand: an empty one hides a node "
        "whose PCC service does not run; or give the daemon and the doctor the right path; with "
        f"--host-root, the host's /var/run must be mounted at {host}/var/run"
    )


@pytest.mark.parametrize("document", ["README.md", "docs/deploy.md", "docs/doctor.md"])
def test_the_docs_tell_the_doctors_story_of_a_missing_device_or_directory(document: str) -> None:
    text = " ".join((Path(__file__).parent.parent / document).read_text().split())
    assert "mkdir -p /var/run/pcc" not in text
    assert "modprobe sev-guest" in text
    assert "remove its label tke.cloud.tencent.com/pcc-device-plugin" in text or (
        "remove the node's label `tke.cloud.tencent.com/pcc-device-plugin`" in text
    )


def test_a_device_other_than_the_one_sysfs_names_warns(host: Path) -> None:
    name_sev_guest(host, "10:122")
    result = pcc_node_checks(host)[SEV_SNP]
    assert result.line() == (
        f"WARN  {SEV_SNP}: {host}/dev/sev-guest is device 1:3, but the sev-guest driver's is "
        f"10:122 ({host}/sys/class/misc/sev-guest/dev); fix: give --pcc-device the sev-guest "
        "driver's device node (/dev/sev-guest on the host)"
    )


def test_without_the_hosts_sys_under_the_host_root_this_containers_sys_is_read(
    host: Path,
) -> None:
    """The manifests mount only the host's /dev and /var/run: sysfs is the same kernel's."""
    line = pcc_node_checks(host)[SEV_SNP].line()
    assert "/sys/class/misc/sev-guest/dev" in line
    assert f"{host}/sys" not in line


def test_a_pcc_directory_that_is_a_symlink_warns(host: Path) -> None:
    real = host / "var" / "run" / "pcc-real"
    (host / "var" / "run" / "pcc").rename(real)
    (host / "var" / "run" / "pcc").symlink_to("pcc-real")
    result = pcc_node_checks(host)[PCC_DIR]
    assert result.line() == (
        f"WARN  {PCC_DIR}: {host}/var/run/pcc is a writable directory, but a symlink to "
        "pcc-real: containers get /var/run/pcc-real; fix: give --pcc-socket-path the directory "
        "it leads to, so that the daemon checks and watches the directory containers get"
    )


def test_a_device_node_that_is_no_symlink_does_not_warn(host: Path) -> None:
    (host / "dev" / "sev-guest").unlink()
    try:
        os.mknod(host / "dev" / "sev-guest", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("needs CAP_MKNOD to make a device node")
    assert pcc_node_checks(host)[DEVICE].status == "PASS"


async def test_a_file_the_daemon_has_not_applied_yet_warns(tmp_path: Path) -> None:
    """As between kubelet updating a ConfigMap volume and the daemon's reload."""
    config = tmp_path / "resources.yaml"
    config.write_text("resources: [{name: example.com/x, mounts: [{hostPath: /tmp}]}]\n")
    body = (
        b'pcc_device_plugin_config_info{hash="0123456789abcdef",source="x"} 1.0\n'
        b"pcc_device_plugin_config_last_reload_successful 1.0\n"
    )

    async def metrics(stream: trio.SocketStream) -> None:
        await stream.receive_some(4096)
        head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        await stream.send_all(head.encode() + body)
        await stream.aclose()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, metrics, 0, host="127.0.0.1")
            )
            (listener,) = listeners
            port = listener.socket.getsockname()[1]
            result = await check_config(
                str(config), f"127.0.0.1:{port}", load(str(config)).digest, None
            )
            nursery.cancel_scope.cancel()
    assert result.status == "WARN"
    assert "is not what the daemon runs (hash 0123456789abcdef)" in result.detail
    assert "at once on SIGHUP" in result.fix


# Attestation beyond the device node: a mixed pool's hardware, a TEE's device and event log,
# configfs-tsm (doctor/attestation.py), and block devices that are the host's.

MIXED_POOL = ROOT / "manifests" / "overlays" / "mixed-pool" / "profiles.yaml"


async def test_a_mixed_pool_on_an_sev_snp_node_checks_only_what_it_has(
    fake_node: FakeNode,
) -> None:
    report = await run_doctor(*fake_node.daemon_args(), f"--config={MIXED_POOL}")
    host = fake_node.host_root
    lines = report.lines
    assert lines["hardware sev-snp"] == (
        f"PASS  hardware sev-snp: the kernel says the node is an SEV-SNP guest "
        f"({host}/sys/bus/platform/devices/sev-guest exists)"
    )
    assert lines["hardware tdx"] == (
        f"SKIP  hardware tdx: the kernel's CPU flags ({host}/proc/cpuinfo) have no tdx_guest: "
        "tke.cloud.tencent.com/tdx-guest list no devices here"
    )
    assert lines["hardware tpm"].startswith("SKIP  hardware tpm: the kernel has bound no TPM")
    for check in (
        "device /dev/tdx[-_]guest",
        "device /dev/tpmrm0",
        "mount /sys/kernel/security/tpm0",
    ):
        assert lines[check].startswith(f"SKIP  {check}: not checked: the node has no ")
    assert report.statuses[DEVICE] == "PASS"
    assert report.statuses[SEV_SNP] == "WARN"  # the fake device is /dev/null
    assert report.statuses[PCC_DIR.replace("socket path", "mount")] == "PASS"


async def test_a_mixed_pool_on_a_tdx_node_checks_its_device_and_its_vtpm(
    fake_node: FakeNode,
) -> None:
    as_tdx_node_with_a_vtpm(fake_node)
    host = fake_node.host_root
    misc = host / "sys" / "class" / "misc" / "tdx_guest"
    misc.mkdir()
    (misc / "dev").write_text("1:3\n")
    args = [*fake_node.daemon_args(), f"--config={MIXED_POOL}"]
    report = await run_doctor(*args)
    lines = report.lines
    assert lines["hardware tdx"] == (
        f"PASS  hardware tdx: the kernel says the node is a TDX guest (the CPU flags in "
        f"{host}/proc/cpuinfo have tdx_guest)"
    )
    assert lines["hardware tpm"].startswith("PASS  hardware tpm: the kernel says the node has")
    assert lines["hardware sev-snp"].startswith("SKIP  hardware sev-snp: the kernel registered no")
    assert lines["device /dev/tdx[-_]guest"] == (
        f"PASS  device /dev/tdx[-_]guest: 1 match, each a character device: {host}/dev/tdx_guest"
    )
    assert lines["TDX guest device"] == (
        f"PASS  TDX guest device: {host}/dev/tdx_guest is the tdx_guest driver's device (1:3)"
    )
    # No TPM resource manager in the fake sysfs: nothing says /dev/tpmrm0 is one.
    assert lines["TPM device"] == (
        f"WARN  TPM device: {host}/sys/class/tpmrm/tpmrm0/dev does not exist: no TPM 2.0 is "
        f"bound to a driver, so nothing says that {host}/dev/tpmrm0 (1:3) is a TPM 2.0's "
        "resource manager; fix: on a node with a vTPM, load its driver (modprobe tpm_crb, or "
        "tpm_tis)"
    )
    log = "/sys/kernel/security/tpm0/binary_bios_measurements"
    assert lines[f"TPM event log {log}"] == f"PASS  TPM event log {log}: {host}{log} can be read"
    assert lines[DEVICE] == f"SKIP  {DEVICE}: not checked: the node has no sev-snp"
    (host / log.lstrip("/")).unlink()
    report = await run_doctor(*args)
    assert report.lines[f"TPM event log {log}"].startswith(
        f"FAIL  TPM event log {log}: {host}{log} does not exist: the TPM's firmware left no "
        "event log"
    )


def tsm_report_of(node: FakeNode) -> tuple[Path, str]:
    """The fake node's TSM report directory, and the doctor's line for it."""
    report_dir = node.host_root / "sys" / "kernel" / "config" / "tsm" / "report"
    return report_dir, check_tsm_report(str(node.host_root)).line()


def test_the_tsm_report_check_on_a_plain_directory_warns(fake_node: FakeNode) -> None:
    """configfs gives each new report its files; a plain directory does not."""
    report_dir, line = tsm_report_of(fake_node)
    assert line == (
        f"WARN  TSM report /sys/kernel/config/tsm/report: {report_dir} takes a new directory, "
        "but without a provider file: it is not configfs-tsm; fix: mount configfs at "
        "/sys/kernel/config on the host; configfs-tsm needs Linux 6.7 or later with configfs "
        "mounted at /sys/kernel/config (mount -t configfs none /sys/kernel/config) and the "
        "TEE's guest driver loaded; or run without --tsm-report"
    )
    assert list(report_dir.iterdir()) == [], "the doctor removes what it made"


@pytest.fixture
def configfs_tsm(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """mkdir and rmdir in the report directory as configfs-tsm answers them: a new report
    gets its files from the kernel (provider among them), or ENXIO without a provider; rmdir
    takes the files with it. Returns the provider, which a test may empty."""
    provider = ["sev_guest"]
    real_mkdir, real_rmdir = os.mkdir, os.rmdir

    def mkdir(path: str, mode: int = 0o777) -> None:
        if "/tsm/report/" not in str(path):
            return real_mkdir(path, mode)
        if not provider:
            raise OSError(errno.ENXIO, os.strerror(errno.ENXIO), path)
        real_mkdir(path, mode)
        for name in ("inblob", "outblob", "auxblob", "generation", "privlevel_floor"):
            (Path(path) / name).write_text("")
        (Path(path) / "provider").write_text(f"{provider[0]}\n")

    def rmdir(path: str) -> None:
        if "/tsm/report/" in str(path):
            for entry in Path(path).iterdir():
                entry.unlink()
        real_rmdir(path)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "rmdir", rmdir)
    return provider


def test_the_tsm_report_check_makes_a_report_and_removes_it(
    fake_node: FakeNode, configfs_tsm: list[str]
) -> None:
    report_dir, line = tsm_report_of(fake_node)
    assert line == (
        f"PASS  TSM report /sys/kernel/config/tsm/report: {report_dir} is there, and a report "
        "can be created in it (provider sev_guest)"
    )
    assert list(report_dir.iterdir()) == []
    configfs_tsm.clear()
    assert tsm_report_of(fake_node)[1] == (
        f"FAIL  TSM report /sys/kernel/config/tsm/report: {report_dir} is there, but no report "
        "can be created in it: no TEE guest driver provides reports (mkdir: No such device or "
        "address); fix: load the TEE's guest driver, which provides the reports: modprobe "
        "sev-guest on an SEV-SNP guest, modprobe tdx_guest on a TDX guest"
    )


def test_the_tsm_report_check_where_it_is_missing_or_read_only(
    fake_node: FakeNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = fake_node.host_root
    report_dir = host / "sys" / "kernel" / "config" / "tsm" / "report"

    real_mkdir = os.mkdir

    def read_only(path: str, mode: int = 0o777) -> None:
        if "/tsm/report/" not in str(path):
            return real_mkdir(path, mode)
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)

    # The plugin's pod sees the host's configfs through a read-only mount: the doctor looks for
    # the driver that provides reports instead.
    with monkeypatch.context() as patched:
        patched.setattr(os, "mkdir", read_only)
        assert check_tsm_report(str(host)).status == "FAIL"
        (host / "sys" / "class" / "misc" / "sev-guest").mkdir()
        assert check_tsm_report(str(host)).line() == (
            f"PASS  TSM report /sys/kernel/config/tsm/report: {report_dir} is there; no report "
            "was tried, as it is read-only here, but its provider's driver is loaded "
            f"({host}/sys/class/misc/sev-guest)"
        )
    report_dir.rmdir()
    assert (
        check_tsm_report(str(host))
        .line()
        .startswith(
            f"FAIL  TSM report /sys/kernel/config/tsm/report: {report_dir} does not exist; fix: "
            "configfs-tsm needs Linux 6.7 or later"
        )
    )
    assert (
        check_tsm_report(str(host))
        .line()
        .endswith(
            f"; with --host-root, the host's /sys/kernel/config must be mounted at "
            f"{host}/sys/kernel/config"
        )
    )


async def test_the_doctor_checks_configfs_tsm_with_tsm_report(fake_node: FakeNode) -> None:
    report = await run_doctor(*fake_node.daemon_args(), "--tsm-report")
    check = "TSM report /sys/kernel/config/tsm/report"
    assert report.statuses[check] == "WARN"  # the fake node's is a plain directory
    assert list(report.lines)[:3] == [DEVICE, SEV_SNP, PCC_DIR]
    report = await run_doctor(*fake_node.daemon_args())
    assert check not in report.lines


def test_block_devices_the_kernel_says_are_the_hosts_are_refused(fake_node: FakeNode) -> None:
    """As the daemon refuses them (tests/test_attestation.py): the root volume on LVM."""
    host = fake_node.host_root
    node = Sysfs(host)
    node.block(f"{VIRTUAL}/dm-0", "253:0")
    node.mounted("xfs", "dm-0")
    node.block(f"{VIRTUAL}/dm-3", "253:3")
    for name, numbers in (("dm-0", (253, 0)), ("dm-3", (253, 3))):
        try:
            os.mknod(host / "dev" / name, 0o600 | stat.S_IFBLK, os.makedev(*numbers))
        except PermissionError:
            pytest.skip("needs CAP_MKNOD to make a block device node")
    used = f"/dev/dm-0 is in use by the host: dm-0 is mounted as xfs ({host}/sys/fs/xfs/dm-0)"
    fix = (
        "fix: nothing, if it is the host's own; to hand it out all the same, set "
        "allowSensitiveHostPath on the profile's entry (docs/profiles.md)"
    )
    glob_check = check_device(DeviceNode("/dev/dm-*", "", "rw", "block"), str(host))
    assert glob_check.line() == (
        f"WARN  device /dev/dm-*: 2 match, each a block device: {host}/dev/dm-0, "
        f"{host}/dev/dm-3; 1 offered, the kernel says the others are the host's: {used}; {fix}"
    )
    fixed = check_device(DeviceNode("/dev/dm-0", "/dev/dm-0", "rw", "block"), str(host))
    assert fixed.line() == f"FAIL  device /dev/dm-0: {used}: its devices are Unhealthy; {fix}"
    opted_in = DeviceNode("/dev/dm-0", "/dev/dm-0", "rw", "block", allow_sensitive=True)
    assert check_device(opted_in, str(host)).status == "PASS"
