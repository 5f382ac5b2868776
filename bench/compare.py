"""Before and after trio-asyncio, and the Go peer, side by side in one run (issue 36, item 5).

    nox -s bench -- --compare [REV]            # about 15 minutes on 2 cores; REV: 32b7764
    nox -s bench -- --compare --quick          # one short turn each: checks the script
    python -m bench.compare [--compare REV] [--passes N] [--quick] [--json PATH]

Three contenders on one fake node and one simulated kubelet, started afresh for each turn and
taking turns (before, after, Go peer, before, after, Go peer), so that the machine's drift
falls on all three and two passes show the noise:

- **before**: the daemon at REV (default `BEFORE`, the last commit on trio-asyncio), checked
  out into a temporary git worktree, with a virtual environment uv makes from that revision's
  own requirements/runtime.txt; run as ``python -P -m pcc_plugin`` with the worktree on
  PYTHONPATH (``-P`` keeps this tree, the working directory, off its ``sys.path``), its
  bytecode compiled into a PYTHONPYCACHEPREFIX of its own and the image's environment, as
  `bench.harness` runs this tree's daemon;
- **after**: this tree's daemon, as `bench.harness` runs it;
- **Go peer**: squat/generic-device-plugin at `GO_PEER_VERSION`, built with ``go install``
  (modules through GOPROXY) into .cache/bench/, exposing 16 shares of the fake node's
  sev-guest under the same resource name; it names its own device IDs, so every Allocate
  asks for one from the simulated kubelet's list. Skipped, and said so, without ``go``.

Each pass first starts each contender 10 times, the three in turns, and stops it with SIGTERM
half a second after it registered: start -> registered, the CPU used and context switches made
until then, and SIGTERM -> exit (timed on a pidfd, `Bench.stop`), the median of each. Then each
turn, in this order: start -> registered; 3 s later a scrape and the probes, then 1 s: idle
memory; the CPU of the next 30 s; a burst of 2,000 Allocate calls one after another on a
connection of its own, held open afterwards as kubelet holds its, and the CPU of the 0-10,
10-36 and 36-46 s after its last answer; Allocate one call after another (5 rounds of 1,000
after 200): CPU per call and p50/p99; Allocate beside each hostile load
(`bench.scenarios.under_hostile_loads`); 8 connections calling at once for 5 s from another
process (`bench.callers`); kubelet's dial-back, 1,000 times, and 50 kubelet restarts
(`bench.scenarios.restarts`; 10 for the Go peer, which notices a restart by looking at its
socket once a second and then waits 5 s before it serves again). The burst comes before
everything else but the start: the old daemon's loop woke for each cancelled asyncio timer when
it fell due (up to 60 s after the call that armed it), and the windows after the burst must
hold only the burst's. The windows start 33 s after the start, past the start's own deadlines
but the 60 s idle deadline of kubelet's connection, which falls in the middle window.

Every CPU figure is the process's CPU clock (every thread's schedstat, the exited ones' too);
clock ticks (utime + stime, what top shows) are printed beside the windows'. Context switches
are every live thread's. How long the contender waited for a CPU while Allocate's latencies
were timed (schedstat's run delay, every live thread's, over the wall time) says how much of
those latencies the machine's other load made: on a shared 2-core machine, often most.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from bench import procfs, scenarios
from bench.harness import (
    IMAGE_ENV,
    PROBES,
    RESOURCE,
    ROOT,
    WAIT,
    Bench,
    accepted,
    allocate_method,
    bytecode_env,
    metrics_port,
    plugin_channel,
    python_module,
    timed_allocates,
)
from bench.report import Report, ms, percentile, report_footer, report_header
from pcc_plugin.sim import Daemon, FakeNode, SimKubelet

BEFORE = "32b7764"
GO_PEER = "github.com/squat/generic-device-plugin"
GO_PEER_VERSION = "v0.0.0-20260515115838-2cc50b05d4d2"
GO_PEER_CACHE = ROOT / ".cache" / "bench" / f"generic-device-plugin@{GO_PEER_VERSION}"
DOMAIN, DEVICE_NAME = RESOURCE.split("/")
GO_PEER_PROBES = ("/metrics", "/health")
SHARES = 16
CALLERS = 8


@attrs.frozen
class Sizes:
    """How much of each measurement a turn makes."""

    idle: float = 30.0
    burst: int = 2000
    # The instants after the burst's last answer between which its CPU is read.
    after_burst: tuple[float, ...] = (0.0, 10.0, 36.0, 46.0)
    rounds: int = 5
    per_round: int = 1000
    hostile_least: int = 1000
    hostile_seconds: float = 5.0
    callers_seconds: float = 5.0
    dials: int = 1000
    restarts: int = 50
    go_restarts: int = 10
    # Starts and stops of each contender per pass, the contenders in turns.
    starts: int = 10


QUICK = Sizes(
    idle=2.0, burst=200, after_burst=(0.0, 2.0, 3.0, 5.0), rounds=2, per_round=200,
    hostile_least=100, hostile_seconds=1.0, callers_seconds=1.0, dials=50, restarts=5,
    go_restarts=1, starts=2,
)  # fmt: skip


@attrs.frozen
class Running:
    """A contender started and registered, with what the turn needs to know of it."""

    daemon: Daemon
    endpoint: str
    device_id: str
    port: int
    probes: tuple[str, ...]
    start_s: float


@attrs.frozen
class Contender:
    name: str
    about: str
    start: Callable[[Bench], Running] | None
    skipped: str = ""
    restarts_of: Callable[[Sizes], int] = lambda sizes: sizes.restarts


def _registered(bench: Bench, spawn: Callable[[], Daemon]) -> tuple[Daemon, str, str, float]:
    """`spawn()` once registered with a full list: it, its endpoint, the first of its device
    IDs in the simulated kubelet's list (the lowest) and its start -> registered in s."""
    before = len(accepted(bench.kubelet))
    started = time.monotonic()
    daemon = spawn()
    registration = bench.registered(before, SHARES)
    device_id = min(bench.kubelet.devices(RESOURCE))
    return daemon, registration.endpoint, device_id, registration.answered_at - started


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True, timeout=WAIT
    ).stdout.strip()


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise SystemExit(
            f"bench.compare: `{name}` is not on PATH: run it as `python3 tools/dev.py -s bench "
            "-- --compare` (tools/dev.py puts its pinned uv on PATH)"
        )
    return path


def before_contender(cleanup: contextlib.ExitStack, work: Path, revision: str) -> Contender:
    """The daemon at `revision`, in a worktree and a virtual environment of its own."""
    uv = _tool("uv")
    commit = _git("rev-parse", "--verify", f"{revision}^{{commit}}")
    tree = work / "before"
    _git("worktree", "add", "--detach", "--quiet", str(tree), commit)
    cleanup.callback(_git, "worktree", "remove", "--force", str(tree))
    venv = work / "before-venv"
    subprocess.run([uv, "venv", "--quiet", "--python", sys.executable, str(venv)], check=True)
    python = str(venv / "bin" / "python")
    subprocess.run(
        [uv, "pip", "install", "--quiet", "--python", python,
         "-r", str(tree / "requirements" / "runtime.txt")],
        check=True,
    )  # fmt: skip
    env = {**bytecode_env(work / "before-pycache", python, tree), "PYTHONPATH": str(tree)}

    def start(bench: Bench) -> Running:
        argv = [python, "-P", "-m", "pcc_plugin", *bench.node.daemon_args(verbosity=0)]
        daemon, endpoint, device_id, took = _registered(
            bench, lambda: bench.spawn_program(*argv, name="before", env=env)
        )
        return Running(daemon, endpoint, device_id, metrics_port(daemon), PROBES, took)

    subject = _git("log", "-1", "--format=%h %s", commit)
    return Contender("before", f"before: {subject} (its own requirements/runtime.txt)", start)


def after_contender() -> Contender:
    def start(bench: Bench) -> Running:
        daemon, endpoint, device_id, took = _registered(bench, bench.spawn)
        return Running(daemon, endpoint, device_id, metrics_port(daemon), PROBES, took)

    head = _git("describe", "--always", "--dirty")
    return Contender("after", f"after: this tree, {head}", start)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def go_peer_contender() -> Contender:
    """squat/generic-device-plugin, built once per version into .cache/bench/."""
    name = "Go peer"
    go = shutil.which("go")
    if go is None:
        return Contender(name, f"{name}: not measured: no `go` on PATH", None, "no `go` on PATH")
    binary = GO_PEER_CACHE / "generic-device-plugin"
    if not binary.exists():
        GO_PEER_CACHE.mkdir(parents=True, exist_ok=True)
        built = subprocess.run(
            [go, "install", f"{GO_PEER}@{GO_PEER_VERSION}"],
            env={**os.environ, "GOBIN": str(GO_PEER_CACHE)}, capture_output=True, text=True,
        )  # fmt: skip
        if built.returncode != 0:
            reason = f"go install exited {built.returncode}: {built.stderr.strip()[-200:]}"
            return Contender(name, f"{name}: not measured: {reason}", None, reason)
    version = subprocess.run([go, "version"], capture_output=True, text=True).stdout.strip()

    def start(bench: Bench) -> Running:
        port = _free_port()
        device = {
            "name": DEVICE_NAME,
            "groups": [{"count": SHARES, "paths": [
                {"path": str(bench.node.device), "mountPath": "/dev/sev-guest"},
            ]}],
        }  # fmt: skip
        argv = [
            str(binary), "--device", json.dumps(device), "--domain", DOMAIN,
            "--plugin-directory", str(bench.node.plugin_dir),
            "--listen", f"127.0.0.1:{port}", "--log-level", "warn",
        ]  # fmt: skip
        daemon, endpoint, device_id, took = _registered(
            bench, lambda: bench.spawn_program(*argv, name="go-peer")
        )
        return Running(daemon, endpoint, device_id, port, GO_PEER_PROBES, took)

    return Contender(
        name, f"{name}: {GO_PEER}@{GO_PEER_VERSION} ({version})", start,
        restarts_of=lambda sizes: sizes.go_restarts,
    )  # fmt: skip


def starts_and_stops(
    bench: Bench, contenders: Sequence[Contender], count: int
) -> dict[str, dict[str, float]]:
    """Each contender started `count` times, in turns, and stopped half a second after it
    registered: the medians of its start -> registered, of the CPU it used and the context
    switches it made until then (read once registered), and of its SIGTERM -> exit."""
    taken: dict[str, list[dict[str, float]]] = {c.name: [] for c in contenders}
    for _ in range(count):
        for contender in contenders:
            assert contender.start is not None
            running = contender.start(bench)
            pid = running.daemon.pid
            cpu_ns, switches = procfs.cpu_ns(pid), procfs.wakeups(pid)
            time.sleep(0.5)
            taken[contender.name].append({
                "starts_ms": running.start_s * 1e3, "start_cpu_ms": cpu_ns / 1e6,
                "start_switches": switches, "stops_ms": bench.stop(running.daemon) * 1e3,
            })  # fmt: skip
    return {
        name: {key: statistics.median(one[key] for one in each) for key in each[0]}
        for name, each in taken.items()
    }


def _cpu(pid: int) -> tuple[int, int]:
    return procfs.cpu_ns(pid), procfs.cpu_ticks(pid)


def after_burst(running: Running, socket_path: Path, sizes: Sizes) -> dict[str, float]:
    """The CPU of a burst of Allocate calls, and of the windows after its last answer."""
    pid = running.daemon.pid
    figures: dict[str, float] = {}
    with plugin_channel(socket_path) as channel:
        method = allocate_method(channel)
        ns, _ = _cpu(pid)
        timed_allocates(method, sizes.burst, running.device_id)
        ended = time.monotonic()
        readings = [_cpu(pid)]
        figures["burst_ms"] = (readings[0][0] - ns) / 1e6
        for instant in sizes.after_burst[1:]:
            time.sleep(max(0.0, ended + instant - time.monotonic()))
            readings.append(_cpu(pid))
    bounds = sizes.after_burst
    for index in range(len(bounds) - 1):
        key = f"after_{bounds[index]:g}_{bounds[index + 1]:g}"
        figures[f"{key}_ms"] = (readings[index + 1][0] - readings[index][0]) / 1e6
        figures[f"{key}_ticks"] = readings[index + 1][1] - readings[index][1]
    return figures


def one_after_another(
    running: Running, socket_path: Path, sizes: Sizes, raw: dict[str, Any]
) -> dict[str, float]:
    """Allocate one call after another, unloaded: CPU per call (the median of the rounds'),
    p50 and p99 of every call; the latencies go into `raw`."""
    pid = running.daemon.pid
    latencies: list[float] = []
    cpu: list[float] = []
    with plugin_channel(socket_path) as channel:
        method = allocate_method(channel)
        timed_allocates(method, 200, running.device_id)
        switches = procfs.wakeups(pid)
        for _ in range(sizes.rounds):
            round_latencies, per_call = scenarios.sequential(
                pid, method, sizes.per_round, running.device_id
            )
            latencies += round_latencies
            cpu.append(per_call)
        switches = procfs.wakeups(pid) - switches
    raw["allocate"] = {"unloaded_s": latencies, "cpu_s": cpu}
    return {
        "allocate_cpu_us": statistics.median(cpu) * 1e6,
        "allocate_switches": switches / len(latencies),
        "p50_ms": percentile(latencies, 50) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
    }


def concurrent_callers(running: Running, socket_path: Path, seconds: float) -> dict[str, float]:
    """`CALLERS` connections calling Allocate one after another, from another process."""
    pid = running.daemon.pid
    args = (str(socket_path), running.device_id, str(CALLERS), str(seconds))
    with python_module("bench.callers", *args, ready="ready") as callers:
        busy = procfs.cpu_ns(pid)
        assert callers.stdout is not None
        output = callers.stdout.read().split()
        busy = procfs.cpu_ns(pid) - busy
        if callers.wait(WAIT) != 0 or len(output) != 3:
            raise RuntimeError(f"bench.callers failed against {socket_path}: {output}")
    calls, elapsed, client_cpu = int(output[0]), float(output[1]), float(output[2])
    return {
        "callers_per_s": calls / elapsed,
        "callers_cpu_us": busy / 1e3 / max(calls, 1),
        "callers_client_cores": client_cpu / elapsed,
    }


def turn(bench: Bench, contender: Contender, sizes: Sizes) -> dict[str, float]:
    """One contender started afresh, measured, stopped: its figures."""
    assert contender.start is not None
    running = contender.start(bench)
    pid = running.daemon.pid
    socket_path = bench.socket(running.endpoint)
    figures: dict[str, float] = {"start_ms": running.start_s * 1e3}
    scenarios.settled_and_scraped(running.port, running.probes)
    memory = procfs.memory(pid)
    figures |= {f"{name}_mib": memory[name] / 1024 for name in ("VmRSS", "RssAnon", "RssFile")}
    idle = scenarios.idle_cpu(pid, sizes.idle)
    figures |= {"idle_ms": idle["ns"] / 1e6, "idle_ticks": idle["ticks"]}
    figures |= after_burst(running, socket_path, sizes)
    waited, started = procfs.run_delay_ns(pid), time.monotonic()
    figures |= one_after_another(running, socket_path, sizes, bench.report.figures)
    scenarios.under_hostile_loads(
        bench, running.daemon, running.endpoint, sizes.hostile_least, sizes.hostile_seconds,
        port=running.port, device_id=running.device_id,
    )  # fmt: skip
    waited = procfs.run_delay_ns(pid) - waited
    figures["run_delay_pct"] = waited / 1e9 / (time.monotonic() - started) * 100
    for load, latencies in zip("abc", bench.report.figures["hostile_s"].values(), strict=True):
        figures[f"{load}_p50_ms"] = percentile(latencies, 50) * 1e3
        figures[f"{load}_p99_ms"] = percentile(latencies, 99) * 1e3
    figures |= concurrent_callers(running, socket_path, sizes.callers_seconds)
    scenarios.restarts(
        bench, running.daemon, running.endpoint, contender.restarts_of(sizes), sizes.dials
    )
    figures["dial_back_us"] = bench.report.figures["dial_back_cpu_s"]["daemon"] * 1e6
    restarted = bench.report.figures["restarts"]
    figures["restart_cpu_us"] = restarted["cpu_ns"] / 1e3 / contender.restarts_of(sizes)
    figures["restart_switches"] = restarted["context_switches"] / contender.restarts_of(sizes)
    registered = [i["accepted"] - i["serving"] for i in bench.report.figures["restart_instants"]]
    figures["restart_p50_ms"] = percentile(registered, 50) * 1e3
    figures["restart_p99_ms"] = percentile(registered, 99) * 1e3
    bench.stop(running.daemon)
    return figures


# The table: one row per figure, one column per contender, each cell every pass's value.
Row = tuple[str, str, Callable[[float], str]]


def _rows(sizes: Sizes) -> list[Row]:
    def fixed(digits: int) -> Callable[[float], str]:
        return lambda value: f"{value:.{digits}f}"

    def ms_value(value: float) -> str:
        return ms(value / 1e3)

    first, second, third, fourth = (f"{bound:g}" for bound in sizes.after_burst)
    window = f"CPU {{}}-{{}} s after a burst of {sizes.burst:,} Allocates, ms (ticks)"
    return [
        (f"start -> registered, median of {sizes.starts} starts (ms)", "starts_ms", ms_value),
        ("  CPU until registered, median (ms)", "start_cpu_ms", fixed(0)),
        ("  context switches until registered, median (every thread)", "start_switches",
         fixed(0)),
        (f"SIGTERM -> exit, median of {sizes.starts} stops (ms)", "stops_ms", ms_value),
        ("start -> registered, the turn's start (ms)", "start_ms", ms_value),
        ("idle VmRSS after a scrape and the probes (MiB)", "VmRSS_mib", fixed(1)),
        ("  anonymous (MiB)", "RssAnon_mib", fixed(1)),
        ("  file-backed (MiB)", "RssFile_mib", fixed(1)),
        (f"idle CPU over {sizes.idle:g} s from 3 s after the start, ms (ticks)", "idle", fixed(2)),
        (f"the burst's own CPU ({sizes.burst:,} calls, one after another), ms", "burst_ms",
         fixed(0)),
        (window.format(first, second), f"after_{first}_{second}", fixed(2)),
        (window.format(second, third), f"after_{second}_{third}", fixed(2)),
        (window.format(third, fourth), f"after_{third}_{fourth}", fixed(2)),
        ("CPU per kubelet dial-back (us)", "dial_back_us", fixed(0)),
        ("CPU per Allocate, one after another (us)", "allocate_cpu_us", fixed(0)),
        ("  context switches per Allocate (every thread)", "allocate_switches", fixed(2)),
        ("Allocate p50, unloaded (ms)", "p50_ms", ms_value),
        ("Allocate p99, unloaded (ms)", "p99_ms", ms_value),
        ("Allocate p50 / p99 beside (a) 1,000 idle connections (ms)", "a", ms_value),
        ("Allocate p50 / p99 beside (b) 4 MiB messages in a loop (ms)", "b", ms_value),
        ("Allocate p50 / p99 beside (c) /metrics at 250/s (ms)", "c", ms_value),
        ("  while these were timed: waited for a CPU, % (run delay)", "run_delay_pct", fixed(0)),
        (f"{CALLERS} connections calling at once (calls/s)", "callers_per_s", fixed(0)),
        ("  server CPU per call (us)", "callers_cpu_us", fixed(0)),
        ("  the callers' process, cores busy", "callers_client_cores", fixed(2)),
        ("kubelet restart -> registered, p50 (ms)", "restart_p50_ms", ms_value),
        ("kubelet restart -> registered, p99 (ms)", "restart_p99_ms", ms_value),
        ("  CPU per restart (us)", "restart_cpu_us", fixed(0)),
        ("  context switches per restart (every thread)", "restart_switches", fixed(1)),
    ]  # fmt: skip


def _cell(passes: list[dict[str, float]], key: str, show: Callable[[float], str]) -> str:
    if not passes:
        return "-"
    if key in ("a", "b", "c"):
        return " / ".join(
            f"{show(one[f'{key}_p50_ms'])}, {show(one[f'{key}_p99_ms'])}" for one in passes
        )
    if f"{key}_ms" in passes[0] and f"{key}_ticks" in passes[0]:
        return " / ".join(f"{show(one[f'{key}_ms'])} ({one[f'{key}_ticks']:.0f})" for one in passes)
    return " / ".join(show(one[key]) for one in passes)


def render(
    header: Sequence[str], contenders: Sequence[Contender],
    results: dict[str, list[dict[str, float]]], sizes: Sizes,
) -> str:  # fmt: skip
    titles = ["figure", *(contender.name for contender in contenders)]
    table = [titles] + [
        [label, *(_cell(results[contender.name], key, show) for contender in contenders)]
        for label, key, show in _rows(sizes)
    ]
    widths = [max(len(row[column]) for row in table) for column in range(len(titles))]
    lines = ["   ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
             for row in table]  # fmt: skip
    rule = "=" * len(lines[0])
    passes = max(len(figures) for figures in results.values())
    skipped = [contender for contender in contenders if contender.start is None]
    notes = [
        f"each cell: pass 1 / pass 2 / ... ({passes} passes, the contenders in turns); "
        "beside a load: p50, p99 of each pass",
        *(f"{contender.name}: not measured: {contender.skipped}" for contender in skipped),
        *_goals(results),
    ]
    return "\n".join([*header, "", rule, lines[0], "-" * len(rule), *lines[1:], rule, *notes])


def _goals(results: dict[str, list[dict[str, float]]]) -> list[str]:
    """Issue 36's goal that has a figure of its own: idle RSS at most twice the Go peer's."""
    after, go = results.get("after", []), results.get("Go peer", [])
    if not after or not go:
        return []
    ratios = [one["VmRSS_mib"] / peer["VmRSS_mib"] for one, peer in zip(after, go, strict=False)]
    return [
        "idle VmRSS, after / Go peer, each pass: "
        + ", ".join(f"{ratio:.2f}x" for ratio in ratios)
        + " (issue 36's goal: at most 2x)"
    ]


def run(args: argparse.Namespace, sizes: Sizes) -> tuple[list[Contender], dict[str, Any]]:
    node = FakeNode.create()
    try:
        with contextlib.ExitStack() as cleanup:
            contenders = [
                before_contender(cleanup, node.root, args.compare),
                after_contender(),
                go_peer_contender(),
            ]
            env = bytecode_env(node.root / "after-pycache")
            results: dict[str, list[dict[str, float]]] = {c.name: [] for c in contenders}
            raw: dict[str, list[dict[str, Any]]] = {c.name: [] for c in contenders}
            with SimKubelet(node.plugin_dir) as kubelet:
                bench = Bench(node, kubelet, cleanup, Report(), env)
                measured = [contender for contender in contenders if contender.start is not None]
                for _ in range(args.passes):
                    cycles = starts_and_stops(bench, measured, sizes.starts)
                    for contender in measured:
                        bench.report = Report()
                        figures = turn(bench, contender, sizes) | cycles[contender.name]
                        results[contender.name].append(figures)
                        raw[contender.name].append(bench.report.figures)
    finally:
        node.remove()
    return contenders, {"summary": results, "raw": raw}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.compare", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--compare", nargs="?", const=BEFORE, default=BEFORE, metavar="REV",
                        help=f"the revision to run as before ({BEFORE})")  # fmt: skip
    parser.add_argument("--passes", type=int, help="turns of each contender (2; 1 with --quick)")
    parser.add_argument("--quick", action="store_true", help="short turns: a smoke run")
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    args = parser.parse_args(argv)
    if args.passes is None:
        args.passes = 1 if args.quick else 2
    sizes = QUICK if args.quick else Sizes()
    started = time.monotonic()
    header = report_header(
        "pcc-device-plugin benchmark: before and after trio-asyncio, and the Go peer",
        "kubelet: pcc_plugin.sim.SimKubelet (grpcio) in the benchmark's process, one fake node",
        "the two daemons: --v=0 --metrics-bind-address=127.0.0.1:0, bytecode compiled into a "
        "PYTHONPYCACHEPREFIX of each, environment as in the image: "
        + " ".join(f"{key}={value}" for key, value in IMAGE_ENV.items()),
    )
    contenders, figures = run(args, sizes)
    header[-1:-1] = [contender.about for contender in contenders]
    header += [report_footer(started), f"command: {' '.join(sys.argv)}"]
    print(render(header, contenders, figures["summary"], sizes))
    if args.json:
        args.json.write_text(json.dumps({"machine": header, **figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
