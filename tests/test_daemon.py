"""The real daemon, as a process, against the simulated kubelet (grpcio)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
from pathlib import Path

import grpc
import pytest
import trio
from daemon_support import HEALTHY_16, RESOURCE, log_line, open_tool_stream, serving

from pcc_plugin.sim import Daemon, FakeNode, SimKubelet, StartDaemon, run_blocking

ENDPOINT = re.compile(r"pcc-\d+-[0-9a-f]{6}-\d+\.sock")


async def test_registers_serves_and_advertises_16_healthy_shares(
    any_kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(20):
        daemon = start_daemon(*fake_node.daemon_args())
        endpoint = await serving(any_kubelet)
        (registration,) = any_kubelet.registrations
        assert registration.version == "v1beta1"
        assert registration.resource_name == RESOURCE
        assert ENDPOINT.fullmatch(endpoint), endpoint
        assert registration.options is not None
        assert not registration.options.pre_start_required
        assert any_kubelet.devices(RESOURCE) == HEALTHY_16
        assert (fake_node.plugin_dir / endpoint).is_socket()
        line = await log_line(daemon, "Registered device plugin with Kubelet")
        assert RESOURCE in line
        assert endpoint in line


async def test_resource_count_and_name(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(20):
        start_daemon(*fake_node.daemon_args(), "--resource-count=3", "-resource-name=example.com/x")
        three = {f"pcc-{i}": "Healthy" for i in range(3)}
        await serving(kubelet, devices=three, resource="example.com/x")
        assert kubelet.devices("example.com/x") == three


async def test_allocate_one_and_several_container_requests(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(20):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=1))
        await serving(kubelet)
        one = await run_blocking(kubelet.allocate, RESOURCE, [["pcc-0", "pcc-5"]])
        several = await run_blocking(kubelet.allocate, RESOURCE, [["pcc-1"], ["pcc-2", "pcc-3"]])
        assert len(one.container_responses) == 1
        assert len(several.container_responses) == 2
        for container in [*one.container_responses, *several.container_responses]:
            # Host paths, not the paths under --host-root the plugin checks.
            assert [(d.container_path, d.host_path, d.permissions) for d in container.devices] == [
                ("/dev/sev-guest", "/dev/sev-guest", "rw")
            ]
            assert [(m.container_path, m.host_path, m.read_only) for m in container.mounts] == [
                ("/var/run/pcc", "/var/run/pcc", False)
            ]
        await log_line(daemon, "Allocate tke.cloud.tencent.com/pcc-device: [['pcc-0', 'pcc-5']]")
        # --v=1 logs each Allocate: a refused one too, with the reason kubelet is given.
        with pytest.raises(grpc.RpcError) as refused:
            await run_blocking(kubelet.allocate, RESOURCE, [["pcc-16"]])
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        await log_line(
            daemon,
            f"Allocate {RESOURCE} refused, INVALID_ARGUMENT: container request 0 names unknown "
            "device IDs 'pcc-16'",
        )


@pytest.mark.parametrize(
    ("payload", "details"),
    [
        (b"", "AllocateRequest has no container requests"),
        (b"\x0a\x00", "container request 0 names no device IDs"),
        (b"\x0a\x07\x0a\x05gpu-0", "unknown device IDs 'gpu-0'"),
        # Longer than every ID the resource has, so refused before it is decoded or looked up.
        (
            b"\x0a\x0b\x0a\x09pcc-10000",
            f"AllocateRequest names a device ID of 9 bytes, longer than any of {RESOURCE}'s "
            "(6 bytes at most)",
        ),
        (b"\x0a\x05\x0a\x03\xff\xfe\xfd", "cannot decode AllocateRequest"),
        (b"\x08\x01", "cannot decode AllocateRequest: field container_requests is sent as varint"),
        (b"\x0a", "cannot decode AllocateRequest"),
    ],
)
async def test_bad_requests_get_invalid_argument_without_a_traceback(
    kubelet: SimKubelet,
    fake_node: FakeNode,
    start_daemon: StartDaemon,
    payload: bytes,
    details: str,
) -> None:
    with trio.fail_after(20):
        daemon = start_daemon(*fake_node.daemon_args())
        await serving(kubelet)
        code, message = await run_blocking(
            kubelet.call_raw, RESOURCE, "/v1beta1.DevicePlugin/Allocate", payload
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details in message
        assert "Traceback" not in daemon.log_text()


@pytest.mark.slow
@pytest.mark.parametrize("kubelet", ["current", "resource-keyed"], indirect=True)
async def test_kubelet_restarts_once_then_100_times_without_leaking_fds(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(120):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        first = await serving(kubelet)
        await run_blocking(kubelet.restart)
        second = await serving(kubelet, registrations=2)
        assert second != first
        assert not (fake_node.plugin_dir / first).exists()
        # Kubelet's stream ends, it deletes our socket, then creates kubelet.sock: whichever
        # the daemon sees first restarts the server.
        await log_line(daemon, re.compile(r"restarting\.|stream ended"))
        fds = daemon.open_fds()
        for restart in range(100):
            await run_blocking(kubelet.restart)
            await serving(kubelet, registrations=3 + restart)
            assert kubelet.devices(RESOURCE) == HEALTHY_16
        assert abs(daemon.open_fds() - fds) <= 2
        assert [r.accepted for r in kubelet.registrations] == [True] * 102


@pytest.mark.parametrize("kubelet", ["current", "resource-keyed"], indirect=True)
async def test_a_kubelet_restart_is_routine_and_warns_of_nothing(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    """Kubelet deletes every socket in its directory as it starts: the daemon's being deleted
    then is no warning, whether it sees that or the new kubelet.sock first."""
    with trio.fail_after(20):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        first = await serving(kubelet)
        for restarts in range(1, 6):
            await run_blocking(kubelet.restart)
            await serving(kubelet, registrations=1 + restarts)
    assert not (fake_node.plugin_dir / first).exists()
    lines = daemon.log_text().splitlines()
    assert not [line for line in lines if "own socket" in line and not line.startswith("I")]


async def test_waits_for_kubelet_then_registers(
    fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    fake_node.plugin_dir.mkdir()
    with trio.fail_after(20):
        daemon = start_daemon(*fake_node.daemon_args())
        await log_line(daemon, f"Waiting for kubelet: {fake_node.plugin_dir}/kubelet.sock")
        with SimKubelet(fake_node.plugin_dir) as kubelet:
            await serving(kubelet)


async def test_waits_for_the_plugin_dir_then_registers(
    fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(20):
        daemon = start_daemon(*fake_node.daemon_args())
        await log_line(daemon, f"Waiting for {fake_node.plugin_dir} to be created")
        with SimKubelet(fake_node.plugin_dir) as kubelet:
            await serving(kubelet)


async def test_register_failures_are_retried_and_each_reason_logged_once(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    kubelet.fail_next_registers(["plugin busy", "plugin busy", "plugin busy", "other trouble"])
    with trio.fail_after(20):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        await serving(kubelet)
        assert kubelet.register_calls == 5
        await log_line(daemon, "Registration with kubelet failed", count=2)
        failures = [
            line
            for line in daemon.log_text().splitlines()
            if "Registration with kubelet failed" in line
        ]
        assert len(failures) == 2
        assert "kubelet answered UNKNOWN: plugin busy" in failures[0]
        assert "kubelet answered UNKNOWN: other trouble" in failures[1]


async def test_registers_again_when_kubelet_drops_the_stream(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(20):
        daemon = start_daemon(*fake_node.daemon_args())
        await serving(kubelet)
        await run_blocking(kubelet.drop_stream, RESOURCE)
        await serving(kubelet, registrations=2)
        await log_line(daemon, "kubelet's ListAndWatch stream ended; registering again")


async def test_recovers_when_its_own_socket_is_deleted(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(20):
        daemon = start_daemon(*fake_node.daemon_args())
        first = await serving(kubelet)
        (fake_node.plugin_dir / first).unlink()
        assert await serving(kubelet, registrations=2) != first
        await log_line(daemon, "own socket")


async def test_recovers_when_the_plugin_dir_is_removed_and_recreated(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(20):
        daemon = start_daemon(*fake_node.daemon_args())
        await serving(kubelet)
        await run_blocking(kubelet.stop)
        # Moved away in one step: the daemon may be serving a fresh socket in it meanwhile.
        shutil.rmtree(fake_node.plugin_dir.rename(fake_node.plugin_dir.with_name("removed")))
        await log_line(daemon, f"Waiting for {fake_node.plugin_dir} to be created")
        await run_blocking(kubelet.start)
        await serving(kubelet, registrations=2)


async def test_removes_dead_sockets_of_its_own_and_keeps_live_ones(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    dead = fake_node.plugin_dir / "pcc-1-aaaaaa-0.sock"
    live = fake_node.plugin_dir / "pcc-2-bbbbbb-0.sock"
    with socket.socket(socket.AF_UNIX) as closed:
        closed.bind(str(dead))
    with socket.socket(socket.AF_UNIX) as listener, trio.fail_after(20):
        listener.bind(str(live))
        listener.listen()
        daemon = start_daemon(*fake_node.daemon_args())
        await serving(kubelet)
        await log_line(daemon, f"Removed stale socket {dead}")
        assert not dead.exists()
        assert live.is_socket()


# What the fatal line says to check, after the phrase operators search for: the doctor's fixes.
CHECK_THE_DEVICE = (
    "; check /dev/sev-guest on the node: on an SEV-SNP guest, load its sev-guest driver "
    "(modprobe sev-guest); a node that is not one has no PCC device: remove its label "
    "tke.cloud.tencent.com/pcc-device-plugin; not on a node: point --pcc-device (below "
    "--host-root, if given) at a character device, e.g. a symlink to /dev/null"
)
CHECK_THE_DIRECTORY = (
    "; check /var/run/pcc on the node: start the PCC service on the node, which creates the "
    "directory; never create it by hand: an empty one hides a node whose PCC service does not run; "
    "not on a node: point --pcc-socket-path (below --host-root, if given) at a directory"
)


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        ("missing device",
         "detect device {host}/dev/sev-guest failed: No such file or directory" + CHECK_THE_DEVICE),
        ("regular file",
         "detect device {host}/dev/sev-guest failed: not a character device" + CHECK_THE_DEVICE),
        ("missing dir",
         "detect socket path {host}/var/run/pcc failed: No such file or directory"
         + CHECK_THE_DIRECTORY),
    ],
)  # fmt: skip
async def test_with_exit_if_missing_detect_failures_exit_1_with_the_phrase_and_the_fix(
    fake_node: FakeNode, start_daemon: StartDaemon, breakage: str, message: str
) -> None:
    if breakage == "missing dir":
        fake_node.pcc_dir.rmdir()
    else:
        fake_node.device.unlink()
        if breakage == "regular file":
            fake_node.device.write_text("")
    with trio.fail_after(20):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0), "--exit-if-missing")
        assert await run_blocking(daemon.exited, 15) == 1
        (line,) = daemon.log_text().splitlines()
        assert re.match(r"E\d{4} ", line)
        assert line.endswith(message.format(host=fake_node.host_root))


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
async def test_a_signal_stops_it_cleanly(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon, stop_signal: int
) -> None:
    with trio.fail_after(20):
        daemon = start_daemon(*fake_node.daemon_args())
        endpoint = await serving(kubelet)
        assert await run_blocking(daemon.terminate, stop_signal, 5.0) == 0
        assert not (fake_node.plugin_dir / endpoint).exists()
        # Kubelet's stream ended with the daemon, not with a hang.
        await run_blocking(kubelet.wait_for, lambda: not kubelet.stream_open(RESOURCE), 5.0)


async def test_a_second_signal_forces_the_exit(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(20):
        daemon = start_daemon(*fake_node.daemon_args())
        await serving(kubelet)
        # Both signals are pending when the daemon resumes, so the second one
        # arrives while the first shutdown is still under way.
        os.kill(daemon.pid, signal.SIGSTOP)
        os.kill(daemon.pid, signal.SIGTERM)
        os.kill(daemon.pid, signal.SIGINT)
        os.kill(daemon.pid, signal.SIGCONT)
        assert await run_blocking(daemon.exited, 10) in (
            128 + signal.SIGTERM,
            128 + signal.SIGINT,
        )


def test_fake_node_paths_fit_in_a_unix_socket(fake_node: FakeNode) -> None:
    assert len(str(Path(fake_node.plugin_dir) / "pcc-4194304-abcdef-999.sock")) < 107


async def test_a_tool_stream_opened_during_register_is_not_taken_for_kubelets(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    """Kubelet's stream is the one on the connection that read the options inside Register."""
    tool: list[tuple[grpc.Channel, grpc.Future]] = []

    def open_before_kubelet_dials(socket_path: Path) -> None:
        tool.append(open_tool_stream(socket_path, timeout=30))

    kubelet.before_dial = open_before_kubelet_dials
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=1))
        await serving(kubelet)
        kubelet.before_dial = None
        ((channel, stream),) = tool
        # The daemon logs each stream before answering on it, but its log reaches us through
        # a pipe and a reader thread, which may be behind what kubelet has seen.
        await run_blocking(lambda: daemon.wait_for_log("stream opened on", count=2))
        opened = [line for line in daemon.log_text().splitlines() if "stream opened on" in line]
        assert len(opened) == 2
        assert "(kubelet's)" not in opened[0]
        assert opened[1].endswith("(kubelet's)")
        # The tool hangs up: nothing happens. Kubelet drops its stream: the plugin registers.
        stream.cancel()
        channel.close()
        await run_blocking(kubelet.drop_stream, RESOURCE)
        await serving(kubelet, registrations=2)
        await run_blocking(daemon.wait_for_log, "stream ended; registering again")
    assert kubelet.register_calls == 2
    assert len(lines_containing(daemon, "stream ended; registering again")) == 1


def lines_containing(daemon: Daemon, text: str) -> list[str]:
    return [line for line in daemon.log_text().splitlines() if text in line]
