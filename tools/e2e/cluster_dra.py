"""Checks 7 and 9 of ``nox -s cluster``: the DRA mode (docs/dra.md) on the same cluster as the
device plugin's checks (cluster.py), from the same operator's copy of ``manifests/``, with kubectl.

Check 7, the migration, on the device plugin's install with its consumers running: the overlay
applied over the base, the driver ready and its devices published, the device plugin gone, the
consumers keeping their containers and devices (one still writes the device); the base applied
again, the device plugin back with 16 allocatable, the consumers kept again, and kubelet deleting
the driver's slices.

Check 9, after the device plugin's uninstall (check 8):

1. install as docs/dra.md says, on the node check 8 unlabelled: ``kubectl label node``, then
   ``kubectl apply -k manifests/overlays/dra``; the DeviceClass
   accepted as written (its ``extendedResourceName`` kept), the driver's pod ready, the node's
   ResourceSlice with 16 devices, written by the driver; the doctor, run in the driver's pod
   with its args, passes the DRA driver check;
2. admission: the driver's own token, pod-bound (read where kubelet mounts it in the pod), may
   write its node's slices and no other node's (the ValidatingAdmissionPolicy); a token of the
   same service account bound to no pod may write none; RBAC gives it nothing else; the same
   overlay moved to another namespace by a user's overlay (``namespace:``): the policy still
   applies to its service account;
3. a pod with a claim (manifests/examples/dra-app) runs; inside it ``/dev/sev-guest`` is a
   writable character device and ``/var/run/pcc`` the node's directory, from the CDI spec the
   driver wrote for the claim (containerd's log names the claim's CDI device);
4. 16 such pods run, on 16 distinct devices; the 17th is Pending with the scheduler's reason;
   one deleted: its claim is unprepared (its CDI spec gone), and the 17th runs;
5. the migration path: a pod asking for ``tke.cloud.tencent.com/pcc-device: 1``, unchanged
   (manifests/examples/confidential-app), runs, served by the driver through the DeviceClass's
   ``extendedResourceName``;
   attributes: on the node made an SEV-SNP guest with TSM (``fake_sev_snp_sysfs``), every
   device says ``teeType`` ``sev-snp`` and ``tsmReport`` true; docs/dra.md's DeviceClass that
   selects on them, applied as written, gets a pod its share; the same class asking for
   another TEE leaves its pod Pending (the scheduler's reason);
6. the device removed: the API server's and kubelet's feature gates as their metrics say;
   the devices stay in the slice with the taint ``<driver>/unhealthy=dev-sev-guest-missing:
   NoSchedule`` (or, where the driver found no taints, withdrawn), every running claim pod's
   status says ``Unhealthy`` with the reason in ``allocatedResourcesStatus``, and a new pod's
   claim is not allocated (Pending, the scheduler's reason); restored: the taints go, the
   pods say ``Healthy`` again, and the pod runs;
7. kubelet restarted, then the driver's pod deleted, with claims prepared: the running pods keep
   their containers and devices, the slices are published again; a pod deleted after the new
   driver started has its claim unprepared by it (the spec gone), and a new pod gets the share;
8. a rolling update of the driver whose new version publishes one attribute changed
   (``--resource-name`` of another vendor: the attribute ``resourceName``), and the rollback:
   the newer instance's slices win, the slice writes over each rollout are counted and stay
   within the driver's bound (docs/dra.md, "Rolling updates");
9. kube-apiserver stopped for 20 s while a claim pod is being started and another deleted:
   the driver needs no API server to unprepare, the pod starts and the other is gone as soon
   as it is back, the running pods keep their containers and devices, the checkpoint holds
   exactly the running pods' claims, the driver was not restarted.
10. ``--unhealthy-taint-effect=NoExecute`` patched into the DaemonSet: with the device removed
    (NoExecute once it has been gone 30 s), kube-controller-manager evicts the running claim
    pods; restored, the overlay applied again.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import attrs
import trio
import yaml

from . import api, pods
from .cluster import (
    CDI_WORDS,
    CONSUMER_GRACE,
    CONSUMERS,
    DAEMONSET,
    DOCTOR,
    NODE_LABEL,
    REPOSITORY,
    SYSTEM,
    Cluster,
    RunningConsumers,
    container_id,
    every_share_taken,
    phase,
    ready,
)
from .kube import Obj, Watch
from .node import NODE_NAME
from .poll import wait_for
from .report import Report, now
from .scenario import DEVICE, RESOURCE, SHARES, expect, make_device, wait_allocatable

# docs/dra.md's command, run in the driver's pod.

DRIVER = "pcc.tke.cloud.tencent.com"
# What manifests/overlays/dra adds beside the base's DaemonSet (docs/dra.md, the way back).
DRA_ONLY_FILES = ("deviceclass.yaml", "rbac.yaml", "node-restriction.yaml")
CDI_DIR = Path("/var/run/cdi")
RESOURCE_API = "/apis/resource.k8s.io/v1"
SLICES = f"{RESOURCE_API}/resourceslices"
CLAIM_PREFIX = "dra-"
# A node that does not exist: the admission policy must refuse the driver its slices.
OTHER_NODE = "pcc-e2e-other-node"
# Check 9.2: the namespace a user's overlay moves the driver to.
MOVED = "pcc-e2e-moved"
# The scheduler's words for a pod whose claims no device can satisfy.
UNALLOCATABLE = "cannot allocate all claims"
# The driver's bound on its slice writes (pcc_plugin/dra/slices.py, WRITE_BURST and
# WRITE_EVERY): each instance writes the pool at most this many times at once, then once per
# this many seconds.
WRITE_BURST = 5
WRITE_EVERY = 30.0
# Check 9.8: the new version's only change, one attribute of every device (resourceName).
CHANGED_RESOURCE = "example.com/pcc-device"
# After each rollout the slices are watched this long for more writes: longer than
# WRITE_EVERY, so that two instances still writing over each other would show.
SETTLE = WRITE_EVERY + 10
# Check 9.9: how long kube-apiserver is stopped.
OUTAGE = 20.0
STATE_DIR = Path("/var/lib/kubelet/plugins") / DRIVER
# What the driver says of an unhealthy device: its taint's key, and the problem (through
# --host-root) that kubelet shows in the pods' status.
TAINT_KEY = f"{DRIVER}/unhealthy"
DEVICE_GONE = "detect device /host/dev/sev-guest failed: No such file or directory"
# The node as an SEV-SNP guest whose kernel serves TSM reports (node_facts.py reads these).
SEV_SNP_GUEST = Path("/sys/bus/platform/devices/sev-guest")
TSM_REPORT = Path("/sys/kernel/config/tsm/report")
# docs/dra.md's DeviceClass that selects on them; a copy of it that asks for another TEE.
DOCS = REPOSITORY / "docs" / "dra.md"
OTHER_TEE_CLASS = "pcc-e2e-other-tee.tke.cloud.tencent.com"


def write_bound(seconds: float) -> int:
    """The most slice writes two instances of the driver can make in `seconds`."""
    return 2 * (WRITE_BURST + int(seconds // WRITE_EVERY) + 1)


def resource_names(pool: list[Obj]) -> set[str]:
    """The resourceName attribute of each device the pool lists."""
    return {
        device["attributes"]["resourceName"]["string"]
        for s in pool
        for device in s["spec"].get("devices") or []
    }


def spec_path(claim_uid: str) -> Path:
    """The CDI spec the driver writes for a prepared claim (docs/dra.md)."""
    return CDI_DIR / f"{DRIVER}-claim_{claim_uid}.json"


def allocated_devices(claim: Obj) -> list[str]:
    """The driver's devices in the claim's allocation."""
    allocation = claim.get("status", {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    return [r["device"] for r in results if r["driver"] == DRIVER and r["pool"] == NODE_NAME]


def claim_name(pod: Obj) -> str | None:
    """The ResourceClaim the pod's one claim (or its extended resource) was given."""
    status = pod.get("status", {})
    extended = status.get("extendedResourceClaimStatus")
    if extended:
        return str(extended["resourceClaimName"])
    statuses = status.get("resourceClaimStatuses") or []
    return str(statuses[0]["resourceClaimName"]) if statuses else None


def service_account_token(pod: Obj) -> str:
    """The token kubelet mounted in the pod (bound to it, so naming its node)."""
    uid = pod["metadata"]["uid"]
    volumes = Path(f"/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~projected")
    (token,) = volumes.glob("*/token")
    return token.read_text()


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


def _shadow(directory: Path, state: Path, replaced: str) -> None:
    """A tmpfs over `directory` (in sysfs, which cannot be written) with its entries there as
    before but `replaced`: each symlink made again, each file and directory bound back from the
    original. In the node's mount namespace only: the machine's sysfs is untouched."""
    original = state / "sysfs" / str(directory).strip("/").replace("/", "-")
    original.mkdir(parents=True)
    _mount("--rbind", str(directory), str(original))
    # The namespace's mounts are shared (kubelet's HostToContainer needs them so): the tmpfs
    # below would appear in this copy too, and each entry be bound to itself.
    _mount("--make-rprivate", str(original))
    entries = [entry for entry in sorted(original.iterdir()) if entry.name != replaced]
    _mount("-t", "tmpfs", "-o", "mode=0755", "pcc-e2e-sysfs", str(directory))
    for entry in entries:
        copy = directory / entry.name
        if entry.is_symlink():
            copy.symlink_to(os.readlink(entry))
            continue
        copy.mkdir() if entry.is_dir() else copy.touch()
        _mount("--rbind", str(entry), str(copy))


def fake_sev_snp_sysfs(state: Path) -> None:
    """The node as an SEV-SNP guest with TSM reports, as the driver reads it from the host's
    sysfs: the SEV-SNP guest's platform device, and configfs' tsm/report."""
    _shadow(SEV_SNP_GUEST.parent, state, SEV_SNP_GUEST.name)
    # A configfs of the machine's own, if it has one, is not written to.
    _shadow(TSM_REPORT.parents[2], state, TSM_REPORT.parents[1].name)
    SEV_SNP_GUEST.mkdir()
    TSM_REPORT.mkdir(parents=True)


def docs_device_class() -> Obj:
    """docs/dra.md's DeviceClass, as written there."""
    blocks = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), re.S)
    (found,) = [doc for doc in map(yaml.safe_load, blocks) if doc.get("kind") == "DeviceClass"]
    return dict(found)


def feature_enabled(metrics: str, gate: str) -> str:
    """`<gate>=<0|1> (<stage>)` as a component's kubernetes_feature_enabled metric says it."""
    match = re.search(
        rf'^kubernetes_feature_enabled\{{name="{gate}",stage="(\w*)"\}} (\d)', metrics, re.M
    )
    expect(match is not None, f"no kubernetes_feature_enabled of {gate}")
    assert match is not None
    return f"{gate}={match[2]} ({match[1] or 'GA'})"


def probe_slice(node: str) -> Obj:
    """A ResourceSlice of the driver for `node`, written only in dry runs."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"pcc-e2e-probe-{node}"},
        "spec": {
            "driver": DRIVER,
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [],
        },
    }


@attrs.define
class Dra:
    cluster: Cluster
    slices: Watch
    claims: Watch
    claim_template: Obj = attrs.field(init=False)
    pod_template: Obj = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.claim_template, self.pod_template = pods.cluster_dra_consumer()
        self.claim_template["metadata"]["namespace"] = CONSUMERS
        self.pod_template["spec"]["terminationGracePeriodSeconds"] = CONSUMER_GRACE

    @property
    def report(self) -> Report:
        return self.cluster.report

    # What the checks read.

    def pool(self) -> list[Obj]:
        return [
            s
            for s in self.slices.current.values()
            if s["spec"]["driver"] == DRIVER and s["spec"].get("nodeName") == NODE_NAME
        ]

    def published(self) -> list[str] | None:
        """The devices the node's pool lists, once its slices agree (one generation, all of the
        slices it counts); None until then."""
        slices = self.pool()
        generations = {s["spec"]["pool"]["generation"] for s in slices}
        counts = {s["spec"]["pool"]["resourceSliceCount"] for s in slices}
        if len(generations) != 1 or counts != {len(slices)}:
            return None
        return sorted(d["name"] for s in slices for d in s["spec"].get("devices") or [])

    async def wait_published(self, what: str, count: int, within: float = 60) -> float:
        """Wait until the pool lists `count` devices; when it was seen."""

        def listed() -> bool | None:
            devices = self.published()
            return True if devices is not None and len(devices) == count else None

        await self.slices.until(f"{what}: {count} devices in the node's slices", listed, within)
        return now()

    def claim_pods(self) -> list[Obj]:
        return [
            pod
            for pod in self.cluster.consumer_pods(CLAIM_PREFIX)
            if "deletionTimestamp" not in pod["metadata"]
        ]

    def claim_of(self, pod: Obj) -> Obj:
        name = claim_name(pod)
        claim = self.claims.current.get(f"{CONSUMERS}/{name}")
        expect(claim is not None, f"{pod['metadata']['name']}: no ResourceClaim {name}")
        assert claim is not None
        return claim

    def device_of(self, pod: Obj) -> tuple[str, str]:
        """The running pod's claim UID and its one device (of this driver)."""
        claim = self.claim_of(pod)
        devices = allocated_devices(claim)
        expect(len(devices) == 1, f"{claim['metadata']['name']}: allocated {devices}")
        return claim["metadata"]["uid"], devices[0]

    async def held(self) -> dict[str, list[tuple[str, list[str]]]]:
        """Kubelet's view (pod-resources): each consumer's devices of the driver, with their
        CDI devices."""
        return {
            pod: devices
            for (namespace, pod, _), devices in (await api.claimed(DRIVER)).items()
            if namespace == CONSUMERS
        }

    # Consumers.

    async def create(
        self, name: str, claim_template: str | None = None, node_name: str | None = None
    ) -> None:
        """A claim pod (on the node named `node_name`, if given)."""
        pod: Obj = yaml.safe_load(yaml.safe_dump(self.pod_template))
        if claim_template is not None:
            (claim,) = pod["spec"]["resourceClaims"]
            claim["resourceClaimTemplateName"] = claim_template
        if node_name is not None:
            pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node_name}
        pod["metadata"]["name"] = name
        pod["metadata"]["namespace"] = CONSUMERS
        pod["metadata"].setdefault("labels", {})["pcc-e2e/role"] = "dra"
        await self.cluster.server.call("POST", f"/api/v1/namespaces/{CONSUMERS}/pods", pod)

    async def delete(self, pod: Obj) -> Path:
        """Delete a running claim pod; its claim's CDI spec, which must go."""
        uid, _ = self.device_of(pod)
        spec = spec_path(uid)
        expect(spec.exists(), f"{pod['metadata']['name']}: no CDI spec {spec}")
        await self.cluster.delete_consumer(pod["metadata"]["name"])
        return spec

    async def gone(self, what: str, spec: Path) -> float:
        async def removed() -> bool | None:
            return None if await trio.Path(spec).exists() else True

        _, at = await wait_for(f"{what}: {spec} removed", removed, 60)
        return at

    def check_cdi_injected(self, pod: Obj, claim_uid: str) -> str:
        """containerd's log: the claim's CDI device, injected into the pod's container."""
        words = f"Container {container_id(pod)}: {CDI_WORDS}"
        log = self.cluster.node.containerd.log.read_text(errors="replace")
        named = [
            line.split(CDI_WORDS, 1)[1].split("]", 1)[0] + "]"
            for line in log.splitlines()
            if words in line
        ]
        wanted = f"[{DRIVER}/claim={claim_uid}]"
        expect(named == [wanted], f"containerd.log: {words}{named}, not {wanted}")
        return wanted

    # 7.

    async def migration(self) -> None:
        """docs/dra.md's migration, there and back, with the device plugin's consumers running."""
        self.report.variant = "7 migration"
        cluster = self.cluster
        running = await cluster.running_consumers()
        expect(bool(running.pods), "no device-plugin consumer runs to migrate with")
        writer = running.pods[0]

        async def consumers_kept(what: str) -> None:
            await cluster.consumers_kept(running, what)
            await cluster.check_in_consumer(writer)

        (plugin,) = cluster.plugin_pods()
        applied = now()
        await cluster.kubectl("apply", "-k", str(cluster.manifests / "overlays" / "dra"))
        driver = await cluster.wait_rolled_out("the DRA driver's pod ready", plugin)
        await self.wait_published("the driver, over the device plugin", SHARES)
        self.report.figure(f"migration: apply → {SHARES} devices in the ResourceSlice",
                           now() - applied)  # fmt: skip
        await wait_allocatable("the device plugin replaced", 0)
        await consumers_kept("migrated to DRA")
        self.report.check(
            f"kubectl apply -k manifests/overlays/dra over the base: the driver "
            f"{driver['metadata']['name']} ready and {SHARES} devices published, the device "
            f"plugin gone (0 allocatable); {len(running.pods)} consumers kept their containers "
            f"and devices ({writer['metadata']['name']} still writes {DEVICE})"
        )

        back = now()
        await cluster.kubectl("apply", "-k", str(cluster.manifests / "base"))
        plugin = await cluster.wait_rolled_out("the device plugin's pod ready", driver)
        await wait_allocatable("the device plugin back", SHARES)
        self.report.figure(f"way back: apply → {SHARES} allocatable", now() - back)
        await consumers_kept("back to the device plugin")
        gone = now()
        await self.slices.until(
            "kubelet deleted the driver's slices", lambda: True if not self.pool() else None, 90
        )
        self.report.figure("way back: driver gone → its slices deleted", now() - gone)
        # docs/dra.md's last step back: the overlay's own objects, which the base does not own.
        overlay = cluster.manifests / "overlays" / "dra"
        files = [a for f in DRA_ONLY_FILES for a in ("-f", str(overlay / f))]
        await cluster.kubectl("delete", *files)
        left = await cluster.kubectl("get", "--ignore-not-found", "-o", "name", *files)
        expect(not left.strip(), f"the overlay's objects are left: {left}")
        await wait_allocatable("the overlay's objects deleted", SHARES)
        self.report.check(
            f"kubectl apply -k manifests/base over the overlay: {plugin['metadata']['name']} "
            f"ready, {SHARES} allocatable; the consumers kept their containers and devices; "
            "kubelet deleted the driver's slices; kubectl delete -f of the overlay's "
            f"{', '.join(DRA_ONLY_FILES)} left the device plugin serving"
        )

    # 9.1 and 9.2

    async def install(self) -> Obj:
        self.report.variant = "9 dra install"
        cluster = self.cluster
        overlay = cluster.manifests / "overlays" / "dra"
        # docs/dra.md's install: the label first (check 8 removed it), then the overlay.
        await cluster.kubectl("label", "node", NODE_NAME, f"{NODE_LABEL}=true")
        applied = now()
        await cluster.kubectl("apply", "-k", str(overlay))
        listed = await cluster.kubectl("get", "deviceclass", DRIVER)
        device_class = await cluster.server.get(f"{RESOURCE_API}/deviceclasses/{DRIVER}")
        kept = device_class["spec"].get("extendedResourceName")
        expect(DRIVER in listed and kept == RESOURCE, f"the DeviceClass: {device_class}")
        published = await self.wait_published("the driver published", SHARES)
        self.report.figure(
            f"dra: apply → {SHARES} devices in the ResourceSlice", published - applied
        )
        plugin = await cluster.wait_rolled_out("the DRA driver's pod ready", None)
        ready_at = cluster.first_seen(plugin, ready)
        assert ready_at is not None
        self.report.figure("dra: apply → driver pod ready (readiness probe)", ready_at - applied)
        logs = await cluster.kubectl("-n", SYSTEM, "logs", f"ds/{DAEMONSET}")
        registered = f"Registered DRA driver {DRIVER} with kubelet"
        expect(registered in logs, f"kubectl logs ds/{DAEMONSET} has no {registered!r}:\n{logs}")
        table = await cluster.kubectl(
            "get", "resourceslices", "--field-selector", f"spec.driver={DRIVER}"
        )
        expect(NODE_NAME in table, f"kubectl get resourceslices:\n{table}")
        managers = {
            entry["manager"] for s in self.pool() for entry in s["metadata"]["managedFields"]
        }
        expect(managers == {"pcc-device-plugin"}, f"the slices were written by {managers}")
        self.report.check(
            f"kubectl label node {NODE_NAME} {NODE_LABEL}=true, kubectl apply -k "
            f"manifests/overlays/dra: the DeviceClass {DRIVER} accepted with "
            f"extendedResourceName {RESOURCE}; the driver {plugin['metadata']['name']} ready, "
            f"its log says {registered!r}; its ResourceSlice for {NODE_NAME} lists {SHARES} "
            "devices, written by the driver"
        )
        # The doctor as docs/dra.md runs it: the pod's args hold `$(NODE_NAME)`, which only
        # kubelet expands, and the image has no shell, so the node's name is given.
        name = plugin["metadata"]["name"]
        doctor = await cluster.kubectl(
            "-n", SYSTEM, "exec", name, "--", DOCTOR, "doctor", "--host-root=/host",
            "--mode=dra", f"--node-name={plugin['spec']['nodeName']}",
        )  # fmt: skip
        lines = doctor.strip().splitlines()
        driver_line = next((line for line in lines if f"DRA driver {DRIVER}:" in line), "")
        expect(driver_line.startswith("PASS"), f"the doctor in {name}:\n{doctor}")
        self.report.check(f"kubectl exec {name} -- {DOCTOR} doctor: {lines[-1]} {driver_line}")
        return plugin

    async def refused(self, method: str, path: str, body: Obj | None, token: str) -> str:
        try:
            await self.cluster.server.call(method, path, body, token=token)
        except RuntimeError as error:
            expect("HTTP 403" in str(error), f"{method} {path}: {error}")
            status = json.loads(str(error).split(": HTTP 403: ", 1)[1])
            return str(status["message"])
        raise AssertionError(f"{method} {path} with the driver's token: allowed")

    async def admission(self, plugin: Obj) -> None:
        self.report.variant = "9 dra admission"
        token = service_account_token(plugin)
        dry_run = f"{SLICES}?dryRun=All"
        await self.cluster.server.call("POST", dry_run, probe_slice(NODE_NAME), token=token)
        other = await self.refused("POST", dry_run, probe_slice(OTHER_NODE), token)
        expect("may change only its own node's ResourceSlices" in other, other)
        self.report.check(
            f"the driver's pod-bound token may create a slice for {NODE_NAME} (dry run); "
            f"for {OTHER_NODE}, the admission policy refuses: {other}"
        )
        unbound = await self.cluster.kubectl("-n", SYSTEM, "create", "token", DAEMONSET)
        no_node = await self.refused("POST", dry_run, probe_slice(NODE_NAME), unbound.strip())
        expect("its token names no node" in no_node, no_node)
        self.report.check(f"a token of the service account bound to no pod: refused: {no_node}")
        for path in (f"/api/v1/namespaces/{SYSTEM}/secrets", "/api/v1/pods"):
            await self.refused("GET", path, None, token)
        self.report.check("RBAC: the driver's token may not list secrets or pods")

    # 9.2, a user's overlay in another namespace

    async def admission_in_another_namespace(self) -> None:
        """A user's overlay that moves the driver to a namespace of its own: its service
        account's writes are still held to its node's slices (the policy does not name
        kube-system). Only the account, its binding (renamed, so that the running driver keeps
        its own) and the policy of that overlay are applied: one driver per node."""
        self.report.variant = "9 dra admission moved"
        cluster = self.cluster
        overlay = cluster.manifests.parent / "moved"
        overlay.mkdir()
        (overlay / "kustomization.yaml").write_text(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
            f"namespace: {MOVED}\nresources:\n  - ../manifests/overlays/dra\n"
        )
        objects = list(yaml.safe_load_all(await cluster.kubectl("kustomize", str(overlay))))
        wanted = ("ServiceAccount", "ClusterRoleBinding", "ValidatingAdmissionPolicy",
                  "ValidatingAdmissionPolicyBinding")  # fmt: skip
        applied = [obj for obj in objects if obj and obj["kind"] in wanted]
        for obj in applied:
            if obj["kind"] == "ClusterRoleBinding":
                obj["metadata"]["name"] = f"{MOVED}-dra"
        await cluster.kubectl("create", "namespace", MOVED)
        await cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(applied))
        token = await cluster.kubectl("-n", MOVED, "create", "token", DAEMONSET)
        dry_run = f"{SLICES}?dryRun=All"

        # kube-apiserver takes up a new binding, and the service account it names as its
        # parameter, from its informers a moment after they are written; until then the
        # parameter is not found, which the policy allows (a missing account has no tokens).
        async def refused_now() -> str | None:
            try:
                return await self.refused("POST", dry_run, probe_slice(NODE_NAME), token.strip())
            except AssertionError:
                return None

        refused, _ = await wait_for(f"the {MOVED} policy in force", refused_now, 30)
        expect("its token names no node" in refused, refused)
        await cluster.kubectl("delete", "clusterrolebinding", f"{MOVED}-dra")
        await cluster.kubectl("delete", "namespace", MOVED, "--wait=false")
        # The policy as the operator's own overlay has it (the moved one's is the same).
        restriction = cluster.manifests / "overlays" / "dra" / "node-restriction.yaml"
        await cluster.kubectl("apply", "-f", str(restriction))
        self.report.check(
            f"a user's overlay with namespace: {MOVED}: its service account, bound the "
            f"overlay's ClusterRole, may still not write a slice from a token bound to no pod: "
            f"{refused}"
        )

    # 9.3 and 9.4

    async def claims_served(self) -> None:
        self.report.variant = "9 dra claims"
        cluster = self.cluster
        templates = f"/apis/resource.k8s.io/v1/namespaces/{CONSUMERS}/resourceclaimtemplates"
        await cluster.server.call("POST", templates, self.claim_template)
        first = f"{CLAIM_PREFIX}1"
        created = now()
        await self.create(first)
        pod = await cluster.consumer_running(first)
        self.report.figure("dra: claim pod created → running", now() - created)
        uid, device = self.device_of(pod)
        expect(spec_path(uid).exists(), f"{first}: no CDI spec {spec_path(uid)}")
        injected = self.check_cdi_injected(pod, uid)
        await cluster.check_in_consumer(pod)
        self.report.check(
            f"{first} runs with its claim ({device}): the driver wrote {spec_path(uid)}, "
            f"containerd injected {injected}; {DEVICE} is a character device it can write, "
            "/var/run/pcc the node's directory"
        )

        names = [f"{CLAIM_PREFIX}{n}" for n in range(2, SHARES + 2)]
        created = now()
        for name in names:
            await self.create(name)

        running, pending = await cluster.pods.until(
            f"{SHARES} claim pods running, 1 pending",
            lambda: every_share_taken(self.claim_pods()),
            180,
        )
        self.report.figure(f"dra: {SHARES} more claim pods created → all shares in use",
                           now() - created)  # fmt: skip
        allocated = {p["metadata"]["name"]: self.device_of(p) for p in running}
        devices = {device for _, device in allocated.values()}
        expect(len(devices) == SHARES, f"the running pods' devices: {sorted(devices)}")
        held = await self.held()
        expected = {
            name: [(device, [f"{DRIVER}/claim={uid}"])] for name, (uid, device) in allocated.items()
        }
        expect(held == expected, f"kubelet's pod-resources: {held}, not {expected}")
        pending_name = pending["metadata"]["name"]
        event = await cluster.scheduler_event(pending_name)
        expect(UNALLOCATABLE in event["message"], f"{event}")
        self.report.check(
            f"{SHARES} claim pods run on {SHARES} distinct devices, each its claim's CDI device "
            f"in kubelet's pod-resources; {pending_name} is Pending: {event['message']}"
        )

        victim = running[0]["metadata"]["name"]
        deleted = now()
        spec = await self.delete(running[0])
        self.report.figure("dra: pod deleted → its claim's CDI spec gone",
                           await self.gone(victim, spec) - deleted)  # fmt: skip
        await cluster.consumer_running(pending_name)
        self.report.figure("dra: pod deleted → the Pending pod running", now() - deleted)
        self.report.check(
            f"{victim} deleted: its claim unprepared ({spec.name} removed); {pending_name} runs"
        )

    # 9.5

    async def extended_resource(self) -> None:
        self.report.variant = "9 dra extended"
        cluster = self.cluster
        await self.delete(self.claim_pods()[0])
        name = "extended-1"
        created = now()
        await cluster.create_consumer(name, "extended")
        pod = await cluster.consumer_running(name)
        self.report.figure("dra: extended-resource pod created → running", now() - created)
        expect(
            bool(pod["status"].get("extendedResourceClaimStatus")),
            f"{name}: no extendedResourceClaimStatus: {pod['status']}",
        )
        uid, device = self.device_of(pod)
        expect(spec_path(uid).exists(), f"{name}: no CDI spec {spec_path(uid)}")
        await cluster.check_in_consumer(pod)
        self.report.check(
            f"{name} asks for {RESOURCE}: 1 as before, and runs on {device} through the "
            f"DeviceClass's extendedResourceName (claim {claim_name(pod)}, {spec_path(uid).name})"
        )

    # 9.5, the node's attributes (issue 38, D)

    async def node_attributes(self) -> None:
        self.report.variant = "9 dra attributes"
        cluster = self.cluster
        wanted = {"teeType": {"string": "sev-snp"}, "tsmReport": {"bool": True}}
        devices = [d for s in self.pool() for d in s["spec"]["devices"]]
        said = [{name: d["attributes"].get(name) for name in wanted} for d in devices]
        expect(
            len(devices) == SHARES and all(one == wanted for one in said),
            f"the devices' node attributes: {said}",
        )
        self.report.check(
            f"on an SEV-SNP guest with TSM ({SEV_SNP_GUEST}, {TSM_REPORT}): all {SHARES} devices "
            f"say {json.dumps(wanted)}"
        )
        documented = docs_device_class()
        other: Obj = yaml.safe_load(yaml.safe_dump(documented))
        other["metadata"]["name"] = OTHER_TEE_CLASS
        (selector,) = other["spec"]["selectors"]
        selector["cel"]["expression"] = selector["cel"]["expression"].replace('"sev-snp"', '"tdx"')
        expect('"tdx"' in selector["cel"]["expression"], f"{DOCS}'s class: {documented}")
        await cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all([documented, other]))
        templates = f"{RESOURCE_API}/namespaces/{CONSUMERS}/resourceclaimtemplates"
        pods_of = {}
        for device_class in (documented, other):
            name = device_class["metadata"]["name"]
            template: Obj = yaml.safe_load(yaml.safe_dump(self.claim_template))
            template["metadata"]["name"] = name.partition(".")[0]
            (request,) = template["spec"]["spec"]["devices"]["requests"]
            request["exactly"]["deviceClassName"] = name
            await cluster.server.call("POST", templates, template)
            pods_of[name] = template["metadata"]["name"]
        spec = await self.delete(self.claim_pods()[0])
        await self.gone("a share freed", spec)
        template_name = pods_of[documented["metadata"]["name"]]
        selected = f"{CLAIM_PREFIX}{template_name}"
        created = now()
        await self.create(selected, template_name)
        pod = await cluster.consumer_running(selected)
        self.report.figure("dra: docs' DeviceClass pod created → running", now() - created)
        uid, device = self.device_of(pod)
        await cluster.check_in_consumer(pod)
        self.report.check(
            f"docs/dra.md's DeviceClass {documented['metadata']['name']} (teeType, tsmReport), "
            f"applied as written: {selected} runs on {device} (claim {uid})"
        )
        template_name = pods_of[OTHER_TEE_CLASS]
        refused = f"{CLAIM_PREFIX}{template_name}"
        await self.create(refused, template_name)
        event = await cluster.scheduler_event(refused)
        expect(UNALLOCATABLE in event["message"], f"{refused}: {event}")
        await cluster.delete_consumer(refused)
        await cluster.pods.until(f"{refused} gone", functools.partial(self.absent, refused), 60)
        self.report.check(
            f"the same class asking for teeType tdx: {refused} Pending: {event['message']}"
        )

    # 9.6

    async def device_removed(self) -> None:
        self.report.variant = "9 dra device"
        cluster = self.cluster
        await self.gates()
        spec = await self.delete(self.claim_pods()[0])
        await self.gone("a share freed", spec)
        holders = [p for p in self.claim_pods() if phase(p) == "Running"]
        await self.health_shown(holders, "Healthy", "before")
        tainting = await self.taints_chosen()
        removed = now()
        DEVICE.unlink()
        if tainting:
            await self.tainted(removed)
        else:
            withdrawn = await self.wait_published("the device removed", 0)
            self.report.figure("dra: device removed → devices withdrawn", withdrawn - removed)
        await self.health_shown(holders, "Unhealthy", "device removed", DEVICE_GONE, removed)
        name = f"{CLAIM_PREFIX}device-gone"
        await self.create(name)
        event = await cluster.scheduler_event(name)

        def with_claim() -> Obj | None:
            pod = cluster.pods.current.get(f"{CONSUMERS}/{name}")
            named = pod and claim_name(pod)
            return pod if named and f"{CONSUMERS}/{named}" in self.claims.current else None

        # The claim controller made the claim, then named it in the pod's status.
        pod = await cluster.pods.until(f"{name} and its claim", with_claim, 30)
        claim = self.claim_of(pod)
        expect(
            UNALLOCATABLE in event["message"]
            and not pod["spec"].get("nodeName")
            and not claim.get("status", {}).get("allocation"),
            f"{name}: {event['message']}; {pod['spec'].get('nodeName')}; {claim.get('status')}",
        )
        shown = "tainted" if tainting else "withdrawn"
        self.report.check(
            f"{DEVICE} removed: the node's devices {shown}; {name}'s claim is not allocated, "
            f"the pod is Pending: {event['message']}"
        )
        restored = now()
        make_device()
        if tainting:
            await self.slices.until(
                "the taints gone", lambda: True if not self.taints() else None, 60
            )
            self.report.figure("dra: device restored → taints gone", now() - restored)
        else:
            back = await self.wait_published("the device restored", SHARES)
            self.report.figure("dra: device restored → devices back", back - restored)
        await self.health_shown(holders, "Healthy", "device restored", "", restored)
        await cluster.consumer_running(name)
        self.report.figure("dra: device restored → the Pending pod running", now() - restored)
        self.report.check(
            f"{DEVICE} restored: {SHARES} devices listed without a taint; {name} runs"
        )

    # 9.6, what the driver says of an unhealthy device: health in the pods' status (issue 38, B),
    # a taint in the slice (C).

    async def gates(self) -> None:
        """The feature gates B and C need, as kube-apiserver and kubelet report them: nothing
        is enabled by the cluster's set-up, these are 1.37.2's defaults."""
        server = await self.cluster.kubectl("get", "--raw", "/metrics")
        kubelet = await self.cluster.kubectl(
            "get", "--raw", f"/api/v1/nodes/{NODE_NAME}/proxy/metrics"
        )
        said = [
            "kube-apiserver " + ", ".join(
                feature_enabled(server, gate)
                for gate in ("DRADeviceTaints", "ResourceHealthStatus")
            ),
            "kubelet " + ", ".join(
                feature_enabled(kubelet, gate)
                for gate in ("ResourceHealthStatus", "ResourceHealthStatusMessage")
            ),
        ]  # fmt: skip
        self.report.check(f"feature gates, by the defaults of 1.37.2: {'; '.join(said)}")

    async def taints_chosen(self) -> bool:
        """Whether the driver said at start that it taints (else it withdraws)."""
        logs = await self.cluster.kubectl("-n", SYSTEM, "logs", f"ds/{DAEMONSET}")
        said = re.search(r"Unhealthy devices will be [^\n]*", logs)
        expect(said is not None, f"the driver did not say how it shows unhealthy devices:\n{logs}")
        assert said is not None
        self.report.check(f"the driver's log: {said[0]}")
        return said[0].startswith(f"Unhealthy devices will be tainted {TAINT_KEY}=")

    def taints(self) -> list[Obj]:
        """Every taint of the node's pool's devices."""
        return [
            taint
            for s in self.pool()
            for device in s["spec"].get("devices") or []
            for taint in device.get("taints") or []
        ]

    async def tainted(self, since: float) -> None:
        """Every device still listed, each with the one taint that says why."""

        def all_tainted() -> bool | None:
            devices = [d for s in self.pool() for d in s["spec"].get("devices") or []]
            taints = [taint for d in devices for taint in d.get("taints", [])]
            said = {(taint["key"], taint.get("value"), taint["effect"]) for taint in taints}
            complete = all(len(d.get("taints", [])) == 1 for d in devices)
            wanted = {(TAINT_KEY, "dev-sev-guest-missing", "NoSchedule")}
            return True if len(devices) == SHARES and complete and said == wanted else None

        await self.slices.until("every device tainted", all_tainted, 60)
        self.report.figure("dra: device removed → devices tainted", now() - since)
        shown = await self.cluster.kubectl(
            "get", "resourceslices", "--field-selector", f"spec.driver={DRIVER}",
            "-o", "jsonpath={.items[0].spec.devices[0].name}: {.items[0].spec.devices[0].taints}",
        )  # fmt: skip
        self.report.check(f"{SHARES} devices still listed, each tainted: {shown}")

    async def health_shown(
        self, holders: list[Obj], health: str, what: str, message: str = "",
        since: float | None = None,
    ) -> None:  # fmt: skip
        """Every pod of `holders` says `health` (with `message`) for its claim's device, in
        status.containerStatuses[].allocatedResourcesStatus, as kubelet writes it."""
        names = [p["metadata"]["name"] for p in holders]
        expected = {}
        for pod in holders:
            uid, _ = self.device_of(pod)
            resource: Obj = {"resourceID": f"{DRIVER}/claim={uid}", "health": health}
            if message:
                resource["message"] = message
            expected[pod["metadata"]["name"]] = [{"name": "claim:pcc", "resources": [resource]}]

        def statuses() -> dict[str, Any]:
            found = {}
            for name in names:
                pod = self.cluster.pods.current.get(f"{CONSUMERS}/{name}") or {}
                (status,) = pod.get("status", {}).get("containerStatuses") or [{}]
                found[name] = status.get("allocatedResourcesStatus")
            return found

        try:
            await self.cluster.pods.until(
                f"{what}: {health} in the claim pods' status",
                lambda: True if statuses() == expected else None,
                60,
            )
        except AssertionError as error:
            raise AssertionError(f"{error}; they say {statuses()}") from None
        if since is not None:
            self.report.figure(f"dra: {what} → {health} in the pods' status", now() - since)
        line = await self.cluster.kubectl(
            "-n", CONSUMERS, "get", "pod", names[0],
            "-o", "jsonpath={.status.containerStatuses[0].allocatedResourcesStatus}",
        )  # fmt: skip
        self.report.check(
            f"{what}: the {len(names)} claim pods' status says {health}; {names[0]}: {line}"
        )

    # 9.7

    async def kept(self, pods: list[Obj], before: dict[str, Any], what: str) -> None:
        """The pods still run in the same containers, with the same devices (as kubelet lists
        them) and their claims' CDI specs; one of them still writes its device."""
        running = RunningConsumers(pods, {container_id(pod) for pod in pods}, before)
        await self.cluster.consumers_kept(running, what, self.held)
        for pod in pods:
            uid, _ = self.device_of(pod)
            expect(spec_path(uid).exists(), f"{what}: {pod['metadata']['name']} lost its CDI spec")
        await self.cluster.check_in_consumer(pods[0])

    async def restarts(self) -> None:
        self.report.variant = "9 dra restarts"
        cluster = self.cluster
        running = [p for p in self.claim_pods() if phase(p) == "Running"]
        held = await self.held()
        devices = {p["metadata"]["name"]: held[p["metadata"]["name"]] for p in running}
        before = {s["metadata"]["uid"] for s in self.pool()}

        kubelet = cluster.node.kubelet
        await kubelet.stop()
        await kubelet.start()

        def published_again() -> bool | None:
            again = {s["metadata"]["uid"] for s in self.pool()}
            listed = self.published()
            fresh = again and not again & before
            return True if fresh and listed is not None and len(listed) == SHARES else None

        await self.slices.until("the slices published again", published_again, 60)
        self.report.figure(
            "dra: kubelet started → slices published again", now() - kubelet.started_at
        )
        await self.kept(running, devices, "kubelet restarted")
        self.report.check(
            f"kubelet restarted: it deleted the node's slices, the driver published {SHARES} "
            f"devices again; {len(running)} claim pods kept their containers and CDI specs"
        )

        published = {s["metadata"]["uid"] for s in self.pool()}
        (old,) = cluster.plugin_pods()
        deleted = now()
        await cluster.kubectl("-n", SYSTEM, "delete", "pod", old["metadata"]["name"],
                              "--wait=false")  # fmt: skip
        new = await cluster.wait_rolled_out("a new driver pod, ready", old)
        self.report.figure("dra: driver pod deleted → new one ready", now() - deleted)
        await self.wait_published("the new driver", SHARES)
        kept = {s["metadata"]["uid"] for s in self.pool()}
        expect(kept == published, f"the slices were written again: {published} → {kept}")
        await self.kept(running, devices, "the driver's pod deleted")
        victim = running[-1]
        deleted = now()
        spec = await self.delete(victim)
        self.report.figure(
            "dra: pod deleted → the new driver removed its spec",
            await self.gone("unprepared by the new driver", spec) - deleted,
        )
        await cluster.pods.until(
            f"{victim['metadata']['name']} gone",
            functools.partial(self.absent, victim["metadata"]["name"]),
            60,
        )
        after = f"{CLAIM_PREFIX}after-restarts"
        await self.create(after)
        await cluster.consumer_running(after)
        self.report.figure("dra: pod deleted → a new claim pod running", now() - deleted)
        self.report.check(
            f"driver pod deleted: {new['metadata']['name']} ready, the slices kept, "
            f"{len(running)} claim pods kept their containers; {victim['metadata']['name']}, "
            f"prepared by the old driver, deleted: unprepared by the new one ({spec.name} "
            f"removed), and {after} got the share"
        )

    def absent(self, name: str) -> bool | None:
        return None if f"{CONSUMERS}/{name}" in self.cluster.pods.current else True

    # 9.8

    def writes_since(self, start: float) -> int:
        """Writes of the node's pool (each a new version of one of its slices, or a deletion)
        the watch saw since `start`."""
        return sum(
            1
            for versions in self.slices.history.values()
            for at, _, obj in versions
            if at >= start
            and obj["spec"]["driver"] == DRIVER
            and obj["spec"].get("nodeName") == NODE_NAME
        )

    async def roll_out(self, what: str, change: list[str], resource: str) -> None:
        """One rolling update of the driver (`change` is the kubectl command that starts it):
        rolled out, the pool saying `resource`, its writes counted until SETTLE after."""
        cluster = self.cluster
        (old,) = cluster.plugin_pods()
        started = now()
        await cluster.kubectl(*change)
        new = await cluster.wait_rolled_out(f"{what}: the new driver ready, the old gone", old)
        rolled = now()
        self.report.figure(f"dra {what}: started → rolled out", rolled - started)

        def says() -> bool | None:
            listed = self.published()
            return True if listed and resource_names(self.pool()) == {resource} else None

        await self.slices.until(f"{what}: every device's resourceName {resource}", says, 60)
        # An observation of what two instances do after the rollout, not a synchronisation.
        await trio.sleep(SETTLE)
        expect(resource_names(self.pool()) == {resource},
               f"{what}: the slices went back to {resource_names(self.pool())}")  # fmt: skip
        writes = self.writes_since(started)
        seconds = now() - started
        bound = write_bound(seconds)
        expect(writes <= bound, f"{what}: {writes} slice writes in {seconds:.0f} s, over {bound}")
        self.report.note(f"{what}: {writes} slice write(s) over the rollout and {SETTLE:.0f} s "
                         f"after ({seconds:.0f} s; the bound is {bound})")  # fmt: skip
        self.report.check(
            f"{what}: {new['metadata']['name']} replaced {old['metadata']['name']}; every "
            f"device says resourceName {resource}, and still does {SETTLE:.0f} s later; "
            f"{writes} slice write(s), within the bound of {bound}"
        )

    async def rolling_update(self) -> None:
        """A new version whose slices say one thing differently, then the way back."""
        self.report.variant = "9 dra rollout"
        patch = json.dumps([{
            "op": "add", "path": "/spec/template/spec/containers/0/args/-",
            "value": f"--resource-name={CHANGED_RESOURCE}",
        }])  # fmt: skip
        await self.roll_out(
            "rollout", ["-n", SYSTEM, "patch", "daemonset", DAEMONSET, "--type=json", "-p", patch],
            CHANGED_RESOURCE,
        )  # fmt: skip
        overlay = self.cluster.manifests / "overlays" / "dra"
        await self.roll_out("rollback", ["apply", "-k", str(overlay)], RESOURCE)

    # 9.9

    async def api_server_outage(self) -> None:
        """kube-apiserver stopped for OUTAGE seconds while one claim pod starts and another
        stops."""
        self.report.variant = "9 dra api outage"
        cluster = self.cluster
        spec = await self.delete(self.claim_pods()[0])
        await self.gone("a share freed", spec)
        running = [p for p in self.claim_pods() if phase(p) == "Running"]
        leaving, staying = running[-1], running[:-1]
        held = await self.held()
        devices = {p["metadata"]["name"]: held[p["metadata"]["name"]] for p in staying}
        (driver,) = cluster.plugin_pods()
        restarts = driver["status"]["containerStatuses"][0]["restartCount"]
        slices_before = {s["metadata"]["uid"] for s in self.pool()}

        arriving = f"{CLAIM_PREFIX}during-outage"
        await self.create(arriving)

        def bound() -> bool | None:
            pod = cluster.pods.current.get(f"{CONSUMERS}/{arriving}")
            return True if pod and pod["spec"].get("nodeName") else None

        await cluster.pods.until(f"{arriving} scheduled", bound, 60)
        leaving_spec = await self.delete(leaving)
        name = leaving["metadata"]["name"]

        def deleting() -> bool | None:
            pod = cluster.pods.current.get(f"{CONSUMERS}/{name}")
            return True if pod is None or "deletionTimestamp" in pod["metadata"] else None

        await cluster.pods.until(f"{name} being deleted", deleting, 30)

        stopped = now()
        await cluster.control_plane.stop_api_server()
        unprepared: float | None = None
        with trio.move_on_after(OUTAGE):
            unprepared = await self.gone(f"{name} unprepared without the API server",
                                         leaving_spec)  # fmt: skip
        if unprepared is not None:
            self.report.figure("dra outage: API server stopped → a deleted pod unprepared",
                               unprepared - stopped)  # fmt: skip
        else:
            self.report.note(f"{name}: not unprepared while the API server was down (kubelet "
                             "had not seen its deletion); after it")  # fmt: skip
        # The outage itself, not a synchronisation.
        await trio.sleep(max(0.0, OUTAGE - (now() - stopped)))
        back = await cluster.control_plane.start_api_server()
        self.report.figure("dra outage: kube-apiserver stopped → ready again", back - stopped)

        await cluster.consumer_running(arriving)
        self.report.figure(f"dra outage: API server back → {arriving} running", now() - back)
        await self.gone(f"{name} unprepared", leaving_spec)
        await cluster.pods.until(f"{name} gone", functools.partial(self.absent, name), 60)
        self.report.figure(f"dra outage: API server back → {name} gone", now() - back)
        await self.kept(staying, devices, "the API server stopped")
        await self.wait_published("after the outage", SHARES)
        (after,) = cluster.plugin_pods()
        expect(
            after["metadata"]["uid"] == driver["metadata"]["uid"]
            and after["status"]["containerStatuses"][0]["restartCount"] == restarts,
            f"the driver was restarted: {after['metadata']['name']} {after['status']}",
        )
        claims = {
            self.device_of(pod)[0]
            for pod in cluster.consumer_pods()
            if "deletionTimestamp" not in pod["metadata"]
            and phase(pod) == "Running"
            and claim_name(pod)
        }
        recorded = set(json.loads((STATE_DIR / "checkpoint.json").read_text())["claims"])
        expect(recorded == claims, f"the checkpoint holds {sorted(recorded)}, the running pods' "
                                   f"claims are {sorted(claims)}")  # fmt: skip
        kept = {s["metadata"]["uid"] for s in self.pool()} == slices_before
        self.report.check(
            f"kube-apiserver stopped {OUTAGE:.0f} s: {name}, deleted, unprepared and gone, "
            f"{arriving} runs, {len(staying)} claim pods kept their containers and devices, the "
            f"checkpoint holds the {len(claims)} running pods' claims, the driver was not "
            f"restarted; the slices {'kept' if kept else 'published again'}"
        )

    # 9.10 (issue 38, C)

    async def no_execute(self) -> None:
        """--unhealthy-taint-effect=NoExecute, as an operator patches it in: the pods that hold
        a claim on the device are evicted when it goes."""
        self.report.variant = "9 dra NoExecute"
        cluster = self.cluster
        holders = [p for p in self.claim_pods() if phase(p) == "Running"]
        expect(bool(holders), "no claim pod runs")
        (old,) = cluster.plugin_pods()
        flag = "--unhealthy-taint-effect=NoExecute"
        patch = [{"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": flag}]
        await cluster.kubectl(
            "-n", SYSTEM, "patch", "daemonset", DAEMONSET, "--type=json", "-p", json.dumps(patch)
        )
        driver = await cluster.wait_rolled_out("the driver with NoExecute, ready", old)
        await self.wait_published("the driver with NoExecute", SHARES)
        removed = now()
        DEVICE.unlink()
        names = {p["metadata"]["name"] for p in holders}

        def evicted() -> bool | None:
            left = names & {p["metadata"]["name"] for p in self.claim_pods()}
            return None if left else True

        try:
            await cluster.pods.until(f"the {len(names)} claim pods evicted", evicted, 90)
            taint = next(iter(self.taints()), {})
        finally:
            make_device()
        self.report.figure("dra NoExecute: device removed → the claim pods evicted",
                           now() - removed)  # fmt: skip
        expect(taint.get("effect") == "NoExecute", f"the taint: {taint}")
        self.report.check(
            f"{driver['metadata']['name']} with {flag}: {DEVICE} removed, the devices tainted "
            f"{taint.get('key')}={taint.get('value')}:NoExecute, and kube-controller-manager "
            f"evicted the {len(names)} claim pods"
        )
        await cluster.kubectl("apply", "-k", str(cluster.manifests / "overlays" / "dra"))
        driver = await cluster.wait_rolled_out("the overlay's driver again", driver)
        await self.slices.until("the taints gone", lambda: True if not self.taints() else None, 60)
        self.report.check(
            f"{DEVICE} restored and the overlay applied again: {driver['metadata']['name']} "
            "ready, no taint left"
        )


async def migrate_and_back(cluster: Cluster, slices: Watch, claims: Watch) -> None:
    """Check 7, on the device plugin's cluster with its consumers running."""
    await Dra(cluster, slices, claims).migration()


async def run(cluster: Cluster, slices: Watch, claims: Watch) -> None:
    """Check 9, on the cluster the device plugin's checks left (the plugin uninstalled)."""
    fake_sev_snp_sysfs(cluster.node.state)
    dra = Dra(cluster, slices, claims)
    plugin = await dra.install()
    await dra.admission(plugin)
    await dra.admission_in_another_namespace()
    await dra.claims_served()
    await dra.extended_resource()
    await dra.node_attributes()
    await dra.device_removed()
    await dra.restarts()
    await dra.rolling_update()
    await dra.api_server_outage()
    await dra.no_execute()
