"""Registering with kubelet, and noticing when kubelet stops listening to us.

Kubelet never redials a plugin and never reconnects a stream, so both are
our job: `Kubelet.register` retries until kubelet accepts (generations.Backoff),
and `reregister_when_stream_ends` restarts the generation when kubelet's
ListAndWatch stream ends, at once, however often (generations.py has the rules).
A kubelet that is stopping still listens for a moment after it ended the stream;
a Register it refuses then is retried, and the new kubelet.sock starts a
generation at once.

A kubelet restart is routine: while kubelet is unreachable, retries are
`--v=1` lines; only after `UNREACHABLE_GRACE` does an error line say so (then
at most once per `UNREACHABLE_REPEAT`), and one info line says when it is back.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Literal

import attrs
import trio

from pcc_plugin import grpc_clients
from pcc_plugin._proto import v1beta1 as api
from pcc_plugin.fs import Identity, identity, is_socket
from pcc_plugin.generations import Backoff, Outage
from pcc_plugin.grpc_server import Call, MethodSpec
from pcc_plugin.klog import V1
from pcc_plugin.plugin_dir import KUBELET_RESTARTED, KUBELET_SOCKET, accepts_connections
from pcc_plugin.state import ResourceState

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
# Kubelet dials back with a 10 s timeout inside Register; leave it room.
REGISTER_TIMEOUT = 15.0
UNREACHABLE_GRACE = 30.0
UNREACHABLE_REPEAT = 60.0
STREAM_ENDED = "kubelet's ListAndWatch stream ended"

Register = Callable[[Path, api.RegisterRequest, float], Awaitable[None]]


@attrs.define(eq=False)
class KubeletLink:
    """Which connection to our socket is kubelet's, and the end of its ListAndWatch stream.

    Kubelet dials the endpoint named in Register and calls GetDevicePluginOptions
    on that connection, inside the Register call (current kubelets) or right
    after it (older ones), then opens ListAndWatch on it. So kubelet's
    connection is the first to call GetDevicePluginOptions once Register was
    sent, one calling it while Register is in flight taking precedence, and
    kubelet's stream is the first ListAndWatch on that connection. A tool's
    stream, on a connection of its own, is never taken for kubelet's, whenever
    it is opened.
    """

    state: ResourceState
    ended: trio.Event = attrs.Factory(trio.Event)
    register: Literal["not sent", "in flight", "answered"] = "not sent"
    connection: object | None = None
    chosen_in_flight: bool = False
    stream_claimed: bool = False
    # The kubelet.sock the last Register went to, from the moment it is sent.
    kubelet: Identity | None = None

    def options_called(self, connection: object) -> None:
        if self.register == "not sent":
            return
        in_flight = self.register == "in flight"
        if self.connection is None or (in_flight and not self.chosen_in_flight):
            self.connection = connection
            self.chosen_in_flight = in_flight
            log.log(V1, "Kubelet dialled in on %s", connection)

    def stream_opened(self, connection: object) -> bool:
        """Whether this ListAndWatch stream is kubelet's."""
        is_kubelet = connection is self.connection and not self.stream_claimed
        self.stream_claimed |= is_kubelet
        log.log(V1, "ListAndWatch stream opened on %s%s",
                connection, " (kubelet's)" if is_kubelet else "")  # fmt: skip
        self.state.stream_opened(is_kubelet)
        return is_kubelet

    def stream_closed(self, is_kubelet: bool) -> None:
        self.state.stream_closed(is_kubelet)
        if is_kubelet:
            self.ended.set()

    def connection_closed(self, connection: object) -> None:
        # Kubelet closes its connection when it drops a plugin; before its stream
        # opened, that is the only sign.
        if connection is self.connection:
            self.ended.set()

    def tell_apart(self, methods: Mapping[str, MethodSpec], service: str) -> dict[str, MethodSpec]:
        """`methods`, the DevicePlugin service at `service`, with kubelet's calls told apart:
        who asks for the options, which ListAndWatch streams open and end."""
        options = methods[service + "GetDevicePluginOptions"].answer
        stream = methods[service + "ListAndWatch"].stream
        assert options is not None
        assert stream is not None

        def options_called(data: bytes, call: Call) -> bytes | Awaitable[bytes]:
            answer = options(data, call)
            self.options_called(call.connection)
            return answer

        async def watched(call: Call) -> None:
            is_kubelet = self.stream_opened(call.connection)
            try:
                await stream(call)
            finally:
                self.stream_closed(is_kubelet)

        return {
            **methods,
            service + "GetDevicePluginOptions": MethodSpec(options_called),
            service + "ListAndWatch": MethodSpec(stream=watched),
        }


@attrs.define(eq=False)
class Kubelet:
    """Kubelet's Registration service as one resource knows it across generations: the
    kubelet.sock it last registered with, and whether kubelet answers. `call` is the Register
    call (a fake kubelet's in unit tests)."""

    state: ResourceState
    call: Register = grpc_clients.register
    registered_with: Identity | None = None
    outage: Outage = attrs.Factory(
        lambda: Outage(
            log,
            quiet="Kubelet is not reachable yet, retrying: {problem}",
            loud="Kubelet has been unreachable for {seconds:.0f} s, retrying: {problem}",
            back="Kubelet is reachable again after {seconds:.0f} s",
            grace=UNREACHABLE_GRACE,
            repeat=UNREACHABLE_REPEAT,
        )
    )

    async def register(
        self, plugin_dir: Path, request: api.RegisterRequest, link: KubeletLink, cause: str
    ) -> None:
        """Register until kubelet accepts, logging each distinct refusal once.

        A registration is counted as a kubelet restart when this generation began because
        kubelet.sock was created anew, or, whatever began it (our socket deleted, the stream's
        end), when kubelet.sock is another than the last one.
        """
        backoff = Backoff()
        kubelet_socket = plugin_dir / KUBELET_SOCKET
        reported: set[str] = set()
        while True:
            if not is_socket(kubelet_socket):
                what = "is not a socket" if kubelet_socket.exists() else "does not exist"
                self.state.kubelet_awaited(kubelet_socket, what)
                log.info("Waiting for kubelet: %s %s yet", kubelet_socket, what)
                # The watcher restarts this generation when kubelet creates it.
                await trio.sleep_forever()
            log.log(V1, "Registering %s at %s with endpoint %s",
                    request.resource_name, kubelet_socket, request.endpoint)  # fmt: skip
            kubelet = link.kubelet = identity(kubelet_socket)
            link.register = "in flight"
            try:
                await self.call(kubelet_socket, request, REGISTER_TIMEOUT)
            except grpc_clients.RegisterFailed as exc:
                self.state.registration_refused(str(exc))
                if isinstance(exc, grpc_clients.Unreachable):
                    self.outage.failed(str(exc))
                else:
                    self.outage.over()
                    if str(exc) not in reported:
                        reported.add(str(exc))
                        log.error("Registration with kubelet failed, retrying: %s", exc)
                await trio.sleep(backoff.next_delay())
                continue
            finally:
                link.register = "answered"
            self.outage.over()
            log.info("Registered device plugin with Kubelet: resource %s, endpoint %s",
                     request.resource_name, request.endpoint)  # fmt: skip
            # The watcher saw kubelet.sock created (KUBELET_RESTARTED), or the socket differs
            # from the last one registered with: one restart either way, even when a quick
            # restart left a kubelet.sock with the old one's inode and change time.
            if self.registered_with is not None and (
                cause == KUBELET_RESTARTED or kubelet != self.registered_with
            ):
                self.state.kubelet_restarted()
                cause = KUBELET_RESTARTED
            self.registered_with = kubelet
            self.state.registered_with_kubelet(cause)
            return


async def reregister_when_stream_ends(
    plugin_dir: Path, link: KubeletLink, restart: Callable[[str], None]
) -> None:
    """Kubelet never redials: when its stream ends, registering again is our job.

    At once if kubelet listens: a new kubelet.sock is a kubelet restart (every
    millisecond before its first admissions counts), the same one dropped us
    (during a rollout every millisecond is a gap in allocatable). If kubelet.sock
    takes no connections, kubelet is restarting: the directory watcher restarts
    this generation when the new kubelet.sock appears.
    """
    await link.ended.wait()
    kubelet_socket = plugin_dir / KUBELET_SOCKET
    if not accepts_connections(kubelet_socket):
        what = "takes no connections" if kubelet_socket.exists() else "does not exist"
        log.info("Waiting for kubelet: its ListAndWatch stream ended and %s %s",
                 kubelet_socket, what)  # fmt: skip
        link.state.kubelet_awaited(kubelet_socket, what)
        await trio.sleep_forever()
    if identity(kubelet_socket) != link.kubelet:
        log.info("kubelet's ListAndWatch stream ended and %s is new: registering again",
                 kubelet_socket)  # fmt: skip
        restart(KUBELET_RESTARTED)
        return
    # A kubelet that is stopping ends the stream before it stops listening: routine.
    log.info("kubelet's ListAndWatch stream ended; registering again")
    restart(STREAM_ENDED)
