"""The node's ResourceSlices: what they say (`desired`), and keeping them so (`publish`).

One pool, named after the node, lists the shares as devices (`pcc-0` ... by default),
`MAX_DEVICES_PER_SLICE` to a slice, each with the attributes claims select on (the resource's,
and the node's confidential computing, node_facts.py). A device that is gone, or whose PCC
directory is, stays listed with a taint where the API server serves taints, and is withdrawn
from the pool where it does not (taints.py says which and why); every change bumps the pool's
generation in each of its slices.

`publish` lists the driver's slices of this node once, then watches them, as client-go's
reflector does: each watch asks the API server to end it after a random 5 to 10 minutes
(`WATCH_SECONDS`), with bookmarks, and the next resumes from the last resource version seen,
so an idle node costs the API server one watch request every 7.5 minutes on average and no
list, no read, never in step with other nodes. The slices as last seen (`Publisher.slices`)
are what is compared with what the node has: a slice deleted (kubelet deletes every slice of
its node when it starts) or changed by someone else, or a change of the devices, is looked
at again at once, without a request; a write reads the Node first (its UID owns the slices:
a Node registered again has a new one). The slices are listed again only after a 410 Gone
(the watch's resource version is too old) or a 409 Conflict (someone else wrote first), both
routine, or an error the API server answered; after a failure without an answer the watch
resumes where it was. Failures wait, jittered (kube.retrying). Nothing polls.

Two instances during a rolling update may want different slices (a new attribute; health
seen a moment apart). Each stamps the slices it writes (`Instance`); an instance leaves
alone what a newer one (another pod) wrote while that one is alive (its DRA socket takes
connections), so the newer one's slices win and stay. Whatever two instances want, each
writes the pool at most `WRITE_BURST` times at once and then once per `WRITE_EVERY`
(`WriteBudget`).
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import random
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
from pcc_plugin.dra.taints import (
    MAX_TAINTED_DEVICES_PER_SLICE,
    RESOURCE_API,
    Unhealthy,
    serves_taints,
)
from pcc_plugin.generations import Outage
from pcc_plugin.klog import V1
from pcc_plugin.resource import Device, ResourceSpec
from pcc_plugin.state import ResourceState

log = logging.getLogger(__name__)

MAX_DEVICES_PER_SLICE = 128
# Each watch asks the API server to end it after a random number of seconds in this range
# (client-go's reflector: its minimum watch timeout, 5 minutes, times 1 to 2), then resumes.
WATCH_SECONDS = (300, 600)
# A watch the API server ends sooner than this, having sent nothing, is a failure (a proxy
# that cuts watches), not a renewal: resumed after a wait, not at once.
WATCH_TOO_SHORT = 1.0
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
    unhealthy = unhealthy or Unhealthy(pool.driver, tainting=False)
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
    # The Node by name: its UID is read only to write (the garbage collector deletes slices
    # an old UID owns, which are then written again).
    owners = [
        (owner.get("kind"), owner.get("name"))
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
    whether another instance still runs; `unhealthy` learns from the answers whether the API
    server keeps taints."""

    api: Api
    pool: Pool
    wanted: Callable[[Pool], list[dict[str, Any]]]
    me: Instance
    alive: Callable[[Instance], bool]
    unhealthy: Unhealthy
    budget: WriteBudget = attrs.Factory(WriteBudget)
    rng: random.Random = attrs.Factory(random.Random)
    # The slices as last listed, written or seen in the watch, by name; and the resource
    # version the watch resumes from.
    slices: dict[str, dict[str, Any]] = attrs.Factory(dict)
    version: str = ""
    # The resource version of each slice's last write whose watch event has not come yet: no
    # news when it comes. One per slice at most.
    _written: dict[str, str] = attrs.Factory(dict)
    generation: int = 0
    # The newest instance, newer than this one, whose slices were seen; while it is alive,
    # what it wrote stays.
    newer: Instance | None = None
    _left_to: Instance | None = None
    # Set when the watch saw a change this instance did not make.
    news: trio.Event = attrs.Factory(trio.Event)
    # What the last request was, for an error line.
    doing: str = ""
    # Set once a request succeeded since the last failure (publish replaces it then): only
    # then are the slices said to be published, the API server to answer again.
    answered: trio.Event = attrs.Factory(trio.Event)
    # Called at each event of a watch (a bookmark too), and at its end: it works.
    heard: Callable[[], None] = lambda: None
    # Whether the slices were listed since the last look (said when they need no write).
    _listed: bool = False
    # While its writes are on their way, their events may come before their answers.
    _writing: bool = False
    # The resource version of each slice's last event (a deletion too): a write's answer that
    # comes after a newer event is not what the slice is now.
    _events: dict[str, int] = attrs.Factory(dict)

    def _selector(self) -> dict[str, str]:
        return {"spec.nodeName": self.pool.node, "spec.driver": self.pool.driver}

    async def relist(self) -> None:
        self.doing = "listing ResourceSlices"
        items, self.version = await self.api.list_slices(self._selector())
        self.answered.set()
        self.slices = {item["metadata"]["name"]: item for item in items}
        self._written.clear()
        self._events.clear()
        self._listed = True

    async def watch(self) -> None:
        """Follow the slices for ever, one watch after another, each resumed where the last
        ended; RequestFailed when one fails."""
        while True:
            self.doing = "watching ResourceSlices"
            seconds = self.rng.randint(*WATCH_SECONDS)
            started, heard = trio.current_time(), self.version
            await self.api.watch_slices(
                self._selector(), self.version, seconds, self._seen, self.answered.set
            )
            if trio.current_time() - started < WATCH_TOO_SHORT and self.version == heard:
                raise RequestFailed("the API server ended the watch of ResourceSlices at once")
            # A whole watch: the API server works, whatever failed before is forgotten.
            self.heard()
            # A look, without a request, at each renewal: a newer instance may be gone.
            self.news.set()

    def _seen(self, kind: str, obj: dict[str, Any]) -> None:
        """One event of the watch (a bookmark only moves the version on)."""
        self.heard()
        metadata = obj.get("metadata") or {}
        version = str(metadata.get("resourceVersion") or "")
        self.version = version or self.version
        if kind == "BOOKMARK":
            return
        name = str(metadata.get("name") or "")
        revision = _revision(version)
        written = self._written.get(name)
        if written is not None and revision <= _revision(written):
            # This instance's own write, or an event from before it that a loaded watch
            # brings late: the slice as written is newer than what the event says.
            if revision == _revision(written):
                del self._written[name]
            return
        self._events[name] = revision
        if kind == "DELETED":
            self.slices.pop(name, None)
        else:
            self.slices[name] = obj
        if (
            self._writing
            and kind != "DELETED"
            and (Instance.of(obj, publisher_key(self.pool.driver)) == self.me)
        ):
            return
        log.log(V1, "ResourceSlice %s %s: looking again", name, kind.lower())
        self.news.set()

    def owned_by(self, node_uid: str) -> None:
        """The Node's UID as just read: the owner of the slices from now on."""
        if self.pool.node_uid and node_uid != self.pool.node_uid:
            log.info("Node %s was registered again (UID %s, was %s): its ResourceSlices are "
                     "owned by the new one", self.pool.node, node_uid,
                     self.pool.node_uid)  # fmt: skip
        self.pool = attrs.evolve(self.pool, node_uid=node_uid)

    async def reconcile(self) -> float:
        """Make the slices as wanted, or leave them to a newer instance; 0 then, else how long
        until the budget allows the write."""
        existing = dict(self.slices)
        key = publisher_key(self.pool.driver)
        for item in existing.values():
            other = Instance.of(item, key)
            # Never itself: a previous run of this pod (the same token) is this instance.
            if (
                other is not None
                and other.token != self.me.token
                and (other > max(self.me, self.newer or self.me))
            ):
                self.newer = other
        unhealthy = self.unhealthy
        unhealthy.recall(existing.values())
        if unhealthy.probe_due:
            self.doing = "asking whether the API server serves device taints"
            unhealthy.probed(
                await serves_taints(self.api, self.pool.driver, self.pool.node, unhealthy.key)
            )
        wanted = self.wanted(self.pool)
        generations = [obj["spec"]["pool"].get("generation", 0) for obj in existing.values()]
        self.generation = max([self.generation, *generations])
        names = {obj["metadata"]["name"] for obj in wanted}
        same = names == set(existing) and all(
            _content(obj) == _content(existing[obj["metadata"]["name"]]) for obj in wanted
        ) and len(set(generations)) == 1  # fmt: skip
        listed, self._listed = self._listed, False
        if same and listed:
            log.info("ResourceSlices of pool %s already say what the node has, generation %d",
                     self.pool.node, self.generation)  # fmt: skip
        if same or self._leave_to_newer():
            return 0.0
        wait = self.budget.wait()
        if wait:
            log.log(V1, "ResourceSlices of pool %s: %d writes in a row, the next in %.0f s",
                    self.pool.node, self.budget.burst, wait)  # fmt: skip
            return wait
        self.budget.spend()
        self.doing = f"reading Node {self.pool.node}"
        self.owned_by(await self.api.node_uid(self.pool.node))
        self.doing = "publishing ResourceSlices"
        wanted = self.wanted(self.pool)
        self.generation += 1
        self._writing = True
        try:
            dropped = await self._write(wanted, existing, key)
        finally:
            self._writing = False
        devices = sum(len(obj["spec"]["devices"]) for obj in wanted)
        log.info("Published %d devices in %d ResourceSlice(s) of pool %s, generation %d",
                 devices, len(wanted), self.pool.node, self.generation)  # fmt: skip
        if any(_tainted(obj) for obj in wanted):
            unhealthy.answered(kept=not dropped)
        if dropped:
            # Written again at once, the unhealthy devices withdrawn: they must not stay
            # allocatable.
            self.news.set()
        return 0.0

    async def _write(
        self, wanted: list[dict[str, Any]], existing: dict[str, dict[str, Any]], key: str
    ) -> bool:
        """Write the wanted slices, delete the others; whether the API server dropped the
        taints it was sent."""
        dropped = False
        names = {obj["metadata"]["name"] for obj in wanted}
        for obj in wanted:
            obj["spec"]["pool"]["generation"] = self.generation
            obj["metadata"].setdefault("annotations", {})[key] = self.me.stamp()
            name = obj["metadata"]["name"]
            if name in existing:
                obj["metadata"]["resourceVersion"] = existing[name]["metadata"]["resourceVersion"]
                written = await self.api.replace_slice(obj)
            else:
                written = await self.api.create_slice(obj)
            self.answered.set()
            version = written["metadata"]["resourceVersion"]
            # The watch may have told of a later change already (the slice deleted by then):
            # resource versions are etcd's revisions, compared as client-go's mutation
            # cache compares them.
            if _revision(version) >= self._events.get(name, 0):
                self._written[name] = version
                self.slices[name] = written
            dropped = dropped or _taints_dropped(obj, written)
        for name in sorted(set(existing) - names):
            await self.api.delete_slice(name)
            self.slices.pop(name, None)
        return dropped

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

    async def keep(
        self, changed: Callable[[], trio.Event], state: ResourceState, outage: Outage
    ) -> None:
        """Reconcile now, then at each change of the devices, each change the watch saw,
        and when the budget or a taint's time says; for ever."""
        while True:
            self.news = news = trio.Event()
            # Taken before the devices are read: a change from here on is not missed.
            change = changed()
            wait = await self.reconcile()
            answered = self.answered.is_set()
            if not wait and answered:
                state.slices_published()
                outage.over()
            due = [wait] if wait else []
            if (later := self.unhealthy.due_in()) is not None:
                due.append(later)
            with trio.move_on_after(min(due, default=float("inf"))):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_then_cancel, nursery, news.wait)
                    nursery.start_soon(_then_cancel, nursery, change.wait)
                    if not answered:
                        nursery.start_soon(_then_cancel, nursery, self.answered.wait)


def _revision(version: str) -> int:
    return int(version) if version.isdigit() else 0


def _tainted(obj: dict[str, Any]) -> bool:
    return any(device.get("taints") for device in obj["spec"]["devices"])


def _taints_dropped(sent: dict[str, Any], written: dict[str, Any]) -> bool:
    """Whether the API server kept none of the taints it was sent (DRADeviceTaints off)."""
    return _tainted(sent) and not any(
        device.get("taints") for device in (written.get("spec") or {}).get("devices") or []
    )


async def _then_cancel(nursery: trio.Nursery, wait: Callable[[], Awaitable[object]]) -> None:
    await wait()
    nursery.cancel_scope.cancel()


async def publish(
    api: Api,
    pool: Pool,
    me: Instance,
    alive: Callable[[Instance], bool],
    wanted: Callable[[Pool], list[dict[str, Any]]],
    changed: Callable[[], trio.Event],
    state: ResourceState,
    unhealthy: Unhealthy,
    rng: random.Random | None = None,
) -> None:
    """Keep the node's slices as `wanted` says, again whenever `changed()` fires; for ever.
    Every failure is the API server's: said, and retried after a wait jittered by `rng`."""
    rng = rng or random.Random()
    backoff, outage = retrying(log, rng)
    publisher = Publisher(api, pool, wanted, me, alive, unhealthy, heard=backoff.reset, rng=rng)
    state.slices_not_published("ResourceSlices not published yet")
    relist = True
    # Whether the last round ended in a routine answer too: then the next waits.
    routine_again = False
    while True:
        try:
            if relist:
                await publisher.relist()
                relist = False
            failed: list[RequestFailed] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_first_of, nursery, failed, publisher.watch)
                nursery.start_soon(
                    _first_of, nursery, failed, publisher.keep, changed, state, outage
                )
            if failed:
                raise failed[0]
        except RequestFailed as error:
            publisher.answered = trio.Event()
            code = status_code(error)
            if code in ROUTINE:
                log.log(V1, "%s: %s; listing again", publisher.doing, describe_error(error))
                relist = True
                if routine_again:
                    await trio.sleep(backoff.next_delay())
                routine_again = True
                continue
            routine_again = False
            # No answer, or the API server's own trouble: the watch resumes where it was.
            # Any other answer (401, 403, ...): listed again once it is over.
            relist = relist or not (code is None or code == 429 or code >= 500)
            why = why_failed(error)
            if code == 404 and publisher.doing.startswith("reading Node"):
                why = f"Node {pool.node} does not exist: check --node-name"
            problem = f"ResourceSlices not published: {publisher.doing} failed: {why}"
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
