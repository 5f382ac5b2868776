"""How the ResourceSlices show a device that is not healthy: tainted, or withdrawn.

Where the API server serves device taints (KEP-5055, the DRADeviceTaints feature: GA and on
in 1.37, beta and on in 1.36, off before), an unhealthy device stays listed with the taint
`<driver>/unhealthy=<cause>:NoSchedule`, the cause naming the host path and what is wrong with
it (`dev-sev-guest-missing`, `var-run-pcc-not-a-directory`): the scheduler gives it to no new
claim that does not tolerate the taint, and whoever reads the slice sees why. A taint keeps
the time it was added (`timeAdded`), however often the slice is written again and across
restarts of the driver (read back from the slice): tolerationSeconds count from it.

`--unhealthy-taint-effect=NoExecute` makes kube-controller-manager's device-taint-eviction
controller also evict the pods whose claims hold the device, for operators who want pods that
can no longer attest gone. Only for a problem that lasts: the device is tainted NoSchedule at
once, and NoExecute once the problem has lasted `NO_EXECUTE_AFTER` (a restart of the PCC
service that recreates its directory takes a second or two; an eviction ends every
confidential pod of the node).

An API server without device taints drops the field, and a tainted device would stay
allocatable: there the device is withdrawn from the pool instead. Which one is learnt from
the API server's answers to the driver's own writes: one that comes back without the taints
it was sent turns tainting off (and the slices are written again at once, the device
withdrawn); while it is off, a device that becomes unhealthy asks again, with a dry-run
create of a slice that carries a taint. Each change is said.
"""

from __future__ import annotations

import datetime
import logging
import time
from collections.abc import Iterable
from typing import Any

import attrs
import trio

from pcc_plugin.dra.kube import Api
from pcc_plugin.flags import TAINT_EFFECTS
from pcc_plugin.resource import Device

log = logging.getLogger(__name__)

KEY_NAME = "unhealthy"
# Devices in a slice where any has a taint (resource.k8s.io/v1's limit); without, 128.
MAX_TAINTED_DEVICES_PER_SLICE = 64
RESOURCE_API = "resource.k8s.io/v1"
# A problem lasts this long before its taint evicts (with --unhealthy-taint-effect=NoExecute).
NO_EXECUTE_AFTER = 30.0
NO_SCHEDULE = "NoSchedule"
NO_EXECUTE = "NoExecute"


def _now() -> float:
    return time.time()


def kubernetes_time(epoch: float) -> str:
    """A Kubernetes time (RFC 3339, whole seconds, UTC), as the API server keeps it."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def _epoch(text: Any) -> float | None:
    try:
        return datetime.datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


@attrs.define
class Since:
    """When a device's problem began: its cause, in wall-clock time (what timeAdded says) and
    on trio's clock (what the NoExecute wait counts on)."""

    cause: str
    epoch: float
    clock: float


@attrs.define
class Unhealthy:
    """What the slices do with the unhealthy devices: tainted while `tainting` (until an
    answer of the API server says it drops taints), else withdrawn. `seen` is told of every
    change of the devices, from the start: it keeps when each device's problem began."""

    driver: str
    effect: str = TAINT_EFFECTS[0]
    tainting: bool = True
    # Whether an answer showed the taints kept (said once); whether a dry run is to ask
    # again, while withdrawing.
    confirmed: bool = False
    probe_due: bool = False
    _since: dict[str, Since] = attrs.Factory(dict)

    @property
    def key(self) -> str:
        return f"{self.driver}/{KEY_NAME}"

    def seen(self, devices: tuple[Device, ...]) -> None:
        now, clock = _now(), trio.current_time()
        since = {}
        for device in devices:
            if device.healthy:
                continue
            cause = device.cause or KEY_NAME
            before = self._since.get(device.id)
            since[device.id] = before if before and before.cause == cause else (
                Since(cause, now, clock)
            )  # fmt: skip
        if not self.tainting and set(since) - set(self._since):
            # A device newly unhealthy while withdrawing: the API server may serve taints by now.
            self.probe_due = True
        self._since = since

    def recall(self, slices: Iterable[dict[str, Any]]) -> None:
        """Take a problem's beginning from the taint a slice already carries for it (written
        by an earlier run), if earlier than this run saw it begin."""
        for obj in slices:
            for device in (obj.get("spec") or {}).get("devices") or []:
                since = self._since.get(str(device.get("name")))
                for taint in device.get("taints") or []:
                    if since is None or taint.get("key") != self.key:
                        continue
                    if taint.get("value") != since.cause:
                        continue
                    added = _epoch(taint.get("timeAdded"))
                    if added is None:
                        continue
                    if taint.get("effect") == NO_EXECUTE:
                        added -= NO_EXECUTE_AFTER
                    if added < since.epoch:
                        since.clock -= since.epoch - added
                        since.epoch = added

    def listed(self, device: Device) -> bool:
        return device.healthy or self.tainting

    def taints(self, device: Device) -> list[dict[str, str]]:
        if device.healthy or not self.tainting:
            return []
        since = self._since[device.id]
        effect, added = self.effect, since.epoch
        if effect == NO_EXECUTE:
            if trio.current_time() - since.clock < NO_EXECUTE_AFTER:
                effect = NO_SCHEDULE
            else:
                added += NO_EXECUTE_AFTER
        return [{"key": self.key, "value": since.cause, "effect": effect,
                 "timeAdded": kubernetes_time(added)}]  # fmt: skip

    def due_in(self) -> float | None:
        """Seconds until a NoSchedule taint is due to become NoExecute; None if none is."""
        if self.effect != NO_EXECUTE or not self.tainting:
            return None
        now = trio.current_time()
        waits = [since.clock + NO_EXECUTE_AFTER - now for since in self._since.values()]
        return min((wait for wait in waits if wait > 0), default=None)

    def answered(self, kept: bool) -> None:
        """The API server's answer to a write with taints: whether it kept them."""
        if kept and not self.confirmed:
            self.confirmed = True
            self._say("the API server serves device taints")
        elif not kept:
            self.tainting = self.confirmed = False
            self._say("the API server dropped a device taint it was sent (DRADeviceTaints is off)")

    def probed(self, served: bool) -> None:
        """The answer to a dry run, asked while withdrawing."""
        self.probe_due = False
        if served:
            self.tainting = self.confirmed = True
            self._say("the API server serves device taints")

    def _say(self, why: str) -> None:
        log.info("Unhealthy devices will be %s: %s", self.describe(), why)
        if not self.tainting and self.effect != TAINT_EFFECTS[0]:
            log.warning(
                "--unhealthy-taint-effect=%s cannot be honoured without device taints: pods "
                "keep running on a device that goes",
                self.effect,
            )

    def say_at_start(self) -> None:
        """What the driver will do, before any answer of the API server told it."""
        log.info("Unhealthy devices will be %s where the API server keeps device taints (its "
                 "answer to the first one tells; else they are withdrawn)",
                 self.describe())  # fmt: skip

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
