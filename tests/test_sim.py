"""The simulated kubelet, fake node and daemon runner, tested against a tiny grpcio plugin."""

from __future__ import annotations

import collections
import os
import queue
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs
import grpc
import pytest
import trio

from pcc_plugin.sim import (
    Daemon,
    FakeNode,
    NoPluginError,
    PluginOptions,
    Registration,
    SimKubelet,
    StartDaemon,
    run_blocking,
)
from pcc_plugin.sim._pb import deviceplugin_v1beta1_pb2 as pb
from pcc_plugin.sim.demo import DRA_ON_A_LAPTOP
from pcc_plugin.sim.rules import ALLOCATE, REGISTER, is_extended_resource_name

RESOURCE = "example.com/widget"
ENDED = f"ListAndWatch ended unexpectedly for device plugin {RESOURCE}"


@attrs.define(eq=False)
class FakePlugin:
    """A device plugin on grpcio that records what kubelet asks of it."""

    socket_path: Path
    device_ids: list[str]
    options: pb.DevicePluginOptions
    # When set, GetDevicePluginOptions waits for it: shows whether Register waits for options.
    options_gate: threading.Event | None = None
    # Set as GetDevicePluginOptions arrives, before it waits for the gate.
    options_asked: threading.Event = attrs.Factory(threading.Event)
    calls: collections.Counter[str] = attrs.Factory(collections.Counter)
    requests: list[Any] = attrs.Factory(list)
    stream_ended: threading.Event = attrs.Factory(threading.Event)
    _streams: list[queue.SimpleQueue[pb.ListAndWatchResponse | None]] = attrs.Factory(list)
    _lock: threading.Lock = attrs.Factory(threading.Lock)
    _server: Any = None

    def start(self) -> None:
        def unary(handler: Any, request_type: Any) -> Any:
            return grpc.unary_unary_rpc_method_handler(
                handler,
                request_deserializer=request_type.FromString,
                response_serializer=lambda message: message.SerializeToString(),
            )

        methods = {
            "GetDevicePluginOptions": unary(self._get_options, pb.Empty),
            "ListAndWatch": grpc.unary_stream_rpc_method_handler(
                self._list_and_watch,
                request_deserializer=pb.Empty.FromString,
                response_serializer=pb.ListAndWatchResponse.SerializeToString,
            ),
            "GetPreferredAllocation": unary(self._preferred, pb.PreferredAllocationRequest),
            "Allocate": unary(self._allocate, pb.AllocateRequest),
            "PreStartContainer": unary(self._pre_start, pb.PreStartContainerRequest),
        }
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=4),
            handlers=[grpc.method_handlers_generic_handler("v1beta1.DevicePlugin", methods)],
        )
        self._server.add_insecure_port(f"unix:{self.socket_path}")
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=0).wait()

    def send(self, devices: dict[str, str]) -> None:
        """Send a new device list, ID to health, on the latest stream."""
        update = pb.ListAndWatchResponse(
            devices=[
                pb.Device(ID=device_id, health=health) for device_id, health in devices.items()
            ]
        )
        with self._lock:
            self._streams[-1].put(update)

    def end_stream(self) -> None:
        with self._lock:
            self._streams[-1].put(None)

    def register(self, kubelet: SimKubelet) -> None:
        register(kubelet, endpoint=self.socket_path.name)

    def _count(self, method: str, request: Any = None) -> None:
        with self._lock:
            self.calls[method] += 1
            if request is not None:
                self.requests.append(request)

    def _get_options(self, request: pb.Empty, context: Any) -> pb.DevicePluginOptions:
        self._count("GetDevicePluginOptions")
        self.options_asked.set()
        if self.options_gate is not None:
            self.options_gate.wait(timeout=5)
        return self.options

    def _list_and_watch(self, request: pb.Empty, context: Any) -> Iterator[pb.ListAndWatchResponse]:
        updates: queue.SimpleQueue[pb.ListAndWatchResponse | None] = queue.SimpleQueue()
        with self._lock:
            self.calls["ListAndWatch"] += 1
            self._streams.append(updates)

        def on_end() -> None:
            updates.put(None)
            self.stream_ended.set()

        context.add_callback(on_end)
        yield pb.ListAndWatchResponse(
            devices=[pb.Device(ID=device_id, health="Healthy") for device_id in self.device_ids]
        )
        while (update := updates.get()) is not None:
            yield update

    def _allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        self._count("Allocate", request)
        return pb.AllocateResponse(
            container_responses=[
                pb.ContainerAllocateResponse(envs={"WIDGETS": ",".join(container.devices_ids)})
                for container in request.container_requests
            ]
        )

    def _preferred(
        self, request: pb.PreferredAllocationRequest, context: Any
    ) -> pb.PreferredAllocationResponse:
        self._count("GetPreferredAllocation", request)
        responses = []
        for container in request.container_requests:
            chosen = list(container.must_include_deviceIDs)
            chosen += [d for d in container.available_deviceIDs if d not in chosen]
            responses.append(
                pb.ContainerPreferredAllocationResponse(
                    deviceIDs=chosen[: container.allocation_size]
                )
            )
        return pb.PreferredAllocationResponse(container_responses=responses)

    def _pre_start(
        self, request: pb.PreStartContainerRequest, context: Any
    ) -> pb.PreStartContainerResponse:
        self._count("PreStartContainer", request)
        return pb.PreStartContainerResponse()


class Plugins:
    """Starts fake plugins in the node's device-plugin directory; stops them at teardown."""

    def __init__(self, plugin_dir: Path) -> None:
        self.plugin_dir = plugin_dir
        self.started: list[FakePlugin] = []

    def start(
        self,
        endpoint: str,
        device_ids: list[str],
        options: pb.DevicePluginOptions | None = None,
        options_gate: threading.Event | None = None,
    ) -> FakePlugin:
        plugin = FakePlugin(
            self.plugin_dir / endpoint,
            device_ids,
            options or pb.DevicePluginOptions(),
            options_gate,
        )
        plugin.start()
        self.started.append(plugin)
        return plugin


@pytest.fixture
def plugins(fake_node: FakeNode) -> Iterator[Plugins]:
    started = Plugins(fake_node.plugin_dir)
    yield started
    for plugin in started.started:
        plugin.stop()


def register(
    kubelet: SimKubelet,
    *,
    version: str = "v1beta1",
    resource: str = RESOURCE,
    endpoint: str = "widget.sock",
) -> None:
    """Register as a plugin does; the request's own options are all off, on purpose."""
    with grpc.insecure_channel(f"unix:{kubelet.socket_path}") as channel:
        channel.unary_unary(
            REGISTER,
            request_serializer=pb.RegisterRequest.SerializeToString,
            response_deserializer=pb.Empty.FromString,
        )(
            pb.RegisterRequest(
                version=version,
                endpoint=endpoint,
                resource_name=resource,
                options=pb.DevicePluginOptions(),
            ),
            timeout=5,
        )


def register_error(kubelet: SimKubelet, **fields: str) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as failure:
        register(kubelet, **fields)
    return failure.value.code(), failure.value.details()


def bind_socket(path: Path) -> None:
    """Leave a socket file behind, as a plugin that died would."""
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))


def instants(registration: Registration, *names: str) -> list[float]:
    """The registration's instants of these names, each of which must have happened."""
    values = [getattr(registration, name) for name in names]
    assert None not in values, registration
    return values


async def wait_until(kubelet: SimKubelet, predicate: Callable[[], bool]) -> None:
    """Wait under the caller's fail_after; the thread gives up by itself a little later."""
    await run_blocking(kubelet.wait_for, predicate, 10)


async def register_and_stream(kubelet: SimKubelet, plugin: FakePlugin) -> None:
    await run_blocking(plugin.register, kubelet)
    await wait_until(kubelet, lambda: kubelet.stream_open(RESOURCE))


# Register validation


@pytest.mark.parametrize(
    "name",
    [
        "tke.cloud.tencent.com/pcc-device",
        "example.com/widget",
        "a/b",
        "example.com/Widget_2.x-y",
        "example.com/" + "w" * 63,
        "a" * 244 + "/w",
    ],
)
def test_extended_resource_names_kubelet_accepts(name: str) -> None:
    assert is_extended_resource_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "widget",
        "kubernetes.io/widget",
        "sub.kubernetes.io/widget",
        "requests.example.com/widget",
        "Example.com/widget",
        "example_com/widget",
        "example.com/",
        "/widget",
        "example.com/-widget",
        "example.com/widget.",
        "example.com/wid get",
        "example.com/a/b",
        "example.com/" + "w" * 64,
        # "requests." makes the prefix 254 characters long.
        "a" * 245 + "/w",
    ],
)
def test_names_kubelet_rejects(name: str) -> None:
    assert not is_extended_resource_name(name)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        pytest.param(
            {"version": "v1alpha"},
            'requested API version "v1alpha" is not supported by kubelet. '
            'Supported versions are ["v1beta1"]',
            id="version",
        ),
        pytest.param(
            {"resource": "widget"}, 'the ResourceName "widget" is invalid', id="no-domain"
        ),
        pytest.param(
            {"resource": "kubernetes.io/widget"},
            'the ResourceName "kubernetes.io/widget" is invalid',
            id="native-domain",
        ),
        pytest.param(
            {"resource": "requests.example.com/widget"},
            'the ResourceName "requests.example.com/widget" is invalid',
            id="quota-prefix",
        ),
        pytest.param({"endpoint": ""}, 'the endpoint "" is not a file name', id="no-endpoint"),
        pytest.param(
            {"endpoint": "../widget.sock"},
            'the endpoint "../widget.sock" is not a file name',
            id="endpoint-outside",
        ),
        pytest.param(
            {"endpoint": "sub/widget.sock"},
            'the endpoint "sub/widget.sock" is not a file name',
            id="endpoint-in-subdir",
        ),
    ],
)
async def test_bad_register_is_answered_unknown_without_dialling(
    kubelet: SimKubelet, fields: dict[str, str], message: str
) -> None:
    # No plugin serves anything: a dial would hang for 10 s and trip fail_after.
    with trio.fail_after(5):
        code, details = await run_blocking(register_error, kubelet, **fields)
    assert code == grpc.StatusCode.UNKNOWN
    assert details.startswith(message)
    [registration] = kubelet.registrations
    assert not registration.accepted
    assert registration.error == details
    assert registration.options is None
    assert kubelet.register_calls == 1


async def test_failed_dial_fails_register(kubelet: SimKubelet) -> None:
    kubelet.dial_timeout = 0.1
    with trio.fail_after(5):
        code, details = await run_blocking(register_error, kubelet, endpoint="absent.sock")
    assert code == grpc.StatusCode.UNKNOWN
    assert details.startswith("failed to dial device plugin")
    [registration] = kubelet.registrations
    assert not registration.accepted
    assert (registration.dialled_at, registration.options_at) == (None, None)


# Order of Register, options and ListAndWatch

OPTIONS = pb.DevicePluginOptions(pre_start_required=True, get_preferred_allocation_available=True)


async def test_current_kubelet_reads_options_inside_register_then_streams(
    kubelet: SimKubelet, plugins: Plugins
) -> None:
    with trio.fail_after(5):
        plugin = plugins.start("widget.sock", ["w-0", "w-1"], OPTIONS)
        await run_blocking(plugin.register, kubelet)
        assert plugin.calls["GetDevicePluginOptions"] == 1
        [registration] = kubelet.registrations
        assert registration.accepted
        assert registration.error is None
        # From GetDevicePluginOptions: the RegisterRequest said False to both.
        assert registration.options == PluginOptions(True, True)
        await wait_until(kubelet, lambda: kubelet.stream_open(RESOURCE))
    assert kubelet.devices(RESOURCE) == {"w-0": "Healthy", "w-1": "Healthy"}
    assert kubelet.messages(RESOURCE) == 1
    assert plugin.calls["ListAndWatch"] == 1


async def test_a_registration_records_the_dial_the_options_and_the_first_list(
    kubelet: SimKubelet, plugins: Plugins
) -> None:
    gate = threading.Event()
    with trio.fail_after(5):
        plugin = plugins.start("widget.sock", ["w-0"], options_gate=gate)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_blocking, plugin.register, kubelet)
            assert await run_blocking(plugin.options_asked.wait, 5)
            asked = time.monotonic()
            gate.set()
        await wait_until(kubelet, lambda: kubelet.stream_open(RESOURCE))
        [registration] = kubelet.registrations
        plugin.send({"w-0": "Unhealthy"})
        await wait_until(kubelet, lambda: kubelet.messages(RESOURCE) == 2)
    received, dialled, options, answered, first_list = instants(
        registration, "received_at", "dialled_at", "options_at", "answered_at", "first_list_at"
    )
    # The dial is stamped as it begins and the options as they come back, around the plugin's
    # wait; the first list after Register was answered, and only the first.
    assert received <= dialled < asked < options <= answered <= first_list
    assert kubelet.registrations == [registration]


async def test_every_list_replaces_the_previous_one(kubelet: SimKubelet, plugins: Plugins) -> None:
    with trio.fail_after(5):
        plugin = plugins.start("widget.sock", ["w-0", "w-1"])
        await register_and_stream(kubelet, plugin)
        plugin.send({"w-2": "Unhealthy"})
        await wait_until(kubelet, lambda: kubelet.messages(RESOURCE) == 2)
    assert kubelet.devices(RESOURCE) == {"w-2": "Unhealthy"}


# Stream ends


@pytest.mark.parametrize("ending", ["plugin-closes-stream", "plugin-stops", "kubelet-drops"])
async def test_stream_end_marks_devices_unhealthy_and_is_never_redialled(
    kubelet: SimKubelet, plugins: Plugins, ending: str
) -> None:
    with trio.fail_after(5):
        plugin = plugins.start("widget.sock", ["w-0", "w-1"])
        await register_and_stream(kubelet, plugin)
        if ending == "plugin-closes-stream":
            plugin.end_stream()
        elif ending == "plugin-stops":
            await run_blocking(plugin.stop)
        else:
            kubelet.drop_stream(RESOURCE)
        # The sim closes the connection before it publishes the end: nothing can redial after.
        await wait_until(kubelet, lambda: not kubelet.stream_open(RESOURCE))
        assert any(event.startswith(ENDED) for event in kubelet.events)
        assert kubelet.devices(RESOURCE) == {"w-0": "Unhealthy", "w-1": "Unhealthy"}
        assert plugin.calls["ListAndWatch"] == 1
        with pytest.raises(NoPluginError):
            await run_blocking(kubelet.allocate, RESOURCE, [["w-0"]])


async def test_coming_back_is_the_plugins_job(kubelet: SimKubelet, plugins: Plugins) -> None:
    with trio.fail_after(5):
        plugin = plugins.start("widget.sock", ["w-0"])
        await register_and_stream(kubelet, plugin)
        kubelet.drop_stream(RESOURCE)
        await wait_until(kubelet, lambda: not kubelet.stream_open(RESOURCE))
        await register_and_stream(kubelet, plugin)
        assert kubelet.devices(RESOURCE) == {"w-0": "Healthy"}
        assert plugin.calls["ListAndWatch"] == 2


async def test_endpoint_keyed_kubelet_lets_an_older_stream_end_alone(
    kubelet: SimKubelet, plugins: Plugins
) -> None:
    with trio.fail_after(5):
        old = plugins.start("old.sock", ["old-0"])
        await register_and_stream(kubelet, old)
        new = plugins.start("new.sock", ["new-0"])
        await run_blocking(new.register, kubelet)
        await wait_until(kubelet, lambda: kubelet.devices(RESOURCE) == {"new-0": "Healthy"})
        old.end_stream()
        await wait_until(
            kubelet, lambda: any(e.startswith(f"{ENDED} (old.sock)") for e in kubelet.events)
        )
        # A round trip to the new plugin after the old end: its connection is still up.
        response = await run_blocking(kubelet.allocate, RESOURCE, [["new-0"]])
    assert response.container_responses[0].envs["WIDGETS"] == "new-0"
    assert kubelet.stream_open(RESOURCE)
    assert kubelet.devices(RESOURCE) == {"new-0": "Healthy"}
    assert not new.stream_ended.is_set()


@pytest.mark.parametrize("kubelet", ["resource-keyed"], indirect=True)
async def test_resource_keyed_kubelet_drops_the_newest_client_when_an_older_stream_ends(
    kubelet: SimKubelet, plugins: Plugins
) -> None:
    with trio.fail_after(5):
        old = plugins.start("old.sock", ["old-0"])
        await register_and_stream(kubelet, old)
        new = plugins.start("new.sock", ["new-0"])
        await run_blocking(new.register, kubelet)
        await wait_until(kubelet, lambda: kubelet.devices(RESOURCE) == {"new-0": "Healthy"})
        old.end_stream()
        await wait_until(kubelet, lambda: not kubelet.stream_open(RESOURCE))
        assert await run_blocking(new.stream_ended.wait, 4)
        with pytest.raises(NoPluginError):
            await run_blocking(kubelet.allocate, RESOURCE, [["new-0"]])
    assert kubelet.devices(RESOURCE) == {"new-0": "Unhealthy"}
    assert any(event.startswith("disconnecting new.sock") for event in kubelet.events)
    assert new.calls["ListAndWatch"] == 1


# Start, stop, restart


def test_start_creates_the_directory_with_mode_0750(
    fake_node: FakeNode, kubelet: SimKubelet
) -> None:
    assert stat.S_IMODE(fake_node.plugin_dir.stat().st_mode) == 0o750
    assert stat.S_ISSOCK(kubelet.socket_path.stat().st_mode)


async def test_restart_wipes_sockets_and_keeps_files_and_subdirectories(
    fake_node: FakeNode, kubelet: SimKubelet, plugins: Plugins
) -> None:
    plugin_dir = fake_node.plugin_dir
    (plugin_dir / "kubelet_internal_checkpoint").write_text("{}")
    (plugin_dir / "sub").mkdir()
    bind_socket(plugin_dir / "sub" / "nested.sock")
    bind_socket(plugin_dir / "stale.sock")
    with trio.fail_after(5):
        plugin = plugins.start("widget.sock", ["w-0"])
        await register_and_stream(kubelet, plugin)
        await run_blocking(kubelet.restart)
        assert await run_blocking(plugin.stream_ended.wait, 4)
    assert sorted(path.name for path in plugin_dir.iterdir()) == [
        "kubelet.sock",
        "kubelet_internal_checkpoint",
        "sub",
    ]
    assert (plugin_dir / "sub" / "nested.sock").exists()
    assert kubelet.running
    assert not kubelet.stream_open(RESOURCE)
    assert kubelet.devices(RESOURCE) == {"w-0": "Unhealthy"}
    # Kubelet going away is not a stream ending "unexpectedly".
    assert not any(event.startswith(ENDED) for event in kubelet.events)


async def test_hundreds_of_restarts_are_fast_and_leave_no_descriptors(
    kubelet: SimKubelet, plugins: Plugins
) -> None:
    def restart_often() -> None:
        for _ in range(150):
            kubelet.restart()

    with trio.fail_after(10):
        await run_blocking(restart_often)
        descriptors = len(os.listdir("/proc/self/fd"))
        await run_blocking(restart_often)
        assert len(os.listdir("/proc/self/fd")) <= descriptors + 2
        await register_and_stream(kubelet, plugins.start("widget.sock", ["w-0"]))


async def test_restarts_with_a_plugin_streaming_are_fast(
    kubelet: SimKubelet, plugins: Plugins
) -> None:
    plugin = plugins.start("widget.sock", ["w-0"])
    with trio.fail_after(10):
        for _ in range(50):
            await register_and_stream(kubelet, plugin)
            await run_blocking(kubelet.restart)
            # The restart deleted the plugin's socket: it serves anew, as a real plugin does.
            await run_blocking(plugin.stop)
            await run_blocking(plugin.start)
    assert plugin.calls["ListAndWatch"] == 50
    assert [r.accepted for r in kubelet.registrations] == [True] * 50
    assert not any(event.startswith(ENDED) for event in kubelet.events)


async def test_stop_ends_streams_and_removes_its_socket(
    kubelet: SimKubelet, plugins: Plugins
) -> None:
    with trio.fail_after(5):
        plugin = plugins.start("widget.sock", ["w-0"])
        await register_and_stream(kubelet, plugin)
        await run_blocking(kubelet.stop)
        assert await run_blocking(plugin.stream_ended.wait, 4)
        await run_blocking(kubelet.stop)
    assert not kubelet.running
    assert not kubelet.socket_path.exists()
    assert not kubelet.stream_open(RESOURCE)


def test_a_socket_path_longer_than_107_bytes_is_refused() -> None:
    with pytest.raises(ValueError, match="107 bytes"):
        SimKubelet(Path("/tmp") / ("d" * 100))


# Fault hooks and calls


async def test_planned_register_failures_come_first_and_skip_the_dial(
    kubelet: SimKubelet, plugins: Plugins
) -> None:
    kubelet.fail_next_registers(["kubelet is busy", "try again"])
    with trio.fail_after(5):
        plugin = plugins.start("widget.sock", ["w-0"])
        failures = [await run_blocking(register_error, kubelet) for _ in range(2)]
        await register_and_stream(kubelet, plugin)
    assert failures == [
        (grpc.StatusCode.UNKNOWN, "kubelet is busy"),
        (grpc.StatusCode.UNKNOWN, "try again"),
    ]
    assert [(r.accepted, r.error) for r in kubelet.registrations] == [
        (False, "kubelet is busy"),
        (False, "try again"),
        (True, None),
    ]
    assert kubelet.register_calls == 3
    assert plugin.calls["GetDevicePluginOptions"] == 1


async def test_calls_reach_the_active_plugin(kubelet: SimKubelet, plugins: Plugins) -> None:
    with trio.fail_after(5):
        plugin = plugins.start("widget.sock", ["w-0", "w-1", "w-2"], OPTIONS)
        await register_and_stream(kubelet, plugin)
        preferred = await run_blocking(
            kubelet.get_preferred_allocation, RESOURCE, ["w-0", "w-1", "w-2"], ["w-2"], 2
        )
        allocated = await run_blocking(kubelet.allocate, RESOURCE, [["w-2", "w-0"]])
        await run_blocking(kubelet.pre_start_container, RESOURCE, ["w-2", "w-0"])
    assert list(preferred.container_responses[0].deviceIDs) == ["w-2", "w-0"]
    assert allocated.container_responses[0].envs["WIDGETS"] == "w-2,w-0"
    preferred_request, allocate_request, pre_start_request = plugin.requests
    assert preferred_request.container_requests[0].allocation_size == 2
    assert list(allocate_request.container_requests[0].devices_ids) == ["w-2", "w-0"]
    assert list(pre_start_request.devices_ids) == ["w-2", "w-0"]


async def test_raw_calls_report_the_status(kubelet: SimKubelet, plugins: Plugins) -> None:
    valid = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=["w-0"])]
    ).SerializeToString()
    with trio.fail_after(5):
        plugin = plugins.start("widget.sock", ["w-0"])
        await register_and_stream(kubelet, plugin)
        # Field 1 (container_requests) announced as 127 bytes long, with none to follow.
        truncated = await run_blocking(kubelet.call_raw, RESOURCE, ALLOCATE, b"\x0a\x7f")
        answered = await run_blocking(kubelet.call_raw, RESOURCE, ALLOCATE, valid)
        unknown_method = await run_blocking(
            kubelet.call_raw, RESOURCE, "/v1beta1.DevicePlugin/Nope", b""
        )
        with pytest.raises(NoPluginError):
            await run_blocking(kubelet.call_raw, "example.com/absent", ALLOCATE, valid)
    assert truncated[0] == grpc.StatusCode.INTERNAL
    assert answered == (grpc.StatusCode.OK, "")
    assert unknown_method[0] == grpc.StatusCode.UNIMPLEMENTED
    assert plugin.calls["Allocate"] == 1


async def test_wait_for_says_what_it_waited_for(kubelet: SimKubelet) -> None:
    def never() -> bool:
        return False

    with trio.fail_after(5), pytest.raises(TimeoutError, match=r"never still false .* 0 Register"):
        await run_blocking(kubelet.wait_for, never, 0.01)


# The fake node and the daemon runner


def test_fake_node_has_the_device_and_pcc_directory(fake_node: FakeNode) -> None:
    assert stat.S_ISCHR(fake_node.device.stat().st_mode)
    assert fake_node.pcc_dir.is_dir()
    assert not fake_node.plugin_dir.exists()
    assert len(str(fake_node.plugin_dir / "kubelet.sock")) < 60
    assert fake_node.daemon_args() == [
        "--host-root",
        str(fake_node.host_root),
        "--pcc-device",
        "/dev/sev-guest",
        "--pcc-socket-path",
        "/var/run/pcc",
        "--device-plugin-path",
        str(fake_node.plugin_dir),
        "--metrics-bind-address=127.0.0.1:0",
        "--v=2",
    ]


WAITS_FOR_SIGTERM = """
import signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
print("ready")
print("ready, on stderr", file=sys.stderr)
signal.sigwait({signal.SIGTERM})
print("stopping")
sys.exit(3)
"""


async def test_daemon_runner_follows_the_log_and_returns_the_exit_code(
    fake_node: FakeNode,
) -> None:
    daemon = Daemon([sys.executable, "-c", WAITS_FOR_SIGTERM], fake_node.root / "d.log")
    try:
        with trio.fail_after(10):
            line = await run_blocking(daemon.wait_for_log, "ready", 8, count=2)
            assert line == "ready, on stderr"
            assert daemon.open_fds() >= 3
            assert await run_blocking(daemon.terminate) == 3
    finally:
        daemon.close()
    assert daemon.log_text() == "ready\nready, on stderr\nstopping\n"
    assert (fake_node.root / "d.log").read_text() == daemon.log_text()


async def test_daemon_runner_reports_an_early_exit_at_once(fake_node: FakeNode) -> None:
    daemon = Daemon(
        [sys.executable, "-c", "print('no kubelet'); raise SystemExit(1)"], fake_node.root / "d.log"
    )
    try:
        with trio.fail_after(10), pytest.raises(RuntimeError, match="exit code 1"):
            await run_blocking(daemon.wait_for_log, "Registered", 8)
    finally:
        daemon.close()


async def test_daemon_runner_kills_what_ignores_sigterm(fake_node: FakeNode) -> None:
    script = (
        "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up'); signal.pause()"
    )
    daemon = Daemon([sys.executable, "-c", script], fake_node.root / "d.log")
    with trio.fail_after(10):
        await run_blocking(daemon.wait_for_log, "up", 8)
        daemon.proc.send_signal(signal.SIGTERM)
        await run_blocking(daemon.close)
    assert daemon.proc.returncode == -signal.SIGKILL


async def test_the_demo_tells_the_whole_story() -> None:
    with trio.fail_after(30):
        demo = await trio.run_process(
            [sys.executable, "-m", "pcc_plugin.sim.demo"], capture_stdout=True, check=False
        )
    story = demo.stdout.decode()
    assert demo.returncode == 0, story
    assert "8. SIGTERM sent: the daemon exited with code 0" in story
    # It ends by pointing at the DRA mode's recipe, which is there.
    assert story.splitlines()[-1] == DRA_ON_A_LAPTOP
    dra_docs = Path(__file__).resolve().parent.parent / "docs" / "dra.md"
    assert "\n## Try it on a laptop\n" in dra_docs.read_text()


# Trying it by hand (README): the simulated kubelet as a command, and `allocate`.

TWO_RESOURCES = """\
resources:
  - name: example.com/first
    count: 2
    devices: [{hostPath: /dev/sev-guest, containerPath: /dev/first}]
  - name: example.com/second
    count: 2
    devices: [{hostPath: /dev/sev-guest, containerPath: /dev/second}]
"""


async def allocate_by_hand(plugin_dir: Path, *args: str) -> tuple[int, str]:
    argv = [sys.executable, "-m", "pcc_plugin.sim", "allocate", "--dir", str(plugin_dir), *args]
    done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    return done.returncode, (done.stdout + done.stderr).decode()


async def test_allocate_by_hand_calls_the_resource_it_names(
    fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    """With two resources, the newest socket is one of them: naming the resource dials the
    endpoint it registered with the simulated kubelet, as kubelet would."""
    config = fake_node.root / "profiles.yaml"
    config.write_text(TWO_RESOURCES)
    plugin_dir = fake_node.plugin_dir
    kubelet = Daemon(
        [sys.executable, "-m", "pcc_plugin.sim", "kubelet", "--dir", str(plugin_dir)],
        fake_node.root / "kubelet.log",
    )
    try:
        # Several Python processes start one after another here: 60 s for a loaded machine.
        with trio.fail_after(60):
            await run_blocking(kubelet.wait_for_log, "kubelet serving Registration", 10.0)
            code, said = await allocate_by_hand(
                plugin_dir, "--resource", "example.com/first", "--timeout", "0.2", "first-0"
            )
            assert code == 1
            assert said == (
                f"example.com/first has not registered with the simulated kubelet in {plugin_dir} "
                "(registered: nothing), after 0.2 s; is the daemon running, with "
                f"--device-plugin-path={plugin_dir}, and the simulated kubelet there?\n"
            )
            # Started before the daemon registers, as the README's block runs it: it waits.
            start_daemon(*fake_node.daemon_args(), f"--config={config}")
            code, said = await allocate_by_hand(
                plugin_dir, "--resource", "example.com/first", "first-0"
            )
            assert code == 0, said
            for name in ("first", "second"):
                await run_blocking(
                    kubelet.wait_for_log, f"registered device plugin example.com/{name}", 10.0
                )
            for name in ("first", "second"):
                code, said = await allocate_by_hand(
                    plugin_dir, "--resource", f"example.com/{name}", f"{name}-1"
                )
                assert code == 0, said
                assert said.startswith(f"{name}-"), said
                assert f"/dev/{name}" in said
            # Without a name, the newest socket answers, for its own IDs only.
            outcomes = [
                await allocate_by_hand(plugin_dir, f"{name}-0") for name in ("first", "second")
            ]
            assert sorted(code for code, _ in outcomes) == [0, 1]
            (refused,) = [said for code, said in outcomes if code == 1]
            assert refused.endswith(
                f"is the newest plugin socket in {plugin_dir}; with several resources "
                "(--config), name the one those devices are of with --resource\n"
            )
        await run_blocking(kubelet.terminate, signal.SIGTERM, 10.0)
        # Stopped, it leaves no record of endpoints that no kubelet serves any more.
        assert not (plugin_dir / "sim-kubelet-endpoints.json").exists()
    finally:
        kubelet.close()
