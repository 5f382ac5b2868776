"""/metrics, /livez and /readyz of the daemon, over real HTTP on a free loopback port."""

from __future__ import annotations

import os
import re
import socket
from importlib.metadata import version
from pathlib import Path

import grpc
import pytest
import trio
from daemon_support import RESOURCE, log_line, open_tool_stream
from metrics_support import get, metrics_port, scrape, value

from pcc_plugin.sim import (
    Daemon,
    FakeNode,
    SimKubelet,
    StartDaemon,
    run_blocking,
    unneeded_imports,
)
from pcc_plugin.state import ResourceState


async def registered(daemon: Daemon, kubelet: SimKubelet, count: int = 1) -> None:
    """Registered `count` times and kubelet's stream open: /readyz then answers 200."""
    # Logged in the same step that marks the resource registered.
    await log_line(daemon, "Registered device plugin with Kubelet", count)
    await run_blocking(kubelet.wait_for, lambda: kubelet.stream_open(RESOURCE), 10.0)


async def test_livez_and_readyz_follow_kubelet(
    fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    fake_node.plugin_dir.mkdir()
    kubelet_sock = fake_node.plugin_dir / "kubelet.sock"
    not_ready = f"{RESOURCE}: waiting for kubelet: {kubelet_sock} does not exist\n"
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args())
        port = await metrics_port(daemon)
        assert await get(port, "/livez") == (200, "text/plain; charset=utf-8", "ok\n")
        await log_line(daemon, "Waiting for kubelet")
        assert await get(port, "/readyz") == (503, "text/plain; charset=utf-8", not_ready)
        assert value(await scrape(port), "pcc_device_plugin_ready") == 0
        with SimKubelet(fake_node.plugin_dir) as kubelet:
            await registered(daemon, kubelet)
            assert await get(port, "/readyz") == (200, "text/plain; charset=utf-8", "ok\n")
            assert value(await scrape(port), "pcc_device_plugin_ready") == 1
            # Counted now: the kubelet's start removed the daemon's socket, which may have made
            # it wait again before kubelet.sock appeared.
            waits = daemon.log_text().count("Waiting for kubelet")
        await log_line(daemon, "Waiting for kubelet", count=waits + 1)
        assert await get(port, "/readyz") == (503, "text/plain; charset=utf-8", not_ready)
        assert (await get(port, "/livez"))[0] == 200
        status, _, body = await get(port, "/nothing-here")
        assert status == 404
        assert "/metrics" in body


async def test_metrics_count_what_the_daemon_does(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(40):
        daemon = start_daemon(*fake_node.daemon_args())
        port = await metrics_port(daemon)
        await registered(daemon, kubelet)
        samples = await scrape(port)
        assert value(samples, "pcc_device_plugin_registrations_total", cause="start") == 1
        assert value(samples, "pcc_device_plugin_kubelet_restarts_total") == 0
        for result in ("ok", "invalid", "unavailable"):
            assert value(samples, "pcc_device_plugin_allocations_total", result=result) == 0
        assert value(samples, "pcc_device_plugin_devices", health="Healthy") == 16
        assert value(samples, "pcc_device_plugin_devices", health="Unhealthy") == 0
        assert value(samples, "pcc_device_plugin_list_and_watch_streams") == 1
        assert value(samples, "pcc_device_plugin_ready") == 1
        # The DRA mode's families are its own (tests/test_dra.py reads them).
        assert not [name for name, _ in samples if name.startswith("pcc_device_plugin_dra_")]
        build = (
            "pcc_device_plugin_build_info",
            frozenset({"version": version("pcc-device-plugin")}.items()),
        )
        assert samples[build] == 1
        for name in (
            "process_resident_memory_bytes",
            "process_virtual_memory_bytes",
            "process_cpu_seconds_total",
            "process_open_fds",
            "process_max_fds",
            "process_start_time_seconds",
        ):
            assert samples[(name, frozenset())] > 0, name

        # Allocate: ok, invalid (an unknown device), unavailable (the device gone).
        await run_blocking(kubelet.allocate, RESOURCE, [["pcc-0"]])
        with pytest.raises(grpc.RpcError, match="unknown device IDs"):
            await run_blocking(kubelet.allocate, RESOURCE, [["gpu-0"]])
        fake_node.device.unlink()
        await run_blocking(
            kubelet.wait_for,
            lambda: set(kubelet.devices(RESOURCE).values()) == {"Unhealthy"},
            10.0,
        )
        with pytest.raises(grpc.RpcError, match="unhealthy"):
            await run_blocking(kubelet.allocate, RESOURCE, [["pcc-1"]])
        samples = await scrape(port)
        for result in ("ok", "invalid", "unavailable"):
            assert value(samples, "pcc_device_plugin_allocations_total", result=result) == 1
        assert value(samples, "pcc_device_plugin_devices", health="Healthy") == 0
        assert value(samples, "pcc_device_plugin_devices", health="Unhealthy") == 16
        fake_node.device.symlink_to("/dev/null")
        await run_blocking(
            kubelet.wait_for,
            lambda: set(kubelet.devices(RESOURCE).values()) == {"Healthy"},
            10.0,
        )

        # A tool's stream counts too, and is not taken for kubelet's.
        endpoint = kubelet.registrations[-1].endpoint
        channel, stream = await run_blocking(open_tool_stream, fake_node.plugin_dir / endpoint)
        try:
            assert value(await scrape(port), "pcc_device_plugin_list_and_watch_streams") == 2
        finally:
            stream.cancel()
            channel.close()
        await log_line(daemon, "ListAndWatch stream opened", count=2)
        assert daemon.log_text().count("(kubelet's)") == 1

        # A kubelet restart: registered again, one more registration.
        await run_blocking(kubelet.restart)
        await registered(daemon, kubelet, count=2)
        samples = await scrape(port)
        registrations = {
            dict(labels)["cause"]: count
            for (name, labels), count in samples.items()
            if name == "pcc_device_plugin_registrations_total"
        }
        assert sum(registrations.values()) == 2
        assert registrations["start"] == 1
        assert value(samples, "pcc_device_plugin_list_and_watch_streams") == 1

        # The restart may have said it too (its stop ends the stream): the next one is this.
        waits = daemon.log_text().count("Waiting for kubelet")
        await run_blocking(kubelet.stop)
        await log_line(daemon, "Waiting for kubelet", count=waits + 1)
        samples = await scrape(port)
        assert value(samples, "pcc_device_plugin_list_and_watch_streams") == 0
        assert value(samples, "pcc_device_plugin_ready") == 0


async def test_every_kubelet_restart_is_counted_and_named(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    restarts = 10
    with trio.fail_after(60):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        port = await metrics_port(daemon)
        await registered(daemon, kubelet)
        for restart in range(restarts):
            await run_blocking(kubelet.restart)
            await registered(daemon, kubelet, count=restart + 2)
        samples = await scrape(port)
    assert value(samples, "pcc_device_plugin_kubelet_restarts_total") == restarts
    assert (
        value(samples, "pcc_device_plugin_registrations_total", cause="kubelet restarted")
        == restarts
    )


async def test_a_port_in_use_is_one_line_and_exit_1(
    fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    """Not a warning and on without probes: the README's curl, and kubelet's probes, would
    reach whatever holds the port."""
    with socket.socket() as taken, trio.fail_after(30):
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        daemon = start_daemon(*fake_node.daemon_args(), f"--metrics-bind-address={address}")
        assert await run_blocking(daemon.exited, 20) == 1
    errors = [line for line in daemon.log_text().splitlines() if re.match(r"[EW]\d{4} ", line)]
    assert len(errors) == 1, daemon.log_text()
    assert errors[0].startswith("E")
    assert errors[0].endswith(
        f"cannot listen on {address} for /metrics, /livez and /readyz: Address already in use; "
        "free it, or give --metrics-bind-address another address (127.0.0.1:0 takes a free "
        "port, which the log names; on a node, the DaemonSet's probes' port too) or an empty "
        "one (no metrics or probes)"
    )
    assert "Traceback" not in daemon.log_text()
    assert "Registered device plugin" not in daemon.log_text()


def tcp_sockets(pid: int) -> list[tuple[str, str]]:
    """(local address, state) of each TCP socket the process holds; state 0A is LISTEN."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith("socket:["):
            inodes.add(target.removeprefix("socket:[").removesuffix("]"))
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                found.append((fields[1], fields[3]))
    return found


@pytest.mark.parametrize("bind_address", ["", "127.0.0.1:0"], ids=["metrics off", "metrics on"])
async def test_registering_imports_only_what_it_needs_and_metrics_only_when_on(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon, bind_address: str
) -> None:
    with trio.fail_after(30):
        # Python reports each import on stderr, which goes to the log.
        daemon = start_daemon(
            *fake_node.daemon_args(),
            f"--metrics-bind-address={bind_address}",
            env={"PYTHONPROFILEIMPORTTIME": "1"},
        )
        await registered(daemon, kubelet)
        log = daemon.log_text()
        imported = {
            match.group(1) for match in re.finditer(r"^import time:.*\|\s+(\S+)$", log, re.M)
        }
        assert "trio" in imported
        listeners = tcp_sockets(daemon.pid)
    assert unneeded_imports(imported) == []
    if bind_address:
        assert "pcc_plugin.http_server" in imported
        assert [state for _, state in listeners] == ["0A"]
    else:
        assert "pcc_plugin.http_server" not in imported
        assert listeners == []
        # Not a word about metrics: no serving line, and no warning either.
        assert "/metrics" not in log
        assert "Metrics and probes" not in log


def test_readyz_says_what_the_state_holds_whatever_was_told_last() -> None:
    """/readyz's reason is decided by the state in one place, not by whichever module wrote
    last: the first thing waited for is said, and each thing is forgotten by what ends it."""
    sock = Path("/k/kubelet.sock")
    state = ResourceState(RESOURCE)
    assert state.not_ready_reason() == "not registered with kubelet yet"
    state.path_awaited("/dev/sev-guest", "does not exist")
    state.directory_awaited(Path("/k"))
    assert state.not_ready_reason() == "waiting for /dev/sev-guest (does not exist)"
    state.paths_in_place()
    assert state.not_ready_reason() == "waiting for /k to be created"
    state.generation_started()
    assert state.not_ready_reason() == "registering with kubelet"
    state.kubelet_awaited(sock, "does not exist")
    state.registration_refused("it said no")
    assert state.not_ready_reason() == "waiting for kubelet: /k/kubelet.sock does not exist"
    state.registered_with_kubelet("start")
    assert state.not_ready_reason() == "registered, but kubelet's ListAndWatch stream is not open"
    state.generation_started()
    state.registration_refused("it said no")
    assert state.not_ready_reason() == "registration failed: it said no"
    state.cannot_serve("cannot serve in /k: [Errno 28] No space left on device")
    assert state.not_ready_reason() == "cannot serve in /k: [Errno 28] No space left on device"

    driver = ResourceState(RESOURCE, needs_stream=False)
    driver.slices_not_published("the API server cannot be reached")
    driver.generation_started()
    assert driver.not_ready_reason() == (
        "waiting for kubelet to register the driver; the API server cannot be reached"
    )
    driver.registration_refused("too old")
    assert driver.not_ready_reason() == (
        "kubelet refused the registration: too old; the API server cannot be reached"
    )
    driver.registered_with_kubelet("start")
    driver.slices_published()
    assert driver.not_ready_reason() is None
