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

import functools
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
    Backoff,
    KubeletStream,
    register_with_kubelet,
    reregister_when_stream_ends,
)
from pcc_plugin.resource import ResourceSpec
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

        cdi.remove_departed_specs(cdi_spec_dir, {spec.name for spec in specs})
    for spec in specs:
        log.info("Starting pcc-device-plugin: %s x%d", spec.name, spec.count)
    return [
        DevicePlugin(
            spec,
            config.host_root,
            ResourceStats(),
            pre_start_check=config.pre_start_check,
            cdi_spec_dir=cdi_spec_dir,
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

            await nursery.start(http_server.serve, config.metrics_bind_address, plugins)
        for plugin in plugins:
            nursery.start_soon(supervise_resource, config, plugin)


async def supervise_resource(config: Flags, plugin: DevicePlugin) -> None:
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


async def serve_resource(config: Flags, plugin: DevicePlugin) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(watch_health, plugin, config.host_root)
        nursery.start_soon(serve_kubelet, Path(config.device_plugin_path), plugin)


async def serve_kubelet(plugin_dir: Path, plugin: DevicePlugin) -> None:
    names = SocketNames(plugin.spec.socket_prefix)
    cause = "start"
    while True:
        plugin.stats.registered = False
        plugin.stats.waiting_for = f"waiting for {plugin_dir} to be created"
        await wait_for_directory(plugin_dir)
        cause = await serve_generation(plugin_dir, plugin, next(names), cause)
        log.log(V1, "Restarting the device plugin server: %s", cause)


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
            remove_stale_sockets(plugin_dir, plugin.spec.socket_prefix, keep=endpoint)
            await serve_socket(nursery, plugin, stream, plugin_dir / endpoint)
        except FileNotFoundError:
            restart(f"{plugin_dir} disappeared")
            return restart.reason or ""
        nursery.start_soon(register_with_kubelet, plugin_dir, request, plugin.stats, cause, stream)
        nursery.start_soon(reregister_when_stream_ends, stream, restart)
    return restart.reason or "cancelled"


async def serve_socket(
    nursery: trio.Nursery, plugin: DevicePlugin, stream: KubeletStream, path: Path
) -> None:
    try:
        await nursery.start(
            grpc_server.serve, plugin, functools.partial(stream.serve, plugin.feed), path
        )
    except PermissionError:
        raise FatalError(
            f"cannot create {path}: permission denied; run the plugin as root "
            "with --device-plugin-path mounted read-write"
        ) from None
