"""The fault suite: the real daemon against a simulated kubelet that restarts, dies and misbehaves.

Faults tests/test_daemon.py already covers, not repeated here: Register failing with UNKNOWN and
then accepted on the first start (test_register_failures_are_retried_and_each_reason_logged_once;
the capped, jittered backoff itself in tests/test_generations.py), a current kubelet dropping
the stream once, the daemon's own socket deleted under a current kubelet, the device-plugin
directory removed while kubelet is stopped, 100 restarts against current and resource-keyed
kubelets, and SIGTERM or SIGINT while idle. This module adds what those leave out.

No test here measures time: latency lives in the benchmark (bench/run.py). Every wait is on an
event (a kubelet state, a log line), under ``trio.fail_after``.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
from typing import Any

import grpc
import pytest
import trio
from daemon_support import (
    HEALTHY_16,
    KUBELET_GONE,
    OWN_SOCKET,
    RESOURCE,
    WAIT,
    dropped_by_kubelet,
    instance,
    log_line,
    serving,
    settled,
    stream_ended,
)
from metrics_support import metrics_port, scrape, value

from pcc_plugin.limits import DEFAULT
from pcc_plugin.sim import (
    Daemon,
    FakeNode,
    NoPluginError,
    SimKubelet,
    StartDaemon,
    run_blocking,
)
from pcc_plugin.sim._pb import deviceplugin_v1beta1_pb2 as pb
from pcc_plugin.sim.rules import ALLOCATE, LIST_AND_WATCH

SHARES = DEFAULT.container_requests
HEALTHY_SHARES = {f"pcc-{index}": "Healthy" for index in range(SHARES)}
# How a call in flight may end when its peer goes away: answered first, or cut off.
CUT_OFF_OR_ANSWERED = (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)


def lines_with(daemon: Daemon, text: str) -> list[str]:
    return [line for line in daemon.log_text().splitlines() if text in line]


def own_sockets(node: FakeNode) -> set[str]:
    return {path.name for path in node.plugin_dir.iterdir() if OWN_SOCKET.fullmatch(path.name)}


def vm_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise LookupError(f"no VmRSS in /proc/{pid}/status")


def assert_no_traceback(daemon: Daemon) -> None:
    text = daemon.log_text()
    assert "Traceback" not in text
    # Logged at every verbosity, with a traceback, when a handler or connection meets a bug.
    assert "failed unexpectedly" not in text


async def allocate_outcome(kubelet: SimKubelet, requests: list[list[str]]) -> grpc.StatusCode:
    """Allocate through kubelet's own connection; OK or the status the call ended with."""
    try:
        await run_blocking(kubelet.allocate, RESOURCE, requests, WAIT)
    except grpc.RpcError as failure:
        code: grpc.StatusCode = failure.code()
        return code
    return grpc.StatusCode.OK


# Kubelet restarts, crashes and drops


# RSS growth allowed over the storm after a warm-up. Measured here: about 1 MiB over those 270
# restarts, flattening later (allocator pools kept by a few long-lived objects); a generation's
# server, connection or stream kept alive each time would add several times the limit.
STORM = 300
WARM_UP = 30
RSS_GROWTH_LIMIT_KIB = 3 * 1024


@pytest.mark.slow
async def test_a_storm_of_300_kubelet_restarts_leaks_nothing(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(180):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        await serving(kubelet)
        fds = daemon.open_fds()
        rss = 0
        for restart in range(1, STORM + 1):
            await run_blocking(kubelet.restart)
            # Re-registered, and answering ListAndWatch with the full list each time.
            await serving(kubelet, registrations=restart + 1)
            if restart == WARM_UP:
                rss = vm_rss_kib(daemon.pid)
        assert abs(daemon.open_fds() - fds) <= 2
        assert vm_rss_kib(daemon.pid) - rss <= RSS_GROWTH_LIMIT_KIB
    registrations = kubelet.registrations
    assert all(registration.accepted for registration in registrations)
    # One Register per restart; a second one is allowed when kubelet.sock appears while a new
    # generation is already registering, but never a loop.
    assert STORM + 1 <= len(registrations) <= 2 * (STORM + 1)
    endpoints = [registration.endpoint for registration in registrations]
    assert len(set(endpoints)) == len(endpoints)
    # Every earlier generation's socket is gone.
    assert not own_sockets(fake_node) & set(endpoints[:-1])
    assert_no_traceback(daemon)


QUICK_RESTARTS = 20
QUICK_RESTART_PAUSE = 0.2


@pytest.mark.parametrize("how", ["restart", "crash"], ids=["SIGTERM", "SIGKILL"])
async def test_kubelet_restarts_in_quick_succession_never_wait(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon, how: str
) -> None:
    """A kubelet restart is never a fault to back off from, however often it comes: twenty
    restarts 0.2 s after the plugin was back (stopped, or killed with its kubelet.sock left
    behind), each registered again with no wait at all. How soon is a figure of the
    benchmark (nox -s bench): about 3 ms on an idle machine."""
    with trio.fail_after(90):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        port = await metrics_port(daemon)
        await serving(kubelet)
        for restart in range(1, QUICK_RESTARTS + 1):
            await trio.sleep(QUICK_RESTART_PAUSE)  # the pace of the scenario, not a wait
            await run_blocking(kubelet.restart if how == "restart" else kubelet.crash)
            if how == "crash":
                await run_blocking(kubelet.start)
            await serving(kubelet, registrations=restart + 1)
        samples = await scrape(port)
    assert value(samples, "pcc_device_plugin_backoff_seconds_total") == 0
    assert_no_traceback(daemon)


async def test_kubelet_dies_while_a_device_list_is_on_its_way(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    """Kubelet is killed mid-ListAndWatch, as the daemon encodes and sends a changed list."""
    all_healthy = {f"pcc-{index}": "Healthy" for index in range(1000)}
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=1), "--resource-count=1000")
        await serving(kubelet, devices=all_healthy)
        fake_node.device.unlink()
        await run_blocking(kubelet.crash)
        fake_node.device.symlink_to("/dev/null")
        # Nobody behind kubelet.sock: it waits for kubelet to come back, or retries quietly.
        line = await log_line(daemon, KUBELET_GONE)
        assert str(kubelet.socket_path) in line
        # It leaves kubelet's files alone.
        assert kubelet.socket_path.is_socket()
        await run_blocking(kubelet.start)
        await serving(kubelet, registrations=2, devices=all_healthy)
    # A kubelet restart is routine: no error line.
    assert not [line for line in daemon.log_text().splitlines() if line.startswith("E")]
    assert_no_traceback(daemon)


async def test_kubelet_dies_mid_allocate(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    # As many container requests as a call may have, to catch the daemon mid-call.
    many = [["pcc-0"]] * DEFAULT.container_requests
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=1), f"--resource-count={SHARES}")
        await serving(kubelet, devices=HEALTHY_SHARES)
        outcomes: list[grpc.StatusCode] = []

        async def allocate_many() -> None:
            outcomes.append(await allocate_outcome(kubelet, many))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(allocate_many)
            # Logged once the request is checked, before the answer is encoded and sent.
            await log_line(daemon, f"Allocate {RESOURCE}: [['pcc-0'], ")
            await run_blocking(kubelet.crash)
        # However far the answer got, the call ended rather than hung.
        assert outcomes[0] in CUT_OFF_OR_ANSWERED
        await run_blocking(kubelet.start)
        await serving(kubelet, registrations=2, devices=HEALTHY_SHARES)
        assert await allocate_outcome(kubelet, [["pcc-3"]]) == grpc.StatusCode.OK
    assert_no_traceback(daemon)


async def test_register_failing_after_a_kubelet_restart_is_retried(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    """The first-start case is in test_daemon.py; here kubelet comes back not quite ready."""
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        await serving(kubelet)
        kubelet.fail_next_registers(["not ready yet", "not ready yet", "still busy"] * 2)
        await run_blocking(kubelet.restart)
        await serving(kubelet, registrations=2)
        await log_line(daemon, "Registration with kubelet failed, retrying", count=2)
    failed = [registration for registration in kubelet.registrations if not registration.accepted]
    assert [registration.error for registration in failed] == [
        "not ready yet",
        "not ready yet",
        "still busy",
    ] * 2
    reported = lines_with(daemon, "Registration with kubelet failed, retrying")
    assert len(reported) == 2
    assert reported[0].endswith("kubelet answered UNKNOWN: not ready yet")
    assert reported[1].endswith("kubelet answered UNKNOWN: still busy")


async def test_kubelet_drops_the_stream_again_and_again(
    any_kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    """test_daemon.py drops it once under a current kubelet; here every kind, three times in a
    row, each answered at once: kubelet ending the stream is not the plugin's fault (a stopping
    kubelet ends it while it still listens)."""
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        port = await metrics_port(daemon)
        endpoints = [await serving(any_kubelet)]
        for drop in range(1, 4):
            await run_blocking(any_kubelet.drop_stream, RESOURCE)
            endpoints.append(await serving(any_kubelet, registrations=drop + 1))
        # One Register per drop: no flapping.
        assert any_kubelet.register_calls == 4
        assert value(await scrape(port), "pcc_device_plugin_backoff_seconds_total") == 0
        # Logged as it registers again: the line may come after kubelet saw the Register.
        await log_line(daemon, "kubelet's ListAndWatch stream ended", count=3)
    assert len(set(endpoints)) == 4
    assert own_sockets(fake_node) == {endpoints[-1]}
    assert len(lines_with(daemon, "kubelet's ListAndWatch stream ended")) == 3


# Kubelet's directory and sockets disturbed


@pytest.mark.parametrize("impostor", ["regular file", "directory"])
async def test_kubelet_sock_replaced_by_a_file_or_directory(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon, impostor: str
) -> None:
    kubelet_sock = kubelet.socket_path
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        await serving(kubelet)
        # As a hostPath mount of a missing kubelet.sock would. Kubelet still serves the unlinked
        # socket; the daemon restarts on seeing the impostor, or at the latest when kubelet's
        # stream ends.
        kubelet_sock.unlink()
        if impostor == "directory":
            kubelet_sock.mkdir()
        else:
            kubelet_sock.write_text("")
        with contextlib.suppress(NoPluginError):
            await run_blocking(kubelet.drop_stream, RESOURCE)
        await log_line(daemon, f"Waiting for kubelet: {kubelet_sock} is not a socket")
        # Fixed by hand, then kubelet restarts.
        if impostor == "directory":
            kubelet_sock.rmdir()
        else:
            kubelet_sock.unlink()
        await run_blocking(kubelet.restart)
        await serving(kubelet, registrations=2)
    # One clear line while it waited, and no attempt to dial something that is not a socket.
    assert len(lines_with(daemon, "is not a socket")) == 1
    assert not lines_with(daemon, "Registration with kubelet failed")


async def test_plugin_dir_removed_under_a_running_kubelet_and_recreated(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    """test_daemon.py removes it with kubelet stopped; here kubelet keeps running meanwhile."""
    plugin_dir = fake_node.plugin_dir
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        await serving(kubelet)
        # Taken out of its path in one step: removed file by file, the daemon may serve a new
        # socket in it (its own was removed) before the last rmdir.
        removed = plugin_dir.rename(plugin_dir.with_name("removed"))
        shutil.rmtree(removed)
        await log_line(daemon, f"Waiting for {plugin_dir} to be created")
        plugin_dir.mkdir(mode=0o750)
        await log_line(daemon, f"Waiting for kubelet: {plugin_dir}/kubelet.sock does not exist")
        # One line for each thing it waits for, not one per look.
        assert len(lines_with(daemon, f"Waiting for {plugin_dir} to be created")) == 1
        assert len(lines_with(daemon, "kubelet.sock does not exist")) == 1
        await run_blocking(kubelet.restart)
        await serving(kubelet, registrations=2)
    assert_no_traceback(daemon)


async def test_own_socket_deleted_under_every_kind_of_kubelet(
    any_kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    """test_daemon.py deletes it under a current kubelet; here every kind."""
    with trio.fail_after(30):
        start_daemon(*fake_node.daemon_args(verbosity=0))
        first = await serving(any_kubelet)
        (fake_node.plugin_dir / first).unlink()
        second = await serving(any_kubelet, registrations=2)
        assert second != first
        # A kubelet keyed by resource may drop the new client once, if the old stream's end
        # reaches it after the new registration; the daemon then registers once more. So
        # the old stream's end is awaited, then serving again, before the call.
        await run_blocking(
            any_kubelet.wait_for,
            lambda: any(
                event.startswith("ListAndWatch ended") and f"({first})" in event
                for event in any_kubelet.events
            ),
            WAIT,
        )
        await serving(any_kubelet, registrations=2)
        assert await allocate_outcome(any_kubelet, [["pcc-1"]]) == grpc.StatusCode.OK
    assert any_kubelet.register_calls <= 3
    assert first not in own_sockets(fake_node)


# Load


def allocate_while_streaming(
    node: FakeNode, endpoint: str, streams: int, calls: int
) -> tuple[list[Any], list[int]]:
    """Open `streams` ListAndWatch streams, make `calls` concurrent Allocate calls, then show
    that every stream still delivers by taking the device away and putting it back.

    Returns the Allocate responses and each stream's message count.
    """
    options = [("grpc.default_authority", "localhost")]
    target = f"unix:{node.plugin_dir / endpoint}"
    with (
        grpc.insecure_channel(target, options) as watching,
        grpc.insecure_channel(target, options) as allocating,
    ):
        list_and_watch = watching.unary_stream(
            LIST_AND_WATCH,
            request_serializer=pb.Empty.SerializeToString,
            response_deserializer=pb.ListAndWatchResponse.FromString,
        )
        allocate = allocating.unary_unary(
            ALLOCATE,
            request_serializer=pb.AllocateRequest.SerializeToString,
            response_deserializer=pb.AllocateResponse.FromString,
        )
        open_streams = [list_and_watch(pb.Empty(), timeout=60) for _ in range(streams)]
        received = [0] * streams

        def next_health(index: int) -> set[str]:
            message = next(open_streams[index])
            received[index] += 1
            assert len(message.devices) == 16
            return {device.health for device in message.devices}

        try:
            for index in range(streams):
                assert next_health(index) == {"Healthy"}
            futures = [
                allocate.future(
                    pb.AllocateRequest(
                        container_requests=[
                            pb.ContainerAllocateRequest(devices_ids=[f"pcc-{call % 16}"])
                        ]
                    ),
                    timeout=30,
                )
                for call in range(calls)
            ]
            responses = [future.result() for future in futures]
            assert all(stream.is_active() for stream in open_streams)
            node.device.unlink()
            try:
                for index in range(streams):
                    assert next_health(index) == {"Unhealthy"}
            finally:
                node.device.symlink_to("/dev/null")
            for index in range(streams):
                assert next_health(index) == {"Healthy"}
        finally:
            for stream in open_streams:
                stream.cancel()
    return responses, received


async def test_200_concurrent_allocates_while_20_streams_are_open(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(60):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        endpoint = await serving(kubelet)
        responses, received = await run_blocking(
            allocate_while_streaming, fake_node, endpoint, 20, 200
        )
        # Kubelet's own stream lived through it too, and saw the change come and go.
        await run_blocking(
            kubelet.wait_for,
            lambda: kubelet.messages(RESOURCE) >= 3 and kubelet.devices(RESOURCE) == HEALTHY_16,
            WAIT,
        )
    assert kubelet.stream_open(RESOURCE)
    assert len(responses) == 200
    for response in responses:
        (container,) = response.container_responses
        assert [device.container_path for device in container.devices] == ["/dev/sev-guest"]
    assert received == [3] * 20
    assert kubelet.register_calls == 1
    assert kubelet.messages(RESOURCE) == 3
    assert_no_traceback(daemon)


# Stopping at awkward moments


async def test_sigterm_during_allocate(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=1), f"--resource-count={SHARES}")
        endpoint = await serving(kubelet, devices=HEALTHY_SHARES)
        outcomes: list[grpc.StatusCode] = []

        async def allocate_many() -> None:
            many = [["pcc-0"]] * DEFAULT.container_requests
            outcomes.append(await allocate_outcome(kubelet, many))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(allocate_many)
            await log_line(daemon, f"Allocate {RESOURCE}: [['pcc-0'], ")
            assert await run_blocking(daemon.terminate, signal.SIGTERM, WAIT) == 0
        await run_blocking(kubelet.wait_for, lambda: stream_ended(kubelet, endpoint), WAIT)
    # Answered before the shutdown, or cut off by it: either way not left hanging.
    assert outcomes[0] in CUT_OFF_OR_ANSWERED
    assert own_sockets(fake_node) == set()
    assert_no_traceback(daemon)


@pytest.mark.parametrize("moment", ["kubelet stopped", "kubelet restarting", "kubelet crashed"])
async def test_sigterm_during_a_restart(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon, moment: str
) -> None:
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=1))
        await serving(kubelet)
        if moment == "kubelet stopped":
            await run_blocking(kubelet.stop)
            await log_line(daemon, "Waiting for kubelet")
        elif moment == "kubelet restarting":
            # Signalled as soon as kubelet is back: the daemon is somewhere between noticing
            # the restart and registering again.
            await run_blocking(kubelet.restart)
        else:
            # Waiting for kubelet to come back to its dead socket.
            await run_blocking(kubelet.crash)
            await log_line(daemon, KUBELET_GONE)
        assert await run_blocking(daemon.terminate, signal.SIGTERM, WAIT) == 0
    assert own_sockets(fake_node) == set()
    assert daemon.log_text().rstrip().endswith("Stopped")
    assert_no_traceback(daemon)


# Two instances: a rolling update with maxSurge


@pytest.mark.parametrize("kubelet", ["current", "resource-keyed"], indirect=True)
async def test_a_second_instance_takes_over_without_flapping(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    """The newcomer registers and takes over; the first keeps its stream until it exits.

    Current kubelets keep clients per socket, so nothing else happens: two Register calls.
    Older kubelets keep one client per resource and disconnect the newest when an older
    stream ends, so the survivor registers once more when the first one exits, and once more
    for each registration of its own that kubelet drops in turn, having seen the stream of
    the one before end only after it: one Register per drop, no more.
    """
    with trio.fail_after(30):
        first = start_daemon(*fake_node.daemon_args(verbosity=1))
        first_endpoint = await serving(kubelet)
        second = start_daemon(*fake_node.daemon_args(verbosity=1))
        second_endpoint = await serving(kubelet, registrations=2)
        assert second_endpoint != first_endpoint
        # Unique names, both served, neither removed by the other.
        assert own_sockets(fake_node) == {first_endpoint, second_endpoint}
        assert not stream_ended(kubelet, first_endpoint)
        assert kubelet.register_calls == 2
        assert await run_blocking(first.terminate, signal.SIGTERM, WAIT) == 0
        # Until kubelet has seen the first instance's stream end, and every one after it.
        survivor = await settled(kubelet)
        assert await allocate_outcome(kubelet, [["pcc-2"]]) == grpc.StatusCode.OK
    dropped = dropped_by_kubelet(kubelet, second_endpoint)
    assert dropped == 0 if kubelet.key_by == "endpoint" else dropped >= 1
    assert kubelet.register_calls == 2 + dropped
    assert instance(survivor) == instance(second_endpoint)
    assert own_sockets(fake_node) == {survivor}
    for daemon in (first, second):
        assert not lines_with(daemon, "Removed stale socket")
        assert_no_traceback(daemon)
    assert lines_with(second, f"Leaving {fake_node.plugin_dir / first_endpoint}")
