"""The DRA mode on the shared skeleton (generations.py): its sockets for kubelet, its
ResourceSlices, its claims, and what it says of its devices.

A generation serves the DRA socket, then the registration socket (dra/sockets.py names
them). Either socket gone (deleted by hand, its directory removed): both are served again.
Kubelet restarting needs nothing of the sockets (it registers the ones it finds), but it
deletes the node's slices, which `slices.publish` writes again. Each change of the devices
goes to kubelet's health stream (health.py), to how unhealthy devices show in the slices
(taints.py) and to the node's attributes (node_facts.py), then to the slices.

The slices are published once the DRA socket is first served, as the Go drivers publish once
their servers run: a device offered by a driver that cannot serve kubelet would take pods that
can never start, and an older instance that sees the slices of this one finds it serving (it
leaves them alone while it does). The API server is the slices' and the claims' only:
whatever its client fails with, the sockets, unprepare and the health streams go on. A bug in
the publishing loop restarts that loop alone (`keep_publishing`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import trio
from asyncinotify import Inotify, Mask

from pcc_plugin import grpc_server
from pcc_plugin.dra import kube, node_facts, slices, taints
from pcc_plugin.dra.checkpoint import Checkpoint
from pcc_plugin.dra.claims import Preparer
from pcc_plugin.dra.health import HealthFeed, health_methods
from pcc_plugin.dra.service import dra_methods, registration_methods
from pcc_plugin.dra.sockets import earlier_sockets, instance_token, socket_paths, state_dir
from pcc_plugin.flags import Flags
from pcc_plugin.fs import Identity
from pcc_plugin.generations import (
    BUG_RESTART_CAP,
    BUG_RESTART_FIRST,
    Backoff,
    Generation,
    ServeGeneration,
)
from pcc_plugin.inotify import DIR_GONE, VANISHED, next_events
from pcc_plugin.inventory import Inventory, watch_health
from pcc_plugin.limits import DRA_SOCKET
from pcc_plugin.plugin_dir import accepts_connections, own_socket_problem, remove_stale_sockets
from pcc_plugin.resource import Device, ResourceSpec
from pcc_plugin.state import ResourceState

log = logging.getLogger(__name__)


class DraMode:
    """One resource as the DRA driver of this node."""

    server = "the DRA driver's sockets"
    directory_flags = "--kubelet-registry-path and --kubelet-plugins-path"

    def __init__(self, config: Flags, spec: ResourceSpec, state: ResourceState) -> None:
        self.config = config
        self.state = state
        self.directory = Path(config.kubelet_registry_path)
        # Set, and replaced, at each change of the devices: what the slices' publisher waits on.
        self._changed = trio.Event()
        self.health = HealthFeed(config.node_name)
        self.unhealthy = taints.Unhealthy(config.driver_name, config.unhealthy_taint_effect)
        self.node = node_facts.NodeFacts()
        # Served at once even with the device missing (tainted or withdrawn in the slices, as
        # when it goes later): kubelet needs the driver registered to unprepare the claims of
        # the pods on the node whatever the device does.
        self.inventory = Inventory(
            spec, config.host_root, state, self._devices_changed, wait_at_start=False
        )

    def _devices_changed(self, devices: tuple[Device, ...]) -> None:
        self.health.update(devices)
        self.unhealthy.seen(devices)
        facts = node_facts.read_facts(self.config.host_root)
        if facts != self.node:
            log.info("Node attributes: %s", facts.describe())
            self.node = facts
        self._changed.set()
        self._changed = trio.Event()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[ServeGeneration]:
        """The API client, the inventory's watch, the slices' publisher and the checkpoint's
        claims, for as long as the generations run; each generation serves the preparer made
        here."""
        config, inventory = self.config, self.inventory
        api = kube.open_client(config.kubeconfig)
        api.counted = self.state.api_requested
        checkpoint = Checkpoint(state_dir(config), config.driver_name)
        preparer = Preparer(
            config.driver_name, config.node_name, inventory, self.state, checkpoint,
            Path(config.cdi_spec_dir), config.instance_name, api.get_claim,
        )  # fmt: skip
        checkpoint.salvage = preparer.salvage

        sysfs = node_facts.sysfs_missing(config.host_root)
        if sysfs:
            log.warning(
                "%s does not exist: the devices get no attributes teeType and tsmReport; mount "
                "the host's /sys there, read-only (manifests/overlays/dra does)",
                sysfs,
            )
        served = trio.Event()
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(watch_health, inventory)
                nursery.start_soon(self.keep_publishing, api, served)
                nursery.start_soon(preparer.forget_deleted_claims)
                yield functools.partial(self.serve_generation, preparer, served)
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(DRA_SOCKET.teardown_grace):
                await api.close()

    def _alive(self, other: slices.Instance) -> bool:
        """Whether another instance of the driver on this node still serves its DRA socket
        (each removes its sockets as it stops)."""
        return accepts_connections(socket_paths(self.config, other.token)[1])

    def _wanted(self, pool: slices.Pool) -> list[dict[str, Any]]:
        devices = self.inventory.devices
        return slices.desired(pool, self.inventory.spec, devices, self.unhealthy, self.node)

    async def keep_publishing(self, api: kube.Api, served: trio.Event) -> None:
        """Keep the slices published (slices.publish) from when the DRA socket is `served`;
        after a bug there, log it and start that loop again, alone: kubelet's calls do not
        depend on it."""
        await served.wait()
        config = self.config
        pool = slices.Pool(config.driver_name, config.node_name, "")
        me = slices.Instance.starting(instance_token(config))
        backoff = Backoff(first=BUG_RESTART_FIRST, cap=BUG_RESTART_CAP)
        self.unhealthy.say_at_start()
        while True:
            try:
                await slices.publish(api, pool, me, self._alive, self._wanted,
                                     lambda: self._changed, self.state,
                                     self.unhealthy)  # fmt: skip
            except Exception as exc:
                delay = backoff.next_delay()
                problem = f"ResourceSlices not published: {type(exc).__name__}: {exc}"
                self.state.slices_not_published(problem)
                log.error("Publishing ResourceSlices failed unexpectedly; again in %.1f s",
                          delay, exc_info=exc)  # fmt: skip
                await trio.sleep(delay)

    async def serve_generation(
        self, preparer: Preparer, served: trio.Event, generation: Generation
    ) -> None:
        """Serve the DRA socket, then the registration socket (`served` set once both are),
        and watch both (each is removed again as it closes)."""
        config = self.config
        state_dir(config).mkdir(parents=True, exist_ok=True)
        remove_stale_sockets(earlier_sockets(config))
        # Beside the sockets, not before them: it waits for the lock another instance may hold.
        generation.nursery.start_soon(preparer.restore_specs)
        registration_path, dra_path = socket_paths(config)
        report = self.state.handler_failed
        registration = registration_methods(
            config.driver_name, str(dra_path), self.state, generation.cause
        )
        kubelets = {**dra_methods(preparer), **health_methods(self.health)}
        sockets = [
            (path, await generation.nursery.start(server.serve, path))
            for server, path in (
                (grpc_server.Server(kubelets, report, limits=DRA_SOCKET), dra_path),
                (grpc_server.Server(registration, report), registration_path),
            )
        ]
        log.info("Serving DRA driver %s on %s, registration on %s",
                 config.driver_name, dra_path, registration_path)  # fmt: skip
        served.set()
        await generation.nursery.start(
            watch_sockets, generation.inotify, sockets, generation.restart
        )


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
