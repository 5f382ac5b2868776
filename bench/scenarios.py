"""The daemon's figures and their targets: start, idle, Allocate, restarts, ListAndWatch."""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from bench import procfs
from bench.harness import (
    LIST_AND_WATCH,
    RESOURCE,
    ROOT,
    WAIT,
    Bench,
    accepted,
    allocate_method,
    metrics_port,
    no_gc,
    plugin_channel,
    seconds_to_exit,
    timed_allocates,
)
from bench.imports import STACK_AS_THE_DAEMON_IMPORTS_IT
from bench.report import Report, mib, ms, percentile
from pcc_plugin.sim import Daemon

# Targets, written for the 2-core machine of BENCHMARKS.md.
START_TO_REGISTERED_MS = 200
IDLE_RSS_MIB = 30
IDLE_MILLICORES = 0.5
ALLOCATE_P99_MS = 2
ALLOCATE_CPU_US = 400
THROUGHPUT_CALLS_S = 3000
REREGISTER_P50_MS = 50
REREGISTER_MAX_MS = 200
TEN_THOUSAND_TO_20_STREAMS_MS = 100


def _as_is(data: bytes) -> bytes:
    return data


def scrape(port: int, path: str = "/metrics") -> bytes:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}{path}", timeout=WAIT) as response:
        body: bytes = response.read()
        return body


def start_to_registered(bench: Bench, runs: int, *, judged: bool) -> None:
    """Daemon starts, each followed by the stack imported alone by the same interpreter.

    The target is judged here only when the image's daemon, which is what a node runs, cannot
    be measured (`bench.image`).
    """
    bench.report.section(f"start -> registered: {runs} process starts, metrics on")
    times, stack = [], []
    stack_alone = [sys.executable, "-c", STACK_AS_THE_DAEMON_IMPORTS_IT]
    for _ in range(runs):
        before = len(accepted(bench.kubelet))
        started = time.monotonic()
        daemon = bench.spawn()
        registration = bench.registered(before)
        times.append(registration.answered_at - started)
        bench.stop(daemon)
        stack.append(seconds_to_exit(stack_alone, bench.env))
    bench.report.figures["start_to_registered_s"] = times
    bench.report.figures["stack_imports_s"] = stack
    report_start(bench.report, "start -> registered, median", times, judged=judged)
    report_stack(bench.report, stack, times)


def report_start(report: Report, figure: str, times: Sequence[float], *, judged: bool) -> None:
    median = statistics.median(times)
    value = f"{ms(median)} ms (min {ms(min(times))}, max {ms(max(times))})"
    if judged:
        report.check(figure, value, median * 1000, START_TO_REGISTERED_MS, "ms")
    else:
        report.add(figure, f"{value}; the target is judged on the image's")


def report_stack(report: Report, stack: Sequence[float], starts: Sequence[float]) -> None:
    """The stack's imports alone beside the daemon's start, both timed the same way, alternated."""
    median = statistics.median(stack)
    report.add(
        "  the stack alone (trio, grpclib, ...), imported as the daemon does, median",
        f"{ms(median)} ms (min {ms(min(stack))}); the daemon's start "
        f"{(statistics.median(starts) - median) * 1000:+.0f} ms over it",
    )


def memory_rows(bench: Bench, pid: int, label: str, *, check: bool) -> dict[str, int]:
    """VmRSS (checked against the target), its parts, and PSS of the process `pid`."""
    figures = procfs.memory(pid)
    value = mib(figures["VmRSS"])
    if check:
        bench.report.check(
            f"idle VmRSS, {label}", value, figures["VmRSS"] / 1024, IDLE_RSS_MIB, "MiB"
        )
    else:
        bench.report.add(f"idle VmRSS, {label}", value)
    bench.report.add(
        "  anonymous / file-backed; VmHWM",
        f"{mib(figures['RssAnon'])} / {mib(figures['RssFile'])}; {mib(figures['VmHWM'])}",
    )
    bench.report.add(
        "  PSS (anonymous / file-backed)",
        f"{mib(figures['Pss'])} ({mib(figures['Pss_Anon'])} / {mib(figures['Pss_File'])})",
    )
    return figures


def idle(bench: Bench, cpu_seconds: float) -> Daemon:
    """Memory with metrics off, on, and on after a scrape; CPU of the last; returns it, running."""
    bench.report.section("idle: 2 s after registering, kubelet's stream open, nothing asked")
    quiet, _ = bench.start("--metrics-bind-address=")
    # Let the start settle (first stream, first health look) before calling it idle.
    time.sleep(2)
    bench.report.figures["idle_metrics_off_kib"] = memory_rows(
        bench, quiet.pid, "metrics off", check=False
    )
    bench.stop(quiet)
    daemon, _ = bench.start()
    time.sleep(2)
    bench.report.figures["idle_metrics_on_kib"] = memory_rows(
        bench, daemon.pid, "metrics on (default), not scraped yet", check=False
    )
    # A node's daemon is probed every 10 s and scraped every 30 s: count what that loads.
    port = metrics_port(daemon)
    for path in ("/metrics", "/livez", "/readyz"):
        scrape(port, path)
    time.sleep(1)
    bench.report.figures["idle_metrics_on_scraped_kib"] = memory_rows(
        bench, daemon.pid, "metrics on (default), scraped", check=True
    )
    ticks, ns = procfs.cpu_ticks(daemon.pid), procfs.cpu_ns(daemon.pid)
    switches = procfs.wakeups(daemon.pid)
    started = time.monotonic()
    time.sleep(cpu_seconds)
    elapsed = time.monotonic() - started
    ticks = procfs.cpu_ticks(daemon.pid) - ticks
    ns = procfs.cpu_ns(daemon.pid) - ns
    switches = procfs.wakeups(daemon.pid) - switches
    millicores = ticks / procfs.CLOCK_TICKS / elapsed * 1000
    bench.report.figures["idle_cpu"] = {
        "seconds": elapsed,
        "ticks": ticks,
        "ns": ns,
        "context_switches": switches,
    }
    bench.report.check(
        f"idle CPU over {elapsed:.0f} s (/proc/<pid>/stat)",
        f"{millicores:.2f} millicores ({ticks} ticks of {1000 // procfs.CLOCK_TICKS} ms)",
        millicores,
        IDLE_MILLICORES,
        "millicores",
    )
    bench.report.add(
        "  same, from schedstat (ns)",
        f"{ns / 1e9 / elapsed * 1000:.3f} millicores, {switches} context switches",
    )
    return daemon


def sequential_allocates(pid: int, method: Any, calls: int) -> tuple[list[float], float]:
    """Latencies of `calls` Allocates one after another, and the server's CPU per call in s."""
    with no_gc():
        timed_allocates(method, min(200, calls))
        busy = procfs.cpu_ns(pid)
        latencies = timed_allocates(method, calls)
        busy = procfs.cpu_ns(pid) - busy
    return latencies, busy / 1e9 / calls


def allocate(bench: Bench, pid: int, endpoint: str, calls: int, callers: int) -> None:
    """Allocate round trips, one by one and from `callers` threads."""
    report = bench.report
    report.section("Allocate round trip, grpcio client, one container request")
    with plugin_channel(bench.socket(endpoint)) as channel:
        method = allocate_method(channel)
        sequential, cpu = sequential_allocates(pid, method, calls)
        p99 = percentile(sequential, 99)
        report.figures["allocate_sequential_s"] = sequential
        report.figures["allocate_cpu_s"] = cpu
        report.add(f"{calls} sequential calls: p50", f"{ms(percentile(sequential, 50))} ms")
        report.check(f"{calls} sequential calls: p99", f"{ms(p99)} ms", p99 * 1000,
                     ALLOCATE_P99_MS, "ms")  # fmt: skip
        rounds = [sequential[start : start + 1000] for start in range(0, calls, 1000)]
        report.add(
            "  p99 of each 1,000 calls in turn",
            ", ".join(ms(percentile(part, 99)) for part in rounds) + " ms",
        )
        report.check("daemon CPU per call", f"{cpu * 1e6:.0f} us", cpu * 1e6, ALLOCATE_CPU_US, "us")

        per_caller = calls // callers
        results: list[list[float]] = [[] for _ in range(callers)]
        barrier = threading.Barrier(callers + 1)

        def caller(index: int) -> None:
            barrier.wait()
            results[index] = timed_allocates(method, per_caller)

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(callers)]
        with no_gc():
            for thread in threads:
                thread.start()
            barrier.wait()
            started, busy = time.perf_counter(), procfs.cpu_ns(pid)
            for thread in threads:
                thread.join()
            wall = time.perf_counter() - started
            busy = procfs.cpu_ns(pid) - busy
        concurrent = [latency for latencies in results for latency in latencies]
        if len(concurrent) != per_caller * callers:
            raise RuntimeError("a concurrent caller failed; see the traceback above")
        report.figures["allocate_concurrent_s"] = concurrent
        report.add(
            f"{callers} concurrent callers x {per_caller}: p50 / p99",
            f"{ms(percentile(concurrent, 50))} / {ms(percentile(concurrent, 99))} ms",
        )
        rate = len(concurrent) / wall
        report.figures["throughput_calls_s"] = rate
        report.check(
            f"{callers} concurrent callers: throughput",
            f"{rate:,.0f} calls/s, daemon busy {busy / 1e9 / wall:.0%} of a core "
            f"({busy / 1e3 / len(concurrent):.0f} us of CPU a call)",
            rate,
            THROUGHPUT_CALLS_S,
            "calls/s",
            at_least=True,
        )


def restarts(bench: Bench, daemon: Daemon, count: int) -> None:
    report, kubelet = bench.report, bench.kubelet
    report.section(f"kubelet restart -> re-registered: {count} restarts in a row")
    before_fds, before_rss = daemon.open_fds(), procfs.proc_status(daemon.pid)["VmRSS"]
    calls_before = kubelet.register_calls
    reregister, sim_restart = [], []
    with no_gc():
        for _ in range(count):
            before = len(accepted(kubelet))
            started = time.monotonic()
            kubelet.restart()
            kubelet_up = time.monotonic()
            registration = bench.registered(before)
            reregister.append(registration.answered_at - kubelet_up)
            sim_restart.append(kubelet_up - started)
    # Whatever a last restart set in motion has settled once the stream is open again.
    after_fds, after_rss = daemon.open_fds(), procfs.proc_status(daemon.pid)["VmRSS"]
    calls = kubelet.register_calls - calls_before
    report.figures["reregister_s"] = reregister
    report.figures["sim_restart_s"] = sim_restart
    p50, p99, worst = (percentile(reregister, 50), percentile(reregister, 99), max(reregister))
    report.check("re-register p50", f"{ms(p50)} ms", p50 * 1000, REREGISTER_P50_MS, "ms")
    report.add("re-register p99", f"{ms(p99)} ms")
    report.check("re-register max", f"{ms(worst)} ms", worst * 1000, REREGISTER_MAX_MS, "ms")
    report.add(
        "  simulated kubelet's own restart (not included)",
        f"p50 {ms(percentile(sim_restart, 50))} ms, max {ms(max(sim_restart))} ms",
    )
    report.add("Register calls per restart", f"{calls / count:.2f} ({calls} calls)")
    report.add("open fds before -> after", f"{before_fds} -> {after_fds}")
    report.add("VmRSS before -> after", f"{mib(before_rss)} -> {mib(after_rss)}")
    report.figures["restarts"] = {
        "fds": [before_fds, after_fds],
        "rss_kib": [before_rss, after_rss],
        "register_calls": calls,
    }


def list_and_watch(bench: Bench, counts: Sequence[int], streams: int, repeats: int) -> None:
    report = bench.report
    report.section(f"ListAndWatch first message (kubelet's stream open too; {repeats} tries each)")
    for count in counts:
        daemon, endpoint = bench.start(f"--resource-count={count}", devices=count)
        with plugin_channel(bench.socket(endpoint)) as channel:
            law = channel.unary_stream(
                LIST_AND_WATCH, request_serializer=_as_is, response_deserializer=_as_is
            )
            singles, size = [], 0
            for _ in range(repeats):
                started = time.perf_counter()
                call = law(b"", timeout=WAIT)
                size = len(next(call))
                singles.append(time.perf_counter() - started)
                call.cancel()
            many = []
            for _ in range(repeats):
                started = time.perf_counter()
                calls = [law(b"", timeout=WAIT) for _ in range(streams)]
                for call in calls:
                    next(call)
                many.append(time.perf_counter() - started)
                for call in calls:
                    call.cancel()
            change_one = _change_reaches(bench, law, 1)
            change = _change_reaches(bench, law, streams)
        bench.stop(daemon)
        single, all_of_them = statistics.median(singles), statistics.median(many)
        report.figures[f"list_and_watch_{count}"] = {
            "bytes": size,
            "one_stream_s": singles,
            f"{streams}_streams_s": many,
            "change_to_one_stream_s": change_one,
            "change_to_all_streams_s": change,
        }
        report.add(f"{count:,} devices: message size", f"{size:,} bytes")
        report.add(f"{count:,} devices: 1 stream", f"{ms(single)} ms")
        figure = f"{count:,} devices: {streams} streams opened at once, all served"
        if count >= 10_000:
            report.check(figure, f"{ms(all_of_them)} ms", all_of_them * 1000,
                         TEN_THOUSAND_TO_20_STREAMS_MS, "ms")  # fmt: skip
        else:
            report.add(figure, f"{ms(all_of_them)} ms")
        shown = ["failed" if taken is None else f"{ms(taken)} ms" for taken in (change_one, change)]
        report.add(f"{count:,} devices: health change -> 1 / {streams} streams",
                   f"{shown[0]} / {shown[1]}")  # fmt: skip


def _change_reaches(bench: Bench, law: Callable[..., Any], streams: int) -> float | None:
    """Remove the device: time until every open stream has the Unhealthy list; put it back."""
    calls = [law(b"", timeout=WAIT) for _ in range(streams)]
    try:
        for call in calls:
            next(call)
        started = time.perf_counter()
        bench.node.device.unlink()
        try:
            for call in calls:
                while b"Unhealthy" not in next(call):
                    pass
            return time.perf_counter() - started
        except grpc.RpcError:
            return None
        finally:
            bench.node.device.symlink_to("/dev/null")
            bench.kubelet.wait_for(
                lambda: set(bench.kubelet.devices(RESOURCE).values()) == {"Healthy"}, WAIT
            )
    finally:
        for call in calls:
            call.cancel()


def compare_with_grpcio(bench: Bench, pid: int, endpoint: str, calls: int, rounds: int) -> None:
    """The same Allocate answered by a minimal grpcio server, and our CPU as a multiple of it.

    The two are called in alternate rounds, so that the host's drift (other machines' load on a
    shared one moves these figures by 2x within an hour) falls on both alike.
    """
    socket_path = bench.node.root / "yardstick.sock"
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.yardstick", str(socket_path)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    per_round = calls // rounds
    ours: list[float] = []
    theirs: list[float] = []
    latencies: list[float] = []
    try:
        assert server.stdout is not None
        if server.stdout.readline().strip() != "serving":
            raise RuntimeError("the grpcio yardstick did not start")
        with (
            plugin_channel(bench.socket(endpoint)) as daemon_channel,
            plugin_channel(socket_path) as yardstick_channel,
        ):
            daemon_method = allocate_method(daemon_channel)
            yardstick_method = allocate_method(yardstick_channel)
            for _ in range(rounds):
                ours.append(sequential_allocates(pid, daemon_method, per_round)[1])
                round_latencies, cpu = sequential_allocates(server.pid, yardstick_method, per_round)
                theirs.append(cpu)
                latencies += round_latencies
    finally:
        server.kill()
        server.wait()
    ratios = sorted(daemon / grpcio for daemon, grpcio in zip(ours, theirs, strict=True))
    bench.report.figures["yardstick"] = {
        "cpu_s": theirs, "daemon_cpu_s": ours, "sequential_s": latencies,
    }  # fmt: skip
    bench.report.add(
        f"grpcio server, same calls ({rounds} rounds alternated with the daemon's): CPU per call",
        f"{statistics.median(theirs) * 1e6:.0f} us (daemon {statistics.median(ours) * 1e6:.0f} us);"
        f" p50 / p99 {ms(percentile(latencies, 50))} / {ms(percentile(latencies, 99))} ms",
    )
    bench.report.add(
        "  daemon CPU per call as a multiple of grpcio's",
        f"{statistics.median(ratios):.2f}x (rounds {ratios[0]:.2f}x to {ratios[-1]:.2f}x)",
    )
