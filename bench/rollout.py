"""A rolling update on one node: how long allocatable is 0 when one of two instances stops.

Each round starts an old instance, then a new one, on a fresh fake node and simulated
kubelet of the kind asked for, and stops one of them. The dip is the time during which the
simulated kubelet does not have the full list of Healthy devices on a live stream, as
kubelet's allocatable would be lower: from the first state change that loses it to the one
that brings it back, both stamped as the simulator records them.
"""

from __future__ import annotations

import contextlib
import signal
import statistics
import threading
import time
from collections.abc import Callable

from bench.harness import RESOURCE, WAIT, Bench
from bench.report import ms
from pcc_plugin.sim import Daemon, FakeNode, SimKubelet
from pcc_plugin.sim.rules import HEALTHY, KeyBy

# A stop that loses nothing shows no dip: the wait for one ends after this long.
NO_DIP_AFTER = 3.0


def dip_seconds(kubelet: SimKubelet, act: Callable[[], None]) -> float:
    """How long the resource is not fully served after `act`; 0 if it never stops being."""
    lost: list[float] = []
    back: list[float] = []

    def served() -> bool:
        devices = kubelet.devices(RESOURCE)
        return (
            kubelet.stream_open(RESOURCE)
            and len(devices) == 16
            and set(devices.values()) == {HEALTHY}
        )

    def dip_over() -> bool:
        # Evaluated by the simulator at each of its state changes, under its lock.
        if not lost:
            if not served():
                lost.append(time.monotonic())
            return False
        if served():
            back.append(time.monotonic())
            return True
        return False

    def watch() -> None:
        with contextlib.suppress(TimeoutError):
            kubelet.wait_for(dip_over, WAIT)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    act()
    watcher.join(NO_DIP_AFTER if not lost else WAIT)
    if not lost:
        return 0.0
    watcher.join(WAIT)
    if not back:
        raise RuntimeError(f"the resource was not served again within {WAIT} s")
    return back[0] - lost[0]


def _round(env: dict[str, str], key_by: KeyBy, stop_newest: bool) -> float:
    node = FakeNode.create()
    daemons: list[Daemon] = []
    try:
        with SimKubelet(node.plugin_dir, key_by=key_by) as kubelet:
            for count in (1, 2):
                daemon = Daemon.spawn_plugin(
                    node.daemon_args(verbosity=1), node.root / f"d{count}.log", env
                )
                daemons.append(daemon)
                daemon.wait_for_log("Registered device plugin with Kubelet", WAIT)
                kubelet.wait_for(lambda: kubelet.stream_open(RESOURCE), WAIT)
            old, new = daemons
            # The old instance follows the new one from its first answer on.
            old.wait_for_log("Following ", WAIT)

            def stop() -> None:
                if stop_newest:
                    new.proc.kill()
                else:
                    old.terminate(signal.SIGTERM, WAIT)

            return dip_seconds(kubelet, stop)
    finally:
        for daemon in daemons:
            daemon.close()
        node.remove()


def rollouts(bench: Bench, rounds: int) -> None:
    report = bench.report
    report.section(f"rolling update, two instances: allocatable's dip, {rounds} rounds each")
    kinds: tuple[tuple[KeyBy, str], ...] = (
        ("resource", "kubelet < 1.37"), ("endpoint", "kubelet >= 1.37"),
    )  # fmt: skip
    for key_by, kind in kinds:
        for stop_newest, what in ((False, "old instance stopped (the update)"),
                                  (True, "new instance killed (SIGKILL)")):  # fmt: skip
            dips = [_round(bench.env, key_by, stop_newest) for _ in range(rounds)]
            bench.report.figures[f"rollout_dip_s {kind} {what}"] = dips
            value = f"median {ms(statistics.median(dips))} ms, max {ms(max(dips))} ms"
            report.add(f"{kind}: {what}", value)
