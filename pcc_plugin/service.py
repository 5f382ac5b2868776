"""The device-plugin mode's answers to kubelet: the DevicePlugin service's five calls.

`DevicePlugin` is one resource's answers, across generations: the device list every
ListAndWatch stream gets, Allocate and PreStartContainer, and with --cdi its CDI spec, kept as
the devices are. `DevicePluginService` serves them on one generation's socket. Requests are
read by `wire` within limits that follow the resource: an Allocate names at most as many
device IDs as the resource advertises, in at most `MAX_CONTAINER_REQUESTS` container requests
(kubelet sends one). Client mistakes are INVALID_ARGUMENT, a gone device FAILED_PRECONDITION.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs

from pcc_plugin import cdi, wire
from pcc_plugin._proto import v1beta1 as api
from pcc_plugin.flags import DEFAULT_INSTANCE_NAME
from pcc_plugin.grpc_server import Call, GRPCError, MethodSpec, Status
from pcc_plugin.inventory import Inventory
from pcc_plugin.klog import V1
from pcc_plugin.registration import KubeletLink
from pcc_plugin.resource import Device, Grant, ResourceSpec, grant
from pcc_plugin.state import ResourceState

log = logging.getLogger(__name__)

SERVICE = "/v1beta1.DevicePlugin/"
# Kubelet sends one container request per Allocate; a pod is far from this many.
MAX_CONTAINER_REQUESTS = 128


class DeviceFeed:
    """The current encoded device list, and a wake-up for every stream when it changes.

    Streams wait on the asyncio side (they are gRPC handlers); `publish` is
    called from trio or asyncio code alike, on the one thread.
    """

    def __init__(self) -> None:
        self._payload = b""
        self._version = 0
        self._changed = asyncio.Event()

    def publish(self, payload: bytes) -> None:
        self._payload = payload
        self._version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def stream(self, send: Callable[[bytes], Awaitable[None]]) -> None:
        """Send the list now and again after every change, until cancelled."""
        sent_version = None
        while True:
            if sent_version != self._version:
                sent_version = self._version
                await send(self._payload)
            else:
                await self._changed.wait()


def encode_listing(devices: tuple[Device, ...]) -> bytes:
    """The full device list, encoded once and shared by every ListAndWatch stream."""
    return bytes(
        api.ListAndWatchResponse(
            devices=[
                api.Device(id=device.id, health="Healthy" if device.healthy else "Unhealthy")
                for device in devices
            ]
        )
    )


class DevicePlugin:
    """One resource's answers to kubelet, in step with its inventory."""

    def __init__(
        self,
        spec: ResourceSpec,
        host_root: str,
        state: ResourceState,
        *,
        pre_start_check: bool = False,
        cdi_spec_dir: Path | None = None,
        instance_name: str = DEFAULT_INSTANCE_NAME,
    ) -> None:
        self.spec = spec
        self.state = state
        self._pre_start_check = pre_start_check
        self._cdi_spec_dir = cdi_spec_dir
        self._instance_name = instance_name
        # Why the spec is not in place (then Allocate names no CDI device), or None.
        self._cdi_problem: str | None = None
        self.feed = DeviceFeed()
        self.inventory = Inventory(spec, host_root, state, self._devices_changed)

    def _devices_changed(self, devices: tuple[Device, ...]) -> None:
        self.feed.publish(encode_listing(devices))
        if self._cdi_spec_dir is not None:
            problem = cdi.write_spec(self._cdi_spec_dir, self.spec, devices, self._instance_name)
            if problem and problem != self._cdi_problem:
                log.error("%s", problem)
            self._cdi_problem = problem

    def options(self) -> api.DevicePluginOptions:
        # Shares of one device are alike: there is no preference to give.
        return api.DevicePluginOptions(
            pre_start_required=self._pre_start_check, get_preferred_allocation_available=False
        )

    def _devices_named(self, where: str, ids: list[str]) -> list[Device]:
        if not ids:
            raise GRPCError(Status.INVALID_ARGUMENT, f"{where} names no device IDs")
        unknown = sorted({device_id for device_id in ids if not self.inventory.get(device_id)})
        if unknown:
            # Quoted short: the details travel in a gRPC trailer, which clients cap at 8 KiB.
            shown = ", ".join(
                repr(device_id if len(device_id) <= 64 else device_id[:64] + "...")
                for device_id in unknown[:5]
            )
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            listed = self.inventory.devices
            known = f"{listed[0].id} to {listed[-1].id}" if listed else "none"
            raise GRPCError(
                Status.INVALID_ARGUMENT,
                f"{where} names unknown device IDs {shown}{more}; {self.spec.name} has {known}",
            )
        return [device for device_id in ids if (device := self.inventory.get(device_id))]

    def allocate(self, containers: list[list[str]]) -> list[Grant]:
        """What each container of one Allocate call gets, by its device IDs."""
        try:
            if not containers:
                raise GRPCError(
                    Status.INVALID_ARGUMENT, "AllocateRequest has no container requests"
                )
            allocated = [
                self._devices_named(f"container request {index}", ids)
                for index, ids in enumerate(containers)
            ]
            for device in (device for devices in allocated for device in devices):
                if device.problem:
                    raise GRPCError(
                        Status.FAILED_PRECONDITION,
                        f"{self.spec.name} device {device.id} is unhealthy: {device.problem}",
                    )
        except GRPCError as refused:
            invalid = refused.status is Status.INVALID_ARGUMENT
            self.state.allocated("invalid" if invalid else "unavailable")
            raise
        self.state.allocated("ok")
        grants = [self._grant(devices) for devices in allocated]
        if log.isEnabledFor(V1):
            log.log(
                V1,
                "Allocate %s: %s -> %s",
                self.spec.name,
                containers,
                [[node.host_path for node in given.device_nodes] for given in grants],
            )
        return grants

    def _grant(self, devices: list[Device]) -> Grant:
        given = grant(self.spec, devices)
        # A runtime fails a container whose CDI device no spec names.
        if self._cdi_spec_dir is None or self._cdi_problem:
            return given
        return attrs.evolve(given, cdi_devices=tuple(cdi.qualified_names(self.spec, devices)))

    def pre_start_container(self, device_ids: list[str]) -> None:
        """Check, before a container starts, that its devices are still there (if asked to)."""
        devices = self._devices_named("PreStartContainerRequest", device_ids)
        if self._pre_start_check:
            # One fresh look at the node; each device's problem includes the shared ones.
            self.inventory.refresh()
            for device in devices:
                now = self.inventory.get(device.id)
                if now and now.problem:
                    raise GRPCError(
                        Status.FAILED_PRECONDITION, f"cannot start the container: {now.problem}"
                    )


class DevicePluginService:
    """The gRPC methods of one resource, for one generation (one socket)."""

    def __init__(self, plugin: DevicePlugin, link: KubeletLink) -> None:
        self._plugin = plugin
        self._link = link
        self._options = bytes(plugin.options())

    def methods(self) -> dict[str, MethodSpec]:
        return {
            SERVICE + "GetDevicePluginOptions": MethodSpec(self.get_device_plugin_options),
            SERVICE + "ListAndWatch": MethodSpec(stream=self.list_and_watch),
            SERVICE + "GetPreferredAllocation": MethodSpec(self.get_preferred_allocation),
            SERVICE + "Allocate": MethodSpec(self.allocate),
            SERVICE + "PreStartContainer": MethodSpec(self.pre_start_container),
        }

    # Unary methods answer a request's bytes with the response's (see grpc_server.MethodSpec).

    def get_device_plugin_options(self, data: bytes, call: Call) -> bytes:
        wire.check_request(data, wire.EMPTY, "Empty")
        self._link.options_called(call.connection)
        return self._options

    async def list_and_watch(self, call: Call) -> None:
        wire.check_request(await call.receive(), wire.EMPTY, "Empty")
        is_kubelet = self._link.stream_opened(call.connection)
        try:
            await self._plugin.feed.stream(call.send)
        finally:
            self._link.stream_closed(is_kubelet)

    def get_preferred_allocation(self, data: bytes, call: Call) -> bytes:
        wire.check_request(data, wire.PREFERRED_ALLOCATION_REQUEST, "PreferredAllocationRequest")
        raise GRPCError(
            Status.UNIMPLEMENTED,
            "GetPreferredAllocation is not offered: every share is the same device",
        )

    def allocate(self, data: bytes, call: Call) -> bytes:
        inventory = self._plugin.inventory
        try:
            containers = wire.read_allocate_request(
                data, MAX_CONTAINER_REQUESTS, len(inventory.devices), inventory.longest_id
            )
            return encode_allocate_response(tuple(self._plugin.allocate(containers)))
        except (wire.WireError, wire.TooMany, wire.TooLong) as exc:
            refused = self._unreadable("AllocateRequest", exc)
        except GRPCError as exc:
            refused = exc
        # --v=1 logs each Allocate: a refused one with the reason kubelet is given.
        log.log(V1, "Allocate %s refused, %s: %s", self._plugin.spec.name, refused.status.name,
                refused.message)  # fmt: skip
        raise refused

    def pre_start_container(self, data: bytes, call: Call) -> bytes:
        inventory = self._plugin.inventory
        try:
            device_ids = wire.read_device_ids(data, len(inventory.devices), inventory.longest_id)
        except (wire.WireError, wire.TooMany, wire.TooLong) as exc:
            raise self._unreadable("PreStartContainerRequest", exc) from None
        self._plugin.pre_start_container(device_ids)
        return b""

    def _unreadable(
        self, name: str, exc: wire.WireError | wire.TooMany | wire.TooLong
    ) -> GRPCError:
        """A request that is malformed, or too large for this resource: INVALID_ARGUMENT."""
        resource, inventory = self._plugin.spec.name, self._plugin.inventory
        if isinstance(exc, wire.TooManyContainers):
            why = f"{name} has more than {MAX_CONTAINER_REQUESTS} container requests"
        elif isinstance(exc, wire.TooMany):
            why = (
                f"{name} names more device IDs than the {len(inventory.devices)} {resource} "
                "advertises"
            )
        elif isinstance(exc, wire.TooLong):
            why = (
                f"{name} names a device ID of {exc.size} bytes, longer than any of "
                f"{resource}'s ({inventory.longest_id} bytes at most)"
            )
        else:
            why = f"cannot decode {name}: {exc}"
        return GRPCError(Status.INVALID_ARGUMENT, why)


@functools.lru_cache(maxsize=256)
def encode_allocate_response(grants: tuple[Grant, ...]) -> bytes:
    """An AllocateResponse, one ContainerAllocateResponse per grant.

    A grant is a pure function of the devices named, and kubelet names one share at a time:
    each answer is encoded once, as the device list is (betterproto2 takes some 100 µs).
    """
    return bytes(
        api.AllocateResponse(
            container_responses=[
                api.ContainerAllocateResponse(
                    envs=dict(given.envs),
                    mounts=[
                        api.Mount(
                            container_path=mount.container_path,
                            host_path=mount.host_path,
                            read_only=mount.read_only,
                        )
                        for mount in given.mounts
                    ],
                    devices=[
                        api.DeviceSpec(
                            container_path=node.container_path,
                            host_path=node.host_path,
                            permissions=node.permissions,
                        )
                        for node in given.device_nodes
                    ],
                    cdi_devices=[api.CdiDevice(name=name) for name in given.cdi_devices],
                )
                for given in grants
            ]
        )
    )
