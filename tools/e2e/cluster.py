"""``nox -s cluster``: the plugin installed as the README says on a one-node cluster, and watched.

The cluster: control_plane.py's etcd, API server, controller manager and scheduler; the e2e's
kubelet joining as the node ``pcc-e2e-node`` (its own client certificate); containerd 2.x with
CDI; a CNI bridge for the pods. An administrator's two steps come first, as on a cluster whose
PodSecurity default is ``baseline``: kube-system labelled ``privileged``, and a namespace for the
consumers (``pcc-consumers``, at the default). The operator works on a copy of ``manifests/``
with kubectl, as the README and docs/deploy.md say; the checks read the API server (watches,
kube.py), kubelet's pod-resources API, containerd and the pods. Each check prints PASS lines
with the time since the start, and figures:

1. install: the image set in the copy's ``manifests/base`` (newName and newTag, the README's
   way), the image in containerd under that name, ``kubectl apply -k manifests/base``: no plugin
   pod while no node is labelled; ``kubectl label node``: the DaemonSet has 1 desired and 1 ready
   (the readiness probe), and the Node 16 allocatable ``tke.cloud.tencent.com/pcc-device``;
2. consumers: a Deployment of 17 confidential-apps (manifests/examples): 16 run, each with a
   writable ``/dev/sev-guest`` and the node's ``/var/run/pcc``, holding 16 distinct devices; the
   17th is Pending with the scheduler's ``Insufficient tke.cloud.tencent.com/pcc-device``, never
   refused by kubelet; scaled to 16, nothing is Pending; one deleted, its share goes to its
   replacement;
3. rollouts: ``kubectl rollout restart`` of the base (surge) once while consumers arrive
   (one every 0.5 s): kubelet's allocatable, read every 10 ms through pod-resources, never drops
   to 0, every consumer runs, the old plugin exits 0. Then the way back for clusters that cannot
   surge (``manifests/overlays/no-surge``) once: its gap and the consumers kubelet refused in it
   are reported, not failed;
4. overlays in turn: hardened, profiles (its ConfigMap edited and applied live: the plugin applies
   it without a restart, seen in allocatable), cdi (containerd resolves the plugin's CDI device
   names from its spec); each one's plugin ready and a consumer served; then the base again;
5. ``kubectl logs`` shows the plugin's start and registration; ``kubectl exec`` of the doctor in
   the plugin's pod passes; ``/metrics`` from the pod's IP counts registrations and allocations;
6. kubelet restarted three times with consumers running: they keep their containers and devices,
   and the plugin's own legs of each restart (tools/e2e/legs.py) are within their bounds; the
   plugin's pod deleted: the DaemonSet makes a new one, registered again;
7. the migration to the DRA mode and back, as docs/dra.md says (cluster_dra.py), with the
   consumers running: they keep their containers and devices both ways;
8. uninstall as docs/deploy.md says: ``kubectl delete -k manifests/base``, the plugin's pod
   gone, 0 allocatable; the node's label removed;
9. the DRA mode on the same cluster (cluster_dra.py): the node labelled and
   ``manifests/overlays/dra`` applied, as docs/dra.md says, claims
   served, the extended resource served by the driver, the device withdrawn and back, kubelet
   and the driver restarted with claims prepared, the admission policy with real tokens.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import secrets
import statistics
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import trio
import yaml

from . import api, kube, kubelet_log, legs, pods
from .control_plane import ControlPlane
from .kube import Obj
from .node import NODE_NAME, Node
from .poll import wait_for
from .report import Report, now
from .scenario import DEVICE, DEVICE_NUMBER, PCC_DIR, RESOURCE, SHARES, expect, wait_allocatable

REPOSITORY = Path(__file__).resolve().parents[2]
SYSTEM = "kube-system"
CONSUMERS = "pcc-consumers"
DAEMONSET = "pcc-device-plugin"
PLUGIN_NAME = "pcc-device-plugin"
CONSUMER_NAME = "confidential-app"
NODE_LABEL = "tke.cloud.tencent.com/pcc-device-plugin"
# The README's own example of a registry's name for the image.
README_IMAGE = "registry.example.com/pcc/pcc-device-plugin"
# The example's `sleep` ignores SIGTERM, so each consumer would take its whole default grace
# period (30 s) to stop; the cluster's consumers are given 2 s.
CONSUMER_GRACE = 2
ROLLOUTS = 1
ARRIVAL_EVERY = 0.5
ARRIVALS_AT_LEAST = 5
SAMPLE_EVERY = 0.01
# Consumers of the Deployment kept for checks 3 and 6: shares left for arriving ones.
KEPT_CONSUMERS = 4
PROFILE_COUNT = 20
DOCTOR = "pcc-device-plugin"
CDI_WORDS = "CDI devices from CRI Config.CDIDevices: "
PLUGIN_PATH = f"/apis/apps/v1/namespaces/{SYSTEM}/daemonsets/{DAEMONSET}"


def labels(obj: Obj) -> dict[str, str]:
    found: dict[str, str] = obj["metadata"].get("labels") or {}
    return found


def phase(pod: Obj) -> str:
    found: str = pod.get("status", {}).get("phase", "")
    return found


def refused(pod: Obj) -> bool:
    """Refused by kubelet's admission (a device plugin's resource it could not allocate)."""
    status: Obj = pod.get("status", {})
    return (
        bool(status.get("phase") == "Failed") and status.get("reason") == "UnexpectedAdmissionError"
    )


def container_id(pod: Obj) -> str:
    (status,) = pod["status"]["containerStatuses"]
    return str(status["containerID"]).removeprefix("containerd://")


def condition(obj: Obj, kind: str) -> bool:
    conditions = obj.get("status", {}).get("conditions") or []
    return any(c["type"] == kind and c["status"] == "True" for c in conditions)


def ready(pod: Obj) -> bool:
    return condition(pod, "Ready")


def every_share_taken(pods: list[Obj]) -> tuple[list[Obj], Obj] | None:
    """The running pods and the one left unscheduled, once `SHARES` run and one waits."""
    running = [p for p in pods if phase(p) == "Running"]
    pending = [p for p in pods if phase(p) == "Pending" and not p["spec"].get("nodeName")]
    if len(running) == SHARES and len(pending) == 1:
        return running, pending[0]
    return None


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


@attrs.define
class Rollout:
    """One `kubectl rollout restart` with consumers arriving, as observed."""

    took_ready: float
    took_gone: float
    zero_seconds: float
    lowest: int
    unanswered: int
    samples: int
    old_exit: int | None
    admitted: list[str]
    refused: list[str]


@attrs.frozen
class RunningConsumers:
    """The consumers running at one moment, with their containers and devices."""

    pods: list[Obj]
    containers: set[str]
    # Each pod's devices as kubelet's pod-resources lists them.
    devices: dict[str, Any]


@attrs.define
class Cluster:
    node: Node
    control_plane: ControlPlane
    report: Report
    server: kube.Api
    pods: kube.Watch
    nodes: kube.Watch
    daemonsets: kube.Watch
    manifests: Path
    plugin_reference: str
    consumer_template: Obj = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        template = pods.cluster_consumer_pod()
        template["spec"]["terminationGracePeriodSeconds"] = CONSUMER_GRACE
        self.consumer_template = template

    # What the checks read.

    def plugin_pods(self) -> list[Obj]:
        return [
            pod
            for key, pod in self.pods.current.items()
            if key.startswith(f"{SYSTEM}/")
            and labels(pod).get("app.kubernetes.io/name") == PLUGIN_NAME
        ]

    def consumer_pods(self, prefix: str = "") -> list[Obj]:
        return [
            pod for key, pod in self.pods.current.items() if key.startswith(f"{CONSUMERS}/{prefix}")
        ]

    def daemonset(self) -> Obj | None:
        return self.daemonsets.current.get(f"{SYSTEM}/{DAEMONSET}")

    def node_allocatable(self) -> str | None:
        node = self.nodes.current.get(f"/{NODE_NAME}")
        return None if node is None else node["status"].get("allocatable", {}).get(RESOURCE)

    def first_seen(self, pod: Obj, condition: Callable[[Obj], bool]) -> float | None:
        """When the watch first saw a version of `pod` for which `condition` holds."""
        return next((at for at, _, obj in self.pods.versions(pod) if condition(obj)), None)

    def rolled_out(self, old_uid: str | None) -> Obj | None:
        """The one plugin pod, when the DaemonSet is rolled out and ready on the node (with a
        new pod, not `old_uid`) and no other plugin pod is left."""
        daemonset = self.daemonset()
        plugins = self.plugin_pods()
        if daemonset is None or len(plugins) != 1:
            return None
        status = daemonset.get("status", {})
        (plugin,) = plugins
        done = (
            status.get("observedGeneration", 0) >= daemonset["metadata"]["generation"]
            and status.get("desiredNumberScheduled") == 1
            and status.get("updatedNumberScheduled") == 1
            and status.get("numberReady") == 1
            and status.get("numberAvailable") == 1
            and plugin["metadata"]["uid"] != old_uid
            and ready(plugin)
            and "deletionTimestamp" not in plugin["metadata"]
        )
        return plugin if done else None

    async def wait_rolled_out(self, what: str, old: Obj | None, within: float = 120) -> Obj:
        old_uid = None if old is None else old["metadata"]["uid"]
        return await self.pods_or_daemonsets_until(what, lambda: self.rolled_out(old_uid), within)

    async def pods_or_daemonsets_until(
        self, what: str, found: Callable[[], Obj | None], within: float
    ) -> Obj:
        """`found()` asked on every change of pods or DaemonSets."""
        async with trio.open_nursery() as nursery:
            result: list[Obj] = []

            async def follow(watch: kube.Watch) -> None:
                result.append(await watch.until(what, found, within))
                nursery.cancel_scope.cancel()

            nursery.start_soon(follow, self.pods)
            nursery.start_soon(follow, self.daemonsets)
        return result[0]

    async def kubectl(self, *args: str, stdin: str | None = None) -> str:
        output: str = await self.server.kubectl(*args, stdin=stdin)
        return output

    # Consumers.

    def consumer_pod(self, name: str, role: str) -> Obj:
        pod: Obj = yaml.safe_load(yaml.safe_dump(self.consumer_template))
        pod["metadata"]["name"] = name
        pod["metadata"]["namespace"] = CONSUMERS
        pod["metadata"].setdefault("labels", {})["pcc-e2e/role"] = role
        return pod

    async def create_consumer(self, name: str, role: str) -> None:
        """A consumer pod, created as a controller creates one (the API, not kubectl)."""
        await self.server.call(
            "POST", f"/api/v1/namespaces/{CONSUMERS}/pods", self.consumer_pod(name, role)
        )

    async def delete_consumer(self, name: str) -> None:
        await self.server.call(
            "DELETE",
            f"/api/v1/namespaces/{CONSUMERS}/pods/{name}",
            {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": CONSUMER_GRACE},
        )

    async def consumer_running(self, name: str, within: float = 120) -> Obj:
        def found() -> Obj | None:
            pod = self.pods.current.get(f"{CONSUMERS}/{name}")
            expect(pod is None or not refused(pod), f"kubelet refused {name}: {pod}")
            return pod if pod and phase(pod) == "Running" else None

        return await self.pods.until(f"{CONSUMERS}/{name} running", found, within)

    async def scheduler_event(self, name: str) -> Obj:
        """The scheduler's FailedScheduling event for the consumer `name`."""
        path = f"/api/v1/namespaces/{CONSUMERS}/events?fieldSelector=involvedObject.name={name}"

        async def failed() -> Obj | None:
            events = (await self.server.get(path))["items"]
            return next((e for e in events if e["reason"] == "FailedScheduling"), None)

        event, _ = await wait_for(f"{name}: the scheduler's event", failed, 60)
        reporter = event.get("reportingComponent") or event.get("source", {}).get("component")
        expect(reporter == "default-scheduler", f"{name}: {event}")
        return event

    async def check_in_consumer(self, pod: Obj) -> None:
        """/dev/sev-guest and /var/run/pcc inside `pod`, as scenario.py checks them."""
        name = pod["metadata"]["name"]
        nonce = secrets.token_hex(8)
        (PCC_DIR / f"from-node-{nonce}").write_text(nonce)
        from_pod = f"from-{name}-{nonce}"
        script = (
            f"stat -c %F:%t:%T {DEVICE}; echo > {DEVICE} && echo written; "
            f"stat -L -c %d:%i {PCC_DIR}; cat {PCC_DIR}/from-node-{nonce}; echo; "
            f"touch {PCC_DIR}/{from_pod}"
        )
        output = await self.kubectl(
            "-n", CONSUMERS, "exec", name, "-c", pods.CONSUMER_CONTAINER, "--", "sh", "-c", script
        )
        node_side = os.stat(PCC_DIR)
        expected = [
            f"character special file:{os.major(DEVICE_NUMBER):x}:{os.minor(DEVICE_NUMBER):x}",
            "written",
            f"{node_side.st_dev}:{node_side.st_ino}",
            nonce,
        ]
        seen = [line for line in output.splitlines() if line]
        expect(seen == expected, f"{name}: saw {seen}, not {expected}")
        expect(
            (PCC_DIR / from_pod).exists(), f"the file {name} wrote is not in the node's {PCC_DIR}"
        )

    async def held_by_consumers(self) -> dict[str, list[str]]:
        return {
            pod: ids
            for (namespace, pod, _), ids in (await api.assigned(RESOURCE)).items()
            if namespace == CONSUMERS
        }

    async def running_consumers(self) -> RunningConsumers:
        running = [p for p in self.deployed() if phase(p) == "Running"]
        names = {p["metadata"]["name"] for p in running}
        held = await self.held_by_consumers()
        return RunningConsumers(
            running,
            {container_id(p) for p in running},
            {name: ids for name, ids in held.items() if name in names},
        )

    async def consumers_kept(
        self,
        consumers: RunningConsumers,
        what: str,
        held_now: Callable[[], Awaitable[dict[str, Any]]] | None = None,
    ) -> None:
        """The consumers still run in the same containers, holding the same devices (as
        `held_now` reads them: the device plugin's by default)."""
        held_now = held_now or self.held_by_consumers
        tasks = await self.node.tasks()
        still = {c for c in consumers.containers if tasks.get(c, (0, ""))[1] == "RUNNING"}
        expect(still == consumers.containers,
               f"{what}: containers gone: {consumers.containers - still}")  # fmt: skip
        devices = consumers.devices

        async def same_devices() -> bool | None:
            held = await held_now()
            return True if {n: held.get(n) for n in devices} == devices else None

        # Kubelet lists a pod's devices again once it has the pod back from the API server.
        await wait_for(f"{what}: the consumers' devices", same_devices, 60)

    # 1.

    async def install(self) -> None:
        self.report.variant = "1 install"
        base = self.manifests / "base"
        kustomization = base / "kustomization.yaml"
        config = yaml.safe_load(kustomization.read_text())
        (entry,) = (i for i in config["images"] if i["name"] == "localhost/pcc-device-plugin")
        entry["newName"] = README_IMAGE
        kustomization.write_text(yaml.safe_dump(config, sort_keys=False))
        image = f"{README_IMAGE}:{entry['newTag']}"
        rendered = re.findall(r"image: (\S+)", await self.kubectl("kustomize", str(base)))
        expect(rendered == [image], f"kubectl kustomize {base} names {rendered}, not {image}")
        await self.node.ctr("images", "tag", "--force", self.plugin_reference, image)
        self.report.check(
            f"the copy's manifests/base names {image} (newName, as the README says); the image "
            "is in containerd under that name"
        )
        applied = now()
        await self.kubectl("apply", "-k", str(base))

        def observed() -> Obj | None:
            daemonset = self.daemonset()
            status = (daemonset or {}).get("status", {})
            if (
                daemonset
                and status.get("observedGeneration") == daemonset["metadata"]["generation"]
            ):
                return daemonset
            return None

        daemonset = await self.daemonsets.until(
            "the DaemonSet seen by its controller", observed, 60
        )
        desired = daemonset["status"]["desiredNumberScheduled"]
        expect(desired == 0 and not self.plugin_pods(), f"no label, yet {daemonset['status']}")
        self.report.check("kubectl apply -k manifests/base: no node labelled, no plugin pod")

        labelled = now()
        await self.kubectl("label", "node", NODE_NAME, f"{NODE_LABEL}=true")
        plugin = await self.wait_rolled_out("the DaemonSet: 1 desired, 1 ready", None)
        ready_at = now()
        created = self.first_seen(plugin, lambda _: True)
        running = self.first_seen(plugin, lambda p: phase(p) == "Running")
        assert created is not None
        assert running is not None
        self.report.figure("apply → label (the operator's pause)", labelled - applied)
        self.report.figure("label → plugin pod created", created - labelled)
        self.report.figure("plugin pod created → running", running - created)
        self.report.figure("label → DaemonSet 1 ready (readiness probe)", ready_at - labelled)
        name = plugin["metadata"]["name"]
        self.report.check(f"kubectl label node: the DaemonSet has 1 desired and 1 ready ({name})")
        await self.nodes.until(
            f"the Node's allocatable {RESOURCE}: {SHARES}",
            lambda: True if self.node_allocatable() == str(SHARES) else None,
            60,
        )
        self.report.figure("DaemonSet ready → Node allocatable 16", now() - ready_at)
        self.report.check(f"the Node's allocatable has {SHARES} {RESOURCE}")

    # 2.

    def deployment(
        self, replicas: int, name: str = CONSUMER_NAME, role: str = "deployment", **spec: Any
    ) -> Obj:
        """A Deployment of consumers named `name`, their pods labelled `role`, with `spec`
        (e.g. tolerations) added to the pods'."""
        pod = self.consumer_pod(name, role)
        template = {"metadata": {"labels": pod["metadata"]["labels"]}, "spec": pod["spec"] | spec}
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": CONSUMERS},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": {"pcc-e2e/role": role}},
                "template": template,
            },
        }

    def deployed(self) -> list[Obj]:
        return [
            pod
            for pod in self.consumer_pods(CONSUMER_NAME)
            if "deletionTimestamp" not in pod["metadata"]
        ]

    async def consumers(self) -> None:
        self.report.variant = "2 consumers"
        created = now()
        await self.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(self.deployment(SHARES + 1)))

        def placed() -> tuple[list[Obj], Obj] | None:
            found = self.deployed()
            expect(not any(refused(p) for p in found), f"kubelet refused a consumer: {found}")
            return every_share_taken(found)

        running, pending = await self.pods.until(
            f"{SHARES} consumers running, 1 pending", placed, 180
        )
        self.report.figure(
            f"Deployment of {SHARES + 1} created → {SHARES} running", now() - created
        )
        took = [
            at_running - at_scheduled
            for pod in running
            if (at_scheduled := self.first_seen(pod, lambda p: bool(p["spec"].get("nodeName"))))
            and (at_running := self.first_seen(pod, lambda p: phase(p) == "Running"))
        ]
        self.report.figure("consumer scheduled → running (median)", median(took))
        self.report.figure("consumer scheduled → running (max)", max(took))
        held = await self.held_by_consumers()
        devices = {device for ids in held.values() for device in ids}
        expect(len(held) == SHARES and len(devices) == SHARES, f"pod-resources: {held}")
        self.report.check(f"{SHARES} consumers run, holding {SHARES} distinct devices")

        event = await self.scheduler_event(pending["metadata"]["name"])
        expect(f"Insufficient {RESOURCE}" in event["message"], f"{event}")
        self.report.check(f"the 17th consumer is Pending: {event['message']}")

        limiter = trio.CapacityLimiter(4)

        async def check(pod: Obj) -> None:
            async with limiter:
                await self.check_in_consumer(pod)

        async with trio.open_nursery() as nursery:
            for pod in running:
                nursery.start_soon(check, pod)
        self.report.check(
            f"in each of the {SHARES}: {DEVICE} is a character device it can write, {PCC_DIR} "
            "is the node's directory (a file written on each side is read on the other)"
        )

        await self.kubectl("-n", CONSUMERS, "scale", f"deployment/{CONSUMER_NAME}",
                           f"--replicas={SHARES}")  # fmt: skip
        await self.pods.until(
            "nothing Pending after the scale to 16",
            lambda: (
                True
                if len(self.deployed()) == SHARES
                and all(phase(p) == "Running" for p in self.deployed())
                else None
            ),
            60,
        )
        self.report.check(f"scaled to {SHARES}: {SHARES} running, nothing Pending")

        gone = running[0]["metadata"]["name"]
        before = {p["metadata"]["name"] for p in self.deployed()}
        deleted = now()
        await self.kubectl("-n", CONSUMERS, "delete", "pod", gone, "--wait=false")

        def replaced() -> Obj | None:
            new = [p for p in self.deployed() if p["metadata"]["name"] not in before]
            return new[0] if new and phase(new[0]) == "Running" else None

        replacement = await self.pods.until(f"{gone}'s replacement running", replaced, 120)
        self.report.figure("consumer deleted → its replacement running", now() - deleted)
        held = await self.held_by_consumers()
        devices = {device for ids in held.values() for device in ids}
        new = replacement["metadata"]["name"]
        expect(
            gone not in held and len(held.get(new, [])) == 1 and len(devices) == SHARES,
            f"pod-resources after {gone} was deleted: {held}",
        )
        self.report.check(
            f"{gone} deleted: its share went to its replacement {new} ({held[new][0]})"
        )

    # 3.

    async def arrive(self, tag: str, names: list[str], until: trio.Event) -> None:
        """A consumer every ARRIVAL_EVERY seconds until `until` (at least ARRIVALS_AT_LEAST);
        each one deleted once running, to give its share back."""

        async def serve(name: str) -> None:
            await self.create_consumer(name, "arrival")

            def settled() -> Obj | None:
                pod = self.pods.current.get(f"{CONSUMERS}/{name}")
                return pod if pod and (phase(pod) == "Running" or refused(pod)) else None

            pod = await self.pods.until(f"{CONSUMERS}/{name} running or refused", settled, 120)
            if not refused(pod):
                await self.delete_consumer(name)

        await arriving(names, lambda number: f"arrival-{tag}-{number}", serve, until)

    async def rollout(self, tag: str) -> Rollout:
        (old,) = self.plugin_pods()
        names: list[str] = []
        async with api.sampling_allocatable(RESOURCE, SAMPLE_EVERY) as samples:
            restarted = now()
            await self.kubectl("-n", SYSTEM, "rollout", "restart", f"daemonset/{DAEMONSET}")
            rolled_out = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.arrive, tag, names, rolled_out)
                new = await self.wait_rolled_out(f"rollout {tag}", old)
                rolled_out.set()
        old_versions = self.pods.versions(old)
        gone = next(at for at, kind, _ in old_versions if kind == "DELETED")
        exits = [
            status["state"]["terminated"]["exitCode"]
            for _, _, version in old_versions
            for status in version.get("status", {}).get("containerStatuses") or []
            if "terminated" in status.get("state", {})
        ]
        ready_at = self.first_seen(new, ready)
        assert ready_at is not None
        zero = sum(t2 - t1 for (t1, c1), (t2, _) in itertools.pairwise(samples) if c1 == 0)
        answered = [count for _, count in samples if count >= 0]
        arrived = [p for name in names for p in self.pods_named(name)]
        return Rollout(
            took_ready=ready_at - restarted,
            took_gone=gone - restarted,
            zero_seconds=zero,
            lowest=min(answered),
            unanswered=len(samples) - len(answered),
            samples=len(samples),
            old_exit=exits[-1] if exits else None,
            admitted=[p["metadata"]["name"] for p in arrived if not refused(p)],
            refused=[p["metadata"]["name"] for p in arrived if refused(p)],
        )

    def pods_named(self, name: str) -> list[Obj]:
        """The last version the watch saw of each pod named `name` in the consumers' namespace."""
        return [
            versions[-1][2]
            for versions in self.pods.history.values()
            if versions[-1][2]["metadata"]["name"] == name
            and versions[-1][2]["metadata"].get("namespace") == CONSUMERS
        ]

    def say_rollout(self, tag: str, seen: Rollout) -> None:
        self.report.figure(f"{tag}: rollout restart → new plugin pod ready", seen.took_ready)
        self.report.figure(f"{tag}: rollout restart → old plugin pod gone", seen.took_gone)
        self.report.figure(f"{tag}: rollout gap (0 allocatable)", seen.zero_seconds)
        self.report.note(
            f"{tag}: {seen.samples} reads of allocatable, lowest {seen.lowest}, "
            f"{seen.unanswered} unanswered, {seen.zero_seconds:.3f} s at 0; old plugin exit "
            f"{seen.old_exit}; {len(seen.admitted)} arriving consumers ran, "
            f"{len(seen.refused)} refused {seen.refused}"
        )

    async def rollouts(self) -> None:
        self.report.variant = "3 rollouts"
        await self.kubectl("-n", CONSUMERS, "scale", f"deployment/{CONSUMER_NAME}",
                           f"--replicas={KEPT_CONSUMERS}")  # fmt: skip
        await self.pods.until(
            f"{KEPT_CONSUMERS} consumers left",
            lambda: True if len(self.consumer_pods(CONSUMER_NAME)) == KEPT_CONSUMERS else None,
            60,
        )
        for number in range(1, ROLLOUTS + 1):
            tag = f"base {number}"
            seen = await self.rollout(f"base-{number}")
            self.say_rollout(tag, seen)
            expect(
                seen.lowest > 0 and seen.unanswered == 0 and not seen.refused
                and seen.old_exit == 0,
                f"{tag}: {seen}",
            )  # fmt: skip
            self.report.check(
                f"{tag}: surge rollout: allocatable never 0 ({seen.samples} reads, lowest "
                f"{seen.lowest}); {len(seen.admitted)} consumers arriving during it all ran; "
                "the old plugin exited 0"
            )
        no_surge = self.manifests / "overlays" / "no-surge"
        await self.kubectl("apply", "-k", str(no_surge))
        seen = await self.rollout("no-surge")
        self.say_rollout("no-surge", seen)
        expect(seen.old_exit == 0, f"no-surge: {seen}")
        arrived = len(seen.refused) + len(seen.admitted)
        self.report.check(
            f"manifests/overlays/no-surge: rolled out with a gap of {seen.zero_seconds:.2f} s at "
            f"0 allocatable; kubelet refused {len(seen.refused)} of {arrived} consumers arriving "
            "during it (reported, not failed: the documented cost)"
        )
        await self.kubectl("apply", "-k", str(self.manifests / "base"))
        await self.kubectl("-n", CONSUMERS, "delete", "pods", "-l", "pcc-e2e/role=arrival",
                           "--wait=false")  # fmt: skip

    # 4.

    async def apply_and_serve(self, name: str, directory: Path) -> Obj:
        (old,) = self.plugin_pods()
        applied = now()
        await self.kubectl("apply", "-k", str(directory))
        plugin = await self.wait_rolled_out(f"{name}: the new plugin ready", old)
        self.report.figure(f"{name}: apply → new plugin pod ready", now() - applied)
        await wait_allocatable(f"{name}: the new plugin", SHARES)
        self.report.check(
            f"{name}: the plugin ({plugin['metadata']['name']}) is ready, {SHARES} allocatable"
        )
        return plugin

    async def serve_one(self, name: str) -> Obj:
        created = now()
        await self.create_consumer(name, "served")
        pod = await self.consumer_running(name)
        self.report.figure(f"{name}: consumer created → running", now() - created)
        await self.check_in_consumer(pod)
        return pod

    async def overlays(self) -> None:
        self.report.variant = "4 overlays"
        overlays = self.manifests / "overlays"
        await self.apply_and_serve("hardened", overlays / "hardened")
        await self.serve_one("served-hardened")
        self.report.check("hardened: a consumer was served")

        profiles = overlays / "profiles"
        kustomization = profiles / "kustomization.yaml"
        # docs/deploy.md: without the hash suffix, an edited profile is applied live.
        config = yaml.safe_load(kustomization.read_text())
        config["generatorOptions"] = {"disableNameSuffixHash": True}
        kustomization.write_text(yaml.safe_dump(config, sort_keys=False))
        plugin = await self.apply_and_serve("profiles", profiles)
        await self.serve_one("served-profiles")
        profile = profiles / "profiles.yaml"
        text = profile.read_text()
        expect(f"count: {SHARES}\n" in text, f"{profile}: no `count: {SHARES}`")
        profile.write_text(text.replace(f"count: {SHARES}\n", f"count: {PROFILE_COUNT}\n", 1))
        edited = now()
        await self.kubectl("apply", "-k", str(profiles))
        await wait_allocatable("the edited profile applied", PROFILE_COUNT, within=180)
        self.report.figure(
            f"profiles: ConfigMap applied → {PROFILE_COUNT} allocatable", now() - edited
        )
        (after,) = self.plugin_pods()
        expect(
            after["metadata"]["uid"] == plugin["metadata"]["uid"]
            and container_id(after) == container_id(plugin)
            and after["status"]["containerStatuses"][0]["restartCount"] == 0,
            f"the plugin restarted: {plugin['status']} → {after['status']}",
        )
        self.report.check(
            f"profiles: the ConfigMap edited to count {PROFILE_COUNT} and applied: "
            f"{PROFILE_COUNT} allocatable, the same plugin container, no restart"
        )

        await self.apply_and_serve("cdi", overlays / "cdi")
        pod = await self.serve_one("served-cdi")
        spec = Path("/var/run/cdi") / f"{RESOURCE.replace('/', '-')}.json"
        expect(spec.exists(), f"no CDI spec {spec} on the node")
        words = f"Container {container_id(pod)}: {CDI_WORDS}[{RESOURCE}="
        log = self.node.containerd.log.read_text(errors="replace")
        lines = [line for line in log.splitlines() if words in line]
        expect(len(lines) == 1, f"containerd.log has no {words!r}")
        named = lines[0].split(CDI_WORDS, 1)[1].split("]", 1)[0] + "]"
        self.report.check(
            f"cdi: the plugin wrote {spec}; containerd injected the CDI device {named} that "
            "kubelet passed from the plugin's Allocate answer into the consumer, which runs"
        )
        await self.apply_and_serve("base again", self.manifests / "base")
        await self.kubectl("-n", CONSUMERS, "delete", "pods", "-l", "pcc-e2e/role=served",
                           "--wait=false")  # fmt: skip

    # 5.

    async def observability(self) -> None:
        self.report.variant = "5 logs, doctor, metrics"
        (plugin,) = self.plugin_pods()
        name = plugin["metadata"]["name"]
        logs = await self.kubectl("-n", SYSTEM, "logs", name)
        for words in ("Starting pcc-device-plugin", "Registered device plugin with Kubelet"):
            expect(words in logs, f"kubectl logs {name} has no {words!r}:\n{logs}")
        registered = next(line for line in logs.splitlines() if "Registered device plugin" in line)
        self.report.check(f"kubectl logs: the start and {registered.split('] ', 1)[-1]!r}")
        (container,) = plugin["spec"]["containers"]
        doctor = await self.kubectl(
            "-n", SYSTEM, "exec", name, "--", DOCTOR, "doctor", *container.get("args", [])
        )
        lines = doctor.strip().splitlines()
        warned = [line.strip() for line in lines if line.lstrip().startswith("WARN")]
        self.report.check(f"kubectl exec {name} -- {DOCTOR} doctor: {lines[-1]}")
        for line in warned:
            self.report.note(f"the doctor in the plugin's pod: {line}")
        address = plugin["status"]["podIP"]
        url = f"http://{address}:8080/metrics"
        _, before = await api.http_get(url)
        await self.serve_one("metrics-probe")
        _, after = await api.http_get(url)
        registrations = metric(after, "pcc_device_plugin_registrations")
        allocated = metric(after, "pcc_device_plugin_allocations", 'result="ok"')
        expect(registrations >= 1, f"{url}: registrations {registrations}")
        expect(
            allocated == metric(before, "pcc_device_plugin_allocations", 'result="ok"') + 1,
            f"{url}: allocations before and after a consumer: {allocated}",
        )
        self.report.check(
            f"{url} (the pod's own address): {registrations:.0f} registration(s), "
            f"{allocated:.0f} allocation(s), one more after a consumer started"
        )
        await self.delete_consumer("metrics-probe")

    # 6.

    async def plugin_log(self) -> Path:
        """The running plugin pod's container log, where kubelet keeps it."""
        (pod,) = self.plugin_pods()
        (status,) = pod["status"]["containerStatuses"]
        return legs.container_log(SYSTEM, pod["metadata"]["name"], pod["metadata"]["uid"],
                                  status["name"], status.get("restartCount", 0))  # fmt: skip

    async def kubelet_restarts(self) -> None:
        self.report.variant = "6 restarts"
        kept = await self.running_consumers()
        kubelet = self.node.kubelet
        restarts: list[legs.Restart] = []
        (plugin,) = self.plugin_pods()
        pid, _ = (await self.node.tasks())[container_id(plugin)]
        for number in range(1, 4):
            server_at: list[float] = []
            sampler = legs.Sampler(pid)
            await sampler.start()
            await kubelet.stop()
            kubelet.forget_actions()
            kubelet.on_line(functools.partial(seen, server_at), kubelet_log.REGISTRATION_SERVER)
            await kubelet.start()
            _, back = await wait_allocatable(
                f"kubelet restart {number}: the plugin registered with the new kubelet", SHARES
            )
            samples = await sampler.stop()
            expect(bool(server_at), f"{kubelet.log}: no {kubelet_log.REGISTRATION_SERVER!r}")
            self.report.figure(f"restart {number}: kubelet started → {SHARES} allocatable",
                               back - kubelet.started_at)  # fmt: skip
            self.report.figure(
                f"restart {number}: registration server started → {SHARES} allocatable",
                back - server_at[0],
            )
            restart = await legs.read_restart(kubelet, self.plugin_log, RESOURCE, SHARES, samples)
            restarts.append(restart)
            for attribute, name, span, _ in legs.LEGS:
                value = getattr(restart, attribute)
                if value is not None:
                    self.report.figure(f"restart {number}: the plugin's {name}, {span}", value)
            await self.consumers_kept(kept, f"kubelet restart {number}")
            self.report.check(
                f"kubelet restart {number}: {SHARES} allocatable {back - server_at[0]:.2f} s after "
                f"its registration server started; {len(kept.pods)} consumers kept their "
                "containers and devices"
            )
        # How soon allocatable is back is kubelet's and the machine's as much as the plugin's:
        # what is judged is the plugin's own part, as in the e2e's race.
        problems = legs.over_bounds(restarts)
        for problem in problems:
            self.report.fail(f"kubelet restarts: {problem}")
        if not problems:
            self.report.check(f"kubelet restarts: {legs.within_bounds(restarts)}")
        (old,) = self.plugin_pods()
        deleted = now()
        await self.kubectl("-n", SYSTEM, "delete", "pod", old["metadata"]["name"], "--wait=false")
        new = await self.wait_rolled_out("a new plugin pod, ready", old)
        self.report.figure("plugin pod deleted → new one ready", now() - deleted)
        await wait_allocatable("the new plugin pod", SHARES)
        self.report.check(
            f"plugin pod deleted: the DaemonSet made {new['metadata']['name']}, registered "
            f"again ({SHARES} allocatable) and ready"
        )

    # 8.

    async def uninstall(self) -> None:
        self.report.variant = "8 uninstall"
        deleted = now()
        await self.kubectl("delete", "-k", str(self.manifests / "base"))
        await self.pods.until(
            "no plugin pod", lambda: True if not self.plugin_pods() else None, 120
        )
        self.report.figure("delete -k → plugin pod gone", now() - deleted)
        await wait_allocatable("the plugin gone", 0)
        self.report.figure("delete -k → 0 allocatable (kubelet)", now() - deleted)
        await self.nodes.until(
            "the Node's allocatable 0",
            lambda: True if self.node_allocatable() == "0" else None,
            60,
        )
        self.report.figure("delete -k → Node allocatable 0", now() - deleted)
        await self.kubectl("label", "node", NODE_NAME, f"{NODE_LABEL}-")
        self.report.check(
            "kubectl delete -k manifests/base: the plugin's pod is gone, 0 allocatable; "
            f"kubectl label node {NODE_NAME} {NODE_LABEL}-"
        )


async def arriving(
    names: list[str],
    name_of: Callable[[int], str],
    serve: Callable[[str], Awaitable[None]],
    until: trio.Event,
) -> None:
    """One arrival every ARRIVAL_EVERY seconds until `until` (at least ARRIVALS_AT_LEAST), each
    named by `name_of(number)` into `names` and served by `serve(name)` in a task of its own."""
    async with trio.open_nursery() as nursery:
        for number in itertools.count(1):
            if until.is_set() and number > ARRIVALS_AT_LEAST:
                break
            names.append(name_of(number))
            nursery.start_soon(serve, names[-1])
            await trio.sleep(ARRIVAL_EVERY)


def seen(times: list[float]) -> None:
    times.append(now())


def metric(text: str, name: str, *words: str) -> float:
    """The sum of the samples of `name` whose labels contain every one of `words`."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and all(w in line for w in words)
    )


async def administer(cluster: kube.Api) -> None:
    """What the cluster's administrator did before the operator came (see the docstring)."""
    await cluster.kubectl(
        "label", "--overwrite", "namespace", SYSTEM, "pod-security.kubernetes.io/enforce=privileged"
    )
    await cluster.kubectl("create", "namespace", CONSUMERS)

    async def default_account() -> Obj | None:
        try:
            return await cluster.get(f"/api/v1/namespaces/{CONSUMERS}/serviceaccounts/default")
        except RuntimeError:
            return None

    await wait_for(f"{CONSUMERS}'s default service account", default_account, 60)
