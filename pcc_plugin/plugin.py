"""One resource as kubelet sees it: its device list, kept in step with the node, and its answers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import trio

from pcc_plugin._proto import v1beta1 as api
from pcc_plugin.flags import DEFAULT_INSTANCE_NAME
from pcc_plugin.klog import V1
from pcc_plugin.resource import Device, DeviceNode, Grant, ResourceSpec, grant, take_inventory
from pcc_plugin.sensitive import OPT_IN, opted_in
from pcc_plugin.state import ResourceState

log = logging.getLogger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


class RequestError(ValueError):
    """A request that names no device or unknown ones: INVALID_ARGUMENT."""


class DeviceUnavailable(RuntimeError):
    """The device or a mount source is gone: FAILED_PRECONDITION, with the reason."""


def encode_listing(devices: tuple[Device, ...]) -> bytes:
    """The full device list, encoded once and shared by every ListAndWatch stream."""
    return bytes(
        api.ListAndWatchResponse(
            devices=[
                api.Device(id=device.id, health=HEALTHY if device.healthy else UNHEALTHY)
                for device in devices
            ]
        )
    )


class DeviceFeed:
    """The current encoded device list, and a wake-up for every stream when it changes.

    Streams wait on the asyncio side (they are gRPC handlers); `publish` is
    called from trio or asyncio code alike, on the one thread.
    """

    def __init__(self, payload: bytes) -> None:
        self._payload = payload
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


def _describe(devices: tuple[Device, ...]) -> str:
    problems = sorted({device.problem for device in devices if device.problem})
    unhealthy = sum(1 for device in devices if device.problem)
    if not unhealthy:
        return f"all {len(devices)} devices Healthy"
    if unhealthy == len(devices) and len(problems) == 1:
        return f"every device is Unhealthy: {problems[0]}"
    return f"{unhealthy} of {len(devices)} devices Unhealthy: {'; '.join(problems)}"


class DevicePlugin:
    """One resource's answers to kubelet, kept in step with the node by `refresh`."""

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
        self._host_root = host_root
        self._pre_start_check = pre_start_check
        self._cdi_spec_dir = cdi_spec_dir
        self._instance_name = instance_name
        # Why the spec is not in place (then Allocate names no CDI device), or None.
        self._cdi_problem: str | None = None
        self._seen: dict[str, DeviceNode] = {}
        self.devices: tuple[Device, ...] = ()
        self._by_id: dict[str, Device] = {}
        # In UTF-8 bytes: a request's longer ID names no device and is refused unread.
        self.longest_id = 0
        self.feed = DeviceFeed(b"")
        # Set, and replaced, at each change of the devices: what trio code waits on.
        self._changed = trio.Event()
        for hazard in opted_in(spec):
            log.warning("%s: %s; containers get it: its entry sets %s", spec.name, hazard, OPT_IN)
        self.refresh()

    def refresh(self) -> None:
        """Look at the node again; on any change publish the whole list and say why."""
        devices = take_inventory(self.spec, self._host_root, self._seen)
        if devices == self.devices:
            return
        before = _describe(self.devices) if self.devices else None
        self.devices = devices
        self._by_id = {device.id: device for device in devices}
        self.longest_id = max((len(device.id.encode()) for device in devices), default=0)
        self.state.devices_seen(devices)
        unhealthy = self.state.unhealthy_devices
        now = _describe(devices)
        if now != before:
            level = logging.WARNING if unhealthy else logging.INFO
            log.log(level, "%s: %s", self.spec.name, now)
        self.feed.publish(encode_listing(devices))
        self._changed.set()
        self._changed = trio.Event()
        if self._cdi_spec_dir is not None:
            from pcc_plugin import cdi

            problem = cdi.write_spec(self._cdi_spec_dir, self.spec, devices, self._instance_name)
            if problem and problem != self._cdi_problem:
                log.error("%s", problem)
            self._cdi_problem = problem

    def next_change(self) -> trio.Event:
        """Set at the next change of the devices."""
        return self._changed

    def options(self) -> api.DevicePluginOptions:
        # Shares of one device are alike: there is no preference to give.
        return api.DevicePluginOptions(
            pre_start_required=self._pre_start_check, get_preferred_allocation_available=False
        )

    def _devices_named(self, where: str, ids: list[str]) -> list[Device]:
        if not ids:
            raise RequestError(f"{where} names no device IDs")
        unknown = sorted(set(ids) - self._by_id.keys())
        if unknown:
            # Quoted short: the details travel in a gRPC trailer, which clients cap at 8 KiB.
            shown = ", ".join(
                repr(device_id if len(device_id) <= 64 else device_id[:64] + "...")
                for device_id in unknown[:5]
            )
            more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
            known = f"{self.devices[0].id} to {self.devices[-1].id}" if self.devices else "none"
            raise RequestError(
                f"{where} names unknown device IDs {shown}{more}; {self.spec.name} has {known}"
            )
        return [self._by_id[device_id] for device_id in ids]

    def allocate(self, containers: list[list[str]]) -> list[Grant]:
        """What each container of one Allocate call gets, by its device IDs."""
        try:
            if not containers:
                raise RequestError("AllocateRequest has no container requests")
            allocated = [
                self._devices_named(f"container request {index}", ids)
                for index, ids in enumerate(containers)
            ]
            for devices in allocated:
                for device in devices:
                    if device.problem:
                        raise DeviceUnavailable(
                            f"{self.spec.name} device {device.id} is unhealthy: {device.problem}"
                        )
        except RequestError:
            self.state.allocated("invalid")
            raise
        except DeviceUnavailable:
            self.state.allocated("unavailable")
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
        from pcc_plugin import cdi

        return attrs.evolve(given, cdi_devices=tuple(cdi.qualified_names(self.spec, devices)))

    def pre_start_container(self, device_ids: list[str]) -> None:
        """Check, before a container starts, that its devices are still there (if asked to)."""
        devices = self._devices_named("PreStartContainerRequest", device_ids)
        if self._pre_start_check:
            # One fresh look at the node; each device's problem includes the shared ones.
            self.refresh()
            for device in devices:
                problem = self._by_id[device.id].problem
                if problem:
                    raise DeviceUnavailable(f"cannot start the container: {problem}")
