"""The daemon's nursery tree, drawn here and only here: every task of the process, both
modes on their shared skeleton (generations.py). [dp] marks the tasks of the device-plugin
mode only (plugin.py), [dra] those of the DRA mode only (dra/driver.py); the rest is both's.

    run_daemon                       under bridge.run: trio, a guest of grpclib's asyncio loop
    └── root nursery
        ├── handle_signals           TERM/INT/QUIT stop; HUP reloads; USR1 logs this tree
        └── stop scope
            ├── serve_http           /metrics, /livez, /readyz (with a bind address)
            │   └── trio.serve_listeners → HttpServer.handle, one per connection
            ├── watch_config_file    [dp] with --config: the file, or the ConfigMap's ..data swap
            └── Resources.serve      the configuration; applies reloads
                └── supervise_resource, one per resource, in a cancel scope of its own: the
                    │                mode's own tasks (Mode.running), then its generations;
                    │                both again, alone, after a bug
                    ├── watch_health          inotify on the device's and mounts' parents
                    ├── DraMode.keep_publishing   [dra] slices.publish, again alone after a bug:
                    │   │                   the node's ResourceSlices listed once, then
                    │   └── publish's nursery, the first failure ends both (then a wait):
                    │       ├── Publisher.watch   one watch after another, resumed where it was
                    │       └── Publisher.keep    the slices written as the node and watch say
                    ├── Preparer.forget_deleted_claims   [dra] at start: the checkpointed claims
                    │                       the API server no longer has, forgotten; then ends
                    └── serve_generations     (in supervise_resource's own task) one
                        │                     generation after another (one inotify)
                        ├── wait_for_directory until kubelet has created it
                        └── generation nursery: cancelling it is how the resource restarts
                            ├── forget_faults_when_stable
                            ├── Preparer.restore_specs   [dra] the checkpointed claims' lost
                            │                   CDI specs, written back under the claims' lock
                            ├── Server.serve        [dp] the socket, a fresh name each time;
                            │   │                   [dra] the DRA socket, then the
                            │   │                   registration socket kubelet dials
                            │   └── trio.serve_listeners → Connection.serve, one per
                            │       connection (below)
                            ├── watch_plugin_dir    [dp] kubelet.sock created, own socket gone
                            ├── follow              [dp] one per newer instance of the
                            │                       resource (rollouts on older kubelets),
                            │                       started when watch_plugin_dir sees it
                            ├── Kubelet.register    [dp] once serving; retries with backoff
                            ├── reregister_when_stream_ends   [dp]
                            └── watch_sockets       [dra] either socket gone: serve both again

A connection's calls run as asyncio tasks that grpclib's protocol starts; the
connection's trio task owns them: on its way out it closes the connection,
which cancels them, and waits for them (`Limits.teardown_grace` at most).
So when a generation's nursery is cancelled, nothing of it outlives it:
tests/test_grpc_server.py checks that no call's task is left.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from pathlib import Path

import trio

from pcc_plugin.configuration import ConfigError, Served, read, watch_config_file
from pcc_plugin.flags import Flags
from pcc_plugin.generations import Mode, supervise_resource
from pcc_plugin.klog import V1
from pcc_plugin.resource import ResourceSpec
from pcc_plugin.state import DaemonState, ResourceState

log = logging.getLogger(__name__)


async def run_daemon(config: Flags, served: Served) -> None:
    path = Path(config.config) if config.config else None
    daemon = DaemonState(served.specs, path, served.digest, served.mode)
    reloads, reload_requests = trio.open_memory_channel[str](1)
    resources = Resources(config, served.mode, daemon)
    async with trio.open_nursery() as root:
        stop = trio.CancelScope()
        await root.start(handle_signals, stop, reloads, resources)
        with stop:
            async with trio.open_nursery() as nursery:
                if config.metrics_bind_address:
                    # Imported only when wanted: it costs memory at every start.
                    from pcc_plugin import http_server

                    bound = await nursery.start(
                        http_server.serve_http, config.metrics_bind_address, daemon
                    )
                    for address, port in bound:
                        log.info(
                            "Serving /metrics, /livez and /readyz on %s port %d", address, port
                        )
                await nursery.start(resources.serve, reload_requests)
                if path is not None and served.mode != "dra":
                    await nursery.start(watch_config_file, path, reloads)
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


class Resources:
    """The resources being served, each in a cancel scope of its own, changed by reloads."""

    def __init__(self, config: Flags, mode: str, daemon: DaemonState) -> None:
        self.config = config
        self.mode = mode
        self.daemon = daemon
        self._running: dict[str, trio.CancelScope] = {}
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

    def _start(self, nursery: trio.Nursery, spec: ResourceSpec) -> None:
        mode = self._mode_for(spec, ResourceState(spec.name, needs_stream=self.mode != "dra"))
        scope = self._running[spec.name] = trio.CancelScope()
        nursery.start_soon(self._run, mode, scope, name=f"supervise_resource {spec.name}")

    def _mode_for(self, spec: ResourceSpec, state: ResourceState) -> Mode:
        config = self.config
        # Each mode's modules are its own (main.py imports them before it settles): the DRA
        # mode's API client costs memory, the device plugin's services start time.
        if self.mode == "dra":
            from pcc_plugin.dra.driver import DraMode

            log.info("Starting pcc-device-plugin as DRA driver %s: %s x%d on node %s",
                     config.driver_name, spec.name, spec.count, config.node_name)  # fmt: skip
            return DraMode(config, spec, state)
        from pcc_plugin.plugin import DevicePluginMode

        log.info("Starting pcc-device-plugin: %s x%d", spec.name, spec.count)
        return DevicePluginMode(config, spec, state)

    async def _run(self, mode: Mode, scope: trio.CancelScope) -> None:
        with self.daemon.serving(mode.state), scope:
            await supervise_resource(mode)

    def _reload(self, nursery: trio.Nursery, reason: str) -> None:
        daemon = self.daemon
        if self.mode == "dra" or daemon.path is None:
            why = ("--mode=dra reads its configuration at start" if self.mode == "dra"
                   else "the resources come from flags, not --config")  # fmt: skip
            log.info("Nothing to reload (%s): %s", reason, why)
            return
        try:
            served = read(self.config)
        except ConfigError as exc:
            daemon.reload_refused()
            log.error("Configuration not reloaded, the running one stays: %s (see %s)",
                      exc, exc.see)  # fmt: skip
            return
        if served.mode != self.mode:
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
                self._running.pop(name).cancel()
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
