"""What users feel, each figure judged against its target; what is printed beside them.

Every target is here, written for the 2-core machine of BENCHMARKS.md (issue 25's item 8 and
issue 26). CPU per Allocate has none: it is printed beside a minimal grpcio server's
(`bench.yardstick`), measured in the same rounds.
"""

from __future__ import annotations

import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from e2e.images import YARDSTICK_SOURCE, go_build

from bench import hostile, image, procfs
from bench.harness import (
    DEVICE_ID,
    PROBES,
    RESOURCE,
    ROOT,
    WAIT,
    Bench,
    accepted,
    allocate_method,
    cpu_per_dial_back,
    metrics_port,
    no_gc,
    plugin_channel,
    probed_and_scraped,
    python_module,
    timed_allocates,
)
from bench.report import Report, mib, ms, percentile
from pcc_plugin.sim import Daemon, Registration
from pcc_plugin.sim.apiserver import FakeApiServer
from pcc_plugin.sim.dra import SimDraKubelet
from pcc_plugin.sim.rules import HEALTHY, UNHEALTHY

# Resident memory once registered, probed and scraped, then left alone.
IDLE_RSS_MIB = 32
# Clock ticks (/proc/<pid>/stat's utime + stime, what top and ps show) charged while idle.
IDLE_CPU_TICKS = 0
# Allocate round trips from a grpcio client, alone and beside each hostile load.
ALLOCATE_P99_MS = 5
# From a kubelet serving again after a restart to its accepting the plugin's Register.
RESTART_TO_REGISTERED_P50_MS = 30
RESTART_TO_REGISTERED_P99_MS = 100
# Issue 26's two legs of that race: kubelet serving -> Register received, and kubelet's dial
# of the plugin -> GetDevicePluginOptions answered and the first device list received.
SERVING_TO_REGISTER_P99_MS = 10
DIAL_TO_FIRST_LIST_P99_MS = 5
# The image's daemon, from its process's start to registered: every start of the run.
IMAGE_START_TO_REGISTERED_MS = 1000
# The DRA driver's node in the fake API server.
DRA_NODE = "bench-node"


def _p50_p99(values: Sequence[float]) -> str:
    return f"{ms(percentile(values, 50))} / {ms(percentile(values, 99))} ms"


def _judge_allocates(report: Report, label: str, latencies: Sequence[float]) -> None:
    report.check(f"Allocate p50 / p99, {label}", f"{_p50_p99(latencies)} ({len(latencies)} calls)",
                 percentile(latencies, 99) * 1000, ALLOCATE_P99_MS, "ms")  # fmt: skip


def start_to_registered(bench: Bench, runs: int) -> None:
    """Starts and stops in the development venv: printed; the start's target is judged on the
    image's. A stop is SIGTERM -> exit, half a second after the start registered."""
    bench.report.section(f"start -> registered, SIGTERM -> exit: {runs} process starts, metrics on")
    times, stops = [], []
    for _ in range(runs):
        before = len(accepted(bench.kubelet))
        started = time.monotonic()
        daemon = bench.spawn()
        times.append(bench.registered(before).answered_at - started)
        time.sleep(0.5)
        stops.append(bench.stop(daemon))
    bench.report.figures["start_to_registered_s"] = times
    bench.report.figures["sigterm_to_exit_s"] = stops
    for label, values in (
        ("start -> registered, median (the target is judged on the image's)", times),
        ("SIGTERM -> exit, median", stops),
    ):
        spread = f"min {ms(min(values))}, max {ms(max(values))}"
        bench.report.add(label, f"{ms(statistics.median(values))} ms ({spread})")


def _idle_memory(report: Report, pid: int, label: str) -> dict[str, int]:
    figures = procfs.memory(pid)
    report.check(f"idle VmRSS after a scrape, {label}", mib(figures["VmRSS"]),
                 figures["VmRSS"] / 1024, IDLE_RSS_MIB, "MiB")  # fmt: skip
    report.add(
        "  anonymous / file-backed; VmHWM",
        f"{mib(figures['RssAnon'])} / {mib(figures['RssFile'])}; {mib(figures['VmHWM'])}",
    )
    return figures


def settled_and_scraped(port: int, paths: tuple[str, ...] = PROBES) -> None:
    """Let a start settle (first stream, first health look), then probe and scrape the plugin
    on its metrics `port`."""
    time.sleep(2)
    probed_and_scraped(port, paths)
    time.sleep(1)


def idle(bench: Bench, cpu_seconds: float) -> Daemon:
    """Memory once probed and scraped, then CPU while nothing is asked; returns it, running."""
    report = bench.report
    report.section("idle: registered, kubelet's stream open, probed and scraped once, then nothing")
    daemon, _ = bench.start()
    settled_and_scraped(metrics_port(daemon))
    report.figures["idle_kib"] = _idle_memory(report, daemon.pid, "dev venv")
    figures = report.figures["idle_cpu"] = idle_cpu(daemon.pid, cpu_seconds)
    elapsed, ticks, ns = figures["seconds"], figures["ticks"], figures["ns"]
    switches = figures["context_switches"]
    report.check(
        f"idle CPU over {elapsed:.0f} s: clock ticks charged (/proc/<pid>/stat)",
        f"{ticks} ticks of {1000 // procfs.CLOCK_TICKS} ms",
        ticks,
        IDLE_CPU_TICKS,
        "ticks",
    )
    report.add(
        "  the same window from schedstat (ns, every thread)",
        f"{ns / 1e6:.2f} ms of CPU ({ns / 1e6 / elapsed:.3f} millicores), "
        f"{switches} context switches",
    )
    return daemon


def dra_idle(bench: Bench) -> None:
    """The DRA driver's memory, measured as the device plugin's: registered with the simulated
    kubelet's DRA side, its slices published to the fake API server, probed and scraped once,
    then left alone. Printed beside the device plugin's (the two figures the docs quote)."""
    report = bench.report
    report.section("idle, the DRA driver: registered, slices published, probed and scraped once")
    root = bench.node.root
    with FakeApiServer() as api:
        api.add_node(DRA_NODE)
        with SimDraKubelet(root / "plugins_registry", DRA_NODE, api) as kubelet:
            daemon = bench.spawn_program(
                sys.executable, "-m", "pcc_plugin", "--mode=dra", f"--node-name={DRA_NODE}",
                f"--kubeconfig={api.write_kubeconfig(root / 'kubeconfig')}",
                f"--kubelet-registry-path={root / 'plugins_registry'}",
                f"--kubelet-plugins-path={root / 'plugins'}", f"--cdi-spec-dir={root / 'cdi'}",
                f"--host-root={bench.node.host_root}", "--metrics-bind-address=127.0.0.1:0",
                "--v=0", name="dra-driver", env=bench.env,
            )  # fmt: skip
            kubelet.wait_for(lambda: any(r.error is None for r in kubelet.registrations), WAIT)
            api.wait_for(lambda: len(api.slices(DRA_NODE)) > 0, WAIT)
            settled_and_scraped(metrics_port(daemon))
            figures = procfs.memory(daemon.pid)
            report.figures["dra_idle_kib"] = figures
            said = f"{mib(figures['VmRSS'])} (anonymous {mib(figures['RssAnon'])})"
            report.add("idle VmRSS after a scrape, the DRA driver (dev venv)", said)
            bench.stop(daemon)


def idle_cpu(pid: int, seconds: float) -> dict[str, float]:
    """What process `pid` costs while nothing is asked of it for `seconds`: clock ticks, ns of
    CPU (every thread) and context switches."""
    ticks, ns = procfs.cpu_ticks(pid), procfs.cpu_ns(pid)
    switches = procfs.wakeups(pid)
    started = time.monotonic()
    time.sleep(seconds)
    return {
        "seconds": time.monotonic() - started,
        "ticks": procfs.cpu_ticks(pid) - ticks,
        "ns": procfs.cpu_ns(pid) - ns,
        "context_switches": procfs.wakeups(pid) - switches,
    }


def sequential(
    pid: int, method: Any, calls: int, device_id: str = DEVICE_ID
) -> tuple[list[float], float]:
    """Latencies of `calls` Allocates one after another, and the server's CPU per call in s."""
    with no_gc():
        busy = procfs.cpu_ns(pid)
        latencies = timed_allocates(method, calls, device_id)
        busy = procfs.cpu_ns(pid) - busy
    return latencies, busy / 1e9 / calls


def allocate(bench: Bench, pid: int, endpoint: str, calls: int, rounds: int) -> None:
    """Allocate round trips, one after another as kubelet makes them, unloaded; the daemon's
    CPU per call beside a grpcio server's answering the same calls.

    The two are called in alternate rounds, so that the host's drift (other machines' load on a
    shared one moves these figures by 2x within an hour) falls on both alike.
    """
    report = bench.report
    report.section("Allocate, one container request from a grpcio client, one call after another")
    socket_path = bench.node.root / "yardstick.sock"
    per_round = calls // rounds
    latencies: list[float] = []
    ours: list[float] = []
    theirs: list[float] = []
    with (
        python_module("bench.yardstick", str(socket_path), ready="serving") as server,
        plugin_channel(bench.socket(endpoint)) as daemon_channel,
        plugin_channel(socket_path) as yardstick_channel,
    ):
        daemon_method = allocate_method(daemon_channel)
        yardstick_method = allocate_method(yardstick_channel)
        timed_allocates(daemon_method, 200)
        timed_allocates(yardstick_method, 200)
        for _ in range(rounds):
            round_latencies, cpu = sequential(pid, daemon_method, per_round)
            latencies += round_latencies
            ours.append(cpu)
            theirs.append(sequential(server.pid, yardstick_method, per_round)[1])
    report.figures["allocate"] = {"unloaded_s": latencies, "cpu_s": ours, "grpcio_cpu_s": theirs}
    _judge_allocates(report, "unloaded", latencies)
    ratios = sorted(daemon / grpcio for daemon, grpcio in zip(ours, theirs, strict=True))
    report.add(
        f"daemon CPU per Allocate; a grpcio server's (median of {rounds} alternated rounds)",
        f"{statistics.median(ours) * 1e6:.0f} us; {statistics.median(theirs) * 1e6:.0f} us "
        f"({statistics.median(ratios):.2f}x, rounds {ratios[0]:.2f}x to {ratios[-1]:.2f}x)",
    )


def _timed_while(method: Any, busy: Callable[[], bool], least: int, device_id: str) -> list[float]:
    """Allocate round trips, one after another, while `busy()` (and at least `least` of them)."""
    latencies: list[float] = []
    while busy() or len(latencies) < least:
        latencies += timed_allocates(method, 10, device_id)
    return latencies


def under_hostile_loads(
    bench: Bench, daemon: Daemon, endpoint: str, least: int, seconds: float,
    *, port: int | None = None, device_id: str = DEVICE_ID,
) -> None:  # fmt: skip
    """Allocate from a well-behaved client while (a) 1,000 idle connections are held to the
    plugin socket, (b) a client sends 4 MiB messages in a loop, (c) /metrics is flooded.

    `port` is the plugin's metrics port (the daemon's, from its log, by default); the calls
    ask for `device_id`."""
    report = bench.report
    report.section("Allocate beside hostile clients, one load at a time")
    path = bench.socket(endpoint)
    figures: dict[str, Any] = {}

    def judge(label: str, latencies: list[float]) -> None:
        figures[label] = latencies
        _judge_allocates(report, label, latencies)

    with plugin_channel(path) as channel:
        method = allocate_method(channel)
        timed_allocates(method, 200, device_id)
        rss_before = procfs.proc_status(daemon.pid)["VmRSS"]
        held: list[socket.socket] = []
        opened = threading.Event()
        opener = hostile.idle_connections(path, held, opened)
        try:
            until = time.monotonic() + seconds
            latencies = _timed_while(
                method, lambda: not opened.is_set() or time.monotonic() < until, least, device_id
            )
            rss_during = procfs.proc_status(daemon.pid)["VmRSS"]
            fds = procfs.open_fds(daemon.pid)
        finally:
            opener.join()
            hostile.close_all(held)
        judge(f"(a) {hostile.IDLE_CONNECTIONS:,} idle connections held", latencies)
        report.add("  VmRSS before / during (a); fds open during",
                   f"{mib(rss_before)} / {mib(rss_during)}; {fds}")  # fmt: skip

        with hostile.client("large", str(path), str(seconds)) as large:
            latencies = _timed_while(method, lambda: large.poll() is None, least, device_id)
            sent, refused = hostile.outcome(large)
        judge("(b) 4 MiB messages in a loop", latencies)
        report.add("  4 MiB messages sent / refused INVALID_ARGUMENT", f"{sent} / {refused}")

        metrics = str(metrics_port(daemon) if port is None else port)
        rate = str(hostile.FLOOD_RATE)
        with hostile.client("metrics", metrics, str(seconds), rate) as flood:
            latencies = _timed_while(method, lambda: flood.poll() is None, least, device_id)
            sent, answered = hostile.outcome(flood)
        judge(f"(c) /metrics at {hostile.FLOOD_RATE:.0f} requests/s", latencies)
        report.add("  /metrics requests answered 200", f"{answered} of {sent}")
    report.figures["hostile_s"] = figures


def _instants(serving: float, registration: Registration) -> dict[str, float]:
    """The instants of one restart's race, as the simulated kubelet stamped them."""
    dialled, options, first_list = (
        registration.dialled_at, registration.options_at, registration.first_list_at,
    )  # fmt: skip
    if dialled is None or options is None or first_list is None:
        raise RuntimeError(f"a registration without its dial, options or list: {registration}")
    return {
        "serving": serving, "received": registration.received_at, "dialled": dialled,
        "options": options, "accepted": registration.answered_at, "first_list": first_list,
    }  # fmt: skip


def _restart_instants(bench: Bench, count: int) -> list[dict[str, float]]:
    """Kubelet restarted `count` times in a row, each once the plugin is back with its list on a
    live stream; each restart's instants."""
    instants = []
    with no_gc():
        for _ in range(count):
            before = len(accepted(bench.kubelet))
            bench.kubelet.restart()
            instants.append(_instants(bench.kubelet.serving_since, bench.registered(before)))
    return instants


def _span(instants: list[dict[str, float]], start: str, end: str) -> list[float]:
    return [instant[end] - instant[start] for instant in instants]


def restarts(bench: Bench, daemon: Daemon, endpoint: str, count: int, dials: int) -> None:
    """Kubelet restarted `count` times in a row (its socket directory wiped each time, as
    kubelet does), each time once the daemon is back with its list on a live stream.

    Every span starts at an instant the simulated kubelet stamps: serving again (its
    kubelet.sock answering), Register received and accepted, its dial of the plugin's socket
    begun, GetDevicePluginOptions answered, the first ListAndWatch list received.
    """
    report, kubelet = bench.report, bench.kubelet
    report.section(f"kubelet restart -> registered again: {count} restarts in a row")
    cpu = cpu_per_dial_back(daemon.pid, bench.socket(endpoint), dials)
    report.figures["dial_back_cpu_s"] = {"daemon": cpu}
    report.add(f"CPU per dial-back ({dials} from a grpcio client, as kubelet dials), the daemon",
               f"{cpu * 1e6:.0f} us")  # fmt: skip
    before_fds, before_rss = daemon.open_fds(), procfs.proc_status(daemon.pid)["VmRSS"]
    calls_before = kubelet.register_calls
    busy, switches = procfs.cpu_ns(daemon.pid), procfs.wakeups(daemon.pid)
    instants = _restart_instants(bench, count)
    busy = procfs.cpu_ns(daemon.pid) - busy
    switches = procfs.wakeups(daemon.pid) - switches
    # Whatever a last restart set in motion has settled once the stream is open again.
    after_fds, after_rss = daemon.open_fds(), procfs.proc_status(daemon.pid)["VmRSS"]
    calls = kubelet.register_calls - calls_before
    report.figures["restart_instants"] = instants
    report.figures["restarts"] = {
        "fds": [before_fds, after_fds], "rss_kib": [before_rss, after_rss], "register_calls": calls,
        "cpu_ns": busy, "context_switches": switches,
    }  # fmt: skip

    def span(start: str, end: str) -> list[float]:
        return _span(instants, start, end)

    registered = span("serving", "accepted")
    for pct, limit in ((50, RESTART_TO_REGISTERED_P50_MS), (99, RESTART_TO_REGISTERED_P99_MS)):
        taken = percentile(registered, pct)
        report.check(f"kubelet restart -> registered, p{pct}", f"{ms(taken)} ms",
                     taken * 1000, limit, "ms")  # fmt: skip
    to_register = span("serving", "received")
    report.check("  kubelet.sock -> Register, p50 / p99", _p50_p99(to_register),
                 percentile(to_register, 99) * 1000, SERVING_TO_REGISTER_P99_MS, "ms")  # fmt: skip
    report.add("  dial-back -> GetDevicePluginOptions answered, p50 / p99",
               _p50_p99(span("dialled", "options")))  # fmt: skip
    to_list = span("dialled", "first_list")
    report.check("  dial-back -> first ListAndWatch list, p50 / p99", _p50_p99(to_list),
                 percentile(to_list, 99) * 1000, DIAL_TO_FIRST_LIST_P99_MS, "ms")  # fmt: skip
    report.add("kubelet.sock -> first list (kubelet knows the devices), p50 / p99",
               _p50_p99(span("serving", "first_list")))  # fmt: skip
    report.add("Register calls per restart", f"{calls / count:.2f} ({calls} calls)")
    report.add("CPU per restart, the daemon (schedstat)", f"{busy / count / 1e3:.0f} us")
    report.add("  context switches per restart (every thread)", f"{switches / count:.1f}")
    report.add("open fds; VmRSS: before -> after",
               f"{before_fds} -> {after_fds}; {mib(before_rss)} -> {mib(after_rss)}")  # fmt: skip


def floor(bench: Bench, count: int, dials: int) -> None:
    """What the race's legs cost below this daemon: grpclib alone on asyncio
    (`bench.stack_floor`), and the e2e's Go yardstick (tools/e2e/yardstick) in the daemon's
    place for the same restarts. Printed beside the daemon's figures; no target."""
    report = bench.report
    report.section("the floor: grpclib alone, and the Go yardstick (tools/e2e/yardstick)")
    socket_path = bench.node.root / "stack-floor.sock"
    with python_module(
        "bench.stack_floor", str(socket_path), ready="serving", env=bench.env
    ) as server:
        cpu = cpu_per_dial_back(server.pid, socket_path, dials)
    report.figures["dial_back_cpu_s"]["grpclib alone"] = cpu
    report.add("CPU per dial-back, grpclib alone on asyncio (bench/stack_floor.py)",
               f"{cpu * 1e6:.0f} us")  # fmt: skip
    go = shutil.which("go")
    if go is None:
        report.add("the Go yardstick's figures", "not measured: no `go` on PATH")
        return
    binary = bench.node.root / "yardstick"
    try:
        go_build(go, YARDSTICK_SOURCE, binary)
    except subprocess.CalledProcessError as exc:
        report.add("the Go yardstick's figures", f"not measured: go build exited {exc.returncode}")
        return
    before = len(accepted(bench.kubelet))
    yardstick = bench.spawn_program(
        str(binary), "--dir", str(bench.node.plugin_dir), name="yardstick"
    )
    endpoint = bench.registered(before).endpoint
    cpu = cpu_per_dial_back(yardstick.pid, bench.socket(endpoint), dials)
    report.figures["dial_back_cpu_s"]["Go yardstick"] = cpu
    report.add("CPU per dial-back, the Go yardstick", f"{cpu * 1e6:.0f} us")
    busy = procfs.cpu_ns(yardstick.pid)
    instants = _restart_instants(bench, count)
    busy = procfs.cpu_ns(yardstick.pid) - busy
    bench.stop(yardstick)
    report.figures["go_yardstick_restart_instants"] = instants
    for label, start, end in (
        (f"the Go yardstick, {count} restarts: kubelet restart -> registered", "serving",
         "accepted"),
        ("  kubelet.sock -> Register", "serving", "received"),
        ("  dial-back -> GetDevicePluginOptions answered", "dialled", "options"),
        ("  dial-back -> first ListAndWatch list", "dialled", "first_list"),
        ("kubelet.sock -> first list (kubelet knows the devices)", "serving", "first_list"),
    ):  # fmt: skip
        report.add(f"{label}, p50 / p99", _p50_p99(_span(instants, start, end)))
    report.add("CPU per restart, the Go yardstick", f"{busy / count / 1e3:.0f} us")


def health_change(bench: Bench, counts: Sequence[int], repeats: int) -> None:
    """The device removed: how long until kubelet has every device Unhealthy."""
    report = bench.report
    report.section(f"health change -> kubelet's list ({repeats} tries each)")
    kubelet = bench.kubelet
    for count in counts:
        daemon, _ = bench.start(f"--resource-count={count}", devices=count)
        taken = []
        for _ in range(repeats):
            started = time.monotonic()
            bench.node.device.unlink()
            kubelet.wait_for(lambda: set(kubelet.devices(RESOURCE).values()) == {UNHEALTHY})
            taken.append(time.monotonic() - started)
            bench.node.device.symlink_to("/dev/null")
            kubelet.wait_for(lambda: set(kubelet.devices(RESOURCE).values()) == {HEALTHY})
        bench.stop(daemon)
        report.figures[f"health_change_{count}_s"] = taken
        report.add(f"{count:,} devices: device removed -> all Unhealthy at kubelet, median / max",
                   f"{ms(statistics.median(taken))} / {ms(max(taken))} ms")  # fmt: skip


def _image_starts(bench: Bench, starts: int) -> list[float]:
    """Start the image's daemon `starts` times; judge its memory once, at the first."""
    times: list[float] = []
    with image.rootfs() as (config, root):
        bench.report.add("entry point", image.entry_point(config))
        for start in range(starts):
            with image.running(bench, config, root) as (daemon, took):
                times.append(took)
                if start == 0:
                    settled_and_scraped(metrics_port(daemon))
                    bench.report.figures["image_idle_kib"] = _idle_memory(
                        bench.report, daemon.pid, "image"
                    )
    return times


def from_image(bench: Bench, starts: int, *, skipped: bool) -> None:
    """The image's daemon as a node runs it: its memory once scraped, and its starts."""
    report = bench.report
    report.section(f"the daemon from the image ({image.ARCHIVE.relative_to(ROOT)})")
    figure = "start -> registered, the image's"
    reason = "skipped (--no-image)" if skipped else image.unavailable()
    if reason is None:
        try:
            times = _image_starts(bench, starts)
        except subprocess.CalledProcessError as exc:
            reason = f"podman failed: {' '.join(exc.cmd[:3])}: {exc.stderr.strip()[:80]}"
    if reason is not None:
        report.not_measured(figure, reason, IMAGE_START_TO_REGISTERED_MS, "ms")
        return
    report.figures["image_start_to_registered_s"] = times
    report.check(
        f"{figure}, the slowest of {starts}",
        f"{ms(max(times))} ms (median {ms(statistics.median(times))}; "
        f"the first, from the image just loaded, {ms(times[0])})",
        max(times) * 1000,
        IMAGE_START_TO_REGISTERED_MS,
        "ms",
    )
