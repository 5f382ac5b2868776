"""The daemon's nursery tree, drawn here and only here: every task of the process.

    run                              bridge.asyncio_loop (grpclib's asyncio loop, one per process)
    └── root nursery
        ├── handle_signals           TERM/INT/QUIT stop; HUP reloads; USR1 logs this tree
        └── stop scope
            ├── http_server.serve    /metrics, /livez, /readyz (with a bind address)
            │   └── trio.serve_listeners → HttpServer.handle, one per connection
            ├── Resources.serve      the configuration; applies reloads
            │   └── supervise_resource, one per resource, in a cancel scope of its own
            │       ├── watch_health           inotify on the device's and mounts' parents
            │       └── serve_kubelet          one generation after another (one inotify)
            │           ├── wait_for_directory until kubelet has created it
            │           └── generation nursery: cancelling it is how the plugin restarts
            │               ├── grpc_server.serve          the socket, a fresh name each time
            │               │   └── trio.serve_listeners → Server.serve_connection, one per
            │               │       connection (below)
            │               ├── watch_plugin_dir           kubelet.sock created, own socket gone
            │               ├── follow, one per newer instance of the resource (rollouts on
            │               │   older kubelets), started when watch_plugin_dir sees its socket
            │               ├── register_with_kubelet      once serving; retries with backoff
            │               ├── reregister_when_stream_ends
            │               └── forget_faults_when_stable
            ├── watch_config_file    with --config: the file, or the ConfigMap's ..data swap
            └── Resources.serve_dra  --mode=dra instead of Resources.serve (pcc_plugin/dra)
                └── supervise_resource → dra.driver.serve_once
                    ├── watch_health
                    ├── slices.publish            the node's ResourceSlices: list, write, watch
                    └── serve_kubelet             one generation of sockets after another
                        └── generation nursery
                            ├── grpc_server.serve  the DRA socket, then
                            ├── grpc_server.serve  the registration socket kubelet dials
                            └── watch_sockets      either gone: serve both again

A connection's calls run as asyncio tasks that grpclib's protocol starts; the
connection's trio task owns them: on its way out it closes the connection,
which cancels them, and waits for them (grpc_server.TEARDOWN_GRACE at most).
So when a generation's nursery is cancelled, nothing of it outlives it:
tests/test_grpc_server.py checks that no call's task is left.

A generation ends only by cancellation, through `Restart`, which records why.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import trio
from asyncinotify import Inotify

from pcc_plugin import bridge, grpc_server
from pcc_plugin._proto import v1beta1 as api
from pcc_plugin.configuration import ConfigError, Served, read, watch_config_file
from pcc_plugin.errors import FatalError
from pcc_plugin.flags import DEFAULT_MODE, Flags
from pcc_plugin.health import watch_health
from pcc_plugin.inotify import open_inotify, wait_for_directory
from pcc_plugin.klog import V1
from pcc_plugin.plugin import DevicePlugin
from pcc_plugin.plugin_dir import SocketNames, own_sockets, remove_stale_sockets, watch_plugin_dir
from pcc_plugin.registration import (
    API_VERSION,
    Backoff,
    KubeletLink,
    Reachability,
    forget_faults_when_stable,
    register_with_kubelet,
    reregister_when_stream_ends,
)
from pcc_plugin.resource import ResourceSpec
from pcc_plugin.rollout import Followers
from pcc_plugin.service import DevicePluginService
from pcc_plugin.state import DaemonState, ResourceState

log = logging.getLogger(__name__)

# A resource whose serving failed with a bug waits this long before it is served again,
# doubling up to the cap; the other resources go on meanwhile.
BUG_RESTART_FIRST = 1.0
BUG_RESTART_CAP = 60.0


@attrs.define
class Restart:
    """Cancels one generation and remembers the first reason given."""

    scope: trio.CancelScope
    reason: str | None = None

    def __call__(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self.scope.cancel()


async def run(config: Flags, served: Served) -> None:
    path = Path(config.config) if config.config else None
    daemon = DaemonState(served.specs, path, served.digest)
    reloads, reload_requests = trio.open_memory_channel[str](1)
    resources = Resources(config, daemon)
    async with bridge.asyncio_loop(), trio.open_nursery() as root:
        stop = trio.CancelScope()
        await root.start(handle_signals, stop, reloads, resources)
        with stop:
            await serve(config, served.mode, resources, reloads, reload_requests)
        # Stopped: the signal handler has nothing left to guard.
        root.cancel_scope.cancel()
    log.info("Stopped")


async def handle_signals(
    stop: trio.CancelScope,
    reloads: trio.MemorySendChannel[str],
    resources: Resources,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """SIGTERM, SIGINT and SIGQUIT stop the daemon (a second one during shutdown exits now);
    SIGHUP reloads the configuration; SIGUSR1 writes the task tree and the state to the log."""
    stopping = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
    with trio.open_signal_receiver(*stopping, signal.SIGHUP, signal.SIGUSR1) as signals:
        task_status.started()
        async for signum in signals:
            name = signal.Signals(signum).name
            if signum == signal.SIGHUP:
                log.info("Received SIGHUP, reloading the configuration")
                with contextlib.suppress(trio.WouldBlock):
                    reloads.send_nowait("SIGHUP")
            elif signum == signal.SIGUSR1:
                for line in resources.describe():
                    log.info("%s", line)
            elif stop.cancel_called:
                log.warning("Received %s again, exiting now", name)
                os._exit(128 + signum)
            else:
                log.info("Received %s, shutting down", name)
                stop.cancel()


async def serve(
    config: Flags,
    mode: str,
    resources: Resources,
    reloads: trio.MemorySendChannel[str],
    reload_requests: trio.MemoryReceiveChannel[str],
) -> None:
    async with trio.open_nursery() as nursery:
        if config.metrics_bind_address:
            # Imported only when wanted: it costs memory at every start.
            from pcc_plugin import http_server

            bound = await nursery.start(
                http_server.serve, config.metrics_bind_address, resources.daemon
            )
            for address, port in bound:
                log.info("Serving /metrics, /livez and /readyz on %s port %d", address, port)
        if mode == "dra":
            nursery.start_soon(resources.serve_dra, reload_requests)
            return
        await nursery.start(resources.serve, reload_requests)
        if config.config:
            await nursery.start(watch_config_file, Path(config.config), reloads)


class Resources:
    """The resources being served, each in a cancel scope of its own, changed by reloads."""

    def __init__(self, config: Flags, daemon: DaemonState) -> None:
        self.config = config
        self.daemon = daemon
        self._running: dict[str, tuple[DevicePlugin, trio.CancelScope]] = {}
        self._cdi_spec_dir = Path(config.cdi_spec_dir) if config.cdi else None

    async def serve(
        self,
        reload_requests: trio.MemoryReceiveChannel[str],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve every resource; apply a new configuration on each reload request."""
        async with trio.open_nursery() as nursery:
            self._remove_departed_cdi_specs()
            for spec in self.daemon.specs:
                self._start(nursery, spec)
            task_status.started()
            async for reason in reload_requests:
                self._reload(nursery, reason)

    async def serve_dra(self, reload_requests: trio.MemoryReceiveChannel[str]) -> None:
        """The DRA mode: its one resource as a DRA driver (pcc_plugin/dra), read at start."""
        from pcc_plugin.dra import driver

        (spec,) = self.daemon.specs
        log.info("Starting pcc-device-plugin as DRA driver %s: %s x%d on node %s",
                 self.config.driver_name, spec.name, spec.count, self.config.node_name)  # fmt: skip
        plugin = DevicePlugin(
            spec, self.config.host_root, ResourceState(spec.name, needs_stream=False)
        )
        self.daemon.resources.append(plugin.state)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(supervise_resource, self.config, plugin, driver.serve_once)
            async for reason in reload_requests:
                log.info("Nothing to reload (%s): --mode=dra reads its configuration at start",
                         reason)  # fmt: skip

    def _start(self, nursery: trio.Nursery, spec: ResourceSpec) -> None:
        log.info("Starting pcc-device-plugin: %s x%d", spec.name, spec.count)
        plugin = DevicePlugin(
            spec,
            self.config.host_root,
            ResourceState(spec.name),
            pre_start_check=self.config.pre_start_check,
            cdi_spec_dir=self._cdi_spec_dir,
            instance_name=self.config.instance_name,
        )
        scope = trio.CancelScope()
        self._running[spec.name] = (plugin, scope)
        self.daemon.resources.append(plugin.state)
        nursery.start_soon(self._run, plugin, scope, name=f"supervise_resource {spec.name}")

    async def _run(self, plugin: DevicePlugin, scope: trio.CancelScope) -> None:
        try:
            with scope:
                await supervise_resource(self.config, plugin, serve_resource)
        finally:
            self.daemon.resources.remove(plugin.state)

    def _reload(self, nursery: trio.Nursery, reason: str) -> None:
        daemon = self.daemon
        if daemon.path is None:
            log.info("Nothing to reload (%s): the resources come from flags, not --config",
                     reason)  # fmt: skip
            return
        try:
            served = read(self.config)
        except ConfigError as exc:
            daemon.reload_refused()
            log.error("Configuration not reloaded, the running one stays: %s", exc)
            return
        if served.mode != DEFAULT_MODE:
            daemon.reload_refused()
            log.error("Configuration not reloaded, the running one stays: %s: mode %s needs a "
                      "restart of the daemon", daemon.path, served.mode)  # fmt: skip
            return
        if served.digest == daemon.digest:
            daemon.reload_unchanged()
            log.log(V1, "Configuration unchanged (%s)", reason)
            return
        old = {spec.name: spec for spec in daemon.specs}
        new = {spec.name: spec for spec in served.specs}
        for name, spec in old.items():
            if new.get(name) != spec:
                log.info("Stopping %s: %s", name, "changed" if name in new else "removed")
                self._running.pop(name)[1].cancel()
        for name, spec in new.items():
            if old.get(name) != spec:
                self._start(nursery, spec)
        daemon.reload_applied(served.specs, served.digest)
        self._remove_departed_cdi_specs()
        unchanged = sorted(name for name in new if old.get(name) == new[name])
        log.info("Configuration %d applied from %s (%s); unchanged, still serving: %s",
                 daemon.generation, daemon.path, reason,
                 ", ".join(unchanged) or "none")  # fmt: skip

    def _remove_departed_cdi_specs(self) -> None:
        if self._cdi_spec_dir is not None:
            from pcc_plugin import cdi

            names = {spec.name for spec in self.daemon.specs}
            cdi.remove_departed_specs(self._cdi_spec_dir, names, self.config.instance_name)

    def describe(self) -> list[str]:
        """The state and the task tree, as SIGUSR1 writes them to the log."""
        return [
            f"State on {signal.SIGUSR1.name}: the configuration, each resource with its "
            "counters, and the task tree",
            *self.daemon.describe(),
            "Task tree:",
            *task_tree(),
        ]


def task_tree() -> list[str]:
    """Every trio task, indented under the task whose nursery runs it."""
    lines: list[str] = []

    def walk(task: trio.lowlevel.Task, depth: int) -> None:
        lines.append(f"{'  ' * depth}{task.name}")
        for nursery in task.child_nurseries:
            for child in sorted(nursery.child_tasks, key=lambda each: each.name):
                walk(child, depth + 1)

    root = trio.lowlevel.current_root_task()
    if root is not None:
        walk(root, 1)
    return lines


ServeOnce = Callable[[Flags, DevicePlugin, Backoff], Awaitable[None]]


async def supervise_resource(config: Flags, plugin: DevicePlugin, serve_once: ServeOnce) -> None:
    """Serve one resource; if it fails, restart it alone so the others keep serving.

    Only a bug gets here (faults of the node are handled where they happen):
    it is logged with its traceback. The backoff forgets once the resource
    has served kubelet for a while (`registration.STABLE_AFTER`).
    """
    backoff = Backoff(first=BUG_RESTART_FIRST, cap=BUG_RESTART_CAP)
    while True:
        try:
            await serve_once(config, plugin, backoff)
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
    """Why a generation ended; after a fault of the plugin's own (a socket it cannot serve)
    the next one may have to wait. Whatever kubelet does is answered at once."""

    reason: str
    fault: bool = False


async def serve_kubelet(plugin_dir: Path, plugin: DevicePlugin, resource_backoff: Backoff) -> None:
    """One generation after another. Faults back to back wait, an isolated one does not.

    The directory's inotify instance lasts as long as this does: closing one that has a
    watch blocks the thread until the kernel has torn the watch down (some 10 ms), and a
    kubelet restart, which ends a generation, is when every millisecond counts.
    """
    names = SocketNames(plugin.spec.socket_prefix)
    restarts = Backoff(immediate_first=True)
    reachability = Reachability()
    cause = "start"
    with open_inotify() as inotify:
        while True:
            plugin.state.waiting(f"waiting for {plugin_dir} to be created")
            await wait_for_directory(plugin_dir)
            plugin.state.generation_started()
            ending = await serve_generation(
                plugin_dir, plugin, inotify, next(names), names.stem, cause, reachability,
                (restarts, resource_backoff),
            )  # fmt: skip
            cause = await after_generation(plugin, ending, restarts)


async def after_generation(plugin: DevicePlugin, ending: Ending, restarts: Backoff) -> str:
    """Say why the generation ended, and wait if that was a fault; the cause of the next."""
    log.log(V1, "Restarting the device plugin server: %s", ending.reason)
    delay = restarts.next_delay() if ending.fault else 0.0
    plugin.state.generation_ended(ending.reason, delay)
    if delay:
        await trio.sleep(delay)
    return ending.reason


async def serve_generation(
    plugin_dir: Path,
    plugin: DevicePlugin,
    inotify: Inotify,
    endpoint: str,
    stem: str,
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
    plugin.state.waiting("registering with kubelet")
    link = KubeletLink(plugin.state)
    service = DevicePluginService(plugin, link)
    server = grpc_server.Server(
        service.methods(), plugin.state.handler_failed, link.connection_closed
    )
    path = plugin_dir / endpoint
    async with trio.open_nursery() as nursery:
        restart = Restart(nursery.cancel_scope)
        try:
            remove_stale_sockets(own_sockets(plugin_dir, plugin.spec.socket_prefix, endpoint), stem)
            listener, own = grpc_server.bind(path)
        except OSError as exc:
            return serving_failed(plugin, path, exc)
        # grpc_server.serve owns the listener from here, and closes it however it ends.
        await nursery.start(grpc_server.serve, server, listener, path, own)
        followers = Followers(nursery, plugin_dir, plugin.spec.socket_prefix, stem, link, restart)
        await nursery.start(
            watch_plugin_dir, inotify, plugin_dir, endpoint, own, restart, followers.appeared
        )
        problem = plugin.state.serving()
        if problem is not None:
            log.info("Serving in %s again, after: %s", plugin_dir, problem)
        nursery.start_soon(
            register_with_kubelet, plugin_dir, request, plugin.state, cause, link, reachability
        )
        nursery.start_soon(reregister_when_stream_ends, plugin_dir, link, restart)
        nursery.start_soon(forget_faults_when_stable, link, *backoffs)
    reason = restart.reason or "cancelled"
    return Ending(reason)


def serving_failed(plugin: DevicePlugin, path: Path, error: OSError) -> Ending:
    """One line per distinct problem, however often it is retried."""
    if isinstance(error, FileNotFoundError | NotADirectoryError) and not path.parent.is_dir():
        return Ending(f"{path.parent} disappeared")
    # The directory, not the socket's name: each retry has a fresh name, and the
    # same problem is said once.
    problem = f"cannot serve in {path.parent}: [Errno {error.errno}] {error.strerror}"
    if plugin.state.cannot_serve(problem):
        log.error("%s; retrying", problem)
    return Ending(problem, fault=True)
