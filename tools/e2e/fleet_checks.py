"""Checks 10 and 11 of ``nox -s cluster``: the plugin on a fleet (fleet.py), as an operator of a
mixed pool sees it. Node A and B are PCC nodes (B on the oldest supported kubelet), C is not one
and is labelled nowhere, D is a PCC node whose PCC service comes up after the plugin.

Check 10, the device plugin (``manifests/base``, as shipped):

1. placement: A, B and D labelled, the base applied: the DaemonSet's pods run on those three and
   none was ever placed on C; A and B are ready with 16 allocatable each; D's plugin runs, not
   ready, its ``/readyz`` naming the PCC directory it waits for;
2. consumers: a Deployment of 2 x 16 + 1 confidential-apps: 16 run on A and 16 on B, each node's
   on 16 distinct devices of its own, the last Pending with the scheduler's ``Insufficient``;
   none on C or D; a consumer on A reaches a pod on B and one on B a pod on A (one pod network);
3. the boot race: D's PCC directory created: D's plugin, the same container (no restart),
   registers within 1 s (its own log's time) and the Pending consumer runs there; then D's
   device removed and its plugin pod deleted: the new pod waits for the device, and registers
   within 1 s of it being made, again without a restart;
4. ``kubectl drain`` of A (D cordoned): A's consumers go to B up to B's 16, the rest Pending,
   the plugin's pod stays on A; ``kubectl uncordon``: every consumer runs again;
5. A's kubelet stopped: the Node goes NotReady, the taint manager evicts A's consumers (they
   tolerate unreachable for 2 s); kubelet started: the plugin registers again, A's 16 are back,
   every consumer runs;
6. a rollout of an image tag over A, B and D with consumers arriving every 0.5 s: none refused,
   allocatable never 0 on any node, the old pods exit 0, at most as many nodes at once as the
   base's ``maxSurge`` allows, and the time it took;
7. uninstalled, the labels removed.

Check 11, the DRA driver hardened (``manifests/overlays/dra-hardened``) on the same fleet:

1. A, B and D labelled, the overlay applied: the driver runs on each, not privileged, its root
   read-only, seccomp RuntimeDefault; each node's ResourceSlices are its own (its name, its pool,
   owned by its Node); none for C;
2. a claim pod on A and one on B: each claim is allocated from its node's pool and prepared by
   that node's driver (its log, its CDI spec) and by no other;
3. a rollout of an image tag over A, B and D with claim pods arriving every 0.5 s: all run, at
   most as many nodes at once as maxSurge allows, the old drivers exit 0;
4. B's kubelet stopped and its Node deleted: its slices are garbage-collected and nobody writes
   them back; its kubelet started again (labelled at registration, as a node pool does): a new
   Node of the same name, new slices owned by it.
"""

from __future__ import annotations

import datetime
import itertools
import math
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import trio
import yaml

from bench.scale import audit

from . import api, legs
from .cluster import (
    CONSUMERS,
    DAEMONSET,
    NODE_LABEL,
    README_IMAGE,
    SYSTEM,
    Cluster,
    arriving,
    container_id,
    labels,
    phase,
    ready,
    refused,
)
from .cluster_dra import (
    CLAIM_PREFIX,
    DRIVER,
    SEV_SNP_GUEST,
    WRITE_EVERY,
    Dra,
    fake_sev_snp_sysfs,
    spec_path,
)
from .fleet import Fleet, make_device
from .kube import Obj, Watch
from .node import POD_RESOURCES_SOCKET, Node
from .poll import Unavailable, wait_for
from .report import now
from .scenario import DEVICE, DEVICE_NUMBER, PCC_DIR, RESOURCE, SHARES, expect

FLEET_APP = "fleet-app"
FLEET_ROLE = "fleet"
# Check 10.5: how long a consumer stays on a node that stopped answering.
UNREACHABLE_TOLERATION = 2
# Check 10.3: the plugin registers this soon after the path it waited for appears.
BOOT_RACE_BOUND = 1.0
# Check 10.6: the new tag every node's containerd has the image under.
ROLLOUT_TAG = "0.1.0-fleet"
# Check 11.3's tag, another again.
DRA_ROLLOUT_TAG = "0.1.0-fleet-dra"
# Check 11.4: how long the slices of a deleted Node are watched for a driver writing them back
# (longer than the driver's WRITE_EVERY).
REWRITE_WATCH = WRITE_EVERY + 10
DRA_OVERLAY = "overlays/dra-hardened"
# Check 12: the TDX resource and device of the mixed pool (manifests/overlays/mixed-pool).
TDX_RESOURCE = "tke.cloud.tencent.com/tdx-guest"
TDX_DEVICE = Path("/dev/tdx_guest")
# A node's procfs as the plugin reads it there (its --host-root's proc): the machine's
# cpuinfo, with the TDX guest's CPU flag on a TDX node.
FAKE_PROC = Path("/var/lib/pcc-e2e/proc")
# The mixed pool as shipped, on this machine: the plugin sees each node's own sysfs (node A's
# has check 9's fake SEV-SNP guest device; a container's own /sys would show the machine's)
# and the node's fake procfs under --host-root.
MIXED_POOL_ON_THIS_MACHINE = f"""\
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - ../manifests/overlays/mixed-pool
patches:
  - patch: |-
      apiVersion: apps/v1
      kind: DaemonSet
      metadata:
        name: pcc-device-plugin
        namespace: kube-system
      spec:
        template:
          spec:
            containers:
              - name: pcc-device-plugin
                volumeMounts:
                  - {{name: node-sys, mountPath: /host/sys, readOnly: true,
                     mountPropagation: HostToContainer}}
                  - {{name: node-proc, mountPath: /host/proc, readOnly: true}}
            volumes:
              - {{name: node-sys, hostPath: {{path: /sys, type: Directory}}}}
              - {{name: node-proc, hostPath: {{path: {FAKE_PROC}, type: Directory}}}}
"""
SAMPLE_EVERY = 0.05
# The first kubelet minor that keeps a device plugin client per socket (kubernetes#135437).
PER_SOCKET_KUBELET = 37
# Check 10.6: how long an older kubelet may be at 0 allocatable after it dropped the new plugin
# with the old one's stream: the plugin's registering again takes milliseconds, kubelet's dial
# and first list some tens more.
RESOURCE_KEYED_GAP = 1.0
METRICS_PORT = 8080
# klog's header: severity, month and day, time (the container's clock, UTC).
KLOG_TIME = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6}) ")
REGISTERED = "Registered device plugin with Kubelet"
TDX_CPU_FLAG = "tdx_guest"


def klog_time(line: str) -> float:
    """The wall-clock time a klog line was written at (its header names no year), from a line of
    a container's log as kubelet keeps it (``<time> <stream> <tag> <line>``)."""
    found = KLOG_TIME.match(line.split(" ", 3)[3])
    assert found, line
    month, day, hour, minute, second, micro = (int(part) for part in found.groups())
    year = datetime.datetime.now(datetime.UTC).year
    at = datetime.datetime(year, month, day, hour, minute, second, micro, datetime.UTC)
    return at.timestamp()


class FleetCheck:
    """What checks 10 and 11 read of the fleet, through the cluster's watches and each node's
    own kubelet (pod-resources), containerd and files."""

    def __init__(self, cluster: Cluster, fleet: Fleet) -> None:
        self.cluster = cluster
        self.fleet = fleet
        self.report = cluster.report
        self.a = fleet.a
        self.b = fleet.member("b")[1]
        self.c = fleet.member("c")[1]
        self.d = fleet.member("d")[1]
        self.pcc_nodes = [self.a, self.b, self.d]
        self.watches: list[Watch] = [cluster.pods, cluster.nodes, cluster.daemonsets]

    # What the checks read.

    def plugins(self) -> dict[str, list[Obj]]:
        """The plugin's pods not being deleted, by node."""
        found: dict[str, list[Obj]] = {}
        for pod in self.cluster.plugin_pods():
            if "deletionTimestamp" not in pod["metadata"]:
                found.setdefault(pod["spec"].get("nodeName", ""), []).append(pod)
        return found

    def plugin_on(self, node: Node) -> Obj | None:
        pods = self.plugins().get(node.name, [])
        return pods[0] if len(pods) == 1 else None

    def consumers(self) -> list[Obj]:
        return [
            pod for pod in self.cluster.consumer_pods(FLEET_APP)
            if "deletionTimestamp" not in pod["metadata"]
        ]  # fmt: skip

    def running_on(self, pods: list[Obj]) -> dict[str, int]:
        counts = {node.name: 0 for node in self.fleet.nodes.values()}
        for pod in pods:
            if phase(pod) == "Running":
                counts[pod["spec"]["nodeName"]] += 1
        return counts

    def all_running(self, count: int) -> bool:
        pods = self.consumers()
        return len(pods) == count and sum(self.running_on(pods).values()) == count

    def unscheduled(self, pods: list[Obj]) -> list[Obj]:
        return [p for p in pods if phase(p) == "Pending" and not p["spec"].get("nodeName")]

    def node_object(self, node: Node) -> Obj | None:
        return self.cluster.nodes.current.get(f"/{node.name}")

    def node_allocatable(self, node: Node) -> str | None:
        found = self.node_object(node)
        return None if found is None else found["status"].get("allocatable", {}).get(RESOURCE)

    async def held(self, node: Node) -> dict[str, list[str]]:
        socket = node.see(POD_RESOURCES_SOCKET)
        return {
            pod: ids
            for (namespace, pod, _), ids in (await api.assigned(RESOURCE, socket)).items()
            if namespace == CONSUMERS
        }

    def plugin_log(self, node: Node, pod: Obj) -> str:
        (status,) = pod["status"]["containerStatuses"]
        path = legs.container_log(SYSTEM, pod["metadata"]["name"], pod["metadata"]["uid"],
                                  status["name"], status.get("restartCount", 0))  # fmt: skip
        return node.see(path).read_text(errors="replace")

    async def log_line(self, node: Node, pod: Obj, words: str, within: float = 30) -> str:
        """The first line of the plugin's log on `node` that contains `words`."""

        async def written() -> str | None:
            try:
                text = self.plugin_log(node, pod)
            except (OSError, KeyError):
                return None
            return next((line for line in text.splitlines() if words in line), None)

        line, _ = await wait_for(f"{node.name}: the plugin's log says {words!r}", written, within)
        return line

    async def readyz(self, pod: Obj) -> tuple[int, str]:
        code, body = await api.http_get(f"http://{pod['status']['podIP']}:{METRICS_PORT}/readyz")
        return code, body

    async def until(self, what: str, found: Callable[[], object], within: float = 120) -> None:
        """`found()` asked on every change of what the check follows until it is truthy."""

        def check() -> bool | None:
            return True if found() else None

        async with trio.open_nursery() as nursery:

            async def follow(watch: Watch) -> None:
                await watch.until(what, check, within)
                nursery.cancel_scope.cancel()

            for watch in self.watches:
                nursery.start_soon(follow, watch)

    # What the operator does.

    async def label(self, nodes: list[Node], on: bool = True) -> None:
        value = f"{NODE_LABEL}=true" if on else f"{NODE_LABEL}-"
        await self.cluster.kubectl("label", "--overwrite", "node",
                                   *(n.name for n in nodes), value)  # fmt: skip

    async def name_the_image(self, tag: str | None = None) -> str:
        """The README's registry name (and `tag`) in the copy's base, and the image under that
        name in every node's containerd, as the nodes would pull it."""
        kustomization = self.cluster.manifests / "base" / "kustomization.yaml"
        config = yaml.safe_load(kustomization.read_text())
        (entry,) = (i for i in config["images"] if i["name"] == "localhost/pcc-device-plugin")
        entry["newName"] = README_IMAGE
        if tag is not None:
            entry["newTag"] = tag
        kustomization.write_text(yaml.safe_dump(config, sort_keys=False))
        image = f"{README_IMAGE}:{entry['newTag']}"
        for node in self.fleet.nodes.values():
            await node.ctr("images", "tag", "--force", self.cluster.plugin_reference, image)
        return image

    def deployment(self, replicas: int) -> Obj:
        tolerations = [
            {"key": f"node.kubernetes.io/{taint}", "operator": "Exists", "effect": "NoExecute",
             "tolerationSeconds": UNREACHABLE_TOLERATION}
            for taint in ("unreachable", "not-ready")
        ]  # fmt: skip
        return self.cluster.deployment(replicas, FLEET_APP, FLEET_ROLE, tolerations=tolerations)

    async def scale(self, replicas: int) -> None:
        await self.cluster.kubectl("-n", CONSUMERS, "scale", f"deployment/{FLEET_APP}",
                                   f"--replicas={replicas}")  # fmt: skip

    # 10.1

    async def place(self) -> None:
        report = self.report
        report.variant = "10.1 placement"
        # The consumers the checks before left hold shares of A in kubelet's checkpoint.
        await self.cluster.kubectl("-n", CONSUMERS, "delete", "deployments,pods", "--all",
                                   "--wait=false")  # fmt: skip
        await self.until("no consumer left", lambda: not self.cluster.consumer_pods())
        image = await self.name_the_image()
        await self.label(self.pcc_nodes)
        applied = now()
        await self.cluster.kubectl("apply", "-k", str(self.cluster.manifests / "base"))

        def placed() -> bool:
            plugins = self.plugins()
            a, b, d = (self.plugin_on(node) for node in self.pcc_nodes)
            daemonset = self.cluster.daemonset() or {}
            return bool(
                a and b and d and ready(a) and ready(b) and phase(d) == "Running"
                and daemonset.get("status", {}).get("desiredNumberScheduled") == 3
                and set(plugins) == {n.name for n in self.pcc_nodes}
            )  # fmt: skip

        await self.until("the plugin on A, B and D; A and B ready", placed)
        report.figure("fleet: apply → plugin ready on A and B", now() - applied)
        d_plugin = self.plugin_on(self.d)
        assert d_plugin is not None
        waiting = f"waiting for /host{PCC_DIR} ("
        line = await self.log_line(self.d, d_plugin, "before serving: ")
        expect(f"waiting for /host{PCC_DIR} before serving: detect socket path" in line, line)
        code, body = await self.readyz(d_plugin)
        expect(code == 503 and waiting in body, f"D's /readyz: {code} {body!r}")
        expect(not ready(d_plugin), f"D's plugin is ready: {d_plugin['status']}")
        await self.until(
            f"A's and B's allocatable {RESOURCE}: {SHARES} each",
            lambda: all(self.node_allocatable(n) == str(SHARES) for n in (self.a, self.b)),
            60,
        )
        on_c = [
            version for versions in self.cluster.pods.history.values()
            for _, _, version in versions
            if version["spec"].get("nodeName") == self.c.name
            and labels(version).get("app.kubernetes.io/name") == DAEMONSET
        ]  # fmt: skip
        on_c_allocatable = self.node_allocatable(self.c)
        expect(not on_c and on_c_allocatable is None, f"on C: {on_c}, {on_c_allocatable}")
        report.check(
            f"{image} applied with A, B and D labelled: the DaemonSet's 3 pods run there, A and B "
            f"ready with {SHARES} allocatable each (B's kubelet "
            f"{self.kubelet_version(self.b)}); D's plugin runs, not ready, /readyz: "
            f"{body.strip()!r}; on C, labelled nowhere, no plugin pod was ever placed"
        )

    def kubelet_version(self, node: Node) -> str:
        return self.kubelet_version_of(node.name)

    def kubelet_version_of(self, name: str) -> str:
        found = self.cluster.nodes.current.get(f"/{name}")
        return "?" if found is None else str(found["status"]["nodeInfo"]["kubeletVersion"])

    def kubelet_minor(self, node: Node) -> int:
        return int(self.kubelet_version(node).split(".")[1])

    # 10.2

    async def place_consumers(self) -> None:
        report = self.report
        report.variant = "10.2 consumers"
        total = 2 * SHARES + 1
        created = now()
        await self.cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(self.deployment(total)))

        def placed() -> Obj | None:
            pods = self.consumers()
            expect(not any(refused(p) for p in pods), f"kubelet refused a consumer: {pods}")
            counts = self.running_on(pods)
            waiting = self.unscheduled(pods)
            done = (counts[self.a.name] == SHARES and counts[self.b.name] == SHARES
                    and len(waiting) == 1 and len(pods) == total)  # fmt: skip
            return waiting[0] if done else None

        pending = await self.cluster.pods.until(f"{2 * SHARES} consumers on A and B, 1 pending",
                                                placed, 180)  # fmt: skip
        report.figure(f"fleet: Deployment of {total} → {2 * SHARES} running", now() - created)
        counts = self.running_on(self.consumers())
        expect(counts[self.c.name] == counts[self.d.name] == 0, f"consumers by node: {counts}")
        for node in (self.a, self.b):
            held = await self.held(node)
            devices = {device for ids in held.values() for device in ids}
            expect(len(held) == SHARES and len(devices) == SHARES, f"{node.name}: {held}")
        event = await self.cluster.scheduler_event(pending["metadata"]["name"])
        expect(f"Insufficient {RESOURCE}" in event["message"], f"{event}")
        report.check(
            f"{total} consumers: {SHARES} run on A and {SHARES} on B, each node's on {SHARES} "
            f"distinct devices of its own (its kubelet's pod-resources); none on C or D; the "
            f"last is Pending: {event['message']}"
        )
        for here, there in ((self.a, self.b), (self.b, self.a)):
            pod = self.consumer_on(here)
            target = self.plugin_on(there)
            assert target is not None
            address = target["status"]["podIP"]
            # busybox's nc: Debian's static busybox has a wget that crashes.
            request = f"printf 'GET /livez HTTP/1.0\\r\\n\\r\\n' | nc -w 5 {address} {METRICS_PORT}"
            answer = await self.cluster.kubectl(
                "-n", CONSUMERS, "exec", pod["metadata"]["name"], "--", "sh", "-c", request
            )
            expect(answer.startswith("HTTP/1.") and answer.rstrip().endswith("ok"),
                   f"GET /livez of {address} from {here.name}: {answer!r}")  # fmt: skip
        report.check("one pod network: a consumer on A reads /livez of B's plugin pod, and one "
                     "on B A's, across the nodes' own network namespaces")  # fmt: skip
        await self.check_in_consumer(self.consumer_on(self.b), self.b)
        report.check(f"in a consumer on B: {DEVICE} is a character device it can write, "
                     f"{PCC_DIR} is B's own directory, not A's")  # fmt: skip

    def consumer_on(self, node: Node) -> Obj:
        return next(
            p for p in self.consumers()
            if phase(p) == "Running" and p["spec"].get("nodeName") == node.name
        )  # fmt: skip

    async def check_in_consumer(self, pod: Obj, node: Node) -> None:
        """The device and the PCC directory in `pod`, which runs on `node`, are that node's."""
        name = pod["metadata"]["name"]
        nonce = f"{time.monotonic_ns():x}"
        pcc_dir = node.see(PCC_DIR)
        (pcc_dir / f"from-{node.name}-{nonce}").write_text(nonce)
        script = (f"stat -c %F:%t:%T {DEVICE}; echo > {DEVICE} && echo written; "
                  f"cat {PCC_DIR}/from-{node.name}-{nonce}; echo")  # fmt: skip
        output = await self.cluster.kubectl("-n", CONSUMERS, "exec", name, "--", "sh", "-c", script)
        expected = [
            f"character special file:{os.major(DEVICE_NUMBER):x}:{os.minor(DEVICE_NUMBER):x}",
            "written",
            nonce,
        ]
        seen = [line for line in output.splitlines() if line]
        expect(seen == expected, f"{name} on {node.name}: saw {seen}, not {expected}")
        for other in self.pcc_nodes:
            if other is not node:
                leaked = other.see(PCC_DIR) / f"from-{node.name}-{nonce}"
                expect(not leaked.exists(), f"{node.name}'s PCC directory is {other.name}'s too")

    # 10.3

    async def boot_race(self) -> None:
        report = self.report
        report.variant = "10.3 boot race"
        before = self.plugin_on(self.d)
        assert before is not None
        pending_name = self.unscheduled(self.consumers())[0]["metadata"]["name"]
        made = time.time()
        self.d.see(PCC_DIR).mkdir(mode=0o755)
        seconds = await self.registered_after(before, made, "PCC directory created")

        def served() -> bool:
            pod = self.cluster.pods.current.get(f"{CONSUMERS}/{pending_name}")
            return bool(pod and phase(pod) == "Running" and pod["spec"]["nodeName"] == self.d.name)

        await self.until(f"{pending_name} running on D", served)
        report.check(
            f"D's PCC directory created: its plugin, the same container, registered "
            f"{seconds * 1000:.0f} ms later (its log), no restart; the Pending consumer "
            f"{pending_name} runs on D"
        )
        self.d.see(DEVICE).unlink()
        await self.cluster.kubectl("-n", SYSTEM, "delete", "pod", before["metadata"]["name"],
                                   "--wait=false")  # fmt: skip
        new = await self.cluster.pods.until(
            "a new plugin pod on D, running",
            lambda: (p if (p := self.plugin_on(self.d)) and p["metadata"]["uid"]
                     != before["metadata"]["uid"] and phase(p) == "Running"
                     and p.get("status", {}).get("containerStatuses") else None),
            120,
        )  # fmt: skip
        line = await self.log_line(self.d, new, "before serving: ")
        expect(f"waiting for /host{DEVICE} before serving: detect device" in line, line)
        code, body = await self.readyz(new)
        expect(code == 503 and f"waiting for /host{DEVICE} (" in body, f"{code} {body!r}")
        made = time.time()
        make_device(self.d.see(DEVICE))
        seconds = await self.registered_after(new, made, "device made")
        report.check(
            f"D's device removed and its plugin pod deleted: the new pod waited for /host{DEVICE} "
            f"(/readyz {body.strip()!r}); made again, it registered {seconds * 1000:.0f} ms later, "
            "no restart"
        )

    async def registered_after(self, pod: Obj, made: float, what: str) -> float:
        """Seconds from `made` (wall clock) to the registration the plugin of `pod` on D logs,
        once it is ready; the same container, never restarted. Judged: BOOT_RACE_BOUND."""
        uid, container = pod["metadata"]["uid"], container_id(pod)
        line = await self.log_line(self.d, pod, REGISTERED)
        in_place = await self.log_line(self.d, pod, " is in place after ")
        ready_pod = await self.cluster.pods.until(
            "D's plugin ready",
            lambda: p if (p := self.plugin_on(self.d)) and ready(p) else None, 60,
        )  # fmt: skip
        (status,) = ready_pod["status"]["containerStatuses"]
        same = ready_pod["metadata"]["uid"] == uid and container_id(ready_pod) == container
        expect(same and status.get("restartCount", 0) == 0, f"D's plugin restarted: {status}")
        seconds = klog_time(line) - made
        self.report.figure(f"D: {what} → the plugin saw it (its log)", klog_time(in_place) - made)
        self.report.figure(f"D: {what} → registered (its log)", seconds)
        expect(seconds <= BOOT_RACE_BOUND,
               f"D's plugin registered {seconds:.3f} s after the {what}: {line}")  # fmt: skip
        return seconds

    # 10.4

    async def drain(self) -> None:
        report = self.report
        report.variant = "10.4 drain"
        await self.cluster.kubectl("cordon", self.d.name)
        keep = 24
        await self.scale(keep)
        await self.until(f"{keep} consumers running", lambda: self.all_running(keep))
        before = self.running_on(self.consumers())
        plugin = self.plugin_on(self.a)
        assert plugin is not None
        drained = now()
        await self.cluster.server.kubectl(
            "drain", self.a.name, "--ignore-daemonsets", "--delete-emptydir-data",
            "--timeout=180s", within=240,
        )  # fmt: skip
        expected_on_b = min(SHARES, before[self.b.name] + before[self.a.name])

        def settled() -> bool:
            pods = self.consumers()
            counts = self.running_on(pods)
            return (
                counts[self.a.name] == 0
                and counts[self.b.name] == expected_on_b
                and len(pods) == keep
                and len(self.unscheduled(pods)) == keep - expected_on_b - counts[self.d.name]
            )

        await self.until("A's consumers on B up to its capacity, the rest Pending", settled)
        report.figure("fleet: drain A → its consumers on B or Pending", now() - drained)
        after = self.plugin_on(self.a)
        expect(after is not None and after["metadata"]["uid"] == plugin["metadata"]["uid"]
               and ready(after), f"the plugin's pod on A after the drain: {after}")  # fmt: skip
        waiting = len(self.unscheduled(self.consumers()))
        report.check(
            f"kubectl drain {self.a.name} (D cordoned): A's {before[self.a.name]} consumers "
            f"went to B up to its {SHARES} ({expected_on_b} there now), {waiting} Pending; the "
            "plugin's pod stayed on A, ready"
        )
        uncordoned = now()
        await self.cluster.kubectl("uncordon", self.a.name)
        await self.until(f"all {keep} consumers running again", lambda: self.all_running(keep))
        report.figure("fleet: uncordon A → every consumer running", now() - uncordoned)
        report.check(f"kubectl uncordon {self.a.name}: all {keep} consumers run again")

    # 10.5

    async def kubelet_stopped(self) -> None:
        report = self.report
        report.variant = "10.5 node lost"
        on_a = {p["metadata"]["name"] for p in self.consumers()
                if p["spec"].get("nodeName") == self.a.name}  # fmt: skip
        expect(bool(on_a), "no consumer on A to lose")
        kubelet = self.a.kubelet
        await kubelet.stop()
        stopped = now()

        def not_ready() -> bool:
            found = self.node_object(self.a)
            conditions = (found or {}).get("status", {}).get("conditions") or []
            return any(c["type"] == "Ready" and c["status"] != "True" for c in conditions)

        await self.until("A NotReady", not_ready, 180)
        report.figure("fleet: A's kubelet stopped → Node NotReady", now() - stopped)

        def evicted() -> bool:
            return all(
                any("deletionTimestamp" in v["metadata"] for _, _, v in self.versions_of(name))
                for name in on_a
            )

        await self.until("A's consumers evicted", evicted, 120)
        report.figure("fleet: A NotReady → its consumers evicted", now() - stopped)
        reasons = {
            c.get("reason")
            for name in on_a for _, _, v in self.versions_of(name)
            for c in v.get("status", {}).get("conditions") or []
            if c["type"] == "DisruptionTarget"
        }  # fmt: skip
        plugin = self.plugin_on(self.a)
        expect(plugin is not None, "the plugin's pod on A was evicted too")
        report.check(
            f"A's kubelet stopped: the Node went NotReady and the taint manager evicted its "
            f"{len(on_a)} consumers ({', '.join(sorted(filter(None, reasons))) or 'no reason'}); "
            "the plugin's pod stays"
        )
        started = now()
        await kubelet.start()
        await self.until("A Ready again", lambda: not not_ready(), 120)
        await wait_for("A's kubelet: the plugin registered again, 16 allocatable",
                       lambda: self.allocatable_is(self.a, SHARES), 120)  # fmt: skip
        report.figure("fleet: A's kubelet started → 16 allocatable", now() - started)
        total = len(self.consumers())
        await self.until(f"all {total} consumers running", lambda: self.all_running(total))
        report.figure("fleet: A's kubelet started → every consumer running", now() - started)
        report.check(f"A's kubelet started: Ready, the plugin registered again ({SHARES} "
                     f"allocatable), all {total} consumers run")  # fmt: skip

    def versions_of(self, name: str) -> list[tuple[float, str, Obj]]:
        return [
            entry
            for versions in self.cluster.pods.history.values()
            if versions[-1][2]["metadata"]["name"] == name
            for entry in versions
        ]

    async def allocatable_is(self, node: Node, count: int) -> bool | None:
        socket = node.see(POD_RESOURCES_SOCKET)
        return True if len(await api.allocatable(RESOURCE, socket)) == count else None

    # 10.6

    async def rollout(self) -> None:
        report = self.report
        report.variant = "10.6 rollout"
        await self.cluster.kubectl("uncordon", self.d.name)
        await self.scale(12)
        await self.until("12 consumers", lambda: len(self.consumers()) == 12)
        # As an operator waits for `kubectl rollout status`: a node whose plugin is not ready
        # (A's, for a while after its kubelet came back) is replaced at once, without a surge.
        await self.until("every plugin ready", lambda: self.rolled_out(None))
        old = {node.name: self.plugin_on(node) for node in self.pcc_nodes}
        image = await self.name_the_image(ROLLOUT_TAG)
        names: list[str] = []
        samples: dict[str, list[tuple[float, int]]] = {}
        async with trio.open_nursery() as sampling:
            for node in self.pcc_nodes:
                sampling.start_soon(self._sample, node, samples)
            applied = now()
            await self.cluster.kubectl("apply", "-k", str(self.cluster.manifests / "base"))
            done = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.cluster.arrive, "fleet", names, done)
                await self.until("the rollout over A, B and D", lambda: self.rolled_out(image),
                                 300)  # fmt: skip
                took = now() - applied
                done.set()
            sampling.cancel_scope.cancel()
        arrived = [p for name in names for p in self.cluster.pods_named(name)]
        rejected = {p["metadata"]["name"]: p["spec"].get("nodeName") for p in arrived
                    if refused(p)}  # fmt: skip
        at_once = self.at_once(old, applied)
        desired = len(self.pcc_nodes)
        surge = self.max_surge(desired)
        zero = {name: sum(t2 - t1 for (t1, c1), (t2, _) in itertools.pairwise(s) if c1 == 0)
                for name, s in samples.items()}  # fmt: skip
        exits = self.old_exits(old)
        report.figure(f"fleet: rollout of a tag over {desired} nodes", took)
        report.figure("fleet: a new plugin pod created → ready (the slowest)",
                      self.slowest_start(applied))  # fmt: skip
        report.count("fleet: nodes updating at once (most)", at_once)
        expect(exits == [0] * desired, f"the old plugins' exit codes: {exits}")
        expect(at_once == min(surge, desired), f"{at_once} nodes at once, maxSurge gives {surge}")
        # Kubelets before 1.37 keep one client per resource: when the old plugin's stream ends
        # they drop the new one too, which registers again at once (deploy.md, "Rolling
        # updates"). Judged there: that it comes back within RESOURCE_KEYED_GAP; what kubelet
        # refused meanwhile is reported.
        keyed = {n.name for n in self.pcc_nodes if self.kubelet_minor(n) < PER_SOCKET_KUBELET}
        for name, seconds in zero.items():
            if name in keyed:
                report.figure(f"fleet: {name} (kubelet {self.kubelet_version_of(name)}) at 0 "
                              "allocatable in the rollout", seconds)  # fmt: skip
                expect(seconds <= RESOURCE_KEYED_GAP,
                       f"{name}: {seconds:.3f} s at 0 allocatable in the rollout")  # fmt: skip
            else:
                expect(seconds == 0, f"{name}: {seconds:.3f} s at 0 allocatable in the rollout")
        wrong = {pod: node for pod, node in rejected.items() if node not in keyed}
        expect(not wrong, f"kubelet refused consumers during the rollout: {wrong}")
        for pod, node in rejected.items():
            report.note(f"{node}'s kubelet {self.kubelet_version_of(node or '')} refused "
                        f"{pod} in the moment it had dropped the new plugin")  # fmt: skip
        report.check(
            f"{image} rolled out over A, B and D in {took:.1f} s, {at_once} nodes at once (the "
            f"base's maxSurge allows {surge} of {desired}); {len(arrived)} consumers arrived "
            f"during it, {len(rejected)} refused; allocatable never 0 on the 1.37 nodes "
            f"({sum(len(s) for s in samples.values())} reads in all), on B (kubelet "
            f"{self.kubelet_version(self.b)}) {zero[self.b.name] * 1000:.0f} ms; the old "
            "plugins exited 0"
        )
        await self.cluster.kubectl("-n", CONSUMERS, "delete", "pods", "-l",
                                   "pcc-e2e/role=arrival", "--wait=false")  # fmt: skip

    async def _sample(self, node: Node, samples: dict[str, list[tuple[float, int]]]) -> None:
        socket = node.see(POD_RESOURCES_SOCKET)
        found = samples.setdefault(node.name, [])
        while True:
            try:
                count = len(await api.allocatable(RESOURCE, socket))
            except Unavailable:
                count = -1
            found.append((now(), count))
            await trio.sleep(SAMPLE_EVERY)

    def rolled_out(self, image: str | None) -> bool:
        """Every PCC node's plugin ready (with `image`, if given) and the DaemonSet done."""
        daemonset = self.cluster.daemonset() or {}
        status = daemonset.get("status", {})
        desired = len(self.pcc_nodes)
        plugins = self.plugins()
        return bool(
            status.get("observedGeneration", 0) >= daemonset["metadata"]["generation"]
            and status.get("updatedNumberScheduled") == desired
            and status.get("numberAvailable") == desired
            and all(len(pods) == 1 and ready(pods[0])
                    and image in (None, pods[0]["spec"]["containers"][0]["image"])
                    for pods in plugins.values())
            and len(plugins) == desired
        )  # fmt: skip

    def max_surge(self, desired: int) -> int:
        """The base's maxSurge for `desired` nodes, rounded up as the DaemonSet controller does."""
        daemonset = self.cluster.daemonset() or {}
        surge = daemonset["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"]
        if isinstance(surge, str) and surge.endswith("%"):
            return math.ceil(desired * int(surge[:-1]) / 100)
        return int(surge)

    def new_pods(self, since: float) -> list[list[tuple[float, str, Obj]]]:
        """The versions of each plugin pod first seen after `since` (the rollout's start)."""
        return [
            versions for versions in self.cluster.pods.history.values()
            if versions[0][0] > since
            and labels(versions[0][2]).get("app.kubernetes.io/name") == DAEMONSET
        ]  # fmt: skip

    def slowest_start(self, since: float) -> float:
        """The longest a new plugin pod of the rollout took from its creation to ready."""
        return max(
            next(at for at, _, v in versions if ready(v)) - versions[0][0]
            for versions in self.new_pods(since)
            if any(ready(v) for _, _, v in versions)
        )

    def at_once(self, old: dict[str, Obj | None], since: float) -> int:
        """The most nodes that had a new plugin pod while their old one was still there."""
        spans = []
        for name, before in old.items():
            assert before is not None
            # The controller counts a node as updated once its old pod is being deleted.
            gone = next(
                at for at, kind, version in self.cluster.pods.versions(before)
                if kind == "DELETED" or "deletionTimestamp" in version["metadata"]
            )  # fmt: skip
            # The DaemonSet's pods are bound by the scheduler: their first version names no node.
            created = min(
                versions[0][0]
                for versions in self.new_pods(since)
                if versions[-1][2]["spec"].get("nodeName") == name
            )
            spans.append((created, gone))
        events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
        most = current = 0
        for _, step in events:
            current += step
            most = max(most, current)
        return most

    def old_exits(self, old: dict[str, Obj | None]) -> list[int | None]:
        exits = []
        for before in old.values():
            assert before is not None
            codes = [
                status["state"]["terminated"]["exitCode"]
                for _, _, version in self.cluster.pods.versions(before)
                for status in version.get("status", {}).get("containerStatuses") or []
                if "terminated" in status.get("state", {})
            ]
            exits.append(codes[-1] if codes else None)
        return exits

    # 10.7

    async def uninstall(self) -> None:
        self.report.variant = "10.7 uninstall"
        await self.cluster.kubectl("-n", CONSUMERS, "delete", "deployment", FLEET_APP)
        await self.cluster.kubectl("delete", "-k", str(self.cluster.manifests / "base"))
        await self.label(self.pcc_nodes, on=False)
        await self.until(
            "no plugin pod and no consumer",
            lambda: not self.cluster.plugin_pods() and not self.consumers(),
        )
        self.report.check("uninstalled: no plugin pod, no consumer, the labels removed")


async def device_plugin(cluster: Cluster, fleet: Fleet) -> None:
    """Check 10 (the module's docstring)."""
    check = FleetCheck(cluster, fleet)
    await check.place()
    await check.place_consumers()
    await check.boot_race()
    await check.drain()
    await check.kubelet_stopped()
    await check.rollout()
    await check.uninstall()


class DraFleetCheck(FleetCheck):
    """Check 11: the DRA driver, hardened, on the fleet."""

    def __init__(self, cluster: Cluster, fleet: Fleet, slices: Watch, claims: Watch) -> None:
        super().__init__(cluster, fleet)
        self.slices = slices
        self.watches.append(slices)
        self.dra = Dra(cluster, slices, claims)
        self.overlay = cluster.manifests / DRA_OVERLAY

    def slices_of(self, node: Node) -> list[Obj]:
        return [
            s for s in self.slices.current.values()
            if s["spec"]["driver"] == DRIVER and s["spec"].get("nodeName") == node.name
        ]  # fmt: skip

    def published(self, node: Node) -> bool:
        """The node's pool whole: one generation, every slice it counts, SHARES devices, each
        slice owned by the node's Node as it is now."""
        pool = self.slices_of(node)
        found = self.node_object(node)
        if not pool or found is None:
            return False
        owner = {"apiVersion": "v1", "kind": "Node", "name": node.name,
                 "uid": found["metadata"]["uid"]}  # fmt: skip
        return (
            len({s["spec"]["pool"]["generation"] for s in pool}) == 1
            and {s["spec"]["pool"]["resourceSliceCount"] for s in pool} == {len(pool)}
            and {s["spec"]["pool"]["name"] for s in pool} == {node.name}
            and sum(len(s["spec"].get("devices") or []) for s in pool) == SHARES
            and all(
                [{k: ref.get(k) for k in owner} for ref in s["metadata"].get("ownerReferences")
                 or []] == [owner]
                for s in pool
            )
        )  # fmt: skip

    def driver_pod_on(self, node: Node) -> Obj | None:
        found = self.plugin_on(node)
        return found if found is not None and ready(found) else None

    # 11.1

    async def install(self) -> None:
        report = self.report
        report.variant = "11.1 DRA placement"
        for path, make in ((DEVICE, make_device), (PCC_DIR, lambda p: p.mkdir(mode=0o755))):
            if not self.d.see(path).exists():
                make(self.d.see(path))
        image = await self.name_the_image()
        await self.label(self.pcc_nodes)
        applied = now()
        await self.cluster.kubectl("apply", "-k", str(self.overlay))
        # The claim pods' template, made by check 9 unless it was left out (`--only`).
        template = self.dra.claim_template["metadata"]["name"]
        templates = f"/apis/resource.k8s.io/v1/namespaces/{CONSUMERS}/resourceclaimtemplates"
        try:
            await self.cluster.server.get(f"{templates}/{template}")
        except RuntimeError:
            await self.cluster.server.call("POST", templates, self.dra.claim_template)

        def placed() -> bool:
            daemonset = self.cluster.daemonset() or {}
            return bool(
                daemonset.get("status", {}).get("desiredNumberScheduled") == 3
                and set(self.plugins()) == {n.name for n in self.pcc_nodes}
                and all(self.driver_pod_on(n) for n in self.pcc_nodes)
                and all(self.published(n) for n in self.pcc_nodes)
            )

        await self.until("the driver ready on A, B and D, each node's slices published", placed)
        report.figure("fleet DRA: apply → every node's slices published", now() - applied)
        expect(not self.slices_of(self.c), f"slices for C: {self.slices_of(self.c)}")
        for node in self.pcc_nodes:
            pod = self.driver_pod_on(node)
            assert pod is not None
            (container,) = pod["spec"]["containers"]
            context = container.get("securityContext") or {}
            pod_context = pod["spec"].get("securityContext") or {}
            seccomp = context.get("seccompProfile") or pod_context.get("seccompProfile") or {}
            expect(
                not context.get("privileged") and context.get("readOnlyRootFilesystem") is True
                and seccomp.get("type") == "RuntimeDefault"
                and context.get("allowPrivilegeEscalation") is False,
                f"{node.name}: the driver's securityContext {context}, seccomp {seccomp}",
            )  # fmt: skip
        await self.start_cost()
        pools = ", ".join(
            f"{n.name}: {len(self.slices_of(n))} slice(s)" for n in self.pcc_nodes
        )  # fmt: skip
        report.check(
            f"{image} as {DRA_OVERLAY} with A, B and D labelled: the driver, not privileged, "
            "its root read-only, seccomp RuntimeDefault, runs and is ready on each; each node's "
            f"pool is its own, owned by its Node ({pools}, {SHARES} devices each); none for C"
        )

    async def start_cost(self) -> None:
        """What each driver that started on a node without one asked of the API server up to its
        first slice written, from the API server's audit log, read by the scale benchmark's own
        code (bench/scale/audit.py), so that a node costs here what it costs there: one list and
        one watch of its slices, a read of its Node, the write; nothing asked twice."""
        requests = audit.by_node(audit.AuditLog(self.cluster.control_plane.audit_log).requests())
        seen = {}
        for node in (self.b, self.d):
            start = audit.to_first_slice(requests.get(node.name, []))
            expect(start is not None, f"{node.name}: no slice write in the audit log")
            assert start is not None
            whats = [request.what for request in start[0]]
            expect(len(whats) == len(set(whats)), f"{node.name} asked again at start: {whats}")
            seen[node.name] = whats
            self.report.count(f"fleet DRA: {node.name}'s requests to its first slice", len(whats))
        self.report.note(
            "each driver's requests to its first slice (kube-apiserver's audit log): "
            + "; ".join(f"{name}: {', '.join(whats)}" for name, whats in seen.items())
        )

    # 11.2

    async def claims_where_they_run(self) -> None:
        report = self.report
        report.variant = "11.2 DRA claims"
        placed = {}
        for node in (self.a, self.b):
            name = f"{CLAIM_PREFIX}fleet-{node.name}"
            await self.dra.create(name, node_name=node.name)
            placed[name] = node
        for name, node in placed.items():
            pod = await self.cluster.consumer_running(name)
            claim = self.dra.claim_of(pod)
            uid = claim["metadata"]["uid"]
            pools = {r["pool"] for r in claim["status"]["allocation"]["devices"]["results"]}
            expect(pools == {node.name}, f"{name}: allocated from {pools}")
            said = f"NodePrepareResources {CONSUMERS}/{claim['metadata']['name']} ({uid})"
            for other in self.pcc_nodes:
                driver = self.driver_pod_on(other)
                assert driver is not None
                prepared_here = said in self.plugin_log(other, driver)
                spec_here = other.see(spec_path(uid)).exists()
                expect(prepared_here == spec_here == (other is node),
                       f"{name}'s claim on {other.name}: prepared {prepared_here}, "
                       f"spec {spec_here}")  # fmt: skip
            await self.check_in_consumer(pod, node)
        report.check(
            "a claim pod on A and one on B (kubelet "
            f"{self.kubelet_version(self.b)}): each claim allocated from its node's pool, "
            "prepared by that node's driver (its log, its CDI spec) and by no other; in each, "
            "the node's own device and PCC directory"
        )
        for name in placed:
            await self.cluster.delete_consumer(name)

    # 11.3

    async def rollout(self) -> None:
        report = self.report
        report.variant = "11.3 DRA rollout"
        old = {node.name: self.plugin_on(node) for node in self.pcc_nodes}
        image = await self.name_the_image(DRA_ROLLOUT_TAG)
        names: list[str] = []
        applied = now()
        await self.cluster.kubectl("apply", "-k", str(self.overlay))
        done = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.arrive, names, done)
            await self.until("the driver rolled out over A, B and D",
                             lambda: self.rolled_out(image)
                             and all(self.published(n) for n in self.pcc_nodes), 300)  # fmt: skip
            took = now() - applied
            done.set()
        at_once = self.at_once(old, applied)
        desired = len(self.pcc_nodes)
        surge = self.max_surge(desired)
        failed = [
            name for name in names
            if not any(phase(version) == "Running" for _, _, version in self.versions_of(name))
        ]  # fmt: skip
        report.figure(f"fleet DRA: rollout of a tag over {desired} nodes", took)
        report.count("fleet DRA: nodes updating at once (most)", at_once)
        expect(not failed, f"claim pods that did not run during the rollout: {failed}")
        expect(at_once == min(surge, desired), f"{at_once} nodes at once, maxSurge gives {surge}")
        expect(self.old_exits(old) == [0] * desired, f"old drivers' exits: {self.old_exits(old)}")
        report.check(
            f"{image} rolled out over A, B and D in {took:.1f} s, {at_once} nodes at once "
            f"(maxSurge {surge} of {desired}); {len(names)} claim pods arrived during it and "
            "all ran; the old drivers exited 0"
        )

    async def arrive(self, names: list[str], until: trio.Event) -> None:
        """A claim pod at each arrival (cluster.arriving) until `until`, each deleted once it
        runs."""

        async def serve(name: str) -> None:
            await self.dra.create(name)
            await self.cluster.consumer_running(name)
            await self.cluster.delete_consumer(name)

        await arriving(names, lambda number: f"{CLAIM_PREFIX}arrival-{number}", serve, until)

    # 11.4

    async def node_deleted(self) -> None:
        report = self.report
        report.variant = "11.4 Node deleted"
        node = self.b
        old_uid = (self.node_object(node) or {})["metadata"]["uid"]
        await node.kubelet.stop()
        deleted = now()
        await self.cluster.kubectl("delete", "node", node.name)
        await self.slices.until(
            f"{node.name}'s slices collected",
            lambda: True if not self.slices_of(node) else None,
            120,
        )
        report.figure("fleet DRA: Node deleted → its slices collected", now() - deleted)
        quiet_from = now()
        await trio.sleep(REWRITE_WATCH)
        written = [
            version
            for versions in self.slices.history.values()
            for at, kind, version in versions
            if at > quiet_from and version["spec"].get("nodeName") == node.name
        ]
        expect(not written, f"{node.name}'s slices written again after the Node went: {written}")
        report.check(
            f"{node.name}'s kubelet stopped and its Node deleted: its slices were collected "
            f"(their owner gone) and in the {REWRITE_WATCH:.0f} s after, nobody wrote them back"
        )
        node.kubelet.argv.append(f"--node-labels={NODE_LABEL}=true")
        started = now()
        await node.kubelet.start()

        def back() -> bool:
            found = self.node_object(node)
            return bool(found and found["metadata"]["uid"] != old_uid and self.published(node))

        await self.until(f"{node.name} registered again, its slices owned by the new Node", back)
        report.figure("fleet DRA: kubelet started → new Node's slices published", now() - started)
        report.check(
            f"{node.name}'s kubelet started again (labelled at registration, as a node pool "
            "does): a new Node of the same name, and the driver, which had stopped writing "
            "while its Node was gone, published new slices owned by it"
        )


def fake_procfs(node: Node, tdx: bool) -> None:
    """The node's procfs as check 12's plugin reads it: the machine's cpuinfo, the first CPU's
    flags with the TDX guest's if `tdx`."""
    proc = node.see(FAKE_PROC)
    proc.mkdir(parents=True, exist_ok=True)
    flags = f" {TDX_CPU_FLAG}" if tdx else ""
    real = Path("/proc/cpuinfo").read_text()
    (proc / "cpuinfo").write_text(
        re.sub(r"^(flags\s*:.*)$", rf"\1{flags}", real, count=1, flags=re.M)
    )


class MixedPoolCheck(FleetCheck):
    """Check 12: one DaemonSet for a pool of SEV-SNP and TDX nodes (manifests/overlays/mixed-pool):
    A is an SEV-SNP guest (check 9's fake sysfs), C becomes a TDX guest (its own device, and a
    CPU flag the node's fake procfs shows the plugin)."""

    async def run(self, dra_overlay: Path) -> None:
        report = self.report
        report.variant = "12 mixed pool"
        # One mode per node: the DRA driver of check 11 goes, with its consumers.
        await self.cluster.kubectl("-n", CONSUMERS, "delete", "pods", "--all", "--wait=false")
        await self.cluster.kubectl("delete", "--ignore-not-found", "-k", str(dra_overlay))
        await self.label([self.a, self.b, self.c, self.d], on=False)
        await self.until("no plugin pod, no consumer",
                         lambda: not self.cluster.plugin_pods()
                         and not self.cluster.consumer_pods())  # fmt: skip
        if not SEV_SNP_GUEST.exists():
            fake_sev_snp_sysfs(self.a.state)
        make_device(self.c.see(TDX_DEVICE))
        fake_procfs(self.a, tdx=False)
        fake_procfs(self.c, tdx=True)
        overlay = self.cluster.manifests.parent / "fleet-mixed-pool"
        overlay.mkdir(exist_ok=True)
        (overlay / "kustomization.yaml").write_text(MIXED_POOL_ON_THIS_MACHINE)
        await self.label([self.a, self.c])
        applied = now()
        await self.cluster.kubectl("apply", "-k", str(overlay))

        def served() -> bool:
            a, c = self.plugin_on(self.a), self.plugin_on(self.c)
            return bool(
                a and c and ready(a) and ready(c)
                and self.offered(self.a, RESOURCE) == SHARES
                and self.offered(self.a, TDX_RESOURCE) == 0
                and self.offered(self.c, TDX_RESOURCE) == SHARES
                and self.offered(self.c, RESOURCE) == 0
            )  # fmt: skip

        await self.until("A offering the PCC device, C the TDX guest", served, 180)
        report.figure("mixed pool: apply → A and C each offering its own", now() - applied)
        report.check(
            f"manifests/overlays/mixed-pool with A (SEV-SNP) and C (TDX) labelled: one DaemonSet, "
            f"ready on both; A offers {SHARES} {RESOURCE} and no {TDX_RESOURCE}, C {SHARES} "
            f"{TDX_RESOURCE} and no {RESOURCE}"
        )
        tdx_pod = self.cluster.consumer_pod("tdx-app", "served")
        (container,) = tdx_pod["spec"]["containers"]
        container["resources"] = {"limits": {TDX_RESOURCE: 1}}
        container["command"] = ["sh", "-c", f"ls -l {TDX_DEVICE} && exec sleep 3600"]
        await self.cluster.server.call("POST", f"/api/v1/namespaces/{CONSUMERS}/pods", tdx_pod)
        await self.cluster.create_consumer("pcc-app", "served")
        for name, node, device in (("tdx-app", self.c, TDX_DEVICE), ("pcc-app", self.a, DEVICE)):
            pod = await self.cluster.consumer_running(name)
            expect(pod["spec"]["nodeName"] == node.name, f"{name} on {pod['spec']['nodeName']}")
            answer = await self.cluster.kubectl(
                "-n", CONSUMERS, "exec", name, "--", "sh", "-c",
                f"stat -c %F {device}; echo > {device} && echo written",
            )  # fmt: skip
            expect(answer.split() == ["character", "special", "file", "written"],
                   f"{name}: {answer!r}")  # fmt: skip
        report.check(
            f"a pod asking for {TDX_RESOURCE} runs on C with a writable {TDX_DEVICE}, one "
            f"asking for {RESOURCE} on A with a writable {DEVICE}"
        )
        await self.cluster.kubectl("-n", CONSUMERS, "delete", "pods", "--all", "--wait=false")
        await self.cluster.kubectl("delete", "-k", str(overlay))
        await self.label([self.a, self.c], on=False)

    def offered(self, node: Node, resource: str) -> int:
        """What the Node's status says of `resource`: its allocatable, 0 where it has none."""
        found = self.node_object(node)
        allocatable = (found or {}).get("status", {}).get("allocatable", {})
        return int(allocatable.get(resource, "0"))


async def dra(cluster: Cluster, fleet: Fleet, slices: Watch, claims: Watch) -> None:
    """Check 11 (the module's docstring)."""
    check = DraFleetCheck(cluster, fleet, slices, claims)
    await check.install()
    await check.claims_where_they_run()
    await check.rollout()
    await check.node_deleted()
    await MixedPoolCheck(cluster, fleet).run(check.overlay)
