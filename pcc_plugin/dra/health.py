"""The devices' health in the pods' status (KEP-4680): kubelet's DRAResourceHealth stream.

Kubelet opens NodeWatchResources on the DRA socket of a driver whose registration lists the
service (`SERVICES`), when its ResourceHealthStatus feature gate is on (beta and on by default
since 1.36), and holds it open. The driver sends every device's health at once, again at each
change of the inventory, and again every `RESEND_EVERY` without one: kubelet trusts a report
for `HEALTH_TIMEOUT` and then says Unknown, and it forgets all of a driver's reports whenever
one of its streams ends (the old pod's in a rolling update), so a resend also fills that gap.
Kubelet writes each device's health into the status of the pods whose claims hold it:
`status.containerStatuses[].allocatedResourcesStatus[].resources[]`, the resource ID being the
claim's CDI device, with the device's problem as the message.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import trio

from pcc_plugin import wire
from pcc_plugin._proto import v1 as api
from pcc_plugin.bridge import call_asyncio, call_trio
from pcc_plugin.grpc_server import Call, MethodSpec
from pcc_plugin.klog import V1
from pcc_plugin.resource import Device

log = logging.getLogger(__name__)

# As registrations list them, newest first: kubelet 1.37 takes v1, the kubelets before know only
# v1alpha1. Both carry the same messages, encoded once.
SERVICES = ["v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"]
WATCH = "NodeWatchResources"
PATHS = tuple(f"/{service}/{WATCH}" for service in SERVICES)
RESEND_EVERY = 30.0
# Seconds: a report outlives two resends that are late or lost.
HEALTH_TIMEOUT = 90
# Kubelet keeps this many characters of a message.
MAX_MESSAGE_CHARS = 1024


class HealthFeed:
    """Every device's health as the streams send it, kept by `update` (the inventory's
    listener, on trio's side)."""

    def __init__(self, pool: str) -> None:
        self.pool = pool
        self._devices: tuple[Device, ...] = ()
        # When the devices were last looked at and found changed (Unix seconds).
        self._since = 0
        self._changed = trio.Event()

    def update(self, devices: tuple[Device, ...]) -> None:
        self._devices = devices
        self._since = int(time.time())
        self._changed.set()
        self._changed = trio.Event()

    def report(self) -> bytes:
        """A NodeWatchResourcesResponse with every device."""
        return bytes(
            api.NodeWatchResourcesResponse(
                devices=[
                    api.DeviceHealth(
                        device=api.DeviceIdentifier(pool_name=self.pool, device_name=device.id),
                        health=api.HealthStatus.HEALTHY
                        if device.healthy
                        else api.HealthStatus.UNHEALTHY,
                        last_updated_time=self._since,
                        health_check_timeout_seconds=HEALTH_TIMEOUT,
                        message=(device.problem or "")[:MAX_MESSAGE_CHARS],
                    )
                    for device in self._devices
                ]
            )
        )

    async def stream(self, send: Callable[[bytes], Awaitable[object]]) -> None:
        """Send the report now, at each change, and after RESEND_EVERY without one; until
        cancelled."""
        while True:
            changed = self._changed
            await send(self.report())
            with trio.move_on_after(RESEND_EVERY):
                await changed.wait()


def health_methods(feed: HealthFeed) -> dict[str, MethodSpec]:
    """NodeWatchResources, in both versions kubelet may pick, on the DRA socket."""
    said = False

    async def watch(call: Call) -> None:
        nonlocal said
        wire.check_request(await call.receive(), wire.EMPTY, "NodeWatchResourcesRequest")
        service = call.path.strip("/").partition("/")[0]
        # Said once per generation (kubelet opens one stream as it registers the driver): it
        # tells the operator that kubelet puts the devices' health into the pods' status. Any
        # more come from elsewhere, and must not flood the log.
        log.log(V1 if said else logging.INFO, "Kubelet watches the devices' health (%s)", service)
        said = True

        async def send(payload: bytes) -> None:
            await call_asyncio(call.send, payload)

        try:
            await call_trio(feed.stream, send)
        finally:
            log.log(V1, "Kubelet's %s stream ended", service)

    return {path: MethodSpec(stream=watch) for path in PATHS}
