"""The node's ResourceSlices: what they say (`desired`), and keeping them so (`publish`).

One pool, named after the node, lists the shares as devices (`pcc-0` ... by default),
`MAX_DEVICES_PER_SLICE` to a slice, each with the attributes claims select on (the resource's,
and the node's confidential computing, node_facts.py). A device that is gone, or whose PCC
directory is, stays listed with a taint where the API server serves taints, and is withdrawn
from the pool where it does not (taints.py says which and why); every change bumps the pool's
generation in each of its slices.

`publish` lists the driver's slices of this node, writes what differs, then watches them:
a slice deleted (kubelet deletes every slice of its node when it starts) or changed by
someone else is written again at once, and so is a change of the devices. A failed request
is retried with backoff; nothing polls.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from pcc_plugin.dra.kube import Api, RequestFailed, describe_error, status_code
from pcc_plugin.dra.node_facts import NodeFacts
from pcc_plugin.dra.taints import MAX_TAINTED_DEVICES_PER_SLICE, Unhealthy
from pcc_plugin.generations import Backoff, Outage
from pcc_plugin.klog import V1
from pcc_plugin.resource import Device, ResourceSpec
from pcc_plugin.state import ResourceState

log = logging.getLogger(__name__)

MAX_DEVICES_PER_SLICE = 128
# After a failed request the next waits this long, doubling to the cap, jittered.
API_RETRY_FIRST = 0.5
API_RETRY_CAP = 15.0
# An error line while the API server cannot be reached, at most this often.
REPORT_EVERY = 60.0
# A watch is renewed (listed again) this often: a connection that died without a word would
# otherwise hold it forever. client-go's reflectors renew every 5 to 10 minutes.
WATCH_RENEW = 300.0
RESOURCE_API = "resource.k8s.io/v1"
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
    """What of a slice is ours to say, without the generation."""
    spec = obj.get("spec") or {}
    pool = spec.get("pool") or {}
    devices = [
        (device.get("name"), device.get("attributes") or {}, device.get("taints") or [])
        for device in spec.get("devices") or []
    ]
    return (spec.get("driver"), spec.get("nodeName"), pool.get("name"),
            pool.get("resourceSliceCount"), devices)  # fmt: skip


@attrs.define
class Publisher:
    """The node's slices, kept as the devices are. `wanted` gives the slices wanted now."""

    api: Api
    pool: Pool
    wanted: Callable[[], list[dict[str, Any]]]
    state: ResourceState
    # Resource versions of the objects this instance wrote: their watch events are no news.
    _written: set[str] = attrs.Factory(set)
    generation: int = 0

    def _selector(self) -> dict[str, str]:
        return {"spec.nodeName": self.pool.node, "spec.driver": self.pool.driver}

    async def reconcile(self) -> str:
        """Make the slices as wanted; the list's resource version, to watch from."""
        items, version = await self.api.list_slices(self._selector())
        existing = {item["metadata"]["name"]: item for item in items}
        wanted = self.wanted()
        generations = [obj["spec"]["pool"].get("generation", 0) for obj in existing.values()]
        self.generation = max([self.generation, *generations])
        names = {obj["metadata"]["name"] for obj in wanted}
        same = names == set(existing) and all(
            _content(obj) == _content(existing[obj["metadata"]["name"]]) for obj in wanted
        ) and len(set(generations)) == 1  # fmt: skip
        if same:
            return version
        self.generation += 1
        for obj in wanted:
            obj["spec"]["pool"]["generation"] = self.generation
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
        return version

    async def watch(self, version: str) -> None:
        """Return on the first event that says the slices may no longer be as written."""
        async for event, obj in self.api.watch_slices(self._selector(), version):
            if event == "BOOKMARK":
                continue
            if event != "DELETED" and obj["metadata"]["resourceVersion"] in self._written:
                continue
            log.log(V1, "ResourceSlice %s %s: publishing again", obj["metadata"]["name"],
                    event.lower())  # fmt: skip
            return


async def publish(
    api: Api,
    driver: str,
    node: str,
    wanted: Callable[[Pool], list[dict[str, Any]]],
    changed: Callable[[], trio.Event],
    state: ResourceState,
) -> None:
    """Keep the node's slices as `wanted` says, again whenever `changed()` fires; forever."""
    backoff = Backoff(first=API_RETRY_FIRST, cap=API_RETRY_CAP)
    outage = Outage(
        log,
        quiet="{problem}; retrying",
        loud="{problem}; retrying",
        back="The API server answers again after {seconds:.0f} s",
        repeat=REPORT_EVERY,
    )
    publisher: Publisher | None = None
    state.slices_not_published("ResourceSlices not published yet")
    what = f"reading Node {node}"
    while True:
        try:
            if publisher is None:
                pool = Pool(driver, node, await api.node_uid(node))
                publisher = Publisher(api, pool, functools.partial(wanted, pool), state)
            what = "publishing ResourceSlices"
            # Taken before the devices are read: a change from here on is not missed.
            change = changed()
            version = await publisher.reconcile()
            state.slices_published()
            outage.over()
            backoff.reset()
            what = "watching ResourceSlices"
            failed: list[RequestFailed] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_first_of, nursery, failed, publisher.watch, version)
                nursery.start_soon(_first_of, nursery, failed, change.wait)
                nursery.start_soon(_first_of, nursery, failed, trio.sleep, WATCH_RENEW)
            if failed:
                raise failed[0]
        except RequestFailed as error:
            why = describe_error(error)
            if status_code(error) == 404 and publisher is None:
                why = f"Node {node} does not exist: check --node-name"
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
