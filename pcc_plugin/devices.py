"""What the plugin advertises and what it answers: pure functions of the configuration."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import attrs
import trio

from pcc_plugin._proto import v1beta1 as api
from pcc_plugin.config import CONTAINER_DEVICE_PATH, CONTAINER_PCC_PATH, Config
from pcc_plugin.klog import V1

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


class RequestError(ValueError):
    """A request kubelet (or anyone) sent that names no device or unknown ones."""


def device_ids(count: int) -> tuple[str, ...]:
    """IDs stay the same across restarts, so kubelet's checkpoint keeps matching them."""
    return tuple(f"pcc-{index}" for index in range(count))


@attrs.frozen
class Shares:
    """The shares of one device node and one PCC directory, as kubelet sees them."""

    config: Config
    ids: tuple[str, ...] = attrs.field()
    known: frozenset[str] = attrs.field()

    @ids.default
    def _ids(self) -> tuple[str, ...]:
        return device_ids(self.config.resource_count)

    @known.default
    def _known(self) -> frozenset[str]:
        return frozenset(self.ids)

    def options(self) -> api.DevicePluginOptions:
        # Every share is the same device, so there is no preference to give,
        # and nothing needs checking before a container starts.
        return api.DevicePluginOptions(
            pre_start_required=False, get_preferred_allocation_available=False
        )

    def listing(self, health: str) -> bytes:
        """The full device list, encoded once and shared by every ListAndWatch stream."""
        message = api.ListAndWatchResponse(
            devices=[api.Device(id=device_id, health=health) for device_id in self.ids]
        )
        return bytes(message)

    def _check_ids(self, where: str, ids: list[str]) -> None:
        if not ids:
            raise RequestError(f"{where} names no device IDs")
        unknown = sorted(set(ids) - self.known)
        if unknown:
            shown = ", ".join(repr(device_id) for device_id in unknown[:5])
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            raise RequestError(
                f"{where} names unknown device IDs {shown}{more}; "
                f"{self.config.resource_name} has {self.ids[0]} to {self.ids[-1]}"
            )

    def allocate(self, request: api.AllocateRequest) -> api.AllocateResponse:
        if not request.container_requests:
            raise RequestError("AllocateRequest has no container requests")
        responses = []
        for index, container in enumerate(request.container_requests):
            self._check_ids(f"container request {index}", container.devices_ids)
            responses.append(self._container_response())
        log.log(
            V1,
            "Allocate %s: %s -> %s and %s",
            self.config.resource_name,
            [container.devices_ids for container in request.container_requests],
            self.config.pcc_device,
            self.config.pcc_socket_path,
        )
        return api.AllocateResponse(container_responses=responses)

    def _container_response(self) -> api.ContainerAllocateResponse:
        # Several shares still mean one device node and one mount.
        return api.ContainerAllocateResponse(
            devices=[
                api.DeviceSpec(
                    container_path=CONTAINER_DEVICE_PATH,
                    host_path=self.config.pcc_device,
                    permissions="rw",
                )
            ],
            mounts=[
                api.Mount(
                    container_path=CONTAINER_PCC_PATH,
                    host_path=self.config.pcc_socket_path,
                    read_only=False,
                )
            ],
        )

    def pre_start_container(
        self, request: api.PreStartContainerRequest
    ) -> api.PreStartContainerResponse:
        self._check_ids("PreStartContainerRequest", request.devices_ids)
        return api.PreStartContainerResponse()


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
