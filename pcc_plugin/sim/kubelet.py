"""A simulated kubelet: the device manager's side of the v1beta1 device plugin API.

It runs on grpcio, a gRPC and protobuf stack independent of the daemon's, so the tests check the
daemon's wire format rather than agreement between two copies of the same generated code. It is
thread-based (no grpc.aio), so trio tests can drive it through worker threads.

It behaves like kubelet's device manager (see kubelet-protocol.md): it wipes the sockets in its
directory at start, validates Register like kubelet and answers failures with status UNKNOWN,
dials the plugin and reads its options inside Register, as kubelets since 1.25 do (the oldest
docs/deploy.md supports), keeps the latest ListAndWatch list per resource, and when a stream ends
marks the devices Unhealthy and never redials.

A unix socket path is limited to 107 bytes (``sun_path`` holds 108 with the NUL), so the plugin
directory must be short: use ``tempfile.mkdtemp(prefix="pcc-", dir="/tmp")``, not pytest's
``tmp_path``.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import attrs
import grpc

from pcc_plugin.sim._pb import deviceplugin_v1beta1_pb2 as pb
from pcc_plugin.sim.rules import (
    ALLOCATE,
    API_VERSION,
    DIAL_TIMEOUT,
    GET_DEVICE_PLUGIN_OPTIONS,
    GET_PREFERRED_ALLOCATION,
    HEALTHY,
    KUBELET_SOCKET,
    LIST_AND_WATCH,
    MAX_SOCKET_PATH_BYTES,
    PRE_START_CONTAINER,
    PRE_START_TIMEOUT,
    UNHEALTHY,
    KeyBy,
    is_extended_resource_name,
    remove_sockets,
)
from pcc_plugin.sim.state import (
    DialError,
    KubeletResource,
    Message,
    NoPluginError,
    PluginClient,
    PluginOptions,
    Registration,
    Simulator,
    serialize,
)

log = logging.getLogger(__name__)

_Response = TypeVar("_Response")


class SimKubelet(Simulator):
    """Serves ``<plugin_dir>/kubelet.sock`` and talks to the plugins that register there.

    ``key_by``: ``"endpoint"`` (kubelet 1.37 and later) keeps a client per socket: an older
    registration's stream of a resource may end without touching the newer one, and when the
    newest one's ends, a remaining endpoint takes over and nothing is marked unhealthy.
    ``"resource"`` (older kubelets) keeps one client per resource: it disconnects the newest
    client of a resource whenever an older stream of that resource ends, and when the newest
    one's ends, marks the resource unhealthy, leaving the older streams open and unheard.

    Every observation method is thread-safe; :meth:`wait_for` blocks until a predicate over them
    holds, woken on each state change.
    """

    def __init__(
        self,
        plugin_dir: Path,
        *,
        key_by: KeyBy = "endpoint",
    ) -> None:
        self.plugin_dir = Path(plugin_dir).absolute()
        self.socket_path = self.plugin_dir / KUBELET_SOCKET
        if len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH_BYTES:
            raise ValueError(
                f"{self.socket_path} is longer than the {MAX_SOCKET_PATH_BYTES} bytes a unix "
                "socket path may have; use a short directory such as one from "
                'tempfile.mkdtemp(prefix="pcc-", dir="/tmp")'
            )
        self.key_by = key_by
        # Kubelet's blocking dial; tests of failed dials shorten it.
        self.dial_timeout = DIAL_TIMEOUT
        super().__init__()
        self._server: Any = None
        self._executor: ThreadPoolExecutor | None = None
        # Bumped by every stop, so work begun for an earlier kubelet instance is discarded.
        self._generation = 0
        self._register_calls = 0
        # When this kubelet last began serving Registration (time.monotonic()).
        self.serving_since = 0.0
        self._registrations: list[Registration] = []
        self._events: list[str] = []
        self._resources: dict[str, KubeletResource] = {}
        self._clients: set[PluginClient] = set()
        self._pending_dials: set[Any] = set()
        self._planned_failures: collections.deque[str] = collections.deque()
        # Called with the plugin's socket while Register is in flight, before the dial back:
        # a test's way to be a tool that finds the socket at the worst moment.
        self.before_dial: Callable[[Path], None] | None = None
        # Called with each accepted registration, under the simulator's lock: how the command
        # tells `allocate` which endpoint a resource registered.
        self.on_registered: Callable[[Registration], None] | None = None

    # Lifecycle

    def start(self) -> None:
        """Make the directory (0750), delete its sockets, and serve Registration."""
        with self._changed:
            if self._server is not None:
                raise RuntimeError("the simulated kubelet is already running")
        if not self.plugin_dir.exists():
            self.plugin_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
            # mkdir's mode passes through the umask; kubelet's directory is 0750.
            self.plugin_dir.chmod(0o750)
        remove_sockets(self.plugin_dir)
        executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="sim-kubelet")
        register = grpc.unary_unary_rpc_method_handler(
            self._register,
            request_deserializer=pb.RegisterRequest.FromString,
            response_serializer=serialize,
        )
        server = grpc.server(
            executor,
            handlers=[
                grpc.method_handlers_generic_handler("v1beta1.Registration", {"Register": register})
            ],
        )
        server.add_insecure_port(f"unix:{self.socket_path}")
        server.start()
        with self._changed:
            self._server = server
            self._executor = executor
            self.serving_since = time.monotonic()
            self._record(f"kubelet serving Registration on {self.socket_path}")

    def stop(self) -> None:
        """Stop serving, close every connection to plugins (their streams end), remove kubelet.sock.

        Devices of every resource become Unhealthy, as for endpoints kubelet restores from its
        checkpoint: they stay so until their plugins register again.
        """
        with self._changed:
            server, executor = self._server, self._executor
            if server is None or executor is None:
                return
            self._server = self._executor = None
            self._generation += 1
            clients = list(self._clients)
            for client in clients:
                client.kubelet_stopping = True
                client.connected = False
            for dial in self._pending_dials:
                dial.cancel()
            for state in self._resources.values():
                state.devices = dict.fromkeys(state.devices, UNHEALTHY)
        server.stop(grace=0).wait()
        executor.shutdown(wait=False, cancel_futures=True)
        for client in clients:
            client.channel.close()
        for client in clients:
            if client.thread is not None:
                client.thread.join(timeout=5)
        self.socket_path.unlink(missing_ok=True)
        with self._changed:
            self._record("kubelet stopped")

    def crash(self) -> None:
        """Die as a killed kubelet does: every connection drops and kubelet.sock stays behind.

        Nothing listens on the socket left behind, so dialling it is refused. A later
        :meth:`start` is kubelet coming back: it deletes that socket with the others.
        """
        self.stop()
        # grpcio removed its socket on stop; a dead one takes its place, as after SIGKILL.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
            dead.bind(str(self.socket_path))
        with self._changed:
            self._record(f"kubelet crashed, leaving {self.socket_path} with nothing listening")

    @property
    def running(self) -> bool:
        with self._changed:
            return self._server is not None

    # Fault hooks

    def fail_next_registers(self, messages: Iterable[str]) -> None:
        """Fail the next Register calls with UNKNOWN and these messages, without dialling."""
        with self._changed:
            self._planned_failures.extend(messages)

    def drop_stream(self, resource: str) -> None:
        """End the active ListAndWatch stream of ``resource`` while the kubelet stays up.

        Kubelet knows that the stream is over before the plugin can: its end is taken into
        account here, before the plugin sees it and registers again.
        """
        with self._changed:
            client = self._active_client(resource)
            self._record(f"dropping the ListAndWatch stream of {resource}")
        self._stream_ended(client, "kubelet dropped it")
        client.list_and_watch.cancel()

    # Observation

    @property
    def register_calls(self) -> int:
        """Register calls received, including those still being answered."""
        with self._changed:
            return self._register_calls

    @property
    def registrations(self) -> list[Registration]:
        with self._changed:
            return list(self._registrations)

    @property
    def events(self) -> list[str]:
        """What happened, one plain line each, as also logged."""
        with self._changed:
            return list(self._events)

    def devices(self, resource: str) -> dict[str, str]:
        """The latest device list of ``resource``: device ID to health."""
        with self._changed:
            return dict(self._resource(resource).devices)

    def stream_open(self, resource: str) -> bool:
        """The active plugin of ``resource`` has sent a list and its stream has not ended."""
        with self._changed:
            active = self._resource(resource).active
            return active is not None and active.streaming

    def active_endpoint(self, resource: str) -> str | None:
        """The endpoint of the plugin kubelet uses for ``resource`` now, or None."""
        with self._changed:
            active = self._resource(resource).active
            return active.endpoint if active else None

    def messages(self, resource: str) -> int:
        """ListAndWatch messages received from the active plugins of ``resource``."""
        with self._changed:
            return self._resource(resource).messages

    # Calls to plugins, as kubelet makes them

    def allocate(
        self, resource: str, container_requests: list[list[str]], timeout: float = 5.0
    ) -> pb.AllocateResponse:
        """Allocate; kubelet itself always sends exactly one container request."""
        request = pb.AllocateRequest(
            container_requests=[
                pb.ContainerAllocateRequest(devices_ids=ids) for ids in container_requests
            ]
        )
        parse = pb.AllocateResponse.FromString
        response: pb.AllocateResponse = self._call(resource, ALLOCATE, request, parse, timeout)
        return response

    def get_preferred_allocation(
        self,
        resource: str,
        available: list[str],
        must_include: list[str],
        allocation_size: int,
        timeout: float = 5.0,
    ) -> pb.PreferredAllocationResponse:
        request = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available,
                    must_include_deviceIDs=must_include,
                    allocation_size=allocation_size,
                )
            ]
        )
        parse = pb.PreferredAllocationResponse.FromString
        response: pb.PreferredAllocationResponse = self._call(
            resource, GET_PREFERRED_ALLOCATION, request, parse, timeout
        )
        return response

    def pre_start_container(
        self, resource: str, device_ids: list[str], timeout: float = PRE_START_TIMEOUT
    ) -> pb.PreStartContainerResponse:
        request = pb.PreStartContainerRequest(devices_ids=device_ids)
        parse = pb.PreStartContainerResponse.FromString
        response: pb.PreStartContainerResponse = self._call(
            resource, PRE_START_CONTAINER, request, parse, timeout
        )
        return response

    def call_raw(
        self, resource: str, method_path: str, payload: bytes, timeout: float = 5.0
    ) -> tuple[grpc.StatusCode, str]:
        """Send ``payload`` as is to ``method_path`` of the active plugin of ``resource``;
        return the status code and its details."""
        try:
            self._call(resource, method_path, payload, bytes, timeout)
        except grpc.RpcError as rpc_error:
            return rpc_error.code(), rpc_error.details() or ""
        return grpc.StatusCode.OK, ""

    # Registration service

    def _register(self, request: pb.RegisterRequest, context: Any) -> pb.Empty:
        received_at = time.monotonic()
        with self._changed:
            self._register_calls += 1
            generation = self._generation
            planned_failure = self._planned_failures.popleft() if self._planned_failures else None
            self._changed.notify_all()
        error = planned_failure or self._validate(request)
        client: PluginClient | None = None
        options: PluginOptions | None = None
        if error is None:
            if self.before_dial is not None:
                self.before_dial(self.plugin_dir / request.endpoint)
            try:
                client, options = self._connect(request)
            except DialError as dial_error:
                error = str(dial_error)
        with self._changed:
            if error is None and generation != self._generation:
                error = "kubelet is shutting down"
            registration = Registration(
                version=request.version,
                endpoint=request.endpoint,
                resource_name=request.resource_name,
                accepted=error is None,
                error=error,
                options=options,
                received_at=received_at,
                answered_at=time.monotonic(),
                dialled_at=client.dialled_at if client is not None else None,
                options_at=client.options_at if client is not None else None,
            )
            self._registrations.append(registration)
            if error is not None:
                self._record(f"rejected Register of {request.resource_name!r}: {error}")
            else:
                self._record(
                    f"registered device plugin {request.resource_name} "
                    f"at endpoint {request.endpoint}"
                )
                if self.on_registered is not None:
                    self.on_registered(registration)
                assert client is not None
                self._attach(client, len(self._registrations) - 1)
        if error is not None:
            if client is not None:
                client.channel.close()
            # Kubelet returns plain Go errors, which reach the plugin as UNKNOWN.
            context.abort(grpc.StatusCode.UNKNOWN, error)
        return pb.Empty()

    def _validate(self, request: pb.RegisterRequest) -> str | None:
        if request.version != API_VERSION:
            return (
                f'requested API version "{request.version}" is not supported by kubelet. '
                f'Supported versions are ["{API_VERSION}"]'
            )
        if not is_extended_resource_name(request.resource_name):
            return f'the ResourceName "{request.resource_name}" is invalid'
        if (
            request.endpoint in ("", ".", "..")
            or "/" in request.endpoint
            or "\0" in request.endpoint
        ):
            return f'the endpoint "{request.endpoint}" is not a file name in {self.plugin_dir}'
        return None

    def _connect(self, request: pb.RegisterRequest) -> tuple[PluginClient, PluginOptions]:
        """Dial the plugin and read its options, as kubelet does before using a plugin.

        A wait-for-ready GetDevicePluginOptions is the blocking dial, so dial and options share
        one deadline. grpcio's channel_ready_future would leave a connectivity poller behind
        that makes closing the channel take up to 200 ms, and restarts slow with it.
        """
        socket_path = self.plugin_dir / request.endpoint
        dialled_at = time.monotonic()
        channel = grpc.insecure_channel(
            f"unix:{socket_path}", options=[("grpc.default_authority", "localhost")]
        )
        reply_future = channel.unary_unary(
            GET_DEVICE_PLUGIN_OPTIONS,
            request_serializer=serialize,
            response_deserializer=pb.DevicePluginOptions.FromString,
        ).future(pb.Empty(), timeout=self.dial_timeout, wait_for_ready=True)
        with self._changed:
            self._pending_dials.add(reply_future)
        try:
            reply = reply_future.result()
        except grpc.FutureCancelledError:
            channel.close()
            raise DialError("failed to dial device plugin: kubelet is shutting down") from None
        except grpc.RpcError as rpc_error:
            channel.close()
            if rpc_error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DialError(
                    f"failed to dial device plugin: {socket_path} did not answer "
                    f"within {self.dial_timeout} s"
                ) from None
            status = f"{rpc_error.code().name}: {rpc_error.details()}"
            raise DialError(f"failed to get device plugin options: {status}") from None
        finally:
            with self._changed:
                self._pending_dials.discard(reply_future)
        options_at = time.monotonic()
        options = PluginOptions(
            pre_start_required=reply.pre_start_required,
            get_preferred_allocation_available=reply.get_preferred_allocation_available,
        )
        client = PluginClient(
            request.resource_name, request.endpoint, channel, dialled_at, options_at
        )
        return client, options

    # ListAndWatch

    def _attach(self, client: PluginClient, registration: int) -> None:
        """Make ``client``, of registration number ``registration``, the active plugin of its
        resource and start its ListAndWatch stream."""
        client.registration = registration
        self._resources.setdefault(client.resource, KubeletResource()).active = client
        self._clients.add(client)
        client.list_and_watch = client.channel.unary_stream(
            LIST_AND_WATCH,
            request_serializer=serialize,
            response_deserializer=pb.ListAndWatchResponse.FromString,
        )(pb.Empty())
        client.thread = threading.Thread(
            target=self._watch,
            args=(client,),
            name=f"sim-kubelet-law-{client.endpoint}",
            daemon=True,
        )
        client.thread.start()
        self._changed.notify_all()

    def _watch(self, client: PluginClient) -> None:
        reason = "the plugin closed the stream"
        try:
            for response in client.list_and_watch:
                self._receive(client, response)
        except grpc.RpcError as rpc_error:
            reason = f"{rpc_error.code().name}: {rpc_error.details()}"
        # Kubelet closes its connection once the stream is over; it never redials.
        client.channel.close()
        self._stream_ended(client, reason)

    def _receive(self, client: PluginClient, response: pb.ListAndWatchResponse) -> None:
        received_at = time.monotonic()
        with self._changed:
            if not client.streaming:
                client.streaming = True
                self._registrations[client.registration] = attrs.evolve(
                    self._registrations[client.registration], first_list_at=received_at
                )
                self._record(
                    f"ListAndWatch stream opened for {client.resource} ({client.endpoint})"
                )
            client.devices = {device.ID: device.health for device in response.devices}
            state = self._resources[client.resource]
            if state.active is not client:
                self._record(f"ignored a device list from a replaced plugin of {client.resource}")
                return
            state.devices = dict(client.devices)
            state.messages += 1
            healthy = sum(health == HEALTHY for health in state.devices.values())
            self._record(
                f"received {len(state.devices)} devices for {client.resource} ({healthy} healthy)"
            )

    def _stream_ended(self, client: PluginClient, reason: str) -> None:
        newest_to_disconnect: PluginClient | None = None
        with self._changed:
            if client not in self._clients:
                return  # dropped by kubelet, and taken into account then
            client.streaming = False
            client.connected = False
            self._clients.discard(client)
            if client.kubelet_stopping:
                self._changed.notify_all()
                return
            self._record(
                f"ListAndWatch ended unexpectedly for device plugin {client.resource} "
                f"({client.endpoint}): {reason}"
            )
            state = self._resources[client.resource]
            newest = state.active
            remaining = [
                other
                for other in self._clients
                if other.resource == client.resource and other.connected and other.streaming
            ]
            if self.key_by == "endpoint" and newest is client and remaining:
                # Kubelet 1.37+: another endpoint of the resource is still there; it takes
                # over with its own latest list, and nothing is marked unhealthy.
                promoted = remaining[-1]
                state.active = promoted
                state.devices = dict(promoted.devices)
                self._record(
                    f"promoted {promoted.endpoint}, still connected, for {client.resource}"
                )
            elif newest is client or self.key_by == "resource":
                state.devices = dict.fromkeys(state.devices, UNHEALTHY)
            if (
                self.key_by == "resource"
                and newest is not None
                and newest is not client
                and newest.connected
            ):
                newest.connected = False
                newest_to_disconnect = newest
                self._record(
                    f"disconnecting {newest.endpoint}, the registered plugin of {client.resource}, "
                    "because an older stream of that resource ended"
                )
        if newest_to_disconnect is not None:
            newest_to_disconnect.channel.close()

    def _resource(self, resource: str) -> KubeletResource:
        """What kubelet keeps of ``resource``: nothing yet if no plugin registered it."""
        return self._resources.get(resource) or KubeletResource()

    def _active_client(self, resource: str) -> PluginClient:
        with self._changed:
            active = self._resource(resource).active
            if active is None or not active.connected:
                raise NoPluginError(f"no connected device plugin for {resource}")
            return active

    def _call(
        self,
        resource: str,
        method_path: str,
        request: Message | bytes,
        parse: Callable[[bytes], _Response],
        timeout: float,
    ) -> _Response:
        """A unary call to the active plugin of ``resource``; bytes are sent as they are."""
        method = self._active_client(resource).channel.unary_unary(
            method_path,
            request_serializer=None if isinstance(request, bytes) else serialize,
            response_deserializer=parse,
        )
        try:
            response: _Response = method(request, timeout=timeout)
        except ValueError as closed:
            # The stream ended and kubelet closed the channel between the lookup and the call.
            raise NoPluginError(f"the device plugin for {resource} just disconnected") from closed
        return response

    def _record(self, event: str) -> None:
        """Log an event and wake the waiters; the caller holds the lock."""
        self._events.append(event)
        log.info("%s", event)
        self._changed.notify_all()

    def _describe(self) -> str:
        resources = "; ".join(
            f"{name}: stream {'open' if self.stream_open(name) else 'closed'}, "
            f"{sum(h == HEALTHY for h in state.devices.values())}/{len(state.devices)} healthy, "
            f"{state.messages} messages"
            for name, state in self._resources.items()
        )
        return (
            f"running={self._server is not None}, {self._register_calls} Register calls, "
            f"resources: {resources or 'none'}; last events: {self._events[-5:]}"
        )
