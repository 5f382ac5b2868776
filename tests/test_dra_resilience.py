"""The DRA mode through what production does to it: rolling updates, API-server outages and
the API server's routine answers, a Node registered again, calls that wait on one another,
requests larger than any kubelet sends.

The real daemon against the simulated kubelet and the fake API server (pcc_plugin/sim), as in
tests/test_dra.py; the slices' publishing loop also on trio's MockClock, for the bounds that
only minutes show. `nox -s cluster` shows the rollout and an outage on a real cluster
(tools/e2e/cluster_dra.py).
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dra_support
import grpclib.const
import grpclib.exceptions
import hypothesis
import hypothesis.strategies
import pytest
import trio
import trio.testing
from dra_support import DRIVER, NODE, SHARES, WAIT, DraNode, published, registered
from metrics_support import get, metrics_port

from pcc_plugin import wire
from pcc_plugin._proto.k8s.io.kubelet.pkg.apis.dra import v1
from pcc_plugin.dra import claims, kube, slices, taints
from pcc_plugin.dra import service as dra_service
from pcc_plugin.dra.checkpoint import Checkpoint, LockBusy, PreparedClaim
from pcc_plugin.inventory import Inventory
from pcc_plugin.limits import DEFAULT
from pcc_plugin.resource import Device, pcc_resource
from pcc_plugin.sim import StartDaemon, run_blocking
from pcc_plugin.state import ResourceState

OLD_UID = "0a0a0a0a-1111-2222-3333-444444444444"
NEW_UID = "0b0b0b0b-1111-2222-3333-444444444444"


def cdi_spec(dra: DraNode, uid: str) -> Path:
    return dra.cdi / f"{DRIVER}-claim_{uid}.json"


def mount_paths(dra: DraNode) -> set[str]:
    """The mountPath attribute of every published device."""
    return {
        device["attributes"]["mountPath"]["string"]
        for obj in dra.slices()
        for device in obj["spec"]["devices"]
    }


async def test_two_instances_that_want_different_slices_leave_the_newer_ones_alone(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """A rolling update whose new version publishes another attribute: the old instance
    does not write back what it wants over what the newer one wrote, and once the newer one
    published, nobody writes again."""
    dra = dra_node
    (dra.node.host_root / "var" / "run" / "pcc-b").mkdir()
    with trio.fail_after(40):
        old = start_daemon(*dra.daemon_args(), f"--pod-uid={OLD_UID}")
        await published(dra, SHARES, generation=1)
        new = start_daemon(
            *dra.daemon_args(), f"--pod-uid={NEW_UID}", "--pcc-socket-path=/var/run/pcc-b"
        )
        await run_blocking(dra.api.wait_for, lambda: mount_paths(dra) == {"/var/run/pcc-b"}, WAIT)
        await run_blocking(new.wait_for_log, "Published 16 devices", WAIT)
        writes = dra.api.slice_writes()
        # Both instances see every write of the other at once: had either anything to write,
        # it would within this window. An observation, not a synchronisation.
        await trio.sleep(3)
        assert dra.api.slice_writes() == writes
        assert mount_paths(dra) == {"/var/run/pcc-b"}
        assert old.terminate() == 0
        assert mount_paths(dra) == {"/var/run/pcc-b"}
        assert "Traceback" not in old.log_text() + new.log_text()


async def test_a_conflict_and_an_expired_watch_are_routine(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """409 Conflict (someone else wrote first) and 410 Gone (a watch's resource version
    compacted away) are how kube-apiserver works: the driver lists again and carries on,
    with no error and nothing on /readyz."""
    dra = dra_node
    # Withdrawn devices make the next write easy to see (an API server that serves no taints).
    dra.api.serves_taints = False
    with trio.fail_after(30):
        daemon = start_daemon(*dra.daemon_args())
        await registered(dra)
        await published(dra, SHARES, generation=1)
        port = await metrics_port(daemon)
        watches = dra.api.requests.count("WATCH resourceslices")
        dra.api.expire_watches()
        await run_blocking(
            dra.api.wait_for,
            lambda: dra.api.requests.count("WATCH resourceslices") > watches,
            WAIT,
        )
        dra.api.conflict_next_write()
        dra.node.pcc_dir.rmdir()
        await published(dra, [])
        assert (await get(port, "/readyz"))[0] == 200
        log = daemon.log_text()
        assert "ResourceSlices not published" not in log
        assert [line for line in log.splitlines() if line.startswith("E")] == []
        assert "Traceback" not in log


async def test_a_node_registered_again_gets_slices_owned_by_its_new_uid(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """The Node deleted and registered again under the same name has a new UID; the garbage
    collector deletes every slice owned by the old one, so the driver must own them by the
    new one, or write them, see them deleted and write them again, for ever."""
    dra = dra_node
    with trio.fail_after(30):
        daemon = start_daemon(*dra.daemon_args())
        await published(dra, SHARES, generation=1)
        node = dra.api.recreate_node(NODE)

        def owned_by_the_new_node() -> bool:
            owners = [owner["uid"] for obj in dra.slices() for owner in
                      obj["metadata"]["ownerReferences"]]  # fmt: skip
            return owners == [node["metadata"]["uid"]] and dra.devices() == SHARES

        await run_blocking(dra.api.wait_for, owned_by_the_new_node, WAIT)
        assert "Traceback" not in daemon.log_text()


async def test_readyz_says_the_api_server_cannot_be_reached_before_kubelet_registers(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """docs/dra.md: while the API server cannot be reached, /readyz says so, whatever else
    the driver waits for."""
    dra = dra_node
    dra.kubelet.stop()
    dra.api.stop()
    with trio.fail_after(30):
        daemon = start_daemon(*dra.daemon_args())
        await run_blocking(daemon.wait_for_log, "ResourceSlices not published", WAIT)
        port = await metrics_port(daemon)
        status, _, body = await get(port, "/readyz")
        assert status == 503
        assert "waiting for kubelet to register the driver" in body
        assert "the API server cannot be reached" in body
        assert "Traceback" not in daemon.log_text()


def checkpoint_text(claims: dict[str, Any]) -> str:
    return json.dumps({"version": 1, "driver": DRIVER, "claims": claims})


class MemoryApi(dra_support.SliceWatcher):
    """kube.Api's node and slice calls, in memory: versions, a watch from a version, 409s."""

    def __init__(self) -> None:
        self.node = "node-uid-1"
        self.slices: dict[str, dict[str, Any]] = {}
        self.events: list[tuple[int, str, dict[str, Any]]] = []
        self.version = 0
        self.writes: list[tuple[float, dict[str, Any]]] = []
        self.changed = trio.Event()

    def _bump(self, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        obj = json.loads(json.dumps(obj))
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.events.append((self.version, kind, obj))
        self.changed.set()
        self.changed = trio.Event()
        return obj

    async def node_uid(self, name: str) -> str:
        return self.node

    async def list_slices(self, fields: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
        return [json.loads(json.dumps(obj)) for obj in self.slices.values()], str(self.version)

    async def watch(
        self, version: str, seconds: int, event: dra_support.Event, opened: Callable[[], None]
    ) -> None:
        opened()
        since = int(version)
        with trio.move_on_after(seconds):
            while True:
                changed = self.changed
                for number, kind, obj in [each for each in self.events if each[0] > since]:
                    since = number
                    event(kind, json.loads(json.dumps(obj)))
                await changed.wait()

    async def create_slice(self, obj: dict[str, Any]) -> dict[str, Any]:
        name = obj["metadata"]["name"]
        if name in self.slices:
            raise conflict("AlreadyExists")
        self.writes.append((trio.current_time(), obj))
        self.slices[name] = self._bump("ADDED", obj)
        return self.slices[name]

    async def replace_slice(self, obj: dict[str, Any]) -> dict[str, Any]:
        name = obj["metadata"]["name"]
        if self.slices[name]["metadata"]["resourceVersion"] != obj["metadata"]["resourceVersion"]:
            raise conflict("Conflict")
        self.writes.append((trio.current_time(), obj))
        self.slices[name] = self._bump("MODIFIED", obj)
        return self.slices[name]

    async def delete_slice(self, name: str) -> None:
        self.writes.append((trio.current_time(), {}))
        self._bump("DELETED", self.slices.pop(name))


def conflict(reason: str) -> kube.RequestFailed:
    return kube.RequestFailed(f"409 {reason}: written meanwhile", 409, reason)


SPEC = pcc_resource("tke.cloud.tencent.com/pcc-device", 16, "/dev/sev-guest", "/var/run/pcc")
HEALTHY = tuple(Device(f"pcc-{i}", "pcc", SPEC.device_nodes, None) for i in range(16))
OLDER = slices.Instance("2026-01-01T00:00:00.000000Z", OLD_UID)
NEWER = slices.Instance("2026-01-01T00:00:01.000000Z", NEW_UID)


async def test_what_the_publisher_remembers_of_its_writes_stays_bounded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """It keeps the resource versions it wrote, to know its own writes in the watch: those
    of the slices as they are now, not one more per write for as long as it runs."""
    api: Any = MemoryApi()
    healthy = [True]

    def wanted(pool: slices.Pool) -> list[dict[str, Any]]:
        return slices.desired(pool, SPEC, HEALTHY if healthy[0] else ())

    publisher = slices.Publisher(api, slices.Pool(DRIVER, NODE, api.node), wanted, OLDER,
                                 lambda other: True, taints.Unhealthy(DRIVER),
                                 slices.WriteBudget(burst=200))  # fmt: skip
    await publisher.relist()
    for _ in range(200):
        healthy[0] = not healthy[0]
        await publisher.reconcile()
    assert len(api.writes) == 200
    assert len(publisher._written) <= len(api.slices)


async def test_a_watch_event_older_than_the_drivers_own_write_leaves_the_slices_alone(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The watch runs behind the writes (a loaded node): the events of the last write but one
    come after the last write's answer. They are history: no news, and no write from a stale
    copy (which kube-apiserver would refuse as a conflict, one wasted write per event)."""
    api: Any = MemoryApi()
    healthy = [True]

    def wanted(pool: slices.Pool) -> list[dict[str, Any]]:
        return slices.desired(pool, SPEC, HEALTHY if healthy[0] else ())

    publisher = slices.Publisher(api, slices.Pool(DRIVER, NODE, api.node), wanted, OLDER,
                                 lambda other: True, taints.Unhealthy(DRIVER))  # fmt: skip
    await publisher.relist()
    for state in (False, True):
        healthy[0] = state
        await publisher.reconcile()
    assert len(api.writes) == 2
    for _, kind, obj in api.events:
        publisher._seen(kind, json.loads(json.dumps(obj)))
    assert not publisher.news.is_set()
    await publisher.reconcile()
    assert len(api.writes) == 2


OTHER_SPEC = pcc_resource(SPEC.name, 16, "/dev/sev-guest", "/var/run/pcc-b")
OTHER = tuple(Device(f"pcc-{i}", "pcc", OTHER_SPEC.device_nodes, None) for i in range(16))


def publishing(
    nursery: trio.Nursery,
    api: Any,
    me: slices.Instance,
    devices: tuple[Device, ...],
    alive: Any = lambda other: True,
) -> trio.CancelScope:
    """One instance's publish loop, in a scope of its own to end it by."""
    scope = trio.CancelScope()
    spec = SPEC if devices is HEALTHY else OTHER_SPEC

    async def run() -> None:
        with scope:
            await slices.publish(
                api, slices.Pool(DRIVER, NODE, ""), me, alive,
                lambda pool: slices.desired(pool, spec, devices), trio.Event,
                ResourceState("x", needs_stream=False, registered=True), taints.Unhealthy(DRIVER),
            )  # fmt: skip

    nursery.start_soon(run)
    return scope


def paths_in(api: Any) -> set[str]:
    return {
        device["attributes"]["mountPath"]["string"]
        for obj in api.slices.values()
        for device in obj["spec"]["devices"]
    }


def writes_by(api: Any, instance: slices.Instance) -> int:
    key = slices.publisher_key(DRIVER)
    return sum(1 for _, obj in api.writes if obj and slices.Instance.of(obj, key) == instance)


def most_in_a_minute(api: Any) -> int:
    times = [at for at, _ in api.writes]
    return max((sum(1 for t in times if start <= t < start + 60) for start in times), default=0)


async def test_the_newer_of_two_instances_that_want_different_slices_wins_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A rollout whose new version says something else: one write of the newer instance,
    none back from the older one, for as long as both run."""
    api: Any = MemoryApi()
    async with trio.open_nursery() as nursery:
        publishing(nursery, api, OLDER, HEALTHY)
        await trio.sleep(1)
        assert paths_in(api) == {"/var/run/pcc"}
        publishing(nursery, api, NEWER, OTHER)
        await trio.sleep(600)
        assert paths_in(api) == {"/var/run/pcc-b"}
        assert (writes_by(api, OLDER), writes_by(api, NEWER)) == (1, 1)
        nursery.cancel_scope.cancel()


async def test_once_the_newer_instance_is_gone_the_older_publishes_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A rollback: the newer pod goes, the older stays; the slices become the older's again
    at its next look (a change, an event, or the watch's renewal), not never."""
    api: Any = MemoryApi()
    running = {OLDER, NEWER}
    async with trio.open_nursery() as nursery:
        publishing(nursery, api, OLDER, HEALTHY, running.__contains__)
        await trio.sleep(1)
        newer = publishing(nursery, api, NEWER, OTHER, running.__contains__)
        await trio.sleep(60)
        assert paths_in(api) == {"/var/run/pcc-b"}
        newer.cancel()
        running.remove(NEWER)
        await trio.sleep(slices.WATCH_SECONDS[1])
        assert paths_in(api) == {"/var/run/pcc"}
        assert writes_by(api, OLDER) == 2
        nursery.cancel_scope.cancel()


async def test_two_instances_that_cannot_tell_which_is_newer_write_within_the_bound(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Whatever two instances want, the writes stay bounded: two that each take the other for
    gone (or an instance of a version that stamps nothing, which looks like one) write
    WRITE_BURST times each, then once per WRITE_EVERY each."""
    api: Any = MemoryApi()
    minutes = 10
    async with trio.open_nursery() as nursery:
        publishing(nursery, api, OLDER, HEALTHY, lambda other: False)
        publishing(nursery, api, NEWER, OTHER, lambda other: False)
        await trio.sleep(minutes * 60)
        nursery.cancel_scope.cancel()
    per_instance = slices.WRITE_BURST + minutes * 60 / slices.WRITE_EVERY
    for instance in (OLDER, NEWER):
        assert writes_by(api, instance) <= per_instance
    assert most_in_a_minute(api) <= 2 * (slices.WRITE_BURST + 60 / slices.WRITE_EVERY)
    # Each took its turn; without the budget there would be thousands.
    assert writes_by(api, OLDER) >= minutes * 60 / slices.WRITE_EVERY / 2


async def test_unprepare_answers_at_once_while_a_claims_read_stalls(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """Claims are read from the API server before the lock that serializes the calls is taken:
    a NodeUnprepareResources, which needs no API server, does not wait for another call's
    read."""
    dra = dra_node
    with trio.fail_after(40):
        daemon = start_daemon(*dra.daemon_args())
        await registered(dra)
        await published(dra, SHARES)
        dra.claim("done", "uid-done")
        await run_blocking(dra.kubelet.prepare, DRIVER, [("default", "done", "uid-done")])
        dra.claim("slow", "uid-slow", device="pcc-4")
        dra.api.stall(lambda request: request.endswith("/resourceclaims/slow"))
        async with trio.open_nursery() as nursery:
            answers: list[Any] = []

            async def prepare_slow() -> None:
                claim = [("default", "slow", "uid-slow")]
                answers.append(await run_blocking(dra.kubelet.prepare, DRIVER, claim, 30))

            nursery.start_soon(prepare_slow)
            await run_blocking(dra.api.wait_for, lambda: bool(dra.api.held), WAIT)
            done = [("default", "done", "uid-done")]
            # Well within the stalled read's deadline: not held up behind it.
            gone = await run_blocking(dra.kubelet.unprepare, DRIVER, done, WAIT)
            assert gone.claims["uid-done"].error == ""
            assert not cdi_spec(dra, "uid-done").exists()
            dra.api.release()
        assert answers[0].claims["uid-slow"].error == ""
        assert set(dra.checkpoint()) == {"uid-slow"}
        assert "Traceback" not in daemon.log_text()


async def test_a_call_that_cannot_have_the_lock_in_time_is_told_so(
    autojump_clock: trio.testing.MockClock, tmp_path: Path, host: Path
) -> None:
    """Another instance holds the lock (stuck on a disk, say): the call answers each claim
    with why, within the answer deadline (so within kubelet's), and kubelet retries."""
    state = tmp_path / "state"
    state.mkdir()
    other = os.open(state / "serialize.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(other, fcntl.LOCK_EX)
    closing = threading.Lock()
    held = [True]

    def release() -> None:
        with closing:
            if held[0]:
                held[0] = False
                os.close(other)

    # A call that would wait for ever ends the test all the same (by failing it).
    timer = threading.Timer(10, release)
    timer.start()
    spec = pcc_resource(SPEC.name, 4, "/dev/sev-guest", "/var/run/pcc")
    resource = ResourceState(spec.name, needs_stream=False)

    async def get_claim(namespace: str, name: str) -> dict[str, Any]:
        raise AssertionError("not reached: a claim prepared before is not read again")

    preparer = claims.Preparer(
        DRIVER, NODE, Inventory(spec, str(host), resource), resource, Checkpoint(state, DRIVER),
        tmp_path / "cdi", "owner", get_claim,
    )  # fmt: skip
    claim = claims.ClaimRef("default", "app", "uid-1")
    try:
        with trio.fail_after(DEFAULT.unary_timeout):
            started = trio.current_time()
            answers = await preparer.unprepare([claim])
    finally:
        timer.cancel()
        release()
    assert trio.current_time() - started <= DEFAULT.answer_within < DEFAULT.unary_timeout
    answer = answers["uid-1"]
    assert isinstance(answer, str)
    assert answer.startswith(f"another call held {state / 'serialize.lock'} for ")
    assert resource.unprepares["failed"] == 1


async def test_specs_are_restored_under_the_lock(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """At start the driver writes back the CDI spec of each prepared claim that lost it (a
    reboot). Under the lock: the other instance of a rollout may be unpreparing that claim,
    and a spec written back after that would stay until the next reboot."""
    dra = dra_node
    dra.state.mkdir(parents=True)
    prepared = {"namespace": "default", "name": "app",
                "devices": [{"requests": ["pcc"], "pool": NODE, "device": "pcc-3"}]}  # fmt: skip
    (dra.state / "checkpoint.json").write_text(checkpoint_text({"uid-1": prepared}))
    other = os.open(dra.state / "serialize.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(other, fcntl.LOCK_EX)
        with trio.fail_after(30):
            daemon = start_daemon(*dra.daemon_args())
            await registered(dra)
            assert not cdi_spec(dra, "uid-1").exists()
            # The other instance unprepares the claim, and lets the lock go.
            (dra.state / "checkpoint.json").write_text(checkpoint_text({}))
            os.close(other)
            other = -1
            await run_blocking(daemon.wait_for_log, "Checked the CDI specs of 0 prepared", WAIT)
            assert not cdi_spec(dra, "uid-1").exists()
    finally:
        if other >= 0:
            os.close(other)


async def test_a_claim_prepared_under_another_instance_name_is_unprepared_whole(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """--instance-name changed between prepare and unprepare (a renamed DaemonSet): the claim
    is in this driver's checkpoint, so its CDI spec is this driver's to remove."""
    dra = dra_node
    with trio.fail_after(40):
        first = start_daemon(*dra.daemon_args(), "--instance-name=before")
        await registered(dra)
        dra.claim("app", "uid-1")
        await run_blocking(dra.kubelet.prepare, DRIVER, [("default", "app", "uid-1")])
        assert cdi_spec(dra, "uid-1").exists()
        assert first.terminate() == 0
        second = start_daemon(*dra.daemon_args(), "--instance-name=after")
        await registered(dra, count=2)
        gone = await run_blocking(dra.kubelet.unprepare, DRIVER, [("default", "app", "uid-1")])
        assert gone.claims["uid-1"].error == ""
        assert dra.checkpoint() == {}
        assert not cdi_spec(dra, "uid-1").exists()
        assert "Traceback" not in second.log_text()


async def test_an_instance_never_defers_to_its_own_pod(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """A container restarted in the same pod (the same --pod-uid) after the clock stepped back
    (NTP at boot, a VM resumed): what its previous run stamped looks newer, and that run's DRA
    socket, which is its own, takes connections. It is itself, not a newer instance."""
    dra = dra_node
    (dra.node.host_root / "var" / "run" / "pcc-b").mkdir()
    pool = slices.Pool(DRIVER, NODE, dra.api.nodes[NODE]["metadata"]["uid"])
    (before,) = slices.desired(pool, OTHER_SPEC, OTHER)
    stamp = slices.Instance("2099-01-01T00:00:00.000000Z", OLD_UID).stamp()
    before["metadata"]["annotations"] = {slices.publisher_key(DRIVER): stamp}
    before["spec"]["pool"]["generation"] = 3
    dra.api.answer("POST", "/apis/resource.k8s.io/v1/resourceslices", {}, before)
    with trio.fail_after(30):
        daemon = start_daemon(*dra.daemon_args(), f"--pod-uid={OLD_UID}")
        await run_blocking(dra.api.wait_for, lambda: mount_paths(dra) == {"/var/run/pcc"}, WAIT)
        assert "left to instance" not in daemon.log_text()


async def test_the_checkpoints_fsyncs_leave_the_event_loop_free(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A saturated disk makes each fsync of the checkpoint wait: the call that writes it waits,
    not kubelet's other calls, the health streams and the probes (the event loop)."""
    released = threading.Event()
    # A second from the first fsync on: the write is held at least that long.
    timer = threading.Timer(1.0, released.set)
    fsync = os.fsync

    def slow_fsync(descriptor: int) -> None:
        if timer.ident is None:
            timer.start()
        released.wait(10)
        fsync(descriptor)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    checkpoint = Checkpoint(tmp_path, DRIVER)
    ticks: list[float] = []

    async def tick() -> None:
        while True:
            ticks.append(trio.current_time())
            await trio.sleep(0.02)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(tick)
            started = trio.current_time()
            async with checkpoint.locked() as prepared:
                prepared["uid-1"] = PreparedClaim("default", "app", ())
            ended = trio.current_time()
            nursery.cancel_scope.cancel()
    timer.cancel()
    assert ended - started >= 1.0
    # The loop ran all along the write: never half a second without a tick.
    during = [started, *(t for t in ticks if started < t < ended), ended]
    assert max(later - earlier for earlier, later in itertools.pairwise(during)) < 0.5
    assert Checkpoint(tmp_path, DRIVER).peek() == {"uid-1": PreparedClaim("default", "app", ())}


async def test_calls_that_give_up_on_the_lock_leave_trios_threads_alone(tmp_path: Path) -> None:
    """The other pod of a rollout hangs holding the lock: every call that gives up leaves its
    wait behind (a thread cannot be stopped), one thread at most, of a limiter of its own;
    the daemon's other threads (trio's 40) stay free, and the lock is had once let go."""
    other = os.open(tmp_path / "serialize.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(other, fcntl.LOCK_EX)
    checkpoint = Checkpoint(tmp_path, DRIVER)
    try:
        for _ in range(50):
            with pytest.raises(LockBusy):
                async with checkpoint.locked(0.01):
                    pass
        with trio.fail_after(5):
            assert await trio.to_thread.run_sync(lambda: 7) == 7
    finally:
        os.close(other)
    with trio.fail_after(5):
        async with checkpoint.locked(5) as prepared:
            assert prepared == {}


def claim_spec(dra: DraNode, uid: str, owner: str) -> Path:
    """A claim's CDI spec as instance `owner` wrote it, whose record may never have reached the
    checkpoint (a crash between the two)."""
    path = cdi_spec(dra, uid)
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "cdiVersion": "0.6.0",
        "kind": f"{DRIVER}/claim",
        "annotations": {"pcc-device-plugin.tke.cloud.tencent.com/instance": owner},
        "devices": [{"name": uid, "containerEdits": {}}],
    }
    path.write_text(json.dumps(document))
    return path


async def test_a_spec_written_before_a_crash_is_removed_under_a_new_instance_name(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """The driver wrote a claim's spec and died before its checkpoint said so; kubelet, which
    never heard, unprepares the claim from the next pod, renamed (--instance-name) meanwhile:
    the spec is this driver's (its name says so) and goes."""
    dra = dra_node
    spec = claim_spec(dra, "uid-crashed", "before")
    with trio.fail_after(30):
        start_daemon(*dra.daemon_args(), "--instance-name=after")
        await registered(dra)
        gone = await run_blocking(
            dra.kubelet.unprepare, DRIVER, [("default", "crashed", "uid-crashed")]
        )
        assert gone.claims["uid-crashed"].error == ""
        assert not spec.exists()


async def test_claims_deleted_from_the_api_server_are_forgotten_at_start(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """A pod force-deleted while the driver was away: kubelet never unprepares its claim, and
    the checkpoint would keep it and restore its spec at every start. At start each checkpointed
    claim is read once: one the API server no longer has (or has anew, another UID) goes."""
    dra = dra_node
    dra.state.mkdir(parents=True)
    prepared = {"namespace": "default", "name": "app",
                "devices": [{"requests": ["pcc"], "pool": NODE, "device": "pcc-3"}]}  # fmt: skip
    entries = {"uid-gone": {**prepared, "name": "gone"}, "uid-kept": {**prepared, "name": "kept"},
               "uid-old": {**prepared, "name": "anew"}}  # fmt: skip
    (dra.state / "checkpoint.json").write_text(checkpoint_text(entries))
    dra.claim("kept", "uid-kept")
    dra.claim("anew", "uid-new")
    with trio.fail_after(30):
        daemon = start_daemon(*dra.daemon_args())
        await registered(dra)
        await run_blocking(daemon.wait_for_log, "was deleted from the API server", WAIT, count=2)
        assert set(dra.checkpoint()) == {"uid-kept"}
        assert cdi_spec(dra, "uid-kept").exists()
        assert not cdi_spec(dra, "uid-gone").exists()
        assert not cdi_spec(dra, "uid-old").exists()
        assert "Traceback" not in daemon.log_text()


async def test_an_unreadable_checkpoint_is_rebuilt_from_the_claims_specs(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """A checkpoint that cannot be read (a disk's fault, another version's format): what was
    prepared is not forgotten while its CDI specs are there (no reboot): each records its
    claim, so kubelet's unprepare removes it and the checkpoint holds it again."""
    dra = dra_node
    with trio.fail_after(40):
        first = start_daemon(*dra.daemon_args())
        await registered(dra)
        dra.claim("app", "uid-1")
        await run_blocking(dra.kubelet.prepare, DRIVER, [("default", "app", "uid-1")])
        assert first.terminate() == 0
        (dra.state / "checkpoint.json").write_text("{torn")
        second = start_daemon(*dra.daemon_args())
        await registered(dra, count=2)
        await run_blocking(
            second.wait_for_log, "1 prepared claims taken from their CDI specs", WAIT
        )
        assert set(dra.checkpoint()) == {"uid-1"}
        assert (dra.state / "checkpoint.json.unreadable").read_text() == "{torn"
        again = await run_blocking(dra.kubelet.prepare, DRIVER, [("default", "app", "uid-1")])
        assert again.claims["uid-1"].error == ""
        assert [device.device_name for device in again.claims["uid-1"].devices] == ["pcc-3"]


def claim_field(namespace: bytes, uid: bytes, name: bytes) -> bytes:
    """A Claim as field 1 of NodePrepareResourcesRequest, in protobuf's wire format."""
    body = b"".join(
        bytes([number << 3 | 2, len(value)]) + value
        for number, value in ((1, namespace), (2, uid), (3, name))
    )
    return bytes([0x0A, len(body)]) + body


# A claim that says it is 256 MiB long: reading it would fail, so a reader that refuses
# the request for something before it never read it.
UNREADABLE = b"\x0a\x80\x80\x80\x80\x01"
REQUEST = "NodePrepareResourcesRequest"


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (
            b"".join(claim_field(b"ns", b"u%d" % i, b"c") for i in range(129)) + UNREADABLE,
            f"{REQUEST} has more than 128 claims",
        ),
        (
            claim_field(b"ns", b"u", b"c") + b"\x10\x01" * 129 + UNREADABLE,
            f"{REQUEST} has more than 128 fields besides its claims",
        ),
        (
            claim_field(b"ns", b"u", b"c" * 100) * 2
            + b"\x0a\x88\x08"
            + b"\x1a\x85\x08"
            + b"c" * 1029
            + UNREADABLE,
            f"{REQUEST} names a claim of 1032 bytes, more than the 1024 of any claim kubelet names",
        ),
    ],
    ids=["claims", "other fields", "a claim's size"],
)
def test_a_request_past_a_limit_is_refused_where_it_passes_it(data: bytes, says: str) -> None:
    """A NodePrepareResourcesRequest is read field by field, each limit checked as it is
    reached, as the device plugin's requests are (pcc_plugin/wire.py): what lies beyond is
    never decoded, so a request of 4 MiB costs what its first 128 claims cost."""
    with pytest.raises(grpclib.exceptions.GRPCError) as refused:
        dra_service.read_claims(data, REQUEST, DEFAULT)
    assert refused.value.status is grpclib.const.Status.INVALID_ARGUMENT
    assert refused.value.message == says


def test_claims_within_the_limits_are_read_in_order() -> None:
    data = b"".join(claim_field(b"ns", b"u%d" % i, b"c%d" % i) for i in range(128))
    read = dra_service.read_claims(data + b"\x10\x01", REQUEST, DEFAULT)
    assert read == [claims.ClaimRef("ns", f"c{i}", f"u{i}") for i in range(128)]


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(
    hypothesis.strategies.lists(
        hypothesis.strategies.tuples(*[hypothesis.strategies.text(max_size=60)] * 3),
        max_size=128,
    )
)
def test_claims_are_read_as_protobuf_writes_them(sent: list[tuple[str, str, str]]) -> None:
    request = v1.NodePrepareResourcesRequest(
        claims=[v1.Claim(namespace=ns, uid=uid, name=name) for ns, uid, name in sent]
    )
    read = wire.read_claims_request(bytes(request), 128, DEFAULT.claim_bytes)
    assert [(c["namespace"], c["uid"], c["name"]) for c in read] == sent
