"""The node's ResourceSlices: what they say (`desired`), and keeping them so (`publish`).

One pool, named after the node, lists the shares as devices (`pcc-0` ... by default),
`MAX_DEVICES_PER_SLICE` to a slice, each with the attributes claims select on (the resource's,
and the node's confidential computing, node_facts.py). A device that is gone, or whose PCC
directory is, stays listed with a taint where the API server serves taints, and is withdrawn
from the pool where it does not (taints.py says which and why); every change bumps the pool's
generation in each of its slices.

`publish` reads the Node (its UID owns the slices, and a Node registered again has a new
one), lists the driver's slices of this node, writes what differs, then watches them: a
slice deleted (kubelet deletes every slice of its node when it starts) or changed by someone
else is looked at again at once, and so is a change of the devices. A failed request is
retried with backoff; a 409 Conflict or 410 Gone is routine: listed again, no error. Nothing
polls.

Two instances during a rolling update may want different slices (a new attribute; health
seen a moment apart). Each stamps the slices it writes (`Instance`); an instance leaves
alone what a newer one wrote while that one is alive (its DRA socket takes connections), so
the newer one's slices win and stay. Whatever two instances want, each writes the pool at
most `WRITE_BURST` times at once and then once per `WRITE_EVERY` (`WriteBudget`).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import re
from collections.abc import Awaitable, Callable
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
from pcc_plugin.dra.node_facts import NodeFacts
from pcc_plugin.dra.taints import MAX_TAINTED_DEVICES_PER_SLICE, RESOURCE_API, Unhealthy
from pcc_plugin.klog import V1
from pcc_plugin.resource import Device, ResourceSpec
from pcc_plugin.state import ResourceState

log = logging.getLogger(__name__)

MAX_DEVICES_PER_SLICE = 128
# A watch is renewed (listed again) this often: a connection that died without a word would
# otherwise hold it forever. client-go's reflectors renew every 5 to 10 minutes.
WATCH_RENEW = 300.0
# Writes of the pool (one request per slice) an instance makes at once, then one per
# WRITE_EVERY at most: a start, a kubelet restart and a device gone and back all go out at
# once; two instances that want different slices cannot write more than that, however they
# disagree (upstream's slice controller waits 30 s, its DefaultSyncDelay, before it writes
# over a change it did not make).
WRITE_BURST = 5
WRITE_EVERY = 30.0
# Answers of the API server that are how it works, not an outage: 409 Conflict (someone else
# wrote first) and 410 Gone (a watch's resource version is too old).
ROUTINE = (409, 410)
_MAX_NAME = 253


@attrs.frozen
class Pool:
    """Who publishes: the driver, the node (and pool), and the Node's UID (its owner)."""

    driver: str
    node: str
    node_uid: str


def attributes(spec: ResourceSpec, device: Device) -> dict[str, dict[str, Any]]:
    """What a claim's selectors can use: `device.attributes["<driver>"].kind` and the rest."""
    found: dict[str, dict[str, Any]] = {
        "kind": {"string": spec.name.partition("/")[2]},
        "resourceName": {"string": spec.name[:64]},
        "share": {"int": int(device.id.rpartition("-")[2])},
    }
    if device.nodes:
        found["hostPath"] = {"string": device.nodes[0].host_path}
    if spec.mounts:
        found["mountPath"] = {"string": spec.mounts[0].host_path}
    return found


def slice_name(pool: Pool, index: int) -> str:
    """`<node>-<driver>-<index>`, or a hash of the first two when that is too long."""
    name = f"{pool.node}-{pool.driver}-{index}"
    if len(name) <= _MAX_NAME:
        return name
    digest = hashlib.sha256(f"{pool.node}/{pool.driver}".encode()).hexdigest()[:16]
    return f"{pool.node[:200]}-{digest}-{index}"


def desired(
    pool: Pool,
    spec: ResourceSpec,
    devices: tuple[Device, ...],
    unhealthy: Unhealthy | None = None,
    node: NodeFacts | None = None,
) -> list[dict[str, Any]]:
    """The slices that say what the node has now (generation left to `publish`): unhealthy
    devices withdrawn, or tainted as `unhealthy` says; the node's facts in every device.

    At least one slice, empty when every device is withdrawn: the pool stays visible. While
    tainting, a slice holds fewer devices whatever their health, so that none moves to
    another slice as its health changes.
    """
    unhealthy = unhealthy or Unhealthy(pool.driver)
    shared = node.attributes() if node else {}
    listed = []
    for device in filter(unhealthy.listed, devices):
        entry: dict[str, Any] = {"name": device.id, "attributes": attributes(spec, device) | shared}
        if taints := unhealthy.taints(device):
            entry["taints"] = taints
        listed.append(entry)
    per_slice = MAX_TAINTED_DEVICES_PER_SLICE if unhealthy.tainting else MAX_DEVICES_PER_SLICE
    starts = range(0, len(listed), per_slice)
    chunks = [listed[start : start + per_slice] for start in starts] or [[]]
    return [
        {
            "apiVersion": RESOURCE_API,
            "kind": "ResourceSlice",
            "metadata": {
                "name": slice_name(pool, index),
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Node", "name": pool.node, "uid": pool.node_uid}
                ],
            },
            "spec": {
                "driver": pool.driver,
                "nodeName": pool.node,
                "pool": {"name": pool.node, "generation": 0, "resourceSliceCount": len(chunks)},
                "devices": chunk,
            },
        }
        for index, chunk in enumerate(chunks)
    ]


def _content(obj: dict[str, Any]) -> Any:
    """What of a slice is ours to say, without the generation and who wrote it."""
    spec = obj.get("spec") or {}
    pool = spec.get("pool") or {}
    devices = [
        (device.get("name"), device.get("attributes") or {}, device.get("taints") or [])
        for device in spec.get("devices") or []
    ]
    owners = [
        (owner.get("kind"), owner.get("name"), owner.get("uid"))
        for owner in (obj.get("metadata") or {}).get("ownerReferences") or []
    ]
    return (spec.get("driver"), spec.get("nodeName"), pool.get("name"),
            pool.get("resourceSliceCount"), devices, owners)  # fmt: skip


_STARTED = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")


@attrs.frozen(order=True)
class Instance:
    """One instance of the driver, as the slices it writes name it: when it started (UTC, to
    the microsecond: the two pods of a rollout share the node's clock) and its token (the
    pod's UID, or the process's own). The one that started last is the newer."""

    started: str
    token: str

    @classmethod
    def starting(cls, token: str) -> Instance:
        now = datetime.datetime.now(datetime.UTC)
        return cls(now.strftime("%Y-%m-%dT%H:%M:%S.%fZ"), token)

    @classmethod
    def of(cls, obj: dict[str, Any], key: str) -> Instance | None:
        """The instance that wrote the slice `obj`, if an instance of this version did."""
        stamp = ((obj.get("metadata") or {}).get("annotations") or {}).get(key)
        started, _, token = str(stamp or "").partition(" ")
        return cls(started, token) if _STARTED.fullmatch(started) and token else None

    def stamp(self) -> str:
        return f"{self.started} {self.token}"


def publisher_key(driver: str) -> str:
    """The annotation that names the instance that wrote a slice."""
    return f"{driver}/publisher"


@attrs.define
class WriteBudget:
    """Writes of the pool allowed: `burst` at once, one more each `every` seconds."""

    burst: int = WRITE_BURST
    every: float = WRITE_EVERY
    tokens: float = attrs.field(default=attrs.Factory(lambda self: self.burst, takes_self=True))
    checked: float | None = None

    def wait(self) -> float:
        """0 if a write is allowed now, else how long until it is."""
        now = trio.current_time()
        if self.checked is not None:
            self.tokens = min(self.burst, self.tokens + (now - self.checked) / self.every)
        self.checked = now
        return 0.0 if self.tokens >= 1 else (1 - self.tokens) * self.every

    def spend(self) -> None:
        self.tokens -= 1


@attrs.define
class Publisher:
    """The node's slices, kept as `wanted(pool)` says, written as instance `me`; `alive` says
    whether another instance still runs."""

    api: Api
    pool: Pool
    wanted: Callable[[Pool], list[dict[str, Any]]]
    me: Instance
    alive: Callable[[Instance], bool]
    budget: WriteBudget = attrs.Factory(WriteBudget)
    # The last list's resource version: the watch starts there.
    version: str = ""
    # Resource versions of the slices written since that list: their watch events are no news.
    # The next list sees them, and the watch from it starts after them, so they are forgotten
    # there: one per slice at most.
    _written: set[str] = attrs.Factory(set)
    generation: int = 0
    # The newest instance, newer than this one, whose slices were seen; while it is alive,
    # what it wrote stays.
    newer: Instance | None = None
    _left_to: Instance | None = None

    def _selector(self) -> dict[str, str]:
        return {"spec.nodeName": self.pool.node, "spec.driver": self.pool.driver}

    def owned_by(self, node_uid: str) -> None:
        """The Node's UID as just read: the owner of the slices from now on."""
        if self.pool.node_uid and node_uid != self.pool.node_uid:
            log.info("Node %s was registered again (UID %s, was %s): its ResourceSlices are "
                     "owned by the new one", self.pool.node, node_uid,
                     self.pool.node_uid)  # fmt: skip
        self.pool = attrs.evolve(self.pool, node_uid=node_uid)

    async def reconcile(self) -> float:
        """Make the slices as wanted, or leave them to a newer instance; 0 then (and `version`
        the list's, to watch from), else how long until the budget allows the write."""
        items, self.version = await self.api.list_slices(self._selector())
        self._written.clear()
        existing = {item["metadata"]["name"]: item for item in items}
        key = publisher_key(self.pool.driver)
        for item in existing.values():
            other = Instance.of(item, key)
            if other is not None and other > max(self.me, self.newer or self.me):
                self.newer = other
        wanted = self.wanted(self.pool)
        generations = [obj["spec"]["pool"].get("generation", 0) for obj in existing.values()]
        self.generation = max([self.generation, *generations])
        names = {obj["metadata"]["name"] for obj in wanted}
        same = names == set(existing) and all(
            _content(obj) == _content(existing[obj["metadata"]["name"]]) for obj in wanted
        ) and len(set(generations)) == 1  # fmt: skip
        if same or self._leave_to_newer():
            return 0.0
        wait = self.budget.wait()
        if wait:
            log.log(V1, "ResourceSlices of pool %s: %d writes in a row, the next in %.0f s",
                    self.pool.node, self.budget.burst, wait)  # fmt: skip
            return wait
        self.budget.spend()
        self.generation += 1
        for obj in wanted:
            obj["spec"]["pool"]["generation"] = self.generation
            obj["metadata"].setdefault("annotations", {})[key] = self.me.stamp()
            name = obj["metadata"]["name"]
            if name in existing:
                obj["metadata"]["resourceVersion"] = existing[name]["metadata"]["resourceVersion"]
                written = await self.api.replace_slice(obj)
            else:
                written = await self.api.create_slice(obj)
            self._written.add(written["metadata"]["resourceVersion"])
        for name in sorted(set(existing) - names):
            await self.api.delete_slice(name)
        devices = sum(len(obj["spec"]["devices"]) for obj in wanted)
        log.info("Published %d devices in %d ResourceSlice(s) of pool %s, generation %d",
                 devices, len(wanted), self.pool.node, self.generation)  # fmt: skip
        return 0.0

    def _leave_to_newer(self) -> bool:
        """Whether a newer instance is alive: its slices stay as it wrote them."""
        newer = self.newer
        if newer is None:
            return False
        if self.alive(newer):
            if self._left_to != newer:
                self._left_to = newer
                log.info("ResourceSlices of pool %s are left to instance %s, which started "
                         "after this one (%s)", self.pool.node, newer.token,
                         newer.started)  # fmt: skip
            return True
        log.info("Instance %s, which published the ResourceSlices of pool %s, is gone: "
                 "publishing them again", newer.token, self.pool.node)  # fmt: skip
        self.newer = self._left_to = None
        return False

    async def watch(self) -> None:
        """Return on the first event that says the slices may no longer be as written."""
        events = self.api.watch_slices(self._selector(), self.version)
        # Closed here, in trio: left to the garbage collector, it would be closed outside.
        async with contextlib.aclosing(events):
            async for event, obj in events:
                if event == "BOOKMARK":
                    continue
                if event != "DELETED" and obj["metadata"]["resourceVersion"] in self._written:
                    continue
                log.log(V1, "ResourceSlice %s %s: looking again", obj["metadata"]["name"],
                        event.lower())  # fmt: skip
                return


async def publish(
    api: Api,
    pool: Pool,
    me: Instance,
    alive: Callable[[Instance], bool],
    wanted: Callable[[Pool], list[dict[str, Any]]],
    changed: Callable[[], trio.Event],
    state: ResourceState,
) -> None:
    """Keep the node's slices as `wanted` says, again whenever `changed()` fires; forever.
    `pool.node_uid` is read from the Node each time."""
    backoff, outage = retrying(log)
    publisher = Publisher(api, pool, wanted, me, alive)
    state.slices_not_published("ResourceSlices not published yet")
    # Whether the last round ended in a routine answer too: then the next waits.
    routine_again = False
    while True:
        what = f"reading Node {pool.node}"
        try:
            publisher.owned_by(await api.node_uid(pool.node))
            what = "publishing ResourceSlices"
            # Taken before the devices are read: a change from here on is not missed.
            change = changed()
            wait = await publisher.reconcile()
            if wait:
                await trio.sleep(wait)
                continue
            state.slices_published()
            outage.over()
            backoff.reset()
            what = "watching ResourceSlices"
            failed: list[RequestFailed] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_first_of, nursery, failed, publisher.watch)
                nursery.start_soon(_first_of, nursery, failed, change.wait)
                nursery.start_soon(_first_of, nursery, failed, trio.sleep, WATCH_RENEW)
            if failed:
                raise failed[0]
            routine_again = False
        except RequestFailed as error:
            code = status_code(error)
            if code in ROUTINE:
                log.log(V1, "%s: %s; listing again", what, describe_error(error))
                if routine_again:
                    await trio.sleep(backoff.next_delay())
                routine_again = True
                continue
            routine_again = False
            why = why_failed(error)
            if code == 404 and what.startswith("reading Node"):
                why = f"Node {pool.node} does not exist: check --node-name"
            problem = f"ResourceSlices not published: {what} failed: {why}"
            state.slices_not_published(problem)
            outage.failed(problem)
            await trio.sleep(backoff.next_delay())


async def _first_of(
    nursery: trio.Nursery,
    failed: list[RequestFailed],
    function: Callable[..., Awaitable[object]],
    *args: object,
) -> None:
    """Await `function(*args)`, then end its siblings: the first of them to finish decides.
    A failed request is kept in `failed`, not raised: it would reach the caller in a group."""
    try:
        await function(*args)
    except RequestFailed as error:
        failed.append(error)
    nursery.cancel_scope.cancel()
