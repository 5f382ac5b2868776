"""The daemon's nursery tree: every long-lived task is started here, or by a task named here.

    run(config, specs)
    └── bridge.asyncio_loop: the one asyncio loop, for grpclib
        └── root nursery
            ├── handle_signals   SIGTERM/SIGINT cancel `stop`; a second one exits at once
            └── stop scope
                ├── http_server.serve      /metrics, /livez, /readyz (with a bind address)
                └── supervise_resource     one per resource; restarts it alone if it fails
                    ├── watch_health       inotify on the device's and mounts' parent dirs
                    └── serve_kubelet      one generation after another:
                        ├── wait_for_directory   until kubelet has created its directory
                        └── generation nursery   cancelling it is how the plugin restarts
                            ├── watch_plugin_dir       kubelet.sock created, own socket gone
                            ├── grpc_server.serve      DevicePlugin on a fresh socket name
                            ├── register_with_kubelet  once serving; retries with backoff
                            └── reregister_when_stream_ends

A generation ends only by cancellation, through `Restart`, which records why.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import attrs
import trio

from pcc_plugin import bridge, grpc_server
from pcc_plugin._proto import v1beta1 as api
from pcc_plugin.errors import FatalError
from pcc_plugin.flags import Flags
from pcc_plugin.health import watch_health
from pcc_plugin.inotify import wait_for_directory
from pcc_plugin.klog import V1
from pcc_plugin.plugin import DevicePlugin
from pcc_plugin.plugin_dir import SocketNames, remove_stale_sockets, watch_plugin_dir
from pcc_plugin.registration import (
    API_VERSION,
    STREAM_ENDED,
    Backoff,
    KubeletLink,
    Reachability,
    forget_faults_when_stable,
    register_with_kubelet,
    reregister_when_stream_ends,
)
from pcc_plugin.resource import ResourceSpec
from pcc_plugin.service import DevicePluginService
from pcc_plugin.stats import ResourceStats

log = logging.getLogger(__name__)


@attrs.define
class Restart:
    """Cancels one generation and remembers the first reason given."""

    scope: trio.CancelScope
    reason: str | None = None

    def __call__(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self.scope.cancel()


async def run(config: Flags, specs: list[ResourceSpec]) -> None:
    plugins = make_plugins(config, specs)
    async with bridge.asyncio_loop(), trio.open_nursery() as root:
        stop = trio.CancelScope()
        await root.start(handle_signals, stop)
        with stop:
            await serve(config, plugins)
        # Stopped: the signal handler has nothing left to guard.
        root.cancel_scope.cancel()
    log.info("Stopped")


def make_plugins(config: Flags, specs: list[ResourceSpec]) -> list[DevicePlugin]:
    cdi_spec_dir = Path(config.cdi_spec_dir) if config.cdi else None
    if cdi_spec_dir is not None:
        from pcc_plugin import cdi

        cdi.remove_departed_specs(cdi_spec_dir, {spec.name for spec in specs}, config.instance_name)
    for spec in specs:
        log.info("Starting pcc-device-plugin: %s x%d", spec.name, spec.count)
    return [
        DevicePlugin(
            spec,
            config.host_root,
            ResourceStats(),
            pre_start_check=config.pre_start_check,
            cdi_spec_dir=cdi_spec_dir,
            instance_name=config.instance_name,
        )
        for spec in specs
    ]


async def handle_signals(
    stop: trio.CancelScope, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """The first SIGTERM or SIGINT stops the daemon; a second one during shutdown exits now."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        async for signum in signals:
            name = signal.Signals(signum).name
            if stop.cancel_called:
                log.warning("Received %s again, exiting now", name)
                os._exit(128 + signum)
            log.info("Received %s, shutting down", name)
            stop.cancel()


async def serve(config: Flags, plugins: list[DevicePlugin]) -> None:
    async with trio.open_nursery() as nursery:
        if config.metrics_bind_address:
            # Imported only when wanted: it costs memory at every start.
            from pcc_plugin import http_server

            bound = await nursery.start(http_server.serve, config.metrics_bind_address, plugins)
            for address, port in bound:
                log.info("Serving /metrics, /livez and /readyz on %s port %d", address, port)
        for plugin in plugins:
            nursery.start_soon(supervise_resource, config, plugin)


async def supervise_resource(config: Flags, plugin: DevicePlugin) -> None:
    """Serve one resource; if it fails, restart it alone so the others keep serving.

    Only a bug gets here (faults of the node are handled where they happen):
    it is logged with its traceback. The backoff forgets once the resource
    has served kubelet for a while (`registration.STABLE_AFTER`).
    """
    backoff = Backoff(first=1.0, cap=60.0)
    while True:
        try:
            await serve_resource(config, plugin, backoff)
        except Exception as exc:
            fatal, _ = exc.split(FatalError) if isinstance(exc, ExceptionGroup) else (None, None)
            if fatal is not None or isinstance(exc, FatalError):
                raise
            delay = backoff.next_delay()
            log.exception("%s failed; restarting it in %.1f s", plugin.spec.name, delay)
            await trio.sleep(delay)


async def serve_resource(config: Flags, plugin: DevicePlugin, backoff: Backoff) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(watch_health, plugin, config.host_root)
        nursery.start_soon(serve_kubelet, Path(config.device_plugin_path), plugin, backoff)


@attrs.frozen
class Ending:
    """Why a generation ended; after a fault the next one may have to wait."""

    reason: str
    fault: bool = False


async def serve_kubelet(plugin_dir: Path, plugin: DevicePlugin, resource_backoff: Backoff) -> None:
    """One generation after another. Faults back to back wait, an isolated one does not."""
    names = SocketNames(plugin.spec.socket_prefix)
    restarts = Backoff(first=0.02, cap=5.0, immediate_first=True)
    reachability = Reachability()
    cause = "start"
    while True:
        plugin.stats.registered = False
        plugin.stats.waiting_for = f"waiting for {plugin_dir} to be created"
        await wait_for_directory(plugin_dir)
        plugin.stats.generation += 1
        ending = await serve_generation(
            plugin_dir, plugin, next(names), cause, reachability, (restarts, resource_backoff)
        )
        plugin.stats.last_restart_reason = ending.reason
        log.log(V1, "Restarting the device plugin server: %s", ending.reason)
        cause = ending.reason
        if ending.fault:
            await trio.sleep(restarts.next_delay())


async def serve_generation(
    plugin_dir: Path,
    plugin: DevicePlugin,
    endpoint: str,
    cause: str,
    reachability: Reachability,
    backoffs: tuple[Backoff, ...],
) -> Ending:
    """Serve on a fresh socket and register, until something cancels; say why it ended."""
    request = api.RegisterRequest(
        version=API_VERSION,
        endpoint=endpoint,
        resource_name=plugin.spec.name,
        options=plugin.options(),
    )
    # serve_kubelet has marked the resource not registered before this generation.
    plugin.stats.waiting_for = "registering with kubelet"
    link = KubeletLink(plugin.stats)
    service = DevicePluginService(plugin, link)
    server = grpc_server.Server(service.methods(), service.on_error, link.connection_closed)
    path = plugin_dir / endpoint
    async with trio.open_nursery() as nursery:
        restart = Restart(nursery.cancel_scope)
        try:
            remove_stale_sockets(plugin_dir, plugin.spec.socket_prefix, keep=endpoint)
            listener, own = grpc_server.bind(path)
        except OSError as exc:
            return serving_failed(plugin, path, exc)
        # grpc_server.serve owns the listener from here, and closes it however it ends.
        await nursery.start(grpc_server.serve, server, listener, path, own)
        await nursery.start(watch_plugin_dir, plugin_dir, endpoint, own, restart)
        plugin.stats.serving_problem = None
        nursery.start_soon(
            register_with_kubelet, plugin_dir, request, plugin.stats, cause, link, reachability
        )
        nursery.start_soon(reregister_when_stream_ends, plugin_dir, link, restart)
        nursery.start_soon(forget_faults_when_stable, link, *backoffs)
    reason = restart.reason or "cancelled"
    return Ending(reason, fault=reason == STREAM_ENDED)


def serving_failed(plugin: DevicePlugin, path: Path, error: OSError) -> Ending:
    """One line per distinct problem, however often it is retried."""
    if isinstance(error, FileNotFoundError | NotADirectoryError) and not path.parent.is_dir():
        return Ending(f"{path.parent} disappeared")
    problem = f"cannot serve on {path}: [Errno {error.errno}] {error.strerror}"
    if plugin.stats.serving_problem != problem:
        plugin.stats.serving_problem = problem
        log.error("%s; retrying", problem)
    plugin.stats.waiting_for = problem
    return Ending(problem, fault=True)
