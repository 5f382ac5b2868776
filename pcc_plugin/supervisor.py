"""The daemon's nursery tree. Every long-lived task starts here.

    run(config, specs)
    └── asyncio loop for grpclib (bridge.asyncio_loop), one for the process
        └── root nursery
            ├── signals: the first SIGTERM/SIGINT cancels `work`; a second exits at once
            └── work
                ├── metrics.serve        /metrics, /livez, /readyz (when a bind address is set)
                └── supervise_resource   one per resource; restarts it alone if it fails
                    ├── watch_health     inotify on the device's and mounts' parent directories
                    └── serve_kubelet    one generation after another:
                        ├── wait_for_directory (until kubelet has created the socket dir)
                        └── generation nursery; cancelling it is how the plugin restarts
                            ├── watch_plugin_dir       kubelet.sock created, own socket/dir removed
                            ├── bridge.serve           DevicePlugin on a socket with a fresh name
                            ├── register_with_kubelet  only once serving; retries with backoff
                            └── reregister_when_stream_ends

A generation ends only by cancellation, through `Restart`, which records why.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import random
import secrets
import signal
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import trio

from pcc_plugin import bridge
from pcc_plugin._proto import v1beta1 as api
from pcc_plugin.config import KUBELET_SOCKET, Config
from pcc_plugin.devices import DeviceFeed, DevicePlugin
from pcc_plugin.health import watch_health
from pcc_plugin.klog import V1
from pcc_plugin.resources import ResourceSpec
from pcc_plugin.stats import ResourceStats
from pcc_plugin.watch import (
    FatalError,
    connect_error,
    is_socket,
    wait_for_directory,
    watch_plugin_dir,
)

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
class Restart:
    """Cancels one generation and remembers the first reason given."""

    scope: trio.CancelScope
    reason: str | None = None

    def __call__(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self.scope.cancel()


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


class SocketNames:
    """Fresh socket names, `<prefix>-<pid>-<token>-<n>.sock`.

    Pods of a DaemonSet often share a PID (1) across a rolling update; the
    random token keeps two instances from ever choosing the same name.
    """

    def __init__(self, prefix: str) -> None:
        self._stem = f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"
        self._counter = itertools.count()

    def __next__(self) -> str:
        return f"{self._stem}-{next(self._counter)}.sock"


def accepts_connections(path: Path) -> bool:
    # Anything but a refusal or a vanished file: assume alive and keep it.
    return not isinstance(connect_error(path), ConnectionRefusedError | FileNotFoundError)


def remove_stale_sockets(plugin_dir: Path, spec: ResourceSpec, keep: str) -> None:
    """Remove sockets of this resource's naming that nothing serves any more."""
    for entry in os.scandir(plugin_dir):
        if entry.name == keep or not spec.is_own_socket(entry.name):
            continue
        path = plugin_dir / entry.name
        if not stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode):
            continue
        if accepts_connections(path):
            log.log(V1, "Leaving %s: another instance serves it", path)
            continue
        try:
            os.unlink(path)
        except FileNotFoundError:
            continue
        log.info("Removed stale socket %s", path)


def socket_identity(path: Path) -> tuple[int, int, int] | None:
    """Tells one kubelet.sock from the next, even if the kernel reuses the inode number."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    return status.st_dev, status.st_ino, status.st_ctime_ns


async def register_with_kubelet(
    plugin_dir: Path,
    request: api.RegisterRequest,
    stats: ResourceStats,
    cause: str,
    stream: KubeletStream,
    register: Register = bridge.register,
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
        kubelet = socket_identity(kubelet_socket)
        stream.register_sent = True
        try:
            await register(kubelet_socket, request, REGISTER_TIMEOUT)
        except bridge.RegisterFailed as exc:
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


async def reregister_when_stream_ends(stream: KubeletStream, restart: Restart) -> None:
    """Kubelet never redials: when its stream ends, registering again is our job."""
    await stream.ended.wait()
    delay = random.uniform(0.05, 0.25)
    log.warning("kubelet's ListAndWatch stream ended; registering again in %d ms", delay * 1000)
    await trio.sleep(delay)
    restart("kubelet's ListAndWatch stream ended")


async def serve_socket(
    nursery: trio.Nursery, plugin: DevicePlugin, stream: KubeletStream, path: Path
) -> None:
    try:
        await nursery.start(
            bridge.serve, plugin, functools.partial(stream.serve, plugin.feed), path
        )
    except PermissionError:
        raise FatalError(
            f"cannot create {path}: permission denied; run the plugin as root "
            "with --device-plugin-path mounted read-write"
        ) from None


async def serve_generation(
    plugin_dir: Path, plugin: DevicePlugin, endpoint: str, cause: str
) -> str:
    """Serve on a fresh socket and register, until something cancels; return why."""
    request = api.RegisterRequest(
        version=API_VERSION,
        endpoint=endpoint,
        resource_name=plugin.spec.name,
        options=plugin.options(),
    )
    # serve_kubelet has marked the resource not registered before this generation.
    plugin.stats.waiting_for = "registering with kubelet"
    stream = KubeletStream(plugin.stats)
    async with trio.open_nursery() as nursery:
        restart = Restart(nursery.cancel_scope)
        await nursery.start(watch_plugin_dir, plugin_dir, endpoint, restart)
        try:
            remove_stale_sockets(plugin_dir, plugin.spec, keep=endpoint)
            await serve_socket(nursery, plugin, stream, plugin_dir / endpoint)
        except FileNotFoundError:
            restart(f"{plugin_dir} disappeared")
            return restart.reason or ""
        nursery.start_soon(register_with_kubelet, plugin_dir, request, plugin.stats, cause, stream)
        nursery.start_soon(reregister_when_stream_ends, stream, restart)
    return restart.reason or "cancelled"


async def serve_kubelet(plugin_dir: Path, plugin: DevicePlugin) -> None:
    names = SocketNames(plugin.spec.socket_prefix)
    cause = "start"
    while True:
        plugin.stats.registered = False
        plugin.stats.waiting_for = f"waiting for {plugin_dir} to be created"
        await wait_for_directory(plugin_dir)
        cause = await serve_generation(plugin_dir, plugin, next(names), cause)
        log.log(V1, "Restarting the device plugin server: %s", cause)


async def serve_resource(config: Config, plugin: DevicePlugin) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(watch_health, plugin, config.host_root)
        nursery.start_soon(serve_kubelet, Path(config.device_plugin_path), plugin)


async def supervise_resource(config: Config, plugin: DevicePlugin) -> None:
    """Serve one resource; if it fails, restart it alone so the others keep serving."""
    backoff = Backoff(first=1.0, cap=60.0)
    while True:
        try:
            await serve_resource(config, plugin)
        except Exception as exc:
            fatal, _ = exc.split(FatalError) if isinstance(exc, ExceptionGroup) else (None, None)
            if fatal is not None or isinstance(exc, FatalError):
                raise
            delay = backoff.next_delay()
            log.exception("%s failed; restarting it in %.1f s", plugin.spec.name, delay)
            await trio.sleep(delay)


async def run(config: Config, specs: list[ResourceSpec]) -> None:
    cdi_spec_dir = Path(config.cdi_spec_dir) if config.cdi else None
    if cdi_spec_dir is not None:
        from pcc_plugin import cdi

        cdi.remove_departed_specs(cdi_spec_dir, {spec.name for spec in specs})
    plugins = [
        DevicePlugin(
            spec,
            config.host_root,
            ResourceStats(),
            pre_start_check=config.pre_start_check,
            cdi_spec_dir=cdi_spec_dir,
        )
        for spec in specs
    ]
    for spec in specs:
        log.info("Starting pcc-device-plugin: %s x%d", spec.name, spec.count)
    async with bridge.asyncio_loop():
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as root:
                work = trio.CancelScope()

                async def serve_until_stopped() -> None:
                    with work:
                        async with trio.open_nursery() as nursery:
                            if config.metrics_bind_address:
                                # Imported only when wanted: it costs memory at every start.
                                from pcc_plugin import metrics

                                await nursery.start(
                                    metrics.serve, config.metrics_bind_address, plugins
                                )
                            for plugin in plugins:
                                nursery.start_soon(supervise_resource, config, plugin)
                    root.cancel_scope.cancel()

                root.start_soon(serve_until_stopped)
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if work.cancel_called:
                        log.warning("Received %s again, exiting now", name)
                        os._exit(128 + signum)
                    log.info("Received %s, shutting down", name)
                    work.cancel()
    log.info("Stopped")
