"""What the plugin advertises and answers for one resource."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import attrs
import trio

from pcc_plugin._proto import v1beta1 as api
from pcc_plugin.klog import V1
from pcc_plugin.resources import ResourceSpec, health_problem
from pcc_plugin.stats import ResourceStats

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


class RequestError(ValueError):
    """A request that names no device or unknown ones: INVALID_ARGUMENT."""


class DeviceUnavailable(RuntimeError):
    """The device or a mount source is gone: FAILED_PRECONDITION, with the reason."""


def device_ids(count: int) -> tuple[str, ...]:
    """IDs stay the same across restarts, so kubelet's checkpoint keeps matching them."""
    return tuple(f"pcc-{index}" for index in range(count))


@attrs.frozen
class Shares:
    """The shares of one resource, as kubelet sees them: pure functions of the spec."""

    spec: ResourceSpec
    ids: tuple[str, ...] = attrs.field()
    known: frozenset[str] = attrs.field()

    @ids.default
    def _ids(self) -> tuple[str, ...]:
        return device_ids(self.spec.count)

    @known.default
    def _known(self) -> frozenset[str]:
        return frozenset(self.ids)

    def listing(self, health: str) -> bytes:
        """The full device list, encoded once and shared by every ListAndWatch stream."""
        message = api.ListAndWatchResponse(
            devices=[api.Device(id=device_id, health=health) for device_id in self.ids]
        )
        return bytes(message)

    def check_ids(self, where: str, ids: list[str]) -> None:
        if not ids:
            raise RequestError(f"{where} names no device IDs")
        unknown = sorted(set(ids) - self.known)
        if unknown:
            shown = ", ".join(repr(device_id) for device_id in unknown[:5])
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise RequestError(
                f"{where} names unknown device IDs {shown}{more}; "
                f"{self.spec.name} has {self.ids[0]} to {self.ids[-1]}"
            )

    def container_response(self) -> api.ContainerAllocateResponse:
        # Several shares still mean each device node and mount once.
        return api.ContainerAllocateResponse(
            devices=[
                api.DeviceSpec(
                    container_path=node.container_path,
                    host_path=node.host_path,
                    permissions=node.permissions,
                )
                for node in self.spec.device_nodes
            ],
            mounts=[
                api.Mount(
                    container_path=mount.container_path,
                    host_path=mount.host_path,
                    read_only=mount.read_only,
                )
                for mount in self.spec.mounts
            ],
            envs=dict(self.spec.envs),
        )


class DeviceFeed:
    """The current encoded device list, and a wake-up for every stream when it changes."""

    def __init__(self, payload: bytes) -> None:
        self._payload = payload
        self._version = 0
        self._changed = trio.Event()

    def publish(self, payload: bytes) -> None:
        self._payload = payload
        self._version += 1
        self._changed.set()
        self._changed = trio.Event()

    async def stream(self, send: Callable[[bytes], Awaitable[None]]) -> None:
        """Send the list now and again after every change, until cancelled."""
        sent_version = None
        while True:
            if sent_version != self._version:
                sent_version = self._version
                await send(self._payload)
            else:
                await self._changed.wait()


class DevicePlugin:
    """One resource's answers to kubelet, with its current health."""

    def __init__(
        self, spec: ResourceSpec, host_root: str, stats: ResourceStats, pre_start_check: bool
    ) -> None:
        self.spec = spec
        self.shares = Shares(spec)
        self.stats = stats
        self._host_root = host_root
        self._pre_start_check = pre_start_check
        self.problem: str | None = None
        self.feed = DeviceFeed(self.shares.listing(HEALTHY))
        stats.devices = spec.count

    def set_problem(self, problem: str | None) -> None:
        """Publish a health change to every stream, and say why in the log."""
        if problem == self.problem:
            return
        self.problem = problem
        self.stats.healthy = problem is None
        if problem:
            log.warning("%s: every device is Unhealthy: %s", self.spec.name, problem)
        else:
            log.info("%s: every device is Healthy again", self.spec.name)
        self.feed.publish(self.shares.listing(UNHEALTHY if problem else HEALTHY))

    def options(self) -> api.DevicePluginOptions:
        # Every share is the same device: there is no preference to give.
        return api.DevicePluginOptions(
            pre_start_required=self._pre_start_check, get_preferred_allocation_available=False
        )

    def allocate(self, request: api.AllocateRequest) -> api.AllocateResponse:
        try:
            if not request.container_requests:
                raise RequestError("AllocateRequest has no container requests")
            for index, container in enumerate(request.container_requests):
                self.shares.check_ids(f"container request {index}", container.devices_ids)
            if self.problem:
                raise DeviceUnavailable(f"{self.spec.name} is unhealthy: {self.problem}")
        except RequestError:
            self.stats.allocations["invalid"] += 1
            raise
        except DeviceUnavailable:
            self.stats.allocations["unavailable"] += 1
            raise
        self.stats.allocations["ok"] += 1
        log.log(
            V1,
            "Allocate %s: %s -> %s",
            self.spec.name,
            [container.devices_ids for container in request.container_requests],
            ", ".join(self.spec.host_paths()),
        )
        response = self.shares.container_response()
        return api.AllocateResponse(
            container_responses=[response] * len(request.container_requests)
        )

    def pre_start_container(
        self, request: api.PreStartContainerRequest
    ) -> api.PreStartContainerResponse:
        self.shares.check_ids("PreStartContainerRequest", request.devices_ids)
        if self._pre_start_check:
            problem = health_problem(self.spec, self._host_root)
            if problem:
                raise DeviceUnavailable(f"cannot start the container: {problem}")
        return api.PreStartContainerResponse()
