"""Registering with kubelet, and noticing when kubelet stops listening to us.

Kubelet never redials a plugin and never reconnects a stream, so both are
our job: `register_with_kubelet` retries until kubelet accepts, and
`reregister_when_stream_ends` restarts the generation when kubelet's
ListAndWatch stream ends.

A kubelet restart, or kubelet ending the stream while it still listens, is
answered at once, however often it comes: only the plugin's own faults (a
refused Register, a socket it cannot serve) wait, `RETRY_FIRST` doubling to
`RETRY_CAP`, and only when they come back to back. A kubelet that is
stopping still listens for a moment after it ended the stream; a Register it
refuses then is retried, and the new kubelet.sock starts a generation at once.

A kubelet restart is routine: while kubelet is unreachable, retries are
`--v=1` lines; only after `UNREACHABLE_GRACE` does an error line say so (then
at most once per `UNREACHABLE_REPEAT`), and one info line says when it is back.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Literal

import attrs
import trio

from pcc_plugin import grpc_clients
from pcc_plugin._proto import v1beta1 as api
from pcc_plugin.fs import Identity, identity, is_socket
from pcc_plugin.klog import V1
from pcc_plugin.plugin_dir import KUBELET_RESTARTED, KUBELET_SOCKET, accepts_connections
from pcc_plugin.state import ResourceState

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
# Kubelet dials back with a 10 s timeout inside Register; leave it room.
REGISTER_TIMEOUT = 15.0
UNREACHABLE_GRACE = 30.0
UNREACHABLE_REPEAT = 60.0
# Registered with kubelet's stream open this long: the faults before are forgotten.
STABLE_AFTER = 10.0
# The wait after a fault, doubling (with jitter) for each one back to back.
RETRY_FIRST = 0.02
RETRY_CAP = 5.0
STREAM_ENDED = "kubelet's ListAndWatch stream ended"

Register = Callable[[Path, api.RegisterRequest, float], Awaitable[None]]


@attrs.define
class Backoff:
    """Capped exponential backoff with jitter, so plugins do not retry in step.

    The first delay is 0 when `immediate_first`: an isolated fault is acted on
    at once, and only faults back to back wait. `reset` forgets them.
    """

    first: float = RETRY_FIRST
    cap: float = RETRY_CAP
    immediate_first: bool = False
    rng: random.Random = attrs.Factory(random.Random)
    attempt: int = 0

    def next_delay(self) -> float:
        attempt = self.attempt
        self.attempt += 1
        if self.immediate_first:
            if attempt == 0:
                return 0.0
            attempt -= 1
        ceiling = min(self.cap, self.first * 2.0**attempt)
        jitter: float = self.rng.uniform(0.5, 1.0)
        return ceiling * jitter

    def reset(self) -> None:
        self.attempt = 0


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
    stream_opened_event: trio.Event = attrs.Factory(trio.Event)
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
        if is_kubelet:
            self.stream_opened_event.set()
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


@attrs.define
class Reachability:
    """Whether kubelet answers, across generations: says so once it matters, not each retry."""

    down_since: float | None = None
    reported_at: float | None = None

    def unreachable(self, reason: str) -> None:
        now = trio.current_time()
        if self.down_since is None:
            self.down_since = now
        down_for = now - self.down_since
        if down_for < UNREACHABLE_GRACE:
            log.log(V1, "Kubelet is not reachable yet, retrying: %s", reason)
            return
        if self.reported_at is None or now - self.reported_at >= UNREACHABLE_REPEAT:
            self.reported_at = now
            log.error("Kubelet has been unreachable for %.0f s, retrying: %s", down_for, reason)

    def reachable(self) -> None:
        if self.down_since is not None and self.reported_at is not None:
            log.info(
                "Kubelet is reachable again after %.0f s", trio.current_time() - self.down_since
            )
        self.down_since = self.reported_at = None


async def register_with_kubelet(
    plugin_dir: Path,
    request: api.RegisterRequest,
    state: ResourceState,
    cause: str,
    link: KubeletLink,
    reachability: Reachability,
    register: Register = grpc_clients.register,
    backoff: Backoff | None = None,
) -> None:
    """Register until kubelet accepts, logging each distinct refusal once.

    A registration is counted as a kubelet restart when this generation began
    because kubelet.sock was created anew, or, whatever began it (our socket
    deleted, the stream's end), when kubelet.sock is another than the last one.
    """
    backoff = backoff or Backoff()
    kubelet_socket = plugin_dir / KUBELET_SOCKET
    reported: set[str] = set()
    while True:
        if not is_socket(kubelet_socket):
            what = "is not a socket" if kubelet_socket.exists() else "does not exist"
            state.waiting(f"waiting for kubelet: {kubelet_socket} {what}")
            log.info("Waiting for kubelet: %s %s yet", kubelet_socket, what)
            # The watcher restarts this generation when kubelet creates it.
            await trio.sleep_forever()
        log.log(V1, "Registering %s at %s with endpoint %s",
                request.resource_name, kubelet_socket, request.endpoint)  # fmt: skip
        kubelet = link.kubelet = identity(kubelet_socket)
        link.register = "in flight"
        try:
            await register(kubelet_socket, request, REGISTER_TIMEOUT)
        except grpc_clients.Unreachable as exc:
            state.waiting(f"registration failed: {exc}")
            reachability.unreachable(str(exc))
            await trio.sleep(backoff.next_delay())
            continue
        except grpc_clients.RegisterFailed as exc:
            reachability.reachable()
            state.waiting(f"registration failed: {exc}")
            if str(exc) not in reported:
                reported.add(str(exc))
                log.error("Registration with kubelet failed, retrying: %s", exc)
            await trio.sleep(backoff.next_delay())
            continue
        finally:
            link.register = "answered"
        reachability.reachable()
        log.info("Registered device plugin with Kubelet: resource %s, endpoint %s",
                 request.resource_name, request.endpoint)  # fmt: skip
        # The watcher saw kubelet.sock created (KUBELET_RESTARTED), or the socket differs from
        # the last one registered with: one restart either way, even when a quick restart left
        # a kubelet.sock with the old one's inode and change time.
        if state.kubelet is not None and (cause == KUBELET_RESTARTED or kubelet != state.kubelet):
            state.kubelet_restarted()
            cause = KUBELET_RESTARTED
        state.kubelet = kubelet
        state.registered_with_kubelet(cause)
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
        link.state.waiting(f"waiting for kubelet: {kubelet_socket} {what}")
        await trio.sleep_forever()
    if identity(kubelet_socket) != link.kubelet:
        log.info("kubelet's ListAndWatch stream ended and %s is new: registering again",
                 kubelet_socket)  # fmt: skip
        restart(KUBELET_RESTARTED)
        return
    # A kubelet that is stopping ends the stream before it stops listening: routine.
    log.info("kubelet's ListAndWatch stream ended; registering again")
    restart(STREAM_ENDED)


async def forget_faults_when_stable(link: KubeletLink, *backoffs: Backoff) -> None:
    """Once kubelet's stream has been open for STABLE_AFTER, earlier faults are forgotten."""
    await link.stream_opened_event.wait()
    await trio.sleep(STABLE_AFTER)
    if not link.ended.is_set():
        for backoff in backoffs:
            backoff.reset()
