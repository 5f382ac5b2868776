"""Preparing claims: what kubelet's NodePrepareResources and NodeUnprepareResources do.

Kubelet names each claim (namespace, name, UID) and sends nothing of its allocation, so the
driver reads the claim from the API server and takes the results of its own driver. A
prepared claim gets a CDI spec of its own (the device node and mounts of the resource, as
in the device-plugin mode's specs) and is written to a checkpoint on the host's disk before
kubelet hears of it, so a driver started again (a restart, a rollout, a reboot) knows what
it prepared, unprepares it, and writes the spec again when kubelet prepares a claim whose
spec was lost (/var/run/cdi is a tmpfs). Both calls are idempotent and always answer with
every device of the claim: kubelet may ask twice.

One call at a time, across instances too: during a rolling update either instance may be
asked, so the checkpoint is read and written under a file lock beside it (`serialize.lock`,
as upstream's kubeletplugin helper names it).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from pcc_plugin import cdi
from pcc_plugin.dra.kube import RequestFailed, describe_error, status_code
from pcc_plugin.inventory import Inventory
from pcc_plugin.klog import V1
from pcc_plugin.state import ResourceState

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.json"
LOCK = "serialize.lock"
CHECKPOINT_VERSION = 1
# Reading the claims of one call from the API server: well inside grpc_server.UNARY_TIMEOUT
# (30 s), itself inside kubelet's 45 s, so that kubelet always hears why a claim failed.
READ_CLAIMS_TIMEOUT = 20.0


@attrs.frozen
class ClaimRef:
    """A claim as kubelet names it."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@attrs.frozen
class PreparedDevice:
    requests: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]


class ClaimError(Exception):
    """This claim cannot be prepared now; kubelet gets the message and tries again later."""


# Reads a ResourceClaim as JSON (namespace, name); raises kube.RequestFailed.
GetClaim = Callable[[str, str], Awaitable[dict[str, Any]]]


class Preparer:
    """The claims this driver prepared on this node, on disk in `state_dir`."""

    def __init__(
        self,
        driver: str,
        node: str,
        inventory: Inventory,
        state: ResourceState,
        state_dir: Path,
        cdi_dir: Path,
        owner: str,
        get_claim: GetClaim,
    ) -> None:
        self.driver = driver
        self.node = node
        self.inventory = inventory
        self.state = state
        self.state_dir = state_dir
        self.cdi_dir = cdi_dir
        self.owner = owner
        self.get_claim = get_claim
        self._lock = trio.Lock()

    # The checkpoint

    def _load(self) -> dict[str, Any]:
        try:
            document = json.loads((self.state_dir / CHECKPOINT).read_bytes())
        except FileNotFoundError:
            return {}
        except ValueError as exc:
            # Kept aside, not lost: an operator can see what was prepared.
            aside = self.state_dir / f"{CHECKPOINT}.unreadable"
            os.replace(self.state_dir / CHECKPOINT, aside)
            log.error("Checkpoint %s was unreadable (%s), moved to %s; starting empty",
                      self.state_dir / CHECKPOINT, exc, aside)  # fmt: skip
            return {}
        claims = document.get("claims") if isinstance(document, dict) else None
        return claims if isinstance(claims, dict) else {}

    def _save(self, claims: dict[str, Any]) -> None:
        """Replace the checkpoint whole, on disk before kubelet hears of the change."""
        document = {"version": CHECKPOINT_VERSION, "driver": self.driver, "claims": claims}
        with tempfile.NamedTemporaryFile(
            "w", dir=self.state_dir, prefix=".checkpoint-", delete=False
        ) as temporary:
            json.dump(document, temporary, indent=1, sort_keys=True)
            temporary.flush()
            os.fsync(temporary.fileno())
        try:
            os.replace(temporary.name, self.state_dir / CHECKPOINT)
        except OSError:
            Path(temporary.name).unlink(missing_ok=True)
            raise
        directory = os.open(self.state_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)

    @contextlib.asynccontextmanager
    async def _serialized(self) -> AsyncIterator[None]:
        """One call at a time in this process (trio's lock) and across instances (flock)."""
        async with self._lock:
            descriptor = os.open(
                self.state_dir / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600
            )
            try:
                # Another instance holds it only while it writes a few files; a thread waits
                # for it, and is waited for even when cancelled, so the lock is never leaked.
                await trio.to_thread.run_sync(fcntl.flock, descriptor, fcntl.LOCK_EX)
                yield
            finally:
                os.close(descriptor)

    def restore_specs(self) -> None:
        """At start: write the spec of every checkpointed claim that lost it (a reboot)."""
        for uid, entry in self._load().items():
            devices = entry.get("devices") or []
            if devices and not cdi.claim_spec_path(self.cdi_dir, self.driver, uid).exists():
                try:
                    self._write_spec(uid, devices[0]["device"])
                except ClaimError as exc:
                    log.error("Prepared claim %s: %s", uid, exc)

    # Prepare and unprepare

    async def prepare(self, claims: list[ClaimRef]) -> dict[str, list[PreparedDevice] | str]:
        """Each claim's devices, or why it cannot be prepared now."""
        try:
            return await self._prepare(claims)
        except OSError as exc:
            self.state.prepared("failed", len(claims))
            return {claim.uid: self._unrecorded(exc) for claim in claims}

    async def unprepare(self, claims: list[ClaimRef]) -> dict[str, str | None]:
        """For each claim, None once it is unprepared (also if it never was), else why not."""
        try:
            return await self._unprepare(claims)
        except OSError as exc:
            self.state.unprepared("failed", len(claims))
            return {claim.uid: self._unrecorded(exc) for claim in claims}

    def _unrecorded(self, error: OSError) -> str:
        """Kubelet retries; the operator reads why in the pod's events and here."""
        problem = f"cannot record prepared claims in {self.state_dir}: {error}"
        log.error("%s", problem)
        return problem

    async def _prepare(self, claims: list[ClaimRef]) -> dict[str, list[PreparedDevice] | str]:
        answers: dict[str, list[PreparedDevice] | str] = {}
        async with self._serialized():
            prepared = self._load()
            unknown = [claim for claim in claims if claim.uid not in prepared]
            allocations = await self._read_allocations(unknown)
            for claim in claims:
                try:
                    if claim.uid in prepared:
                        devices = self._again(claim, prepared[claim.uid])
                    else:
                        devices = self._first_time(claim, allocations[claim.uid], prepared)
                except ClaimError as exc:
                    self.state.prepared("failed")
                    log.warning("NodePrepareResources %s (%s): %s", claim, claim.uid, exc)
                    answers[claim.uid] = str(exc)
                    continue
                self.state.prepared("ok")
                answers[claim.uid] = devices
            self._save(prepared)
        return answers

    async def _unprepare(self, claims: list[ClaimRef]) -> dict[str, str | None]:
        answers: dict[str, str | None] = {}
        async with self._serialized():
            prepared = self._load()
            for claim in claims:
                try:
                    cdi.remove_claim_spec(self.cdi_dir, self.driver, claim.uid, self.owner)
                except OSError as exc:
                    self.state.unprepared("failed")
                    answers[claim.uid] = f"cannot remove its CDI spec: {exc}"
                    continue
                known = prepared.pop(claim.uid, None) is not None
                self.state.unprepared("ok")
                log.log(V1, "NodeUnprepareResources %s (%s): %s", claim, claim.uid,
                        "unprepared" if known else "not prepared here, nothing to do")  # fmt: skip
                answers[claim.uid] = None
            self._save(prepared)
        return answers

    async def _read_allocations(
        self, claims: list[ClaimRef]
    ) -> dict[str, dict[str, Any] | ClaimError]:
        """Each claim as the API server has it, read at once, or why it could not be read."""
        found: dict[str, dict[str, Any] | ClaimError] = {
            claim.uid: ClaimError(f"reading the ResourceClaim took over {READ_CLAIMS_TIMEOUT} s")
            for claim in claims
        }

        async def read(claim: ClaimRef) -> None:
            try:
                found[claim.uid] = await self.get_claim(claim.namespace, claim.name)
            except RequestFailed as error:
                if status_code(error) == 404:
                    found[claim.uid] = ClaimError("the ResourceClaim does not exist")
                else:
                    found[claim.uid] = ClaimError(
                        f"cannot read the ResourceClaim: {describe_error(error)}"
                    )

        with trio.move_on_after(READ_CLAIMS_TIMEOUT):
            async with trio.open_nursery() as nursery:
                for claim in claims:
                    nursery.start_soon(read, claim)
        return found

    def _again(self, claim: ClaimRef, entry: dict[str, Any]) -> list[PreparedDevice]:
        """A claim prepared before: the same answer, its spec written again if it was lost."""
        devices = self._devices(claim.uid, entry)
        if devices and not cdi.claim_spec_path(self.cdi_dir, self.driver, claim.uid).exists():
            log.info("CDI spec of prepared claim %s (%s) is missing: writing it again",
                     claim, claim.uid)  # fmt: skip
            self._write_spec(claim.uid, devices[0].device)
        return devices

    def _first_time(
        self,
        claim: ClaimRef,
        read: dict[str, Any] | ClaimError,
        prepared: dict[str, Any],
    ) -> list[PreparedDevice]:
        if isinstance(read, ClaimError):
            raise read
        entry = {
            "namespace": claim.namespace,
            "name": claim.name,
            "devices": self._allocated(claim, read),
        }
        devices = self._devices(claim.uid, entry)
        if devices:
            self._write_spec(claim.uid, devices[0].device)
        prepared[claim.uid] = entry
        names = ", ".join(device.device for device in devices) or "no device of this driver"
        log.info("NodePrepareResources %s (%s): %s", claim, claim.uid, names)
        return devices

    def _allocated(self, claim: ClaimRef, read: dict[str, Any]) -> list[dict[str, Any]]:
        """This driver's devices in the claim's allocation; ClaimError if it cannot have them."""
        uid = (read.get("metadata") or {}).get("uid")
        if uid != claim.uid:
            raise ClaimError(
                f"the ResourceClaim has UID {uid}, not {claim.uid}: it was deleted and "
                "created again"
            )
        allocation = (read.get("status") or {}).get("allocation")
        if not allocation:
            raise ClaimError("the ResourceClaim is not allocated")
        results = (allocation.get("devices") or {}).get("results") or []
        devices = []
        by_id = {device.id: device for device in self.inventory.devices}
        for result in results:
            if result.get("driver") != self.driver:
                continue
            name = result.get("device")
            if result.get("pool") != self.node:
                raise ClaimError(
                    f"device {name} is allocated from pool {result.get('pool')}, not from this "
                    f"node's pool {self.node}"
                )
            device = by_id.get(name)
            if device is None:
                raise ClaimError(f"device {name} is not one of this node's")
            if device.problem:
                raise ClaimError(f"device {name} is unhealthy: {device.problem}")
            # A subrequest's results name it `request/subrequest`; containers name the request.
            request = str(result.get("request", "")).partition("/")[0]
            devices.append({"requests": [request], "pool": self.node, "device": name})
        return devices

    def _devices(self, uid: str, entry: dict[str, Any]) -> list[PreparedDevice]:
        cdi_ids = (cdi.claim_device_id(self.driver, uid),)
        return [
            PreparedDevice(tuple(device["requests"]), device["pool"], device["device"], cdi_ids)
            for device in entry.get("devices") or []
        ]

    def _write_spec(self, uid: str, device_id: str) -> None:
        by_id = {device.id: device for device in self.inventory.devices}
        device = by_id.get(device_id)
        if device is None:
            raise ClaimError(f"device {device_id} is no longer one of this node's")
        try:
            cdi.write_claim_spec(
                self.cdi_dir, self.driver, uid, self.inventory.spec, device, self.owner
            )
        except (OSError, cdi.CdiConflict) as exc:
            raise ClaimError(f"cannot write its CDI spec: {exc}") from None
