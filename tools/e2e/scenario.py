"""The checks, in order, and the figures; run inside the node's namespaces (see node.py).

For each plugin pod template (``plugin``: manifests/base; ``plugin-hardened``:
manifests/overlays/hardened), through kubelet's pod-resources API, kubelet's HTTPS API and the
pods themselves:

1. the plugin's static pod starts and kubelet has 16 allocatable devices; the pod becomes ready;
2. consumer-1 (manifests/examples/confidential-app, one share) runs; inside it /dev/sev-guest is
   a character device it can write, and /var/run/pcc is the node's directory (same inode; a file
   written on either side is read on the other);
3. consumers 2 to 16 run, holding 16 distinct devices; consumer-17 is refused by kubelet's
   admission (all 16 shares are held) and never gets a container;
4. kubelet is restarted three times: 16 allocatable again each time, and consumer-1 keeps its
   container and its device, which it can still write;
5. the plugin's container is killed: kubelet starts a new one, which registers again (16
   allocatable) and becomes ready;
6. the device node is removed: 0 allocatable; kubelet's readiness probe keeps the plugin ready, as
   docs/deploy.md says (/readyz is about registration, not the device); restored: 16 again.

Polls (kubelet has no watch on these APIs) use poll.wait_for; every wait has a timeout.
"""

from __future__ import annotations

import os
import secrets
import stat
import time
from pathlib import Path

import attrs
import trio

from . import api, pods
from .node import NODE_IP, Node
from .poll import wait_for

RESOURCE = "tke.cloud.tencent.com/pcc-device"
SHARES = 16
DEVICE = Path("/dev/sev-guest")
# The fake device: the same major and minor as /dev/null, so writes go nowhere.
DEVICE_NUMBER = os.makedev(1, 3)
PCC_DIR = Path("/var/run/pcc")
PLUGIN = "pcc-device-plugin"
PLUGIN_NAMESPACE = "kube-system"
CONSUMER_NAMESPACE = "default"
VARIANTS = ("plugin", "plugin-hardened")
KUBELET_RESTARTS = 3
METRICS_PORT = 8080


def now() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def make_device() -> None:
    os.mknod(DEVICE, 0o666 | stat.S_IFCHR, DEVICE_NUMBER)
    os.chmod(DEVICE, 0o666)


def make_node_files() -> None:
    """The fake SEV-SNP device and the PCC directory, in the namespace's /dev and /run overlays."""
    make_device()
    PCC_DIR.mkdir(mode=0o755)


@attrs.define
class Report:
    """What the run prints: checks passed, facts observed, figures; each line with the time
    since the start."""

    figures: dict[str, dict[str, float]] = attrs.field(factory=dict)
    facts: list[str] = attrs.field(factory=list)
    variant: str = ""
    started: float = attrs.field(factory=now)

    def say(self, kind: str, text: str) -> None:
        print(f"{now() - self.started:6.1f}s {kind:<5} [{self.variant}] {text}", flush=True)

    def check(self, text: str) -> None:
        self.say("PASS", text)

    def note(self, text: str) -> None:
        self.say("NOTE", text)
        self.facts.append(f"[{self.variant}] {text}")

    def figure(self, name: str, seconds: float) -> None:
        self.figures.setdefault(name, {})[self.variant] = seconds
        self.say("TIME", f"{name}: {seconds:.2f} s")

    def table(self) -> str:
        variants = list(dict.fromkeys(v for row in self.figures.values() for v in row))
        width = max(len(name) for name in self.figures) if self.figures else 10
        lines = [f"{'figure (seconds)':<{width}}  " + "  ".join(f"{v:>15}" for v in variants)]
        for name, row in self.figures.items():
            cells = (f"{row[v]:>15.2f}" if v in row else f"{'-':>15}" for v in variants)
            lines.append(f"{name:<{width}}  " + "  ".join(cells))
        return "\n".join(lines)


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


async def wait_allocatable(what: str, count: int, within: float = 60) -> tuple[list[str], float]:
    """Poll pod-resources until kubelet has exactly `count` allocatable devices."""

    async def probe() -> list[str] | None:
        ids = await api.allocatable(RESOURCE)
        return ids if len(ids) == count else None

    return await wait_for(f"{what}: {count} allocatable", probe, within)


async def running(
    name: str, container: str, not_id: str | None = None, within: float = 120
) -> tuple[api.Obj, float]:
    """Wait until kubelet reports `container` of static pod `name` running (with another ID
    than `not_id`); (its container status, when seen)."""
    full = api.pod_name(name)

    async def probe() -> api.Obj | None:
        pod = (await api.pods()).get(full)
        status = pod and api.container_status(pod, container)
        if status and "running" in status.get("state", {}) and status.get("containerID"):
            return status if status["containerID"] != not_id else None
        return None

    return await wait_for(f"{full}/{container} running", probe, within)


def container_id(status: api.Obj) -> str:
    runtime_id: str = status["containerID"]
    return runtime_id.removeprefix("containerd://")


def process_start(pid: int) -> float:
    """When process `pid` started, on CLOCK_BOOTTIME (10 ms resolution)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[19]) / os.sysconf("SC_CLK_TCK")


async def task_pid(node: Node, status: api.Obj) -> int:
    pid, _ = (await node.tasks())[container_id(status)]
    return pid


async def ready(name: str, container: str, within: float) -> tuple[api.Obj, float]:
    full = api.pod_name(name)

    async def probe() -> api.Obj | None:
        pod = (await api.pods()).get(full)
        status = pod and api.container_status(pod, container)
        return status if status and status.get("ready") else None

    return await wait_for(f"{full}/{container} ready", probe, within)


async def in_consumer(number: int, *argv: str) -> str:
    return await api.run_in_container(
        CONSUMER_NAMESPACE, api.pod_name(f"consumer-{number}"), pods.CONSUMER_CONTAINER, *argv
    )


async def check_device_in_consumer(report: Report, number: int) -> None:
    kind = (await in_consumer(number, "stat", "-c", "%F", str(DEVICE))).strip()
    expect(kind == "character special file", f"consumer-{number}: {DEVICE} is a {kind!r}")
    numbers = (await in_consumer(number, "stat", "-c", "%t:%T", str(DEVICE))).strip()
    expected = f"{os.major(DEVICE_NUMBER):x}:{os.minor(DEVICE_NUMBER):x}"
    expect(numbers == expected, f"consumer-{number}: {DEVICE} is {numbers}, not {expected}")
    await in_consumer(number, "sh", "-c", f"echo>{DEVICE}")
    report.check(f"consumer-{number}: {DEVICE} is a character device ({numbers}) it can write")


async def check_pcc_dir_in_consumer(report: Report, number: int) -> None:
    node_side = os.stat(PCC_DIR)
    inside = (await in_consumer(number, "stat", "-L", "-c", "%d:%i", str(PCC_DIR))).strip()
    expect(
        inside == f"{node_side.st_dev}:{node_side.st_ino}",
        f"consumer-{number}: {PCC_DIR} is {inside}, the node's is "
        f"{node_side.st_dev}:{node_side.st_ino}",
    )
    nonce = secrets.token_hex(8)
    (PCC_DIR / f"from-node-{nonce}").write_text(nonce)
    read = await in_consumer(number, "cat", f"{PCC_DIR}/from-node-{nonce}")
    expect(read == nonce, f"consumer-{number} read {read!r} from the node's file, not {nonce!r}")
    await in_consumer(number, "touch", f"{PCC_DIR}/from-consumer-{number}-{nonce}")
    expect(
        (PCC_DIR / f"from-consumer-{number}-{nonce}").exists(),
        f"the file consumer-{number} wrote into {PCC_DIR} is not in the node's {PCC_DIR}",
    )
    report.check(
        f"consumer-{number}: {PCC_DIR} is the node's directory (inode {inside}); "
        "a file written on each side is read on the other"
    )


async def assigned_to_consumers() -> dict[int, list[str]]:
    found = await api.assigned(RESOURCE)
    return {
        int(pod.removesuffix(api.pod_name("")).removeprefix("consumer-")): ids
        for (namespace, pod, _), ids in found.items()
        if namespace == CONSUMER_NAMESPACE and pod.startswith("consumer-")
    }


async def start_consumer(node: Node, number: int) -> None:
    node.put_static_pod(f"consumer-{number}", pods.dump(pods.consumer_pod(number)))


async def remove_pod(node: Node, name: str, *, until_removed: bool = False) -> None:
    """Remove static pod `name`; wait until kubelet has stopped its containers, or with
    `until_removed` until it has removed them and the sandbox from containerd.

    Kubelet starts a static pod of the same name again only once it is done with the old one.
    """
    full = api.pod_name(name)
    pod = (await api.pods()).get(full)
    uid = pod["metadata"]["uid"] if pod else None
    ids = {
        container_id(s)
        for s in (pod or {}).get("status", {}).get("containerStatuses", [])
        if s.get("containerID")
    }
    node.remove_static_pod(name)

    async def gone() -> bool | None:
        if full in await api.pods():
            return None
        if until_removed and uid:
            selector = f'labels."io.kubernetes.pod.uid"=={uid}'
            return (
                None
                if (await node.ctr("containers", "list", "--quiet", selector)).split()
                else True
            )
        tasks = await node.tasks()
        return True if all(tasks.get(i, (0, "STOPPED"))[1] == "STOPPED" for i in ids) else None

    await wait_for(f"{full} {'removed' if until_removed else 'stopped'}", gone, 90)


async def plugin_started(node: Node, report: Report, variant: str) -> api.Obj:
    pod = pods.plugin_pod(variant)
    written = now()
    node.put_static_pod(PLUGIN, pods.dump(pod))
    ids, allocatable_at = await wait_allocatable("plugin started", SHARES)
    expect(len(set(ids)) == SHARES, f"device IDs are not distinct: {ids}")
    status, _ = await running(PLUGIN, pods.PLUGIN_CONTAINER)
    started = process_start(await task_pid(node, status))
    report.figure("plugin manifest written → plugin process started", started - written)
    report.figure("plugin process started → 16 allocatable", allocatable_at - started)
    report.check(f"{SHARES} allocatable {RESOURCE} ({ids[0]} ... {ids[-1]})")
    _, ready_at = await ready(PLUGIN, pods.PLUGIN_CONTAINER, within=60)
    report.figure("plugin process started → pod ready (readiness probe)", ready_at - started)
    report.check("the plugin's pod is ready (kubelet's readiness probe on /readyz)")
    return status


async def consumers(node: Node, report: Report) -> str:
    """consumer-1 to consumer-16 run, consumer-17 is refused; only consumer-1 is left running."""
    written = now()
    await start_consumer(node, 1)
    _, running_at = await running("consumer-1", pods.CONSUMER_CONTAINER)
    report.figure("consumer manifest written → consumer running", running_at - written)
    held = await assigned_to_consumers()
    expect(len(held.get(1, [])) == 1, f"consumer-1 holds {held.get(1)} per pod-resources")
    report.check(f"consumer-1 runs and holds one device ({held[1][0]}) per pod-resources List")
    await check_device_in_consumer(report, 1)
    await check_pcc_dir_in_consumer(report, 1)

    written = now()
    for number in range(2, SHARES + 1):
        await start_consumer(node, number)
    async with trio.open_nursery() as nursery:
        for number in range(2, SHARES + 1):
            nursery.start_soon(running, f"consumer-{number}", pods.CONSUMER_CONTAINER)
    report.figure("15 consumer manifests written → all running", now() - written)
    held = await assigned_to_consumers()
    devices = [device for ids in held.values() for device in ids]
    expect(
        sorted(held) == list(range(1, SHARES + 1)) and len(set(devices)) == SHARES,
        f"pod-resources List: {held}",
    )
    report.check(f"{SHARES} consumers run, holding {SHARES} distinct devices")

    written = now()
    await start_consumer(node, SHARES + 1)
    name = api.pod_name(f"consumer-{SHARES + 1}")

    async def refused() -> api.Obj | None:
        pod = (await api.pods()).get(name)
        return pod if pod and pod.get("status", {}).get("phase") == "Failed" else None

    pod, refused_at = await wait_for(f"{name} refused", refused, 60)
    status = pod["status"]
    report.figure("17th consumer manifest written → refused", refused_at - written)
    expect(
        not any("running" in s.get("state", {}) for s in status.get("containerStatuses", [])),
        f"{name} has a running container: {status}",
    )
    expect(SHARES + 1 not in await assigned_to_consumers(), f"{name} holds a device")
    report.check(
        f"consumer-{SHARES + 1} refused: phase Failed, reason {status.get('reason')!r}, "
        f"message {status.get('message')!r}; no container, no device"
    )
    report.note(f"17th consumer refused: {status.get('reason')}: {status.get('message')}")

    async with trio.open_nursery() as nursery:
        for number in range(2, SHARES + 2):
            nursery.start_soon(remove_pod, node, f"consumer-{number}")
    first = (await running("consumer-1", pods.CONSUMER_CONTAINER))[0]
    return container_id(first)


async def kubelet_restarts(node: Node, report: Report, consumer_container: str) -> None:
    (device,) = (await assigned_to_consumers())[1]
    for restart in range(1, KUBELET_RESTARTS + 1):
        await node.kubelet.stop()
        await node.kubelet.start()
        _, allocatable_at = await wait_allocatable(f"kubelet restart {restart}", SHARES)
        report.figure(
            f"kubelet restart {restart}: kubelet started → 16 allocatable",
            allocatable_at - node.kubelet.started_at,
        )
        status, _ = await running("consumer-1", pods.CONSUMER_CONTAINER, within=60)
        expect(
            container_id(status) == consumer_container and status.get("restartCount") == 0,
            f"consumer-1's container changed: {status}",
        )
        held = (await assigned_to_consumers()).get(1)
        expect(held == [device], f"consumer-1 holds {held} after the restart, not [{device}]")
        await check_device_in_consumer(report, 1)
        report.check(
            f"kubelet restart {restart}: {SHARES} allocatable; consumer-1 kept its container "
            f"and device {device}"
        )


async def plugin_killed(node: Node, report: Report, status: api.Obj) -> None:
    old = container_id(status)
    killed = now()
    await node.ctr("tasks", "kill", "--signal", "SIGKILL", old)
    try:
        _, zero_at = await wait_allocatable("plugin killed", 0, within=10)
        report.figure("plugin killed → 0 allocatable", zero_at - killed)
    except AssertionError:
        report.note("0 allocatable was not seen after the kill (the new plugin was quicker)")
    new, _ = await running(PLUGIN, pods.PLUGIN_CONTAINER, not_id=status["containerID"], within=90)
    started = process_start(await task_pid(node, new))
    _, allocatable_at = await wait_allocatable("plugin restarted by kubelet", SHARES)
    report.figure("plugin killed → new plugin process started (by kubelet)", started - killed)
    report.figure("new plugin process started → 16 allocatable", allocatable_at - started)
    expect(new.get("restartCount", 0) >= 1, f"restartCount: {new}")
    report.check(
        f"plugin container {old[:12]} killed; kubelet started {container_id(new)[:12]} "
        f"(restartCount {new['restartCount']}), which registered again: {SHARES} allocatable"
    )
    _, ready_at = await ready(PLUGIN, pods.PLUGIN_CONTAINER, within=60)
    report.figure("new plugin process started → pod ready", ready_at - started)
    report.check("the new plugin container is ready")


async def readiness_probe_after(pod: str, since: float) -> dict[str, float]:
    """The readiness probe results kubelet counts, once one more probe ran after `since`
    results were counted."""

    async def probe() -> dict[str, float] | None:
        counts = await api.probe_results(pod, "Readiness")
        return counts if sum(counts.values()) > since else None

    counts, _ = await wait_for(f"{pod}: next readiness probe", probe, 30)
    return counts


async def device_removed(node: Node, report: Report) -> None:
    full = api.pod_name(PLUGIN)
    before = await api.probe_results(full, "Readiness")
    removed = now()
    await trio.Path(DEVICE).unlink()
    _, zero_at = await wait_allocatable("device removed", 0, within=30)
    report.figure("device removed → 0 allocatable", zero_at - removed)
    report.check(f"{DEVICE} removed: 0 allocatable")
    # Kubelet probes every 10 s; wait until it has probed after the devices went unhealthy.
    counted = await api.probe_results(full, "Readiness")
    after = await readiness_probe_after(full, sum(counted.values()))
    failed = after.get("failed", 0) - before.get("failed", 0)
    pod = (await api.pods())[full]
    plugin = api.container_status(pod, pods.PLUGIN_CONTAINER) or {}
    code, body = await api.http_get(f"http://{NODE_IP}:{METRICS_PORT}/readyz")
    _, metrics = await api.http_get(f"http://{NODE_IP}:{METRICS_PORT}/metrics")
    unhealthy = [
        line for line in metrics.splitlines()
        if line.startswith("pcc_device_plugin_devices{") and 'health="Unhealthy"' in line
    ]  # fmt: skip
    report.note(
        f"device removed: readiness probes since removal failed {failed:.0f} time(s); pod Ready="
        f"{api.condition(pod, 'Ready')}, container ready={plugin.get('ready')}; /readyz answers "
        f"{code} {body.strip()!r}; {unhealthy}"
    )
    expect(
        code == 200 and failed == 0 and plugin.get("ready") is True,
        "docs/deploy.md: readiness says nothing about the device (registered and stream open "
        f"means ready); observed /readyz {code} {body.strip()!r}, ready={plugin.get('ready')}",
    )
    report.check(
        "kubelet's readiness probe still passes with the device gone (/readyz 200), as "
        "docs/deploy.md says: readiness is about registration; the devices are Unhealthy"
    )
    restored = now()
    await trio.to_thread.run_sync(make_device)
    _, back_at = await wait_allocatable("device restored", SHARES, within=30)
    report.figure("device restored → 16 allocatable", back_at - restored)
    report.check(f"{DEVICE} restored: {SHARES} allocatable")


async def run_variant(node: Node, report: Report, variant: str) -> None:
    report.variant = variant
    print(f"\n===== {variant}: {pods.MANIFESTS / variant}", flush=True)
    status = await plugin_started(node, report, variant)
    consumer = await consumers(node, report)
    await kubelet_restarts(node, report, consumer)
    status, _ = await running(PLUGIN, pods.PLUGIN_CONTAINER)
    await plugin_killed(node, report, status)
    await device_removed(node, report)
    await remove_pod(node, "consumer-1")
    await remove_pod(node, PLUGIN, until_removed=True)


async def run(node: Node, report: Report, variants: list[str]) -> None:
    for variant in variants:
        await run_variant(node, report, variant)
