"""The device-plugin mode's answers to kubelet: the DevicePlugin service's five calls.

`DevicePlugin` is one resource's answers, across generations: the device list every
ListAndWatch stream gets, Allocate and PreStartContainer, and with --cdi its CDI spec, kept as
the devices are; `methods` serves them on one generation's socket. Requests are
read by `wire` within limits that follow the resource: an Allocate names at most as many
device IDs as the resource advertises, in at most `Limits.container_requests` container
requests (kubelet sends one). Client mistakes are INVALID_ARGUMENT, a gone device
FAILED_PRECONDITION.
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
from pcc_plugin.limits import DEFAULT, Limits
from pcc_plugin.resource import Device, Grant, ResourceSpec, grant
from pcc_plugin.state import ResourceState

log = logging.getLogger(__name__)

SERVICE = "/v1beta1.DevicePlugin/"


class DeviceFeed:
    """The encoded device list, and a wake-up for every stream (an asyncio task) when it
    changes; `publish` is called from trio or asyncio code alike, on the one thread."""

    def __init__(self) -> None:
        self._payload = b""
        self._changed = asyncio.Event()

    def publish(self, payload: bytes) -> None:
        self._payload = payload
        self._changed.set()
        self._changed = asyncio.Event()

    async def stream(self, send: Callable[[bytes], Awaitable[None]]) -> None:
        """Send the list now and again after every change, until cancelled."""
        while True:
            changed = self._changed
            await send(self._payload)
            await changed.wait()


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
        limits: Limits = DEFAULT,
    ) -> None:
        self.spec = spec
        self.limits = limits
        self.state = state
        self._cdi_spec_dir = cdi_spec_dir
        self._instance_name = instance_name
        # Why the spec is not in place (then Allocate names no CDI device), or None.
        self._cdi_problem: str | None = None
        # Shares of one device are alike: there is no preference to give.
        self.options = api.DevicePluginOptions(
            pre_start_required=pre_start_check, get_preferred_allocation_available=False
        )
        self._options = bytes(self.options)
        self.feed = DeviceFeed()
        self.inventory = Inventory(spec, host_root, state, self._devices_changed)

    def _devices_changed(self, devices: tuple[Device, ...]) -> None:
        self.feed.publish(encode_listing(devices))
        if self._cdi_spec_dir is not None:
            problem = cdi.write_spec(self._cdi_spec_dir, self.spec, devices, self._instance_name)
            if problem and problem != self._cdi_problem:
                log.error("%s", problem)
            self._cdi_problem = problem

    def methods(self) -> dict[str, MethodSpec]:
        """The service, as one generation's socket serves it."""
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
        return self._options

    async def list_and_watch(self, call: Call) -> None:
        wire.check_request(await call.receive(), wire.EMPTY, "Empty")
        await self.feed.stream(call.send)

    def get_preferred_allocation(self, data: bytes, call: Call) -> bytes:
        # Not offered, so nothing of the request is read: only that it is a message at all.
        wire.check_request(data, wire.EMPTY, "PreferredAllocationRequest")
        raise GRPCError(
            Status.UNIMPLEMENTED,
            "GetPreferredAllocation is not offered: every share is the same device",
        )

    def allocate(self, data: bytes, call: Call) -> bytes:
        limits = self.limits
        try:
            containers = wire.read_allocate_request(
                data, limits.container_requests, len(self.inventory.devices),
                self.inventory.longest_id,
            )  # fmt: skip
            return encode_allocate_response(tuple(self.grants(containers)))
        except (wire.WireError, wire.TooMany, wire.TooLong) as exc:
            refused = self._unreadable("AllocateRequest", exc)
        except GRPCError as exc:
            refused = exc
        # --v=1 logs each Allocate: a refused one with the reason kubelet is given.
        log.log(V1, "Allocate %s refused, %s: %s", self.spec.name, refused.status.name,
                refused.message)  # fmt: skip
        raise refused

    def grants(self, containers: list[list[str]]) -> list[Grant]:
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
            given = [[node.host_path for node in each.device_nodes] for each in grants]
            log.log(V1, "Allocate %s: %s -> %s", self.spec.name, containers, given)
        return grants

    def _grant(self, devices: list[Device]) -> Grant:
        given = grant(self.spec, devices)
        # A runtime fails a container whose CDI device no spec names.
        if self._cdi_spec_dir is None or self._cdi_problem:
            return given
        return attrs.evolve(given, cdi_devices=tuple(cdi.qualified_names(self.spec, devices)))

    def pre_start_container(self, data: bytes, call: Call) -> bytes:
        """Check, before a container starts, that its devices are still there (if asked to)."""
        try:
            device_ids = wire.read_device_ids(
                data, len(self.inventory.devices), self.inventory.longest_id
            )
        except (wire.WireError, wire.TooMany, wire.TooLong) as exc:
            raise self._unreadable("PreStartContainerRequest", exc) from None
        devices = self._devices_named("PreStartContainerRequest", device_ids)
        if self.options.pre_start_required:
            # One fresh look at the node; each device's problem includes the shared ones.
            self.inventory.refresh()
            for device in devices:
                now = self.inventory.get(device.id)
                if now and now.problem:
                    raise GRPCError(
                        Status.FAILED_PRECONDITION, f"cannot start the container: {now.problem}"
                    )
        return b""

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

    def _unreadable(
        self, name: str, exc: wire.WireError | wire.TooMany | wire.TooLong
    ) -> GRPCError:
        """A request that is malformed, or too large for this resource: INVALID_ARGUMENT."""
        resource, count = self.spec.name, len(self.inventory.devices)
        if isinstance(exc, wire.TooManyContainers):
            why = f"{name} has more than {self.limits.container_requests} container requests"
        elif isinstance(exc, wire.TooMany):
            why = f"{name} names more device IDs than the {count} {resource} advertises"
        elif isinstance(exc, wire.TooLong):
            why = (
                f"{name} names a device ID of {exc.size} bytes, longer than any of "
                f"{resource}'s ({self.inventory.longest_id} bytes at most)"
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
