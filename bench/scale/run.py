"""One kind of driver at scale, phase by phase, against a control plane of its own.

`measure` starts etcd and kube-apiserver, N Nodes, then N drivers and reads, from the API
server's audit log (audit.py), its /metrics, the kernel's connection table (connections.py)
and /proc: the start, an idle window, a 30 s outage of the API server and what follows it,
one device change and one slice deleted by someone else; then stops everything. Every figure
goes into `Figures` (report.py prints them); nothing is judged.
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from bench import procfs
from bench.scale import audit
from bench.scale.apiserver import ControlPlane, Failed, go_heap, open_watches
from bench.scale.connections import Connections
from bench.scale.drivers import DEVICES, Kind, Node

START_WITHIN = 180.0
POLL = 0.05
# After a slice write the benchmark waited for: what else the driver does about it.
AFTERMATH = 5.0
# "Nodes at once": the most distinct nodes whose requests fall within this many seconds.
AT_ONCE = 10.0
# After the outage, the herd is every request until then.
HERD_OVER = 60.0
# After the outage, how long every node may take to write its slices again.
CONSISTENT_WITHIN = 300.0

Log = Callable[[str], None]


@attrs.frozen
class Settings:
    nodes: int
    # Drivers starting at once: the next starts when one has published its slices.
    concurrency: int
    settle: float
    idle: float
    outage: float
    after_outage: float
    change_within: float
    # One node's slices deleted, and waited for: the Go reference takes 30 to 60 s (its
    # sync delay, its mutation cache's TTL), too long for a smoke run.
    delete_one: bool = True
    keep: Path | None = None


@attrs.define
class Figures:
    """What one kind measured, as report.py names it (and --json writes it)."""

    values: dict[str, Any] = attrs.Factory(dict)

    def __setitem__(self, key: str, value: Any) -> None:
        self.values[key] = value

    def __getitem__(self, key: str) -> Any:
        return self.values[key]


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _rss_kib(pid: int) -> int:
    return procfs.proc_status(pid)["VmRSS"]


def _cpu(pid: int) -> float:
    return procfs.cpu_ns(pid) / 1e9


@attrs.define
class Run:
    kind: Kind
    settings: Settings
    program: Path | None
    env: dict[str, str]
    plane: ControlPlane
    nodes: list[Node]
    log: Log
    figures: Figures = attrs.Factory(Figures)
    auditlog: audit.AuditLog = attrs.field(init=False)
    connections: Connections = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.auditlog = audit.AuditLog(self.plane.audit_log)
        self.connections = Connections(
            self.plane.port, lambda: {n.pid: n.name for n in self.nodes if n.alive()}
        )

    def check_alive(self, nodes: list[Node]) -> None:
        for node in nodes:
            if not node.alive():
                tail = "\n".join(node.log.read_text(errors="replace").splitlines()[-15:])
                raise Failed(f"the driver of {node.name} exited; {node.log}:\n{tail}")

    def start(self) -> None:
        """Every driver started, at most `concurrency` at once that have not yet published;
        each one's CPU read as its first slice write is seen."""
        pending = collections.deque(self.nodes)
        starting: dict[str, Node] = {}
        while pending or starting:
            while pending and len(starting) < self.settings.concurrency:
                node = pending.popleft()
                node.started = time.time()
                self.kind.start(node, self.program, self.env)
                starting[node.name] = node
            time.sleep(POLL)
            for request in self.auditlog.read():
                published = starting.get(request.node)
                if published is not None and request.writes_slices():
                    published.start_cpu = _cpu(published.pid)
                    published.published = request.answered
                    del starting[request.node]
            self.check_alive(list(starting.values()))
            late = [n.name for n in starting.values() if time.time() - n.started > START_WITHIN]
            if late:
                raise Failed(f"no slice published within {START_WITHIN:.0f} s by {late}")
        requests = audit.by_node(self.auditlog.requests())
        counts, cpus, took, sequences = [], [], [], collections.Counter[str]()
        for node in self.nodes:
            found = audit.to_first_slice(
                [r for r in requests[node.name] if r.received >= node.started]
            )
            assert found is not None
            before, _ = found
            counts.append(len(before))
            sequences[", ".join(r.what for r in before)] += 1
            cpus.append(node.start_cpu)
            took.append(node.published - node.started)
        f = self.figures
        f["start.requests"] = (_median(counts), max(counts))
        f["start.sequence"] = sequences.most_common(1)[0][0]
        f["start.cpu"] = (_median(cpus), max(cpus))
        f["start.seconds"] = (_median(took), max(took))
        f["start.spread"] = audit.spread(n.published for n in self.nodes)
        self.log(
            f"{self.kind.key}: {len(self.nodes)} drivers published in "
            f"{f['start.spread']:.0f} s; median {f['start.requests'][0]:g} requests, "
            f"{f['start.cpu'][0]:.2f} s CPU each"
        )

    def idle(self) -> None:
        """The idle window: requests, connections, watches, CPU and memory."""
        nodes, f = self.nodes, self.figures
        apiserver = self.plane.apiserver.pid
        time.sleep(self.settings.settle)
        start = time.time()
        cpu_before = {n.name: _cpu(n.pid) for n in nodes}
        apiserver_before = _cpu(apiserver)
        self.log(f"{self.kind.key}: idle for {self.settings.idle:.0f} s")
        time.sleep(self.settings.idle)
        end = time.time()
        seconds = end - start
        cpu = [(_cpu(n.pid) - cpu_before[n.name]) / seconds for n in nodes]
        f["idle.driver_cpu"] = _median(cpu)
        f["idle.apiserver_cpu"] = (_cpu(apiserver) - apiserver_before) / seconds
        self.check_alive(nodes)
        requests = audit.between(self.auditlog.requests(), start, end)
        f["idle.seconds"] = seconds
        f["idle.rates"] = audit.per_node_hour(requests, len(nodes), seconds)
        f["idle.codes"] = audit.codes(requests)
        f["idle.peak"] = audit.peak_per_second(requests)
        f["idle.at_once"] = audit.most_nodes_within(requests, AT_ONCE)
        opened = self.connections.opened_between(start, end)
        ours = [c for c in opened if c.node]
        f["idle.connections"] = len(ours) * 3600 / seconds / len(nodes)
        f["idle.connections_unknown"] = len(opened) - len(ours)
        established = self.connections.established()
        f["idle.established"] = sum(1 for node in established.values() if node) / len(nodes)
        f["idle.watches"] = open_watches(self.plane.metrics(), audit.SLICES)
        rss = [_rss_kib(n.pid) for n in nodes]
        f["memory.driver"] = (_median(rss), max(rss))
        f["memory.drivers_total"] = sum(rss)
        f["memory.apiserver"] = _rss_kib(apiserver)
        f["memory.apiserver_heap"] = go_heap(self.plane.metrics())
        f["memory.etcd"] = _rss_kib(self.plane.etcd.pid)

    def outage(self) -> None:
        """The API server stopped for `outage` seconds and started again; at once, every
        slice of the drivers deleted (what changed while it was away), and then: the herd,
        and how long until every node has written its slices again."""
        nodes, f, settings = self.nodes, self.figures, self.settings
        self.log(f"{self.kind.key}: kube-apiserver stopped for {settings.outage:.0f} s")
        stopped = self.plane.stop_apiserver()
        time.sleep(max(0.0, stopped + settings.outage - time.time()))
        restarted = time.time()
        f["outage.apiserver_start"] = self.plane.start_apiserver()
        ready = time.time()
        f["outage.down"] = ready - stopped
        deleted = self.delete_slices(None)
        # Watched for `after_outage`, and longer if some node has not written its slices
        # again by then, up to CONSISTENT_WITHIN.
        until = ready + settings.after_outage
        while time.time() < max(until, ready + CONSISTENT_WITHIN):
            time.sleep(1.0)
            written = self.written_since(deleted)
            if time.time() >= until and None not in written.values():
                break
        until = time.time()
        self.check_alive(nodes)
        requests = audit.between(self.auditlog.requests(), restarted, until)
        first = audit.first_per_node(requests, restarted)
        f["outage.first"] = (min(first.values(), default=ready) - ready,
                             max(first.values(), default=ready) - ready)  # fmt: skip
        f["outage.came_back"] = len(first)
        f["outage.peak"] = audit.peak_per_second(requests)
        herd = audit.between(requests, restarted, ready + HERD_OVER)
        f["outage.herd_requests"] = len(herd) / len(nodes)
        opened = self.connections.opened_between(restarted, ready + HERD_OVER)
        f["outage.connections"] = sum(1 for c in opened if c.node) / len(nodes)
        f["outage.codes"] = audit.codes(herd)
        written = self.written_since(deleted)
        back = [when - ready for when in written.values() if when is not None]
        f["outage.consistent"] = (_median(back), max(back, default=float("nan")))
        f["outage.never"] = sum(1 for when in written.values() if when is None)
        # From the moment every node is consistent again (and AT_ONCE more): nodes coming in
        # step then are a cycle's, not the herd's tail.
        settled = max([ready + HERD_OVER, *(w + AT_ONCE for w in written.values() if w)])
        later = audit.between(requests, settled, until)
        f["outage.later_window"] = max(0.0, until - settled)
        f["outage.later_at_once"] = audit.most_nodes_within(later, AT_ONCE)
        f["outage.right"] = self.slices_right()

    def written_since(self, deleted: dict[str, float]) -> dict[str, float | None]:
        """Node -> when it wrote its slices again after they were deleted (None: not yet)."""
        by_node = audit.by_node(self.auditlog.requests())
        return {
            node: audit.slices_written(by_node.get(node, []), when).get(node)
            for node, when in deleted.items()
        }

    def delete_slices(self, node: str | None) -> dict[str, float]:
        """Every slice of the driver (of `node`, or of every node) deleted as the
        administrator: node -> when its last slice was gone."""
        done: dict[str, float] = {}
        for item in self.plane.slices(self.kind.driver, node):
            self.plane.delete_slices([item["metadata"]["name"]])
            done[item["spec"]["nodeName"]] = time.time()
        return done

    def slices_right(self) -> int:
        """How many nodes have their slices as published: every device, one pool."""
        devices: collections.Counter[str] = collections.Counter()
        for item in self.plane.slices(self.kind.driver):
            devices[item["spec"]["nodeName"]] += len(item["spec"].get("devices") or [])
        return sum(1 for node in self.nodes if devices[node.name] == DEVICES)

    def after(self, node: Node, since: float, key: str) -> None:
        """What `node` does after `since`: until its slice write is answered (or
        `change_within`), and AFTERMATH more; requests, latency, CPU."""
        cpu_before = _cpu(node.pid)
        deadline = since + self.settings.change_within
        written = None
        while written is None and time.time() < deadline:
            time.sleep(POLL * 4)
            done = audit.slices_written(
                [r for r in self.auditlog.read() if r.node == node.name], since
            )
            written = done.get(node.name)
        end = (written or deadline) + AFTERMATH
        time.sleep(max(0.0, end - time.time()))
        requests = audit.between(self.auditlog.requests(), since, end)
        mine = [r for r in requests if r.node == node.name]
        self.figures[key] = {
            "latency": None if written is None else written - since,
            "requests": [r.what for r in mine],
            "cpu": _cpu(node.pid) - cpu_before,
            "within": self.settings.change_within,
        }

    def changes(self) -> None:
        """One device gone and back (where the driver can see it), one node's slices deleted."""
        first, second = self.nodes[0], self.nodes[-1]
        if self.kind.changes_devices:
            since = time.time()
            self.kind.device_gone(first)
            self.after(first, since, "change.gone")
            since = time.time()
            self.kind.device_back(first)
            self.after(first, since, "change.back")
        if not self.settings.delete_one:
            self.figures["change.deleted"] = "not measured (--quick)"
            return
        deleted = self.delete_slices(second.name)
        if not deleted:
            raise Failed(f"{second.name} has no slices to delete")
        self.after(second, min(deleted.values()), "change.deleted")


def measure(
    kind: Kind,
    settings: Settings,
    binaries: tuple[Path, Path],
    program: Path | None,
    env: dict[str, str],
    log: Log,
) -> Figures:
    """Everything for one kind of driver, on a control plane of its own; all stopped after."""
    names = [f"node-{index:03d}" for index in range(settings.nodes)]
    with contextlib.ExitStack() as stack:
        if settings.keep is None:
            top = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pcc-scale-")))
        else:
            top = settings.keep / kind.key
        plane = ControlPlane(top / "cp", *binaries, names)
        stack.callback(plane.stop)
        figures = Figures()
        figures["apiserver.start"] = plane.start()
        plane.prepare()
        time.sleep(settings.settle)
        figures["memory.apiserver_before"] = _rss_kib(plane.apiserver.pid)
        figures["memory.apiserver_heap_before"] = go_heap(plane.metrics())
        nodes = [Node(index, name, top / f"{index:03d}") for index, name in enumerate(names)]
        for node in nodes:
            kind.layout(node, plane)
        stack.callback(_stop_all, nodes)
        run = Run(kind, settings, program, env, plane, nodes, log, figures)
        run.connections.start()
        stack.callback(run.connections.stop)
        run.start()
        run.idle()
        run.outage()
        run.changes()
        return figures


def _stop_all(nodes: list[Node]) -> None:
    for node in nodes:
        if node.alive():
            assert node.process is not None
            node.process.terminate()
    for node in nodes:
        node.stop()
