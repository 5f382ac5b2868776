"""Registering with kubelet, and noticing when kubelet stops listening to us.

Kubelet never redials a plugin and never reconnects a stream, so both are
our job: `register_with_kubelet` retries until kubelet accepts, and
`reregister_when_stream_ends` restarts the generation when kubelet's
ListAndWatch stream ends.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import trio

from pcc_plugin import grpc_clients
from pcc_plugin._proto import v1beta1 as api
from pcc_plugin.fs import identity, is_socket
from pcc_plugin.klog import V1
from pcc_plugin.plugin import DeviceFeed
from pcc_plugin.plugin_dir import KUBELET_SOCKET
from pcc_plugin.stats import ResourceStats

log = logging.getLogger(__name__)

API_VERSION = "v1beta1"
# Kubelet dials back with a 10 s timeout inside Register; leave it room.
REGISTER_TIMEOUT = 15.0

Register = Callable[[Path, api.RegisterRequest, float], Awaitable[None]]


@attrs.define
class Backoff:
    """Capped exponential backoff with jitter, so plugins do not retry in step."""

    first: float = 0.02
    cap: float = 5.0
    rng: random.Random = attrs.Factory(random.Random)
    attempt: int = 0

    def next_delay(self) -> float:
        ceiling = min(self.cap, self.first * 2.0**self.attempt)
        self.attempt += 1
        jitter: float = self.rng.uniform(0.5, 1.0)
        return ceiling * jitter


@attrs.define
class KubeletStream:
    """Kubelet's ListAndWatch stream: the first one opened after Register was sent.

    Kubelet learns the socket's name from Register and opens its stream right
    after; other streams come from tools (doctor, benchmarks) that found the
    socket in the directory, and their end means nothing.
    """

    stats: ResourceStats
    ended: trio.Event = attrs.Factory(trio.Event)
    register_sent: bool = False
    claimed: bool = False

    async def serve(self, feed: DeviceFeed, send: Callable[[bytes], Awaitable[None]]) -> None:
        is_kubelet = self.register_sent and not self.claimed
        self.claimed |= is_kubelet
        log.log(V1, "ListAndWatch stream opened%s", " (kubelet's)" if is_kubelet else "")
        self.stats.streams_open += 1
        self.stats.kubelet_stream_open |= is_kubelet
        try:
            await feed.stream(send)
        finally:
            self.stats.streams_open -= 1
            if is_kubelet:
                self.stats.kubelet_stream_open = False
                self.ended.set()


async def register_with_kubelet(
    plugin_dir: Path,
    request: api.RegisterRequest,
    stats: ResourceStats,
    cause: str,
    stream: KubeletStream,
    register: Register = grpc_clients.register,
    backoff: Backoff | None = None,
) -> None:
    """Register until kubelet accepts, logging each distinct failure once.

    A registration with another kubelet.sock than the last one is counted as
    a kubelet restart, whichever event (our socket deleted, kubelet.sock
    created, the stream's end) made this generation start.
    """
    backoff = backoff or Backoff()
    kubelet_socket = plugin_dir / KUBELET_SOCKET
    reported: set[str] = set()
    while True:
        if not is_socket(kubelet_socket):
            what = "is not a socket" if kubelet_socket.exists() else "does not exist"
            stats.waiting_for = f"waiting for kubelet: {kubelet_socket} {what}"
            log.info("Waiting for kubelet: %s %s yet", kubelet_socket, what)
            # The watcher restarts this generation when kubelet creates it.
            await trio.sleep_forever()
        log.log(V1, "Registering %s at %s with endpoint %s",
                request.resource_name, kubelet_socket, request.endpoint)  # fmt: skip
        kubelet = identity(kubelet_socket)
        stream.register_sent = True
        try:
            await register(kubelet_socket, request, REGISTER_TIMEOUT)
        except grpc_clients.RegisterFailed as exc:
            stats.waiting_for = f"registration failed: {exc}"
            if str(exc) not in reported:
                reported.add(str(exc))
                log.error("Registration with kubelet failed, retrying: %s", exc)
            await trio.sleep(backoff.next_delay())
            continue
        log.info("Registered device plugin with Kubelet: resource %s, endpoint %s",
                 request.resource_name, request.endpoint)  # fmt: skip
        if stats.kubelet is not None and kubelet != stats.kubelet:
            stats.kubelet_restarts += 1
            cause = "kubelet restarted"
        stats.kubelet = kubelet
        stats.registered = True
        stats.registrations[cause] += 1
        return


async def reregister_when_stream_ends(
    stream: KubeletStream, restart: Callable[[str], None]
) -> None:
    """Kubelet never redials: when its stream ends, registering again is our job."""
    await stream.ended.wait()
    delay = random.uniform(0.05, 0.25)
    log.warning("kubelet's ListAndWatch stream ended; registering again in %d ms", delay * 1000)
    await trio.sleep(delay)
    restart("kubelet's ListAndWatch stream ended")
