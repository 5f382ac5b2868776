"""How the ResourceSlices show a device that is not healthy: tainted, or withdrawn.

Where the API server serves device taints (KEP-5055, the DRADeviceTaints feature: GA and on
in 1.37, beta and on in 1.36, off before), an unhealthy device stays listed with the taint
`<driver>/unhealthy=<cause>:NoSchedule`, the cause naming the host path and what is wrong with
it (`dev-sev-guest-missing`, `var-run-pcc-not-a-directory`): the scheduler gives it to no new
claim that does not tolerate the taint, and whoever reads the slice sees why.
`--unhealthy-taint-effect=NoExecute` makes kube-controller-manager's device-taint-eviction
controller also evict the pods whose claims hold it, for operators who want pods that can no
longer attest gone. A taint keeps the time it was first seen (`timeAdded`), however often the
slice is written again: eviction and tolerationSeconds count from it.

An API server without device taints drops the field, and a tainted device would stay
allocatable: there the device is withdrawn from the pool instead, as the driver did before
taints. `choose` asks the API server once, at start, with a dry-run create of a slice that
carries a taint (the answer keeps it or not), and says which it chose.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import attrs
import trio

from pcc_plugin.dra.kube import (
    Api,
    RequestFailed,
    describe_error,
    retrying,
    status_code,
    why_failed,
)
from pcc_plugin.flags import TAINT_EFFECTS
from pcc_plugin.resource import Device
from pcc_plugin.state import ResourceState

log = logging.getLogger(__name__)

KEY_NAME = "unhealthy"
# Devices in a slice where any has a taint (resource.k8s.io/v1's limit); without, 128.
MAX_TAINTED_DEVICES_PER_SLICE = 64
RESOURCE_API = "resource.k8s.io/v1"


def _now() -> str:
    """Now as a Kubernetes time (RFC 3339, whole seconds, UTC), as the API server keeps it."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@attrs.define
class Unhealthy:
    """What the slices do with the unhealthy devices: `tainting` once the API server was found
    to serve taints (`choose`), else withdrawal. `seen` is told of every change of the devices,
    from the start: it keeps when each device's problem began."""

    driver: str
    effect: str = TAINT_EFFECTS[0]
    tainting: bool = False
    # By device: its problem's cause, and since when (a Kubernetes time).
    _since: dict[str, tuple[str, str]] = attrs.Factory(dict)

    @property
    def key(self) -> str:
        return f"{self.driver}/{KEY_NAME}"

    def seen(self, devices: tuple[Device, ...]) -> None:
        now = _now()
        since = {}
        for device in devices:
            if device.healthy:
                continue
            cause = device.cause or KEY_NAME
            before = self._since.get(device.id)
            since[device.id] = before if before and before[0] == cause else (cause, now)
        self._since = since

    def listed(self, device: Device) -> bool:
        return device.healthy or self.tainting

    def taints(self, device: Device) -> list[dict[str, str]]:
        if device.healthy or not self.tainting:
            return []
        cause, since = self._since[device.id]
        return [{"key": self.key, "value": cause, "effect": self.effect, "timeAdded": since}]

    def describe(self) -> str:
        if self.tainting:
            return f"tainted {self.key}=<cause>:{self.effect}"
        return "withdrawn from the ResourceSlices"


def probe_slice(driver: str, node: str, key: str) -> dict[str, Any]:
    """A slice of this node with one tainted device, only ever created as a dry run."""
    return {
        "apiVersion": RESOURCE_API,
        "kind": "ResourceSlice",
        "metadata": {"generateName": f"{driver}-taint-probe-"},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "probe", "taints": [{"key": key, "effect": TAINT_EFFECTS[0]}]}],
        },
    }


async def serves_taints(api: Api, driver: str, node: str, key: str) -> bool:
    """Whether the API server keeps a device's taint (RequestFailed if it does not answer)."""
    written = await api.create_slice(probe_slice(driver, node, key), dry_run=True)
    devices = (written.get("spec") or {}).get("devices") or [{}]
    return bool(devices[0].get("taints"))


def _retried(error: RequestFailed) -> bool:
    """No answer, or one that says to come back: asked again. Other answers are final."""
    code = status_code(error)
    return code is None or code == 429 or code >= 500


async def choose(api: Api, unhealthy: Unhealthy, node: str, state: ResourceState) -> None:
    """Ask the API server whether it serves device taints (until it answers), set
    `unhealthy.tainting` and say which was chosen."""
    backoff, outage = retrying(log)
    state.slices_not_published("ResourceSlices not published yet")
    while True:
        try:
            served = await serves_taints(api, unhealthy.driver, node, unhealthy.key)
            why = "the API server serves device taints" if served else (
                "the API server dropped a device taint it was sent (DRADeviceTaints is off)"
            )  # fmt: skip
            break
        except RequestFailed as error:
            if not _retried(error):
                served = False
                why = f"a dry-run ResourceSlice with a taint was refused: {describe_error(error)}"
                break
            problem = (
                "ResourceSlices not published: asking whether the API server serves device "
                f"taints failed: {why_failed(error)}"
            )
            state.slices_not_published(problem)
            outage.failed(problem)
            await trio.sleep(backoff.next_delay())
    outage.over()
    unhealthy.tainting = served
    log.info("Unhealthy devices will be %s: %s", unhealthy.describe(), why)
    if not served and unhealthy.effect != TAINT_EFFECTS[0]:
        log.warning(
            "--unhealthy-taint-effect=%s cannot be honoured without device taints: pods keep "
            "running on a device that goes",
            unhealthy.effect,
        )
