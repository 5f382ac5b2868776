"""The checks, in order, and the figures; run inside the node's namespaces (see node.py).

For each plugin pod template (``plugin``: manifests/base; ``plugin-hardened``:
manifests/overlays/hardened), through kubelet's pod-resources API, kubelet's HTTPS API, the
pods themselves and /proc:

1. the plugin's static pod starts, kubelet has 16 allocatable devices, the pod becomes ready, and
   the kernel enforces the container's security context as the manifest writes it;
2. consumer-1 (manifests/examples/confidential-app, one share) runs; inside it /dev/sev-guest is
   a character device it can write, and /var/run/pcc is the node's directory (same inode; a file
   written on either side is read on the other);
3. consumers 2 to 16 run, holding 16 distinct devices; consumer-17 is refused by kubelet's
   admission (all 16 shares are held) and never gets a container; 2 to 17 are removed again;
4. kubelet is restarted three times: 16 allocatable again each time, and consumer-1 keeps its
   container and its device, which it can still write;
5. the race (issue 26): kubelet is restarted N times, by SIGKILL and SIGTERM in turn, and each
   time a consumer is written into staticPodPath the moment kubelet logs that its device plugin
   registration server starts; kubelet must admit every one (it admits at once, and a pod it
   admits before the plugin has registered and listed its devices fails for good with
   UnexpectedAdmissionError). The pods stay until the check ends, as in the issue's measurement
   (kubelet comes back with more to do each round); with --race-pods=removed each round's pod
   goes before the next, so kubelet comes back to a near-empty node. Figures per round from
   kubelet's own log;
6. the plugin's container is killed: kubelet starts a new one, which registers again (16
   allocatable) and becomes ready;
7. the device node is removed: 0 allocatable; kubelet's readiness probe keeps the plugin ready, as
   docs/deploy.md says (/readyz is about registration, not the device); restored: 16 again.

Then the Go yardstick (``yardstick``, pods.yardstick_pod) in the plugin's place, through 1 to 3
(without the readiness probe) and 5, so that the race's figures have a floor beside them.

Each variant after the first runs on a node reset to no pods (harness.reset_node): kubelet starts
a static pod only when it is done with an earlier one of the same namespace and name, which can
take a minute of its garbage collection. Each variant's consumers are in a namespace of their own
(``<variant>-consumers``). Polls (kubelet has no watch on these APIs) use poll.wait_for; every
wait has a timeout.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import trio

from . import api, kubelet_log, legs, pods
from .api import PodRef
from .node import NODE_IP, NODE_NAME, Daemon, Node
from .poll import wait_for
from .report import Report, now

RESOURCE = "tke.cloud.tencent.com/pcc-device"
SHARES = 16
DEVICE = Path("/dev/sev-guest")
# The fake device: the same major and minor as /dev/null, so writes go nowhere.
DEVICE_NUMBER = os.makedev(1, 3)
PCC_DIR = Path("/var/run/pcc")
PLUGIN = PodRef("kube-system", "pcc-device-plugin")
VARIANTS = ("plugin", "plugin-hardened")
# Not a variant of ours: the Go yardstick (pods.yardstick_pod), through checks 1 to 3 and the
# race, so that the race's figures have a floor beside them (docs/e2e.md). Its refused pods are
# figures, not failures.
YARDSTICK = "yardstick"
RUN_BY_DEFAULT = (*VARIANTS, YARDSTICK)
KUBELET_RESTARTS = 3
# The race's rounds start this far apart, as in issue 26's measurement (2 to 3 s): a kubelet
# that restarts faster than that is in a crash loop, which is another matter.
RACE_PACE = 2.5
METRICS_PORT = 8080


def make_device() -> None:
    os.mknod(DEVICE, 0o666 | stat.S_IFCHR, DEVICE_NUMBER)
    os.chmod(DEVICE, 0o666)


def make_node_files() -> None:
    """The fake SEV-SNP device and the PCC directory, in the namespace's /dev and /run overlays."""
    make_device()
    PCC_DIR.mkdir(mode=0o755)


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
    ref: PodRef, container: str, not_id: str | None = None, within: float = 120
) -> tuple[api.Obj, float]:
    """Wait until kubelet reports `container` of `ref` running (with another ID than `not_id`);
    (its container status, when seen)."""

    async def probe() -> api.Obj | None:
        pod = await api.pod(ref)
        status = pod and api.container_status(pod, container)
        if status and "running" in status.get("state", {}) and status.get("containerID"):
            return status if status["containerID"] != not_id else None
        return None

    return await wait_for(f"{ref}/{container} running", probe, within)


async def ready(ref: PodRef, container: str, within: float) -> tuple[api.Obj, float]:
    async def probe() -> api.Obj | None:
        pod = await api.pod(ref)
        status = pod and api.container_status(pod, container)
        return status if status and status.get("ready") else None

    return await wait_for(f"{ref}/{container} ready", probe, within)


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


async def remove_pod(node: Node, ref: PodRef) -> None:
    """Remove static pod `ref` and wait until kubelet has dropped it (its containers stop
    later: the example's sleep takes its 30 s grace period)."""
    node.remove_static_pod(ref.namespace, ref.name)

    async def gone() -> bool | None:
        return None if await api.pod(ref) else True

    await wait_for(f"{ref} dropped", gone, 60)


def process_security(pid: int) -> dict[str, str]:
    """What the kernel enforces on process `pid`: user, capabilities, no_new_privs, seccomp,
    root mount, SELinux context; and whether this machine has SELinux at all."""
    status = dict(
        line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if ":\t" in line
    )  # fmt: skip
    root = next(
        line.split()[5].split(",")[0]
        for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()
        if line.split()[4] == "/"
    )
    try:
        selinux = Path(f"/proc/{pid}/attr/current").read_text().strip("\0\n") or "none"
    except OSError as error:
        selinux = f"none ({error.strerror})"
    return {
        "uid": status["Uid"].split()[0],
        "CapEff": status["CapEff"].strip(),
        "CapBnd": status["CapBnd"].strip(),
        "NoNewPrivs": status["NoNewPrivs"].strip(),
        "Seccomp": {"0": "off", "1": "strict", "2": "filter"}[status["Seccomp"].strip()],
        "root": root,
        "SELinux": selinux,
        "host SELinux": "enabled" if Path("/sys/fs/selinux/enforce").exists() else "absent",
    }


@attrs.frozen
class RaceRound:
    """One round of the race: what happened to the pod, and the restart's steps (legs.Restart)
    from the plugin's log and kubelet's. `written` and `pod_added` are epoch times, None when
    not seen."""

    number: int
    signal: str
    admitted: bool
    reason: str
    restart: legs.Restart
    written: float | None
    pod_added: float | None

    @classmethod
    async def read(
        cls, number: int, signal: str, pod: api.Obj, written_at: list[float], kubelet: Daemon,
        ref: PodRef, samples: legs.Samples | None,
    ) -> RaceRound:  # fmt: skip
        restart = await legs.read_restart(kubelet, plugin_log, RESOURCE, SHARES, samples)
        lines = kubelet_log.lines_of_start(kubelet.log, kubelet.starts)
        added = kubelet_log.first(lines, kubelet_log.POD_ADDED, ref.full, after=restart.server)
        status = pod["status"]
        return cls(
            number=number,
            signal=signal,
            admitted=status.get("phase") != "Failed",
            reason=f"{status.get('reason')}: {status.get('message')}",
            restart=restart,
            written=written_at[0] if written_at else None,
            pod_added=None if added is None else added.seconds,
        )

    def describe(self) -> str:
        restart = self.restart

        def since(instant: float | None) -> str:
            return legs.ms(None if instant is None else instant - restart.created)

        outcome = "admitted" if self.admitted else f"REFUSED ({self.reason})"
        retried = (
            f", refused by kubelet, sent again {since(restart.register_taken)}"
            if restart.register_taken != restart.register_sent
            else ""
        )
        line = (
            f"race round {self.number} (kubelet {self.signal}): consumer {outcome}; after "
            f"kubelet.sock appeared: consumer written {since(self.written)}, Register sent "
            f"{since(restart.register_sent)}{retried} (read by kubelet "
            f"{since(restart.register_read)}), "
            f"kubelet took the pod {since(self.pod_added)}, list sent "
            f"{legs.ms(restart.list_leg)} after kubelet went on to open the stream (dial-in → "
            f"that {legs.ms(restart.kubelet_turn)}; the plugin idle {legs.ms(restart.list_idle)} "
            f"of it), devices processed {since(restart.processed)}; "
            f"the plugin waited for a CPU {legs.ms(restart.register_wait)} in its register leg, "
            f"{legs.ms(restart.list_wait)} in its list leg, {legs.ms(restart.cpu_wait)} in all "
            f"(on a CPU {legs.ms(restart.cpu_used)})"
        )
        if not self.admitted:
            line += f"; {legs.why_refused(restart, self.pod_added)}"
        return line


async def plugin_log() -> Path:
    """The plugin's running container's log (or the yardstick's)."""
    pod = await api.pod(PLUGIN)
    status = pod and api.container_status(pod, pods.PLUGIN_CONTAINER)
    if pod is None or status is None:
        raise AssertionError(f"{PLUGIN}: kubelet reports no {pods.PLUGIN_CONTAINER} container")
    # A static pod's name ends in the node's.
    metadata = pod["metadata"]
    return legs.container_log(metadata["namespace"], metadata["name"], metadata["uid"],
                              pods.PLUGIN_CONTAINER, status.get("restartCount", 0))  # fmt: skip


@attrs.define
class Variant:
    """One run of the plugin from one pod template, with its consumers."""

    node: Node
    report: Report
    name: str
    race_rounds: int
    race_pods_removed: bool
    yardstick: Path | None = None

    def consumer(self, number: int) -> PodRef:
        return PodRef(f"{self.name}-consumers", f"consumer-{number}")

    async def in_consumer(self, number: int, *argv: str) -> str:
        return await api.run_in_container(self.consumer(number), pods.CONSUMER_CONTAINER, *argv)

    def start_consumer(self, number: int) -> None:
        ref = self.consumer(number)
        pod = pods.consumer_pod(ref.namespace, ref.name)
        self.node.put_static_pod(ref.namespace, ref.name, pods.dump(pod))

    async def held_by_consumers(self) -> dict[int, list[str]]:
        """consumer number -> device IDs, per pod-resources List."""
        namespace, suffix = self.consumer(0).namespace, f"-{NODE_NAME}"
        return {
            int(pod.removesuffix(suffix).removeprefix("consumer-")): ids
            for (pod_namespace, pod, _), ids in (await api.assigned(RESOURCE)).items()
            if pod_namespace == namespace
        }

    async def run(self) -> None:
        self.report.variant = self.name
        if self.yardstick is not None:
            print(f"\n===== {self.name}: {self.yardstick}", flush=True)
            await self.plugin_started(pods.yardstick_pod(self.yardstick), probed=False)
            await self.consumers()
            await self.race(self.race_rounds)
            return
        print(f"\n===== {self.name}: {pods.MANIFESTS / self.name}", flush=True)
        status = await self.plugin_started(pods.plugin_pod(self.name))
        await self.check_security(status)
        consumer = await self.consumers()
        await self.kubelet_restarts(consumer)
        await self.race(self.race_rounds)
        status, _ = await running(PLUGIN, pods.PLUGIN_CONTAINER)
        await self.plugin_killed(status)
        await self.device_removed()

    async def plugin_started(self, pod: api.Obj, probed: bool = True) -> api.Obj:
        written = now()
        self.node.put_static_pod(PLUGIN.namespace, PLUGIN.name, pods.dump(pod))
        ids, allocatable_at = await wait_allocatable("plugin started", SHARES)
        expect(len(set(ids)) == SHARES, f"device IDs are not distinct: {ids}")
        status, _ = await running(PLUGIN, pods.PLUGIN_CONTAINER)
        started = process_start(await task_pid(self.node, status))
        self.report.figure("plugin manifest written → plugin process started", started - written)
        self.report.figure("plugin process started → 16 allocatable", allocatable_at - started)
        self.report.check(f"{SHARES} allocatable {RESOURCE} ({ids[0]} ... {ids[-1]})")
        if not probed:
            return status
        _, ready_at = await ready(PLUGIN, pods.PLUGIN_CONTAINER, within=60)
        self.report.figure("plugin process started → pod ready", ready_at - started)
        self.report.check("the plugin's pod is ready (kubelet's readiness probe on /readyz)")
        return status

    async def check_security(self, status: api.Obj) -> None:
        """The container's security context as the kernel enforces it, against the manifest."""
        found = process_security(await task_pid(self.node, status))
        context = pods.plugin_pod(self.name)["spec"]["containers"][0]["securityContext"]
        self.report.note(f"the plugin's process: {', '.join(f'{k}={v}' for k, v in found.items())}")
        if context.get("privileged"):
            expect(found["CapEff"] == found["CapBnd"] != "0" * 16, f"privileged, but {found}")
            self.report.check("privileged: every capability of the bounding set")
            return
        expect(
            found["uid"] == str(context["runAsUser"])
            and found["CapEff"] == "0" * 16
            and found["NoNewPrivs"] == "1"
            and found["Seccomp"] == "filter"
            and found["root"] == "ro",
            f"hardened, but the kernel enforces {found}",
        )
        self.report.check(
            f"hardened as the manifest asks: UID {found['uid']}, no capabilities, no_new_privs, "
            "seccomp filter (RuntimeDefault), read-only root"
        )
        selinux = context.get("seLinuxOptions", {}).get("type")
        if selinux and selinux not in found["SELinux"]:
            self.report.note(
                f"seLinuxOptions.type {selinux} is not enforced: SELinux on this machine: "
                f"{found['host SELinux']}; containerd runs with enable_selinux = false; the "
                f"process's context: {found['SELinux']}"
            )

    async def check_device_in_consumer(self, number: int) -> None:
        kind = (await self.in_consumer(number, "stat", "-c", "%F", str(DEVICE))).strip()
        expect(kind == "character special file", f"consumer-{number}: {DEVICE} is a {kind!r}")
        numbers = (await self.in_consumer(number, "stat", "-c", "%t:%T", str(DEVICE))).strip()
        expected = f"{os.major(DEVICE_NUMBER):x}:{os.minor(DEVICE_NUMBER):x}"
        expect(numbers == expected, f"consumer-{number}: {DEVICE} is {numbers}, not {expected}")
        await self.in_consumer(number, "sh", "-c", f"echo>{DEVICE}")
        self.report.check(
            f"consumer-{number}: {DEVICE} is a character device ({numbers}) it can write"
        )

    async def check_pcc_dir_in_consumer(self, number: int) -> None:
        node_side = os.stat(PCC_DIR)
        inode = f"{node_side.st_dev}:{node_side.st_ino}"
        inside = (await self.in_consumer(number, "stat", "-L", "-c", "%d:%i", str(PCC_DIR))).strip()
        expect(inside == inode, f"consumer-{number}: {PCC_DIR} is {inside}, the node's {inode}")
        nonce = secrets.token_hex(8)
        (PCC_DIR / f"from-node-{nonce}").write_text(nonce)
        read = await self.in_consumer(number, "cat", f"{PCC_DIR}/from-node-{nonce}")
        expect(read == nonce, f"consumer-{number} read {read!r} from the node's file")
        written = PCC_DIR / f"from-{self.name}-consumer-{number}-{nonce}"
        await self.in_consumer(number, "touch", str(written))
        expect(written.exists(), f"the file consumer-{number} wrote is not in the node's {PCC_DIR}")
        self.report.check(
            f"consumer-{number}: {PCC_DIR} is the node's directory (inode {inside}); "
            "a file written on each side is read on the other"
        )

    async def consumers(self) -> str:
        """consumer-1 to 16 run, consumer-17 is refused; consumer-1 stays; its container ID."""
        written = now()
        self.start_consumer(1)
        _, running_at = await running(self.consumer(1), pods.CONSUMER_CONTAINER)
        self.report.figure("consumer manifest written → consumer running", running_at - written)
        held = await self.held_by_consumers()
        expect(len(held.get(1, [])) == 1, f"consumer-1 holds {held.get(1)} per pod-resources")
        self.report.check(f"consumer-1 runs and holds one device ({held[1][0]}) per pod-resources")
        await self.check_device_in_consumer(1)
        await self.check_pcc_dir_in_consumer(1)

        written = now()
        for number in range(2, SHARES + 1):
            self.start_consumer(number)
        async with trio.open_nursery() as nursery:
            for number in range(2, SHARES + 1):
                nursery.start_soon(running, self.consumer(number), pods.CONSUMER_CONTAINER)
        self.report.figure("15 consumer manifests written → all running", now() - written)
        held = await self.held_by_consumers()
        devices = {device for ids in held.values() for device in ids}
        expect(
            sorted(held) == list(range(1, SHARES + 1)) and len(devices) == SHARES,
            f"pod-resources List: {held}",
        )
        self.report.check(f"{SHARES} consumers run, holding {SHARES} distinct devices")

        extra = self.consumer(SHARES + 1)
        written = now()
        self.start_consumer(SHARES + 1)

        async def refused() -> api.Obj | None:
            pod = await api.pod(extra)
            return pod if pod and pod.get("status", {}).get("phase") == "Failed" else None

        pod, refused_at = await wait_for(f"{extra} refused", refused, 60)
        status = pod["status"]
        self.report.figure("17th consumer manifest written → refused", refused_at - written)
        expect(
            not any("running" in s.get("state", {}) for s in status.get("containerStatuses", [])),
            f"{extra} has a running container: {status}",
        )
        expect(SHARES + 1 not in await self.held_by_consumers(), f"{extra} holds a device")
        self.report.check(f"consumer-{SHARES + 1} refused: no container, no device")
        self.report.note(
            f"17th consumer: phase Failed, {status.get('reason')}: {status.get('message')}"
        )

        async with trio.open_nursery() as nursery:
            for number in range(2, SHARES + 2):
                nursery.start_soon(remove_pod, self.node, self.consumer(number))
        first, _ = await running(self.consumer(1), pods.CONSUMER_CONTAINER)
        return container_id(first)

    async def kubelet_restarts(self, consumer_container: str) -> None:
        (device,) = (await self.held_by_consumers())[1]
        for restart in range(1, KUBELET_RESTARTS + 1):
            await self.node.kubelet.stop()
            await self.node.kubelet.start()
            _, allocatable_at = await wait_allocatable(f"kubelet restart {restart}", SHARES)
            self.report.figure(
                f"kubelet restart {restart}: kubelet started → 16 allocatable",
                allocatable_at - self.node.kubelet.started_at,
            )
            status, _ = await running(self.consumer(1), pods.CONSUMER_CONTAINER, within=60)
            expect(
                container_id(status) == consumer_container and status.get("restartCount") == 0,
                f"consumer-1's container changed: {status}",
            )
            held = (await self.held_by_consumers()).get(1)
            expect(held == [device], f"consumer-1 holds {held} after the restart, not [{device}]")
            await self.check_device_in_consumer(1)
            self.report.check(
                f"kubelet restart {restart}: {SHARES} allocatable; consumer-1 kept its container "
                f"and device {device}"
            )

    async def race(self, rounds: int) -> None:
        """Issue 26's race on the real kubelet, judged by what the plugin does in it: its two
        legs of each kubelet restart within their bounds (legs.py), read from its log and
        kubelet's. The consumers admitted or refused are figures, each refused one attributed.
        All rounds run; a failed check fails the session at its end."""
        namespace = f"{self.name}-race"
        status, _ = await running(PLUGIN, pods.PLUGIN_CONTAINER)
        pid = await task_pid(self.node, status)
        outcomes: list[RaceRound] = []
        for number in range(1, rounds + 1):
            paced = trio.current_time() + RACE_PACE
            outcomes.append(await self.race_round(namespace, number, pid))
            await trio.sleep_until(paced)
        await trio.to_thread.run_sync(
            shutil.copyfile, await plugin_log(), self.node.logs / f"race-{self.name}-plugin.log"
        )
        restarts = [o.restart for o in outcomes]
        self.race_figures(outcomes)
        admitted = [o for o in outcomes if o.admitted]
        whose = [f"round {o.number}: {legs.why_refused(o.restart, o.pod_added)}"
                 for o in outcomes if not o.admitted]  # fmt: skip
        self.report.note(
            f"race: {len(admitted)} of {rounds} consumers admitted, {rounds - len(admitted)} "
            f"refused ({sum(o.signal == 'SIGKILL' for o in outcomes)} kubelet SIGKILLs, "
            f"{sum(o.signal == 'SIGTERM' for o in outcomes)} SIGTERMs)"
            + "".join(f"; {line}" for line in whose)
        )
        if not self.race_pods_removed:
            async with trio.open_nursery() as nursery:
                for number in range(1, rounds + 1):
                    nursery.start_soon(remove_pod, self.node, PodRef(namespace, f"race-{number}"))
        problems = legs.over_bounds(restarts)
        if self.yardstick is not None:
            for problem in problems:
                self.report.note(f"race: the yardstick's {problem} (a figure, not a check)")
            return
        for problem in problems:
            # The checks after this one still run: the session fails at its end.
            self.report.fail(f"race: {problem} (the round lines above say when what came)")
        if not problems:
            self.report.check(
                f"race: over {rounds} kubelet restarts, {legs.within_bounds(restarts)}"
            )

    def race_figures(self, outcomes: list[RaceRound]) -> None:
        """The legs' figures, the pods', and every round's instants in race-<variant>.jsonl
        beside the logs."""
        restarts = [o.restart for o in outcomes]
        for attribute, name, span, _ in legs.LEGS:
            values = [v for r in restarts if (v := getattr(r, attribute)) is not None]
            if values:
                label = f"race: the plugin's {name}, {span}"
                self.report.figure(f"{label} (median)", statistics.median(values))
                self.report.figure(f"{label} (p99)", legs.p99(values))
                judged = legs.judged(restarts, attribute)
                self.report.figure(f"race: the plugin's {name}, its own part (p99)",
                                   legs.p99(judged))  # fmt: skip
        for attribute, label in (
            ("register_wait", "waiting for a CPU in its register leg (max)"),
            ("list_wait", "waiting for a CPU in its list leg (max)"),
            ("cpu_wait", "waiting for a CPU, kubelet.sock created → devices processed (max)"),
            ("cpu_used", "on a CPU, kubelet.sock created → devices processed (median)"),
        ):
            values = [v for r in restarts if (v := getattr(r, attribute)) is not None]
            if values:
                figure = statistics.median if label.endswith("(median)") else max
                self.report.figure(f"race: the plugin {label}", figure(values))
        for name, label in legs.KUBELET_LEGS.items():
            values = [v for r in restarts if (v := getattr(r, name)) is not None]
            if values:
                self.report.figure(f"race: {label} (median)", statistics.median(values))
                self.report.figure(f"race: {label} (max)", max(values))
        taken = [o.pod_added - o.restart.created for o in outcomes if o.pod_added is not None]
        if taken:
            label = "race: kubelet.sock created → kubelet took the pod"
            self.report.figure(f"{label} (median)", statistics.median(taken))
            self.report.figure(f"{label} (min)", min(taken))
        self.report.count("race: consumers admitted", sum(o.admitted for o in outcomes))
        self.report.count("race: consumers refused", sum(not o.admitted for o in outcomes))
        with (self.node.logs / f"race-{self.name}.jsonl").open("a") as out:
            for outcome in outcomes:
                out.write(json.dumps(attrs.asdict(outcome)) + "\n")

    async def race_round(self, namespace: str, number: int, pid: int) -> RaceRound:
        """One kubelet restart with a consumer written as its registration server starts; the
        plugin (process `pid`) sampled for its waits for a CPU meanwhile."""
        ref = PodRef(namespace, f"race-{number}")
        manifest = pods.dump(pods.consumer_pod(ref.namespace, ref.name))
        written_at: list[float] = []

        def write_consumer() -> None:
            written_at.append(time.time())
            self.node.put_static_pod(ref.namespace, ref.name, manifest)

        kubelet = self.node.kubelet
        signal_name = "SIGKILL" if number % 2 else "SIGTERM"
        sampler = legs.Sampler(pid)
        await sampler.start()
        await (kubelet.kill() if signal_name == "SIGKILL" else kubelet.stop())
        kubelet.forget_actions()
        kubelet.on_line(write_consumer, kubelet_log.REGISTRATION_SERVER)
        await kubelet.start()

        async def settled() -> api.Obj | None:
            pod = await api.pod(ref)
            status = (pod or {}).get("status", {})
            if status.get("phase") == "Failed":
                return pod
            container = pod and api.container_status(pod, pods.CONSUMER_CONTAINER)
            return pod if container and "running" in container.get("state", {}) else None

        pod, _ = await wait_for(f"{ref} admitted or refused", settled, 60)
        await wait_allocatable(
            f"race round {number}: the plugin registered with the new kubelet", SHARES
        )
        samples = await sampler.stop()
        outcome = await RaceRound.read(number, signal_name, pod, written_at, kubelet, ref, samples)
        self.report.say("TIME", outcome.describe())
        if self.race_pods_removed:
            await remove_pod(self.node, ref)
        return outcome

    async def plugin_killed(self, status: api.Obj) -> None:
        old = container_id(status)
        killed = now()
        await self.node.ctr("tasks", "kill", "--signal", "SIGKILL", old)
        try:
            _, zero_at = await wait_allocatable("plugin killed", 0, within=10)
            self.report.figure("plugin killed → 0 allocatable", zero_at - killed)
        except AssertionError:
            self.report.note("0 allocatable was not seen after the kill")
        new, _ = await running(PLUGIN, pods.PLUGIN_CONTAINER, not_id=status["containerID"])
        started = process_start(await task_pid(self.node, new))
        _, allocatable_at = await wait_allocatable("plugin restarted by kubelet", SHARES)
        self.report.figure("plugin killed → new plugin process started", started - killed)
        self.report.figure("new plugin process started → 16 allocatable", allocatable_at - started)
        expect(new.get("restartCount", 0) >= 1, f"restartCount: {new}")
        self.report.check(
            f"plugin container {old[:12]} killed; kubelet started {container_id(new)[:12]} "
            f"(restartCount {new['restartCount']}), which registered again: {SHARES} allocatable"
        )
        _, ready_at = await ready(PLUGIN, pods.PLUGIN_CONTAINER, within=60)
        self.report.figure("new plugin process started → pod ready", ready_at - started)
        self.report.check("the new plugin container is ready")

    async def device_removed(self) -> None:
        before = await api.probe_results(PLUGIN, "Readiness")
        removed = now()
        await trio.Path(DEVICE).unlink()
        _, zero_at = await wait_allocatable("device removed", 0, within=30)
        self.report.figure("device removed → 0 allocatable", zero_at - removed)
        self.report.check(f"{DEVICE} removed: 0 allocatable")
        # Kubelet probes every 10 s: wait for one probe after the devices went unhealthy.
        probed = sum((await api.probe_results(PLUGIN, "Readiness")).values())

        async def next_probe() -> dict[str, float] | None:
            counts = await api.probe_results(PLUGIN, "Readiness")
            return counts if sum(counts.values()) > probed else None

        after, _ = await wait_for(f"{PLUGIN}: the next readiness probe", next_probe, 30)
        failed = after.get("failed", 0) - before.get("failed", 0)
        pod = await api.pod(PLUGIN) or {}
        plugin = api.container_status(pod, pods.PLUGIN_CONTAINER) or {}
        code, body = await api.http_get(f"http://{NODE_IP}:{METRICS_PORT}/readyz")
        _, metrics = await api.http_get(f"http://{NODE_IP}:{METRICS_PORT}/metrics")
        unhealthy = [
            line for line in metrics.splitlines()
            if line.startswith("pcc_device_plugin_devices{") and 'health="Unhealthy"' in line
        ]  # fmt: skip
        self.report.note(
            f"device removed: readiness probes failed since: {failed:.0f}; pod Ready="
            f"{api.condition(pod, 'Ready')}, container ready={plugin.get('ready')}; /readyz "
            f"answers {code} {body.strip()!r}; {' '.join(unhealthy)}"
        )
        expect(
            code == 200 and failed == 0 and plugin.get("ready") is True,
            "docs/deploy.md: readiness says nothing about the device (registered and stream open "
            f"is ready); observed /readyz {code} {body.strip()!r}, ready={plugin.get('ready')}",
        )
        self.report.check(
            "the readiness probe still passes with the device gone (/readyz 200), as "
            "docs/deploy.md says: readiness is about registration; the devices are Unhealthy"
        )
        restored = now()
        await trio.to_thread.run_sync(make_device)
        _, back_at = await wait_allocatable("device restored", SHARES, within=30)
        self.report.figure("device restored → 16 allocatable", back_at - restored)
        self.report.check(f"{DEVICE} restored: {SHARES} allocatable")


async def run(
    node: Node,
    report: Report,
    variants: list[str],
    race_rounds: int,
    race_pods_removed: bool,
    reset: Callable[[], Awaitable[None]],
    yardstick: Path | None = None,
) -> None:
    """Each variant on a node without pods (`reset` clears it between two); the yardstick's
    binary for the variant named YARDSTICK."""
    for number, name in enumerate(variants):
        if number:
            await reset()
        binary = yardstick if name == YARDSTICK else None
        await Variant(node, report, name, race_rounds, race_pods_removed, binary).run()
