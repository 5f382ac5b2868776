"""The real daemon against careless and hostile neighbours on its gRPC socket and HTTP port.

Each test attacks, then checks that the daemon is still there and that kubelet noticed
nothing: its stream is still open, and an Allocate through its connection still answers.
Every wait is on an event (an answer, a closed connection, a log line).
"""

from __future__ import annotations

import contextlib
import re
import resource
import shutil
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import trio
from daemon_support import RESOURCE, WAIT, log_line, serving
from metrics_support import metrics_port
from raw_clients import Outcome, call, grpc_frame, http_get, reset_after

from pcc_plugin.limits import DEFAULT
from pcc_plugin.sim import Daemon, FakeNode, SimKubelet, StartDaemon, run_blocking
from pcc_plugin.sim._pb import deviceplugin_v1beta1_pb2 as pb

ALLOCATE = "/v1beta1.DevicePlugin/Allocate"
INVALID_ARGUMENT, UNIMPLEMENTED, RESOURCE_EXHAUSTED = 3, 12, 8
MIB = 1024 * 1024


def allocate_pcc_1(node: FakeNode, endpoint: str) -> Outcome:
    """A well-formed Allocate of one share, from a connection of its own."""
    return call(node.plugin_dir / endpoint, ALLOCATE, grpc_frame(b"\x0a\x07\x0a\x05pcc-1"))


async def kubelet_unharmed(kubelet: SimKubelet, daemon: Daemon) -> None:
    assert daemon.proc.poll() is None
    assert kubelet.stream_open(RESOURCE)
    response = await run_blocking(kubelet.allocate, RESOURCE, [["pcc-0"]], WAIT)
    assert len(response.container_responses) == 1
    assert kubelet.register_calls == 1
    text = daemon.log_text()
    assert "Traceback" not in text


def vm_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise LookupError(pid)


@contextlib.contextmanager
def more_open_files() -> Iterator[None]:
    """This process holds thousands of connections: its soft limit goes up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def open_connections(path: Path, count: int) -> list[socket.socket]:
    """`count` connections that send nothing, each connected once the server's backlog has
    room (a server that gives up on some may close them: they are held all the same)."""
    held = []
    for _ in range(count):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        # Blocking: waits for room in the server's backlog.
        with contextlib.suppress(OSError):
            sock.connect(str(path))
        held.append(sock)
    return held


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True


# The gRPC socket


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        # A field that claims 127 bytes, then 7: protobuf's own parsers refuse it.
        (grpc_frame(bytes.fromhex("0a7f0a05") + b"pcc-0"), INVALID_ARGUMENT, "claims 127 bytes"),
        (grpc_frame(b"\x0a\x07\x0a\x05pcc-0", compressed=True), UNIMPLEMENTED, "compress"),
        (grpc_frame(b"\x0a\x07", length=100), INVALID_ARGUMENT, "stream ended before"),
        (b"\x00\x00", INVALID_ARGUMENT, "stream ended before"),
        (grpc_frame(b"\x0a\x07\x0a\x05pcc-0", length=5 * MIB), RESOURCE_EXHAUSTED, "larger"),
    ],
    ids=["truncated protobuf", "compressed", "length beyond the data", "half a prefix", "5 MiB"],
)
async def test_malformed_frames_get_a_status_that_names_the_problem(
    kubelet: SimKubelet,
    fake_node: FakeNode,
    start_daemon: StartDaemon,
    body: bytes,
    status: int,
    message: str,
) -> None:
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        endpoint = await serving(kubelet)
        outcome = await run_blocking(call, fake_node.plugin_dir / endpoint, ALLOCATE, body)
        assert outcome.status == status, outcome
        assert message in outcome.message
        await kubelet_unharmed(kubelet, daemon)


async def test_a_5_mib_message_is_refused_and_a_declared_4_gib_one_is_not_buffered(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(60):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        endpoint = await serving(kubelet)
        socket_path = fake_node.plugin_dir / endpoint
        before = vm_rss_mib(daemon.pid)
        # 5 MiB of real data, sent as fast as the server's flow control lets it through.
        five = grpc_frame(b"\x0a\x07\x0a\x05pcc-0" + b"\0" * (5 * MIB))
        outcome = await run_blocking(call, socket_path, ALLOCATE, five)
        assert outcome.status == RESOURCE_EXHAUSTED, outcome
        # A prefix that declares 4 GiB, then 256 MiB of data pushed behind it.
        declared = struct.pack(">?I", False, (4 << 30) - 1) + b"\0" * (256 * MIB)
        outcome = await run_blocking(call, socket_path, ALLOCATE, declared)
        assert outcome.status == RESOURCE_EXHAUSTED, outcome
        assert vm_rss_mib(daemon.pid) - before < 16
        await kubelet_unharmed(kubelet, daemon)


async def test_100000_device_ids_are_refused_without_decoding_them(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        endpoint = await serving(kubelet)
        many = pb.ContainerAllocateRequest(devices_ids=["pcc-0"] * 100_000)
        body = grpc_frame(pb.AllocateRequest(container_requests=[many]).SerializeToString())
        outcome = await run_blocking(call, fake_node.plugin_dir / endpoint, ALLOCATE, body)
        assert outcome.status == INVALID_ARGUMENT, outcome
        assert "names more device IDs than the 16" in outcome.message
        await kubelet_unharmed(kubelet, daemon)


@pytest.mark.slow
async def test_1100_connections_under_a_1024_file_limit(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    prlimit = shutil.which("prlimit")
    assert prlimit, "prlimit (util-linux) is needed"
    with trio.fail_after(60), more_open_files():
        daemon = start_daemon(
            *fake_node.daemon_args(verbosity=1), wrapper=[prlimit, "--nofile=1024:1024"]
        )
        endpoint = await serving(kubelet)
        flood = await run_blocking(open_connections, fake_node.plugin_dir / endpoint, 1100)
        try:
            await log_line(daemon, "connections open, the limit")
            assert daemon.open_fds() < 200
            await kubelet_unharmed(kubelet, daemon)
            outcome = await run_blocking(allocate_pcc_1, fake_node, endpoint)
            assert outcome.status == 0, outcome
        finally:
            for sock in flood:
                sock.close()
        await kubelet_unharmed(kubelet, daemon)


@pytest.mark.slow
async def test_running_out_of_descriptors_is_waited_out(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    """With so few descriptors that accept() fails, new connections wait, and nothing dies."""
    prlimit = shutil.which("prlimit")
    assert prlimit, "prlimit (util-linux) is needed"
    with trio.fail_after(60):
        daemon = start_daemon(
            *fake_node.daemon_args(verbosity=1), wrapper=[prlimit, "--nofile=48:48"]
        )
        endpoint = await serving(kubelet)
        flood = await run_blocking(open_connections, fake_node.plugin_dir / endpoint, 100)
        try:
            line = await log_line(daemon, "accept returned EMFILE (Too many open files); retrying")
            assert line.startswith("W")
            await kubelet_unharmed(kubelet, daemon)
        finally:
            for sock in flood:
                sock.close()
        # Once the flood is gone, a new client gets in again.
        outcome = await run_blocking(allocate_pcc_1, fake_node, endpoint)
        assert outcome.status == 0, outcome
        assert len(re.findall("accept returned EMFILE", daemon.log_text())) <= 3
        await kubelet_unharmed(kubelet, daemon)


@pytest.mark.slow
async def test_3000_held_connections_cost_bounded_memory(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(90), more_open_files():
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        endpoint = await serving(kubelet)
        idle = vm_rss_mib(daemon.pid)
        flood = await run_blocking(open_connections, fake_node.plugin_dir / endpoint, 3000)
        try:
            # Answered on a connection accepted after all of the flood's.
            outcome = await run_blocking(allocate_pcc_1, fake_node, endpoint)
            assert outcome.status == 0, outcome
            await kubelet_unharmed(kubelet, daemon)
            assert vm_rss_mib(daemon.pid) < 64
        finally:
            for sock in flood:
                sock.close()
        await kubelet_unharmed(kubelet, daemon)
        assert vm_rss_mib(daemon.pid) - idle < 8


async def test_a_handler_that_raises_is_logged_at_v0_answered_internal_and_counted(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon, tmp_path: Path
) -> None:
    # The daemon's own Allocate made to fail for one device ID, from outside its code.
    (tmp_path / "sitecustomize.py").write_text(
        "import pcc_plugin.service as service\n"
        "grants = service.DevicePlugin.grants\n"
        "def failing(self, containers):\n"
        "    if ['pcc-13'] in containers:\n"
        "        raise RuntimeError('injected for the test')\n"
        "    return grants(self, containers)\n"
        "service.DevicePlugin.grants = failing\n"
    )
    with trio.fail_after(30):
        daemon = start_daemon(
            *fake_node.daemon_args(verbosity=0), env={"PYTHONPATH": str(tmp_path)}
        )
        await serving(kubelet)
        with pytest.raises(grpc.RpcError) as failure:
            await run_blocking(kubelet.allocate, RESOURCE, [["pcc-13"]], WAIT)
        assert failure.value.code() == grpc.StatusCode.INTERNAL
        line = await log_line(daemon, "Allocate failed unexpectedly")
        assert line.startswith("E")
        # The traceback's last line may still be on its way from the daemon's pipe.
        await log_line(daemon, "RuntimeError: injected for the test")
        port = await metrics_port(daemon)
        metrics = await run_blocking(
            http_get, "127.0.0.1", port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        assert (
            b'pcc_device_plugin_handler_errors_total{resource="tke.cloud.tencent.com/pcc-device",'
            b'where="Allocate"} 1.0' in metrics
        )
        assert daemon.proc.poll() is None
        response = await run_blocking(kubelet.allocate, RESOURCE, [["pcc-0"]], WAIT)
        assert len(response.container_responses) == 1


# The HTTP port


@pytest.mark.parametrize(
    "request_bytes",
    [b"", b"GET /metr", b"\x16\x03\x01\x02\x00garbage"],
    ids=["nothing", "half a request", "garbage"],
)
async def test_an_http_client_that_resets_ends_only_its_connection(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon, request_bytes: bytes
) -> None:
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        await serving(kubelet)
        port = await metrics_port(daemon)

        def reset_one() -> None:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(request_bytes)
            reset_after(sock)

        for _ in range(20):
            await run_blocking(reset_one)
        answer = await run_blocking(
            http_get, "127.0.0.1", port, b"GET /livez HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        assert answer.startswith(b"HTTP/1.1 200 ")
        await kubelet_unharmed(kubelet, daemon)


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Padding: " + b"a" * 9000 + b"\r\n\r\n", 431),
        (b"DELETE /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 405),
    ],
    ids=["a huge header", "not GET"],
)
async def test_bad_http_requests_get_a_4xx(
    kubelet: SimKubelet,
    fake_node: FakeNode,
    start_daemon: StartDaemon,
    request_bytes: bytes,
    status: int,
) -> None:
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        await serving(kubelet)
        port = await metrics_port(daemon)
        answer = await run_blocking(http_get, "127.0.0.1", port, request_bytes)
        assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:200]
        await kubelet_unharmed(kubelet, daemon)


@pytest.mark.slow
async def test_http_floods_and_slow_clients_are_bounded(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(60):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        await serving(kubelet)
        port = await metrics_port(daemon)
        # Slow clients hold every connection the server allows...
        slow = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(20)]
        for sock in slow:
            sock.sendall(b"GET /livez HTTP/1.1\r\n")
        try:
            await log_line(daemon, "HTTP connections open, the limit")
            # ...and are cut off after the request deadline: the port answers again.
            for sock in slow:
                assert await run_blocking(closed_by_server, sock)
            for _ in range(200):
                answer = await run_blocking(
                    http_get, "127.0.0.1", port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
                )
                assert answer.startswith(b"HTTP/1.1 200 ")
        finally:
            for sock in slow:
                sock.close()
        await kubelet_unharmed(kubelet, daemon)


async def test_probes_are_answered_while_a_thousand_half_requests_wait(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    """Kubelet's liveness and readiness probes get through a flood of connections that each
    sent half a request head: the oldest of those makes room for each newcomer."""
    with trio.fail_after(60), more_open_files():
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        await serving(kubelet)
        await log_line(daemon, "Registered device plugin with Kubelet")
        port = await metrics_port(daemon)

        def half_requests() -> list[socket.socket]:
            held = []
            for _ in range(1000):
                sock = socket.create_connection(("127.0.0.1", port), timeout=10)
                sock.sendall(b"GET /livez HTTP/1.1\r\nHos")
                held.append(sock)
            return held

        flood = await run_blocking(half_requests)
        try:
            for path in (b"/livez", b"/readyz"):
                # Not how fast (that is the machine's as much as the daemon's): that the probe
                # gets in at all. A daemon that made no room would take it only after the
                # connections ahead of it timed out, REQUEST_TIMEOUT for each MAX_CONNECTIONS.
                request = b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n\r\n"
                answer = await run_blocking(
                    http_get, "127.0.0.1", port, request, timeout=DEFAULT.http_timeout
                )
                assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        finally:
            for sock in flood:
                sock.close()
        await kubelet_unharmed(kubelet, daemon)
