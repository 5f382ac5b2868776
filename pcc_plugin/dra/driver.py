"""The DRA mode's serving: its sockets for kubelet, its ResourceSlices, its claims.

Either socket gone (deleted by hand, its directory removed): both are served again. Kubelet
restarting needs nothing of the sockets (it registers the ones it finds), but it deletes the
node's slices, which `slices.publish` writes again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio
from asyncinotify import Inotify, Mask

from pcc_plugin import grpc_server
from pcc_plugin.dra import kube, slices
from pcc_plugin.dra.claims import Preparer
from pcc_plugin.dra.service import DraService, RegistrationService
from pcc_plugin.dra.sockets import earlier_sockets, socket_paths, state_dir
from pcc_plugin.flags import Flags
from pcc_plugin.fs import Identity
from pcc_plugin.health import watch_health
from pcc_plugin.inotify import DIR_GONE, VANISHED, next_events, open_inotify, wait_for_directory
from pcc_plugin.klog import V1
from pcc_plugin.plugin import DevicePlugin
from pcc_plugin.plugin_dir import own_socket_problem, remove_stale_sockets
from pcc_plugin.registration import Backoff

log = logging.getLogger(__name__)


async def serve_once(config: Flags, plugin: DevicePlugin, backoff: Backoff) -> None:
    """Everything of the mode, until cancelled (supervisor.supervise_resource restarts it
    after a bug)."""
    api = kube.open_client(config.kubeconfig)
    preparer = Preparer(
        config.driver_name, config.node_name, plugin, state_dir(config),
        Path(config.cdi_spec_dir), config.instance_name, api.get_claim,
    )  # fmt: skip

    def wanted(pool: slices.Pool) -> list[dict[str, Any]]:
        return slices.desired(pool, plugin.spec, plugin.devices)

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(watch_health, plugin, config.host_root)
            nursery.start_soon(
                slices.publish, api, config.driver_name, config.node_name, wanted,
                plugin.next_change, plugin.state,
            )  # fmt: skip
            nursery.start_soon(serve_kubelet, config, plugin, preparer)
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(grpc_server.TEARDOWN_GRACE):
            await api.close()


async def serve_kubelet(config: Flags, plugin: DevicePlugin, preparer: Preparer) -> None:
    """One generation of sockets after another; faults back to back wait."""
    registry = Path(config.kubelet_registry_path)
    restarts = Backoff(immediate_first=True)
    problem: str | None = None
    while True:
        plugin.state.waiting(f"waiting for {registry} to be created")
        await wait_for_directory(registry)
        plugin.state.generation_started()
        plugin.state.waiting("waiting for kubelet to register the driver")
        try:
            state_dir(config).mkdir(parents=True, exist_ok=True)
            remove_stale_sockets(earlier_sockets(config))
            preparer.restore_specs()
            reason = await serve_generation(config, plugin, preparer)
            fault = False
            if problem is not None:
                log.info("Serving for kubelet again, after: %s", problem)
                problem = None
        except OSError as exc:
            reason = (
                f"cannot serve in {exc.filename or registry}: [Errno {exc.errno}] {exc.strerror}"
            )
            fault = True
            if reason != problem:
                log.error("%s; retrying", reason)
            problem = reason
            plugin.state.waiting(reason)
        log.log(V1, "Serving the DRA sockets again: %s", reason)
        delay = restarts.next_delay() if fault else 0.0
        plugin.state.generation_ended(reason, delay)
        await trio.sleep(delay)
        if not fault:
            restarts.reset()


async def serve_generation(config: Flags, plugin: DevicePlugin, preparer: Preparer) -> str:
    """Serve the DRA socket, then the registration socket, until one goes; say why it ended.
    OSError when a socket cannot be served (each is removed again as it closes)."""
    registration_path, dra_path = socket_paths(config)
    report = plugin.state.handler_failed
    dra_server = grpc_server.Server(DraService(preparer).methods(), report, idle_client=True)
    registration = RegistrationService(config.driver_name, str(dra_path), plugin.state)
    registration_server = grpc_server.Server(registration.methods(), report)
    reason = "cancelled"
    with open_inotify() as inotify:
        async with trio.open_nursery() as nursery:

            def restart(why: str) -> None:
                nonlocal reason
                reason = why
                nursery.cancel_scope.cancel()

            sockets: list[tuple[Path, Identity]] = []
            for server, path in ((dra_server, dra_path), (registration_server, registration_path)):
                listener, own = grpc_server.bind(path)
                # grpc_server.serve owns the listener from here, and closes it however it ends.
                await nursery.start(grpc_server.serve, server, listener, path, own)
                sockets.append((path, own))
            log.info("Serving DRA driver %s on %s, registration on %s",
                     config.driver_name, dra_path, registration_path)  # fmt: skip
            await nursery.start(watch_sockets, inotify, sockets, restart)
    return reason


_GONE = VANISHED | DIR_GONE | Mask.ONLYDIR


async def watch_sockets(
    inotify: Inotify,
    sockets: list[tuple[Path, Identity]],
    restart: Callable[[str], None],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Call `restart(reason)` once a socket is no longer ours (deleted, replaced) or its
    directory goes. Watches first, then looks: nothing slips between."""
    try:
        for path, _ in sockets:
            inotify.add_watch(path.parent, _GONE)
    except (FileNotFoundError, NotADirectoryError):
        task_status.started()
        restart("a socket's directory disappeared")
        return
    task_status.started()
    while True:
        for path, own in sockets:
            problem = own_socket_problem(path, own)
            if problem:
                log.info("inotify: own socket %s %s, serving again.", path, problem)
                restart(f"own socket {path.name} {problem}")
                return
        await next_events(inotify)
