"""Preparing claims: what kubelet's NodePrepareResources and NodeUnprepareResources do.

Kubelet names each claim (namespace, name, UID) and sends nothing of its allocation, so the
driver reads the claim from the API server and takes the results of its own driver. A
prepared claim gets a CDI spec of its own (the device node and mounts of the resource, as in
the device-plugin mode's specs) and a record in the checkpoint (checkpoint.py) before kubelet
hears of it. Both calls are idempotent and always answer with every device of the claim:
kubelet may ask twice.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import trio

from pcc_plugin import cdi
from pcc_plugin.dra.checkpoint import (
    Checkpoint,
    Claims,
    LockBusy,
    PreparedClaim,
    PreparedDevice,
    claims_of,
)
from pcc_plugin.dra.kube import RequestFailed, describe_error, retrying, status_code
from pcc_plugin.inventory import Inventory
from pcc_plugin.klog import V1
from pcc_plugin.limits import DEFAULT, Limits
from pcc_plugin.state import ResourceState

log = logging.getLogger(__name__)


# Reads a ResourceClaim as JSON (namespace, name); raises kube.RequestFailed.
GetClaim = Callable[[str, str], Awaitable[dict[str, Any]]]


@attrs.frozen
class ClaimRef:
    """A claim as kubelet names it."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


class ClaimError(Exception):
    """This claim cannot be prepared now; kubelet gets the message and tries again later.
    `reason` names the stage, as /metrics counts it (api, claim, unhealthy, cdi)."""

    def __init__(self, message: str, reason: str = "claim") -> None:
        super().__init__(message)
        self.reason = reason


@attrs.define(eq=False)
class Preparer:
    """Prepares and unprepares the claims of this driver's devices on this node."""

    driver: str
    node: str
    inventory: Inventory
    state: ResourceState
    checkpoint: Checkpoint
    cdi_dir: Path
    owner: str
    get_claim: GetClaim
    # What a call may hold (`claims`, `claim_bytes`); its deadlines: claims read within
    # `read_claims_timeout`, every call (claims read, the lock waited for, the work done)
    # answered within `answer_within`.
    limits: Limits = DEFAULT

    async def prepare(self, claims: list[ClaimRef]) -> dict[str, PreparedClaim | str]:
        """Each claim as prepared, or why it cannot be now.

        1. The claims not prepared before (as the checkpoint says now) are read from the API
           server, all at once, without the lock: a stalled read holds up no other call.
        2. Under the checkpoint's lock, a claim prepared before gets the same answer (its CDI
           spec written again if it was lost: /var/run/cdi is a tmpfs); a new one gets this
           driver's devices of its allocation, a CDI spec, and a record.
        3. The checkpoint is written as the lock is let go, before kubelet hears the answers.
        """
        deadline = trio.current_time() + self.limits.answer_within
        known = self.checkpoint.peek()
        read = await self._read([claim for claim in claims if claim.uid not in known])
        answers: dict[str, PreparedClaim | str] = {}
        new: list[tuple[ClaimRef, PreparedClaim]] = []
        try:
            async with self.checkpoint.locked(deadline - trio.current_time()) as prepared:
                for claim in claims:
                    try:
                        answers[claim.uid] = self._prepare(claim, prepared, read, new)
                    except ClaimError as exc:
                        self.state.prepare_failed(exc.reason)
                        log.warning("NodePrepareResources %s: %s", claim, exc)
                        answers[claim.uid] = str(exc)
                self._count(prepared)
        except (OSError, LockBusy) as exc:
            self.state.prepare_failed(_stage(exc), len(claims))
            return dict.fromkeys((claim.uid for claim in claims), self._unrecorded(exc))
        # Said once recorded: a claim the checkpoint could not keep was never prepared.
        for claim, done in new:
            names = ", ".join(device.device for device in done.devices)
            log.info("NodePrepareResources %s: %s", claim, names or "no device of this driver")
        return answers

    async def unprepare(self, claims: list[ClaimRef]) -> dict[str, str | None]:
        """For each claim, None once it is unprepared (also if it never was), else why not:
        its CDI spec removed (this driver's, whichever instance name wrote it, if the claim
        is in its checkpoint; else only if this instance wrote it), then its record."""
        answers: dict[str, str | None] = {}
        done: list[tuple[ClaimRef, str]] = []
        try:
            async with self.checkpoint.locked(self.limits.answer_within) as prepared:
                for claim in claims:
                    try:
                        # The spec's name is this driver's and the claim's: whoever wrote it
                        # (another --instance-name, a run that crashed before its checkpoint),
                        # the claim is gone from the node.
                        cdi.remove_claim_spec(
                            self.cdi_dir, self.driver, claim.uid, self.owner, any_instance=True
                        )
                    except OSError as exc:
                        self.state.unprepare_failed("cdi")
                        answers[claim.uid] = f"cannot remove its CDI spec: {exc}"
                        continue
                    known = prepared.pop(claim.uid, None) is not None
                    self.state.unprepared("ok")
                    what = "unprepared" if known else "not prepared here, nothing to do"
                    done.append((claim, what))
                    answers[claim.uid] = None
                self._count(prepared)
        except (OSError, LockBusy) as exc:
            self.state.unprepare_failed(_stage(exc), len(claims))
            return dict.fromkeys((claim.uid for claim in claims), self._unrecorded(exc))
        for claim, what in done:
            log.log(V1, "NodeUnprepareResources %s: %s", claim, what)
        return answers

    async def restore_specs(self) -> None:
        """At start: write the spec of every checkpointed claim that lost it (a reboot). Under
        the lock, however long it takes: another instance may be unpreparing one of them."""
        try:
            async with self.checkpoint.locked() as prepared:
                written = 0
                for uid, claim in prepared.items():
                    if self._spec_lost(uid, claim):
                        try:
                            self._write_spec(uid, claim)
                            written += 1
                        except ClaimError as exc:
                            log.error("Prepared claim %s: %s", uid, exc)
                log.log(V1, "Checked the CDI specs of %d prepared claims: %d written again",
                        len(prepared), written)  # fmt: skip
                self._count(prepared)
        except OSError as exc:
            log.error("Prepared claims' CDI specs not checked: %s", exc)

    def salvage(self) -> Claims:
        """The prepared claims the CDI specs record: what an unreadable checkpoint held, as
        far as a reboot left the specs (kubelet prepares the others again)."""
        return claims_of(cdi.claim_records(self.cdi_dir, self.driver))

    async def forget_deleted_claims(self) -> None:
        """At start: forget the checkpointed claims whose ResourceClaim is gone (or was
        created again, a new UID), which kubelet will never unprepare (a pod force-deleted
        while the driver was away), their CDI specs with them. A claim in use cannot be
        deleted (its finalizer), so a claim that is gone is used by no pod here. Asked until
        the API server answers, once per claim."""
        backoff, outage = retrying(log)
        left = self.checkpoint.peek()
        while left:
            uid, claim = next(iter(left.items()))
            try:
                found = await self.get_claim(claim.namespace, claim.name)
            except RequestFailed as error:
                if status_code(error) != 404:
                    outage.failed(f"Checking prepared claim {claim.namespace}/{claim.name} "
                                  f"({uid}) failed: {describe_error(error)}")  # fmt: skip
                    await trio.sleep(backoff.next_delay())
                    continue
                found = {}
            del left[uid]
            if (found.get("metadata") or {}).get("uid") == uid:
                continue
            try:
                async with self.checkpoint.locked() as prepared:
                    if prepared.pop(uid, None) is None:
                        continue
                    cdi.remove_claim_spec(self.cdi_dir, self.driver, uid, self.owner,
                                          any_instance=True)  # fmt: skip
            except OSError as exc:
                log.error("Prepared claim %s/%s (%s) is deleted, but cannot be forgotten: %s",
                          claim.namespace, claim.name, uid, exc)  # fmt: skip
                continue
            log.info("Prepared claim %s/%s (%s) was deleted from the API server: forgotten, "
                     "its CDI spec removed", claim.namespace, claim.name, uid)  # fmt: skip
        outage.over()

    def _prepare(
        self,
        claim: ClaimRef,
        prepared: Claims,
        read: dict[str, dict[str, Any] | ClaimError],
        new: list[tuple[ClaimRef, PreparedClaim]],
    ) -> PreparedClaim:
        """The claim as prepared before, or prepared now (added to `prepared` and `new`)."""
        if claim.uid in prepared:
            again = prepared[claim.uid]
            if self._spec_lost(claim.uid, again):
                log.info("CDI spec of prepared claim %s is missing: writing it again", claim)
                self._write_spec(claim.uid, again)
            self.state.prepared("ok")
            return again
        found = read.get(claim.uid)
        if found is None:
            # Prepared when this call looked, unprepared by another call since.
            raise ClaimError("it was unprepared while this call prepared it; kubelet tries again")
        if isinstance(found, ClaimError):
            raise found
        now = PreparedClaim(claim.namespace, claim.name, self._allocated(claim, found))
        if now.devices:
            self._write_spec(claim.uid, now)
        prepared[claim.uid] = now
        new.append((claim, now))
        self.state.prepared("ok")
        return now

    async def _read(self, claims: list[ClaimRef]) -> dict[str, dict[str, Any] | ClaimError]:
        """Each claim as the API server has it, read at once, or why it could not be read."""
        late = ClaimError(
            f"reading the ResourceClaim took over {self.limits.read_claims_timeout} s", "api"
        )
        found: dict[str, dict[str, Any] | ClaimError] = dict.fromkeys(
            (claim.uid for claim in claims), late
        )

        async def read(claim: ClaimRef) -> None:
            try:
                found[claim.uid] = await self.get_claim(claim.namespace, claim.name)
            except RequestFailed as error:
                found[claim.uid] = (
                    ClaimError("the ResourceClaim does not exist")
                    if status_code(error) == 404
                    else ClaimError(
                        f"cannot read the ResourceClaim: {describe_error(error)}", "api"
                    )
                )

        with trio.move_on_after(self.limits.read_claims_timeout):
            async with trio.open_nursery() as nursery:
                for claim in claims:
                    nursery.start_soon(read, claim)
        return found

    def _allocated(self, claim: ClaimRef, read: dict[str, Any]) -> tuple[PreparedDevice, ...]:
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
        devices = []
        for result in (allocation.get("devices") or {}).get("results") or []:
            if result.get("driver") != self.driver:
                continue
            name = result.get("device")
            if result.get("pool") != self.node:
                raise ClaimError(
                    f"device {name} is allocated from pool {result.get('pool')}, not from this "
                    f"node's pool {self.node}"
                )
            device = self.inventory.get(name)
            if device is None:
                raise ClaimError(f"device {name} is not one of this node's")
            if device.problem:
                raise ClaimError(f"device {name} is unhealthy: {device.problem}", "unhealthy")
            # A subrequest's results name it `request/subrequest`; containers name the request.
            request = str(result.get("request", "")).partition("/")[0]
            devices.append(PreparedDevice((request,), self.node, name))
        return tuple(devices)

    def _spec_lost(self, uid: str, claim: PreparedClaim) -> bool:
        """Whether a prepared claim with devices has no CDI spec (/var/run/cdi is a tmpfs)."""
        return (
            bool(claim.devices) and not cdi.claim_spec_path(self.cdi_dir, self.driver, uid).exists()
        )

    def _write_spec(self, uid: str, claim: PreparedClaim) -> None:
        """The spec of a claim this driver prepared: its own, whichever instance name wrote a
        spec there before."""
        device = self.inventory.get(claim.devices[0].device)
        if device is None:
            raise ClaimError(f"device {claim.devices[0].device} is no longer one of this node's")
        try:
            cdi.write_claim_spec(
                self.cdi_dir, self.driver, uid, self.inventory.spec, device, self.owner,
                attrs.asdict(claim),
            )  # fmt: skip
        except (OSError, cdi.CdiConflict) as exc:
            raise ClaimError(f"cannot write its CDI spec: {exc}", "cdi") from None

    def _count(self, prepared: Claims) -> None:
        self.state.prepared_devices = sum(len(claim.devices) for claim in prepared.values())

    def _unrecorded(self, error: OSError | LockBusy) -> str:
        """Kubelet retries; the operator reads why in the pod's events and here."""
        if isinstance(error, LockBusy):
            problem = str(error)
        else:
            problem = f"cannot record prepared claims in {self.checkpoint.directory}: {error}"
        log.error("%s", problem)
        return problem


def _stage(error: OSError | LockBusy) -> str:
    return "lock" if isinstance(error, LockBusy) else "checkpoint"
