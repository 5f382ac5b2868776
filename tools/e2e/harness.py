"""PID 1 of the node's namespaces: set the node up, run the checks, tear everything down.

The e2e (``--session e2e``): containerd and a standalone kubelet, then scenario.py. The cluster
(``--session cluster``): containerd, the control plane (control_plane.py) and kubelet joining
it, then cluster.py. The first SIGINT or SIGTERM cancels the checks; the tear-down then runs
shielded, with a timeout on each step, and later signals are ignored. Whatever it does not stop,
the kernel kills when this process exits.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio

from . import CLUSTER_STAGES, api, cluster_dra, fleet_checks, kube, pods, scenario
from . import fleet as fleet_
from .cluster import CONSUMERS, REPOSITORY, SYSTEM, Cluster, administer, condition
from .control_plane import ControlPlane
from .node import CONTAINERD_SOCKET, NODE_NAME, Node, privatise
from .poll import wait_for
from .report import Report, now


async def _cancel_on_signal(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            if not scope.cancel_called:
                print(f"e2e: {signal.Signals(signum).name}: stopping", flush=True)
                scope.cancel()


async def _containerd_answers(node: Node) -> bool | None:
    node.containerd.check_running()
    try:
        await node.ctr("version", within=5)
    except RuntimeError:
        return None
    return True


async def _kubelet_answers(node: Node) -> bool | None:
    node.kubelet.check_running()
    await api.allocatable(scenario.RESOURCE)
    return True


async def start_containerd(node: Node) -> None:
    await node.containerd.start()
    await wait_for(f"containerd on {node.name}'s {CONTAINERD_SOCKET}",
                   lambda: _containerd_answers(node), 30)  # fmt: skip


async def start_kubelet(node: Node) -> None:
    await node.kubelet.start()
    await wait_for("kubelet's pod-resources API", lambda: _kubelet_answers(node), 60)


async def start_containerd_with_images(
    node: Node,
    args: argparse.Namespace,
    report: Report,
    plugin_names: set[str],
    consumer_names: set[str],
) -> None:
    """containerd, with the pause image, the plugin's image also as `plugin_names`, and the
    consumers' busybox image as `consumer_names`."""
    node.write_containerd_config(args.pause_reference)
    started = now()
    await start_containerd(node)
    # Node A's figures keep their names; the fleet's members' say theirs.
    on = "" if node.name == NODE_NAME else f"{node.name}: "
    report.figure(f"{on}containerd started → answers", now() - started)
    started = now()
    for archive in (args.pause_image, args.consumer_image, args.plugin_image):
        await node.ctr("images", "import", archive, within=300)
    for source, names in ((args.plugin_reference, plugin_names),
                          (args.consumer_reference, consumer_names)):  # fmt: skip
        for reference in sorted(names - {source}):
            await node.ctr("images", "tag", "--force", source, reference)
    report.figure(f"{on}images imported into containerd", now() - started)


async def start_node(node: Node, args: argparse.Namespace, report: Report) -> None:
    # Each image under every name the rendered pods use.
    plugin = set().union(*(pods.images(pods.plugin_pod(v)) for v in scenario.VARIANTS))
    consumer = pods.images(pods.consumer_pod("default", "consumer"))
    await start_containerd_with_images(node, args, report, plugin, consumer)
    await start_kubelet(node)
    report.figure("kubelet started → pod-resources answers", now() - node.kubelet.started_at)


async def reset_node(node: Node) -> None:
    """A node with no pods, images kept: kubelet stopped, every static pod file, container and
    sandbox removed, containerd restarted (its CRI state reloaded), kubelet started again.

    Between two variants: kubelet starts a static pod only when it is done with the earlier one
    of the same name, which takes up to a minute of its garbage collection.
    """
    await node.kubelet.stop()
    node.remove_all_static_pods()
    await node.delete_all_containers()
    await node.containerd.stop()
    await start_containerd(node)
    await start_kubelet(node)


async def tear_down(
    node: Node, control_plane: ControlPlane | None, fleet: fleet_.Fleet | None = None
) -> None:
    """Stop kubelet, every container, containerd (of each node of the fleet too), the control
    plane: each step bounded, each failure reported."""
    nodes = [node] if fleet is None else list(fleet.nodes.values())
    steps: list[tuple[str, Callable[[], Awaitable[object]]]] = []
    for each in nodes:
        steps += [
            (f"stop kubelet on {each.name}", each.kubelet.stop),
            (f"stop the containers on {each.name}", each.stop_all_containers),
            (f"stop containerd on {each.name}", each.containerd.stop),
        ]
    if control_plane is not None:
        steps.append(("stop the control plane", control_plane.stop))
    if fleet is not None:
        steps.append(("release the fleet's namespaces", fleet.release))
    for step, action in steps:
        try:
            with trio.fail_after(60):
                await action()
        except Exception as error:  # report it and go on: the kernel does the rest
            print(f"e2e: tear-down: {step}: {error!r}", file=sys.stderr, flush=True)


def check_failures(error: Exception) -> list[AssertionError]:
    """The failed checks that `error` is, alone or grouped by nurseries; [] if it is anything
    else too (a bug of the checks, shown with its traceback)."""
    if isinstance(error, AssertionError):
        return [error]
    if isinstance(error, ExceptionGroup):
        failures, rest = error.split(AssertionError)
        if failures is not None and rest is None:
            return [leaf for group in failures.exceptions for leaf in check_failures(group)]
    return []


def keep_pod_logs(logs: Path, nodes: list[Node]) -> None:
    """Every container's log as each node's kubelet kept it (/var/log/pods is private to the
    node): node A's in `logs`/pods, the fleet's in `logs`/<node>/pods. `python -m e2e` removes
    them with the rest after a run that passed, unless --keep-logs."""
    for node in nodes:
        source = node.see(Path("/var/log/pods"))
        target = logs / "pods" if node.name == NODE_NAME else logs / node.name / "pods"
        if source.is_dir():
            shutil.copytree(source, target, symlinks=False, dirs_exist_ok=True)


async def run_cluster(
    fleet: fleet_.Fleet,
    control_plane: ControlPlane,
    report: Report,
    plugin_reference: str,
    stages: tuple[str, ...] = CLUSTER_STAGES,
) -> None:
    """The control plane and every node's kubelet started, then the stages: ``node`` checks 1 to
    8 on node A, ``fleet`` the device plugin on the whole fleet (fleet_checks.py), ``dra`` check 9
    on node A, ``fleet-dra`` the DRA driver on the whole fleet."""
    node = fleet.a
    report.variant = report.column = "cluster"
    for name, seconds in (await control_plane.start()).items():
        report.figure(f"{name} started → answers", seconds)
    await start_kubelet(node)
    for member in fleet.members.values():
        await member[1].kubelet.start()
    cluster_api = kube.Api(control_plane)
    watches = {
        name: kube.Watch(cluster_api, path)
        for name, path in (
            ("pods", "/api/v1/pods"),
            ("nodes", "/api/v1/nodes"),
            ("daemonsets", f"/apis/apps/v1/namespaces/{SYSTEM}/daemonsets"),
            ("slices", "/apis/resource.k8s.io/v1/resourceslices"),
            ("claims", "/apis/resource.k8s.io/v1/resourceclaims"),
        )
    }
    async with trio.open_nursery() as nursery:
        for watch in watches.values():
            await nursery.start(watch.run)

        def all_ready() -> dict[str, str] | None:
            versions = {}
            for name in fleet.nodes:
                found = watches["nodes"].current.get(f"/{name}")
                if found is None or not condition(found, "Ready"):
                    return None
                versions[name] = found["status"]["nodeInfo"]["kubeletVersion"]
            return versions

        versions = await watches["nodes"].until("every Node of the fleet Ready", all_ready, 120)
        report.figure("kubelet started → Node Ready", now() - node.kubelet.started_at)
        await administer(cluster_api)
        report.check(
            f"the cluster: {len(versions)} Nodes Ready ("
            + ", ".join(f"{name} kubelet {version}" for name, version in versions.items())
            + f"); kube-system at PodSecurity privileged, {CONSUMERS} at the default, baseline"
        )
        manifests = node.state / "operator" / "manifests"
        shutil.copytree(REPOSITORY / "manifests", manifests)
        checks = Cluster(
            node, control_plane, report, cluster_api, watches["pods"], watches["nodes"],
            watches["daemonsets"], manifests, plugin_reference,
        )  # fmt: skip
        if "node" in stages:
            await checks.install()
            await checks.consumers()
            await checks.rollouts()
            await checks.overlays()
            await checks.observability()
            await checks.kubelet_restarts()
            await cluster_dra.migrate_and_back(checks, watches["slices"], watches["claims"])
            await checks.uninstall()
        if "fleet" in stages:
            await fleet_checks.device_plugin(checks, fleet)
        if "dra" in stages:
            await cluster_dra.run(checks, watches["slices"], watches["claims"])
        if "fleet-dra" in stages:
            await fleet_checks.dra(checks, fleet, watches["slices"], watches["claims"])
        nursery.cancel_scope.cancel()


async def main(args: argparse.Namespace) -> int:
    state, logs = Path(args.state), Path(args.logs)
    privatise(state)
    scenario.make_node_files()
    report = Report(variant="node")
    outcome = "cancelled"
    started = time.monotonic()
    with trio.CancelScope() as work:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_signal, work)
            control_plane = None
            if args.session == "cluster":
                control_plane = ControlPlane(state, logs, Path(args.control_plane), Path(args.etcd))
            node = Node(
                state, logs, Path(args.kubelet), Path(args.containerd), Path(args.runc), nursery,
                kubeconfig=None if control_plane is None else control_plane.kubelet_kubeconfig,
                client_ca=None if control_plane is None else control_plane.pki.ca.certificate,
            )  # fmt: skip
            fleet: fleet_.Fleet | None = None
            try:
                if control_plane is None:
                    await start_node(node, args, report)
                    await scenario.run(
                        node, report, args.variant or list(scenario.VARIANTS), args.race,
                        args.race_pods == "removed", reset=lambda: reset_node(node),
                        yardstick=args.yardstick and Path(args.yardstick),
                    )  # fmt: skip
                else:
                    node.write_cni_config()
                    kubelets = {"kubelet": node.kubelet_binary,
                                "kubelet-1.35": Path(args.kubelet_1_35)}  # fmt: skip
                    fleet = await fleet_.open_fleet(node, control_plane, state, logs, kubelets,
                                                   nursery)  # fmt: skip
                    consumer_images = pods.images(pods.cluster_consumer_pod())
                    async with trio.open_nursery() as starting:
                        for each in fleet.nodes.values():
                            starting.start_soon(
                                start_containerd_with_images, each, args, report, set(),
                                consumer_images,
                            )  # fmt: skip
                    await run_cluster(fleet, control_plane, report, args.plugin_reference,
                                      tuple(args.only or CLUSTER_STAGES))  # fmt: skip
                outcome = "failed" if report.failures else "passed"
            except Exception as error:
                outcome = "failed"
                failed = check_failures(error)
                for failure in failed:
                    report.say("FAIL", str(failure))
                if not failed:
                    report.say("ERROR", "")
                    traceback.print_exc()
            finally:
                with trio.CancelScope(shield=True):
                    keep_pod_logs(logs, [node] if fleet is None else list(fleet.nodes.values()))
                    await tear_down(node, control_plane, fleet)
                nursery.cancel_scope.cancel()
    print(f"\n{report.table()}\n", flush=True)
    for fact in report.facts:
        print(f"observed: {fact}")
    for text in report.failures:
        print(f"FAILED: {text}")
    print(
        f"{args.session} {outcome} after {time.monotonic() - started:.0f} s inside the node's "
        "namespaces"
    )
    return 0 if outcome == "passed" else 1
