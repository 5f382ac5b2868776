"""PID 1 of the node's namespaces: set the node up, run the scenario, tear everything down.

The first SIGINT or SIGTERM cancels the scenario; the tear-down then runs shielded, with a
timeout on each step, and later signals are ignored. Whatever it does not stop, the kernel kills
when this process exits.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

import trio

from . import api, pods, scenario
from .node import CONTAINERD_SOCKET, Node, privatise
from .poll import wait_for


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
    await wait_for(f"containerd on {CONTAINERD_SOCKET}", lambda: _containerd_answers(node), 30)


async def start_kubelet(node: Node) -> None:
    await node.kubelet.start()
    await wait_for("kubelet's pod-resources API", lambda: _kubelet_answers(node), 60)


async def start_node(node: Node, args: argparse.Namespace, report: scenario.Report) -> None:
    node.write_containerd_config(args.pause_reference)
    started = scenario.now()
    await start_containerd(node)
    report.figure("containerd started → answers", scenario.now() - started)
    started = scenario.now()
    for archive in (args.pause_image, args.plugin_image):
        await node.ctr("images", "import", archive, within=300)
    # The plugin's image under every name the rendered pods use (the consumer's included).
    wanted = set().union(*(pods.images(pods.plugin_pod(v)) for v in scenario.VARIANTS))
    wanted |= pods.images(pods.consumer_pod("default", "consumer"))
    for reference in sorted(wanted - {args.plugin_reference}):
        await node.ctr("images", "tag", "--force", args.plugin_reference, reference)
    report.figure("images imported into containerd", scenario.now() - started)
    await start_kubelet(node)
    report.figure(
        "kubelet started → pod-resources answers", scenario.now() - node.kubelet.started_at
    )


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


async def tear_down(node: Node) -> None:
    """Stop kubelet, every container, containerd: each step bounded, each failure reported."""
    for step, action in (
        ("stop kubelet", node.kubelet.stop),
        ("stop the containers", node.stop_all_containers),
        ("stop containerd", node.containerd.stop),
    ):
        try:
            with trio.fail_after(60):
                await action()
        except Exception as error:  # report it and go on: the kernel does the rest
            print(f"e2e: tear-down: {step}: {error!r}", file=sys.stderr, flush=True)


def keep_pod_logs(logs: Path) -> None:
    """Every container's log as kubelet kept it (/var/log/pods is private to the namespace);
    `python -m e2e` removes them with the rest after a run that passed, unless --keep-logs."""
    source = Path("/var/log/pods")
    if source.is_dir():
        shutil.copytree(source, logs / "pods", symlinks=False, dirs_exist_ok=True)


async def main(args: argparse.Namespace) -> int:
    state, logs = Path(args.state), Path(args.logs)
    privatise(state)
    scenario.make_node_files()
    node = Node(state=state, logs=logs, kubelet_binary=Path(args.kubelet))
    report = scenario.Report(variant="node")
    variants = args.variant or list(scenario.VARIANTS)
    outcome = "cancelled"
    started = time.monotonic()
    with trio.CancelScope() as work:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_cancel_on_signal, work)
            try:
                await start_node(node, args, report)
                await scenario.run(node, report, variants, reset=lambda: reset_node(node))
                outcome = "passed"
            except AssertionError as failure:
                outcome = "failed"
                report.say("FAIL", str(failure))
            except Exception:
                outcome = "failed"
                report.say("ERROR", "")
                traceback.print_exc()
            finally:
                with trio.CancelScope(shield=True):
                    keep_pod_logs(logs)
                    await tear_down(node)
                nursery.cancel_scope.cancel()
    print(f"\n{report.table()}\n", flush=True)
    for fact in report.facts:
        print(f"observed: {fact}")
    print(f"e2e {outcome} after {time.monotonic() - started:.0f} s inside the node's namespaces")
    return 0 if outcome == "passed" else 1
