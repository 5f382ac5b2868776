"""The simulated kubelet's DRA side: plugin registration and the DRA node calls, on grpcio.

Like kubelet's plugin manager, it watches its plugins_registry directory (inotify, in a
thread) and registers the sockets already there at start: it dials each one, asks GetInfo
(1 s deadline), checks the answer as kubelet does (type DRAPlugin, a driver name, an
endpoint, a service it supports: the first of the plugin's list it knows), and says how it
went with NotifyRegistrationStatus. A socket removed drops its instance. As kubelet does since
1.34, it connects to each accepted instance's DRA socket at once and holds that connection,
idle, watching it (`connections`: whether it was up, each time that changed), a close being to
kubelet the driver gone; it is plain HTTP/2 (h2), which this module controls whole, and calls
open grpcio channels of their own. Calls go to the newest instance of a driver, with kubelet's
45 s deadline. At start it deletes the node's ResourceSlices from the API server, as kubelet
does.

Like a kubelet with ResourceHealthStatus on (1.36 and later), it opens the DRAResourceHealth
stream of each instance whose registration lists a version it knows (`health_services`, its
own preference first), keeps each device's last report (`device_health`: Unknown once a report
is older than its timeout), forgets all of a driver's reports when one of its streams ends, and
opens the stream again 5 s later, until the instance goes or the stream answers UNIMPLEMENTED.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import grpc
import h2.config
import h2.connection
import h2.events
import h2.exceptions
from asyncinotify import InitFlags, Inotify, Mask

from pcc_plugin.fs import connect_error
from pcc_plugin.inotify import pending_events
from pcc_plugin.sim._pb import (
    dra_health_v1_pb2,
    dra_health_v1alpha1_pb2,
    dra_v1_pb2,
    dra_v1beta1_pb2,
    pluginregistration_pb2,
)
from pcc_plugin.sim.apiserver import FakeApiServer
from pcc_plugin.sim.rules import CALL_TIMEOUT
from pcc_plugin.sim.state import Simulator, serialize

log = logging.getLogger(__name__)

GET_INFO = "/pluginregistration.Registration/GetInfo"
NOTIFY = "/pluginregistration.Registration/NotifyRegistrationStatus"
# Kubelet's registration deadlines.
GET_INFO_TIMEOUT = 1.0
NOTIFY_TIMEOUT = 5.0
# The services kubelet 1.37 speaks, as registrations name them, and their gRPC paths.
SERVICES = {
    "v1.DRAPlugin": ("/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/", dra_v1_pb2),
    "v1beta1.DRAPlugin": ("/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/", dra_v1beta1_pb2),
}
# The health services kubelet 1.37 knows, its preference first, and their stream's path.
HEALTH_SERVICES = {
    "v1.DRAResourceHealth": ("/v1.DRAResourceHealth/NodeWatchResources", dra_health_v1_pb2),
    "v1alpha1.DRAResourceHealth": (
        "/v1alpha1.DRAResourceHealth/NodeWatchResources",
        dra_health_v1alpha1_pb2,
    ),
}
# Kubelet opens a health stream again this long after one ended; without a timeout in a report
# it trusts it this long.
HEALTH_RETRY = 5.0
DEFAULT_HEALTH_TIMEOUT = 30.0


@attrs.frozen
class DraRegistration:
    """One registration kubelet accepted, or refused (`error`)."""

    socket: str
    driver: str
    endpoint: str
    service: str
    supported: tuple[str, ...]
    # Whether the endpoint took a connection when GetInfo was answered.
    endpoint_served: bool
    error: str | None
    # The health service this kubelet watches, or "" (none it knows is listed).
    health_service: str = ""


@attrs.frozen
class DeviceHealthReport:
    """A device's last health report, as kubelet keeps it."""

    health: str
    message: str
    timeout: float
    received: float


class SimDraKubelet(Simulator):
    """kubelet's plugin manager and DRA manager for one node."""

    def __init__(
        self,
        registry_dir: Path,
        node: str,
        api: FakeApiServer | None = None,
        services: tuple[str, ...] = tuple(SERVICES),
        health_services: tuple[str, ...] = tuple(HEALTH_SERVICES),
    ) -> None:
        """`services`: those this kubelet knows (1.34 to 1.37 know both; 1.32 and 1.33 only
        v1beta1); `health_services`: the health streams it opens (1.37 both, 1.36 v1alpha1,
        none with ResourceHealthStatus off)."""
        self.registry_dir = registry_dir
        self.services = services
        self.health_services = health_services
        self.node = node
        self.api = api
        super().__init__()
        self.registrations: list[DraRegistration] = []
        # Accepted instances by registration socket name, newest last.
        self._instances: dict[str, DraRegistration] = {}
        # By DRA socket: whether kubelet's connection to it is up, each time that changed.
        self.connections: dict[str, list[bool]] = {}
        # Each device's last health report, by (driver, pool, device); each health stream's
        # history by DRA socket ("open", or why it ended).
        self._health: dict[tuple[str, str, str], DeviceHealthReport] = {}
        self.health_streams: dict[str, list[str]] = {}
        # By DRA socket: kubelet's held connection to it and its health watcher, if any.
        self._links: dict[str, list[HeldConnection | HealthWatcher]] = {}
        self._thread: threading.Thread | None = None
        self._stop_write: int | None = None

    def start(self) -> None:
        """Start as kubelet does: delete the node's slices, register what is there, watch."""
        if self.api is not None:
            self.api.delete_slices(self.node)
        self.registry_dir.mkdir(parents=True, exist_ok=True)
        inotify = Inotify(flags=InitFlags.CLOEXEC | os.O_NONBLOCK)
        inotify.add_watch(
            self.registry_dir, Mask.CREATE | Mask.MOVED_TO | Mask.DELETE | Mask.MOVED_FROM
        )
        stop_read, self._stop_write = os.pipe()
        for path in sorted(self.registry_dir.iterdir()):
            self._appeared(path.name)
        self._thread = threading.Thread(
            target=self._watch, args=(inotify, stop_read), name="sim-dra-kubelet", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        if self._stop_write is None or self._thread is None:
            return
        os.write(self._stop_write, b"x")
        self._thread.join(timeout=5)
        os.close(self._stop_write)
        self._stop_write = None
        with self._changed:
            self._instances.clear()
            links, self._links = self._links, {}
            self._changed.notify_all()
        for link in itertools.chain.from_iterable(links.values()):
            link.close()

    def _describe(self) -> str:
        return f"registrations: {self.registrations[-3:]}"

    def instances(self, driver: str) -> list[DraRegistration]:
        with self._changed:
            return [one for one in self._instances.values() if one.driver == driver]

    def device_health(self, driver: str, pool: str, device: str) -> tuple[str, str]:
        """The health kubelet would put in a pod's status: its last report, or UNKNOWN (and
        no message) without one, or once it is older than its timeout."""
        with self._changed:
            report = self._health.get((driver, pool, device))
        if report is None or time.monotonic() - report.received > report.timeout:
            return "UNKNOWN", ""
        return report.health, report.message

    # Health streams (the watchers' threads call these)

    def _health_reported(self, driver: str, response: Any, pb: Any) -> None:
        now = time.monotonic()
        with self._changed:
            for device in response.devices:
                timeout = device.health_check_timeout_seconds or DEFAULT_HEALTH_TIMEOUT
                key = (driver, device.device.pool_name, device.device.device_name)
                self._health[key] = DeviceHealthReport(
                    pb.HealthStatus.Name(device.health), device.message, timeout, now
                )
            self._changed.notify_all()

    def _health_stream(self, driver: str, endpoint: str, what: str) -> None:
        """A stream opened ("open") or ended (why); an end forgets the driver's reports."""
        with self._changed:
            self.health_streams.setdefault(endpoint, []).append(what)
            if what != "open":
                for key in [key for key in self._health if key[0] == driver]:
                    del self._health[key]
            self._changed.notify_all()

    # The calls

    def prepare(
        self, driver: str, claims: list[tuple[str, str, str]], timeout: float = CALL_TIMEOUT
    ) -> Any:
        """NodePrepareResources of (namespace, name, uid) claims, to the newest instance."""
        return self._call(driver, "NodePrepareResources", claims, timeout)

    def unprepare(
        self, driver: str, claims: list[tuple[str, str, str]], timeout: float = CALL_TIMEOUT
    ) -> Any:
        return self._call(driver, "NodeUnprepareResources", claims, timeout)

    def call_raw(self, driver: str, method: str, payload: bytes) -> tuple[grpc.StatusCode, str]:
        """Send `payload` as is to the newest instance's `method`; the status and its details."""
        instance = self.instances(driver)[-1]
        path, _ = SERVICES[instance.service]
        with grpc.insecure_channel(f"unix:{instance.endpoint}") as channel:
            try:
                channel.unary_unary(path + method)(payload, timeout=CALL_TIMEOUT)
            except grpc.RpcError as failure:
                return failure.code(), failure.details() or ""
        return grpc.StatusCode.OK, ""

    def _call(
        self, driver: str, method: str, claims: list[tuple[str, str, str]], timeout: float
    ) -> Any:
        instances = self.instances(driver)
        if not instances:
            raise LookupError(f"DRA driver {driver} is not registered")
        instance = instances[-1]
        path, pb = SERVICES[instance.service]
        request_type = getattr(pb, f"{method}Request")
        response_type = getattr(pb, f"{method}Response")
        request = request_type(
            claims=[pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]
        )
        with grpc.insecure_channel(f"unix:{instance.endpoint}") as channel:
            call = channel.unary_unary(
                path + method,
                request_serializer=serialize,
                response_deserializer=response_type.FromString,
            )
            return call(request, timeout=timeout)

    # Registration

    def _watch(self, inotify: Inotify, stop_read: int) -> None:
        try:
            while True:
                ready, _, _ = select.select([inotify.fd, stop_read], [], [])
                if stop_read in ready:
                    return
                for event in pending_events(inotify):
                    if event.name is None:
                        continue
                    if event.mask & (Mask.CREATE | Mask.MOVED_TO):
                        self._appeared(str(event.name))
                    else:
                        self._vanished(str(event.name))
        finally:
            inotify.close()
            os.close(stop_read)

    def _appeared(self, name: str) -> None:
        path = self.registry_dir / name
        if name.startswith(".") or not path.is_socket():
            return
        registration = self._register(path)
        endpoint = registration.endpoint
        with self._changed:
            self.registrations.append(registration)
            self._changed.notify_all()
            if registration.error is not None:
                log.info("refused DRA plugin %s: %s", name, registration.error)
                return
            self._instances.pop(name, None)
            self._instances[name] = registration
            log.info("registered DRA driver %s at %s", registration.driver, endpoint)
            old = self._links.pop(endpoint, [])
        # The old watcher's stream ends before the new one opens.
        for link in old:
            link.close()
        links: list[HeldConnection | HealthWatcher] = [
            HeldConnection(endpoint, functools.partial(self._connection_changed, endpoint))
        ]
        if registration.health_service:
            links.append(HealthWatcher(self, registration))
        with self._changed:
            self._links[endpoint] = links

    def _vanished(self, name: str) -> None:
        with self._changed:
            instance = self._instances.pop(name, None)
            if instance is None:
                return
            log.info("deregistered the DRA plugin of %s", name)
            links = self._links.pop(instance.endpoint, [])
            self._changed.notify_all()
        for link in links:
            link.close()

    def _connection_changed(self, endpoint: str, up: bool) -> None:
        with self._changed:
            history = self.connections.setdefault(endpoint, [])
            if history[-1:] != [up]:
                history.append(up)
                self._changed.notify_all()

    def _register(self, path: Path) -> DraRegistration:
        with grpc.insecure_channel(f"unix:{path}") as channel:
            try:
                info = channel.unary_unary(
                    GET_INFO,
                    request_serializer=serialize,
                    response_deserializer=pluginregistration_pb2.PluginInfo.FromString,
                )(pluginregistration_pb2.InfoRequest(), timeout=GET_INFO_TIMEOUT)
            except grpc.RpcError as failure:
                return DraRegistration(
                    path.name, "", "", "", (), False, f"GetInfo: {failure.code().name}"
                )
            endpoint = info.endpoint or str(path)
            served = connect_error(Path(endpoint)) is None
            error = _validate(info, self.services)
            service = next((one for one in info.supported_versions if one in self.services), "")
            notify = channel.unary_unary(NOTIFY, request_serializer=serialize)
            try:
                notify(
                    pluginregistration_pb2.RegistrationStatus(
                        plugin_registered=error is None, error=error or ""
                    ),
                    timeout=NOTIFY_TIMEOUT,
                )
            except grpc.RpcError as failure:
                error = error or f"NotifyRegistrationStatus: {failure.code().name}"
        health = next((one for one in self.health_services if one in info.supported_versions), "")
        return DraRegistration(
            path.name, info.name, endpoint, service, tuple(info.supported_versions), served, error,
            health,
        )  # fmt: skip


class HealthWatcher:
    """Kubelet's DRAResourceHealth stream to one instance, in a thread: opened again
    HEALTH_RETRY after it ends, until stopped or answered UNIMPLEMENTED."""

    def __init__(self, kubelet: SimDraKubelet, registration: DraRegistration) -> None:
        self._kubelet = kubelet
        self._registration = registration
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None
        self._thread = threading.Thread(target=self._run, name="sim-dra-health", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stopped.set()
        with self._lock:
            if self._call is not None:
                self._call.cancel()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        kubelet, registration = self._kubelet, self._registration
        path, pb = HEALTH_SERVICES[registration.health_service]
        while not self._stopped.is_set():
            with grpc.insecure_channel(f"unix:{registration.endpoint}") as channel:
                watch = channel.unary_stream(
                    path,
                    request_serializer=serialize,
                    response_deserializer=pb.NodeWatchResourcesResponse.FromString,
                )
                with self._lock:
                    if self._stopped.is_set():
                        return
                    self._call = watch(pb.NodeWatchResourcesRequest())
                kubelet._health_stream(registration.driver, registration.endpoint, "open")
                why = "ended"
                try:
                    for response in self._call:
                        kubelet._health_reported(registration.driver, response, pb)
                except grpc.RpcError as failure:
                    why = f"{failure.code().name}: {failure.details()}"
                kubelet._health_stream(registration.driver, registration.endpoint, why)
                if why.startswith("UNIMPLEMENTED"):
                    return
            self._stopped.wait(HEALTH_RETRY)


class HeldConnection:
    """An HTTP/2 connection that says nothing once set up, as kubelet's to a DRA socket between
    claims. `changed(True)` once the server's SETTINGS arrive, `changed(False)` when the server
    closes it (or it cannot be made); closing it here says nothing."""

    def __init__(self, endpoint: str, changed: Callable[[bool], None]) -> None:
        self._changed = changed
        self._closing = False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._thread = threading.Thread(
            target=self._run, args=(endpoint,), name="sim-dra-held", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._closing = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=5)
        self._sock.close()

    def _run(self, endpoint: str) -> None:
        http2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        try:
            self._sock.connect(endpoint)
            http2.initiate_connection()
            self._sock.sendall(http2.data_to_send())
            while data := self._sock.recv(65536):
                events = http2.receive_data(data)
                self._sock.sendall(http2.data_to_send())  # acknowledgements
                if any(isinstance(event, h2.events.RemoteSettingsChanged) for event in events):
                    self._changed(True)
        except (OSError, h2.exceptions.ProtocolError):
            pass
        if not self._closing:
            self._changed(False)


def _validate(info: Any, services: tuple[str, ...]) -> str | None:
    if info.type != "DRAPlugin":
        return f"unknown plugin type {info.type!r}"
    if not info.name:
        return "the driver has no name"
    if info.endpoint and not info.endpoint.startswith("/"):
        return f"endpoint {info.endpoint!r} is not an absolute path"
    if not any(one in services for one in info.supported_versions):
        return f"none of the services {list(info.supported_versions)} is supported"
    return None
