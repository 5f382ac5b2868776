"""Allocate from a well-behaved client while hostile ones press on the daemon.

In one run, on one daemon: Allocate p50/p99 unloaded, then while (a) 1,000 idle connections
are held to the plugin socket, (b) a client sends 4 MiB messages in a loop, (c) /metrics is
flooded; and VmRSS during (a) and after. The hostile clients of (b) and (c) run in processes
of their own (bench.hostile_clients), so that they do not share the timed client's GIL.

Then, on a daemon with 10,000 devices, every bounded input at its bound at once: the peak
resident memory, which the manifests' memory request and limit are sized by.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import yaml

from bench import procfs
from bench.harness import (
    LIST_AND_WATCH,
    ROOT,
    WAIT,
    Bench,
    allocate_method,
    metrics_port,
    plugin_channel,
    timed_allocates,
)
from bench.report import mib, ms, percentile
from pcc_plugin.grpc_server import FIRST_REQUEST_TIMEOUT

IDLE_CONNECTIONS = 1000
HOLD_SECONDS = 3.0
FLOOD_RATE = 250.0
# The requirement: under a /metrics flood, Allocate p99 within this factor of its unloaded figure.
FLOOD_P99_FACTOR = 2.0
# Peak memory: the most devices a resource may have, ListAndWatch streams that stop reading,
# enough 4 MiB senders to exhaust the large-message budget, health flapping all the while.
PEAK_DEVICES = 10_000
STALLED_STREAMS = 20
LARGE_SENDERS = 4
FLAP_SECONDS = 0.25
# The peak must fit in the memory the manifests request.
DAEMONSET = ROOT / "manifests" / "base" / "daemonset.yaml"


def _timed_while(method: Any, busy: Callable[[], bool], least: int) -> list[float]:
    """Allocate round trips, one after another, while `busy()` (and at least `least` of them)."""
    latencies: list[float] = []
    while busy() or len(latencies) < least:
        latencies += timed_allocates(method, 10)
    return latencies


@contextlib.contextmanager
def _hostile(*args: str) -> Iterator[subprocess.Popen[str]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.hostile_clients", *args],
        cwd=ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert process.stdout is not None
        if process.stdout.readline().strip() != "ready":
            raise RuntimeError(f"hostile client {args[0]} did not start")
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def _outcome(process: subprocess.Popen[str]) -> tuple[int, int]:
    assert process.stdout is not None
    sent, answered = process.stdout.read().split()
    return int(sent), int(answered)


def _hold_idle_connections(
    path: Path, count: int, held: list[socket.socket], done: threading.Event
) -> None:
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            held.append(sock)
            # Blocking: waits for room in the listen backlog, as a determined client would.
            sock.connect(str(path))
    except OSError:
        pass  # the daemon refused us: we hold what we got
    finally:
        done.set()


def under_hostile_clients(bench: Bench, least: int, seconds: float) -> None:
    report = bench.report
    report.section("Allocate p50 / p99 from a well-behaved client, alone and beside hostile ones")
    daemon, endpoint = bench.start()
    port = metrics_port(daemon)
    path = bench.socket(endpoint)
    figures: dict[str, Any] = {}
    with plugin_channel(path) as channel:
        method = allocate_method(channel)
        timed_allocates(method, 200)

        def show(label: str, latencies: list[float]) -> float:
            p50, p99 = percentile(latencies, 50), percentile(latencies, 99)
            figures[label] = {"p50_s": p50, "p99_s": p99, "calls": len(latencies)}
            report.add(f"{label}: p50 / p99", f"{ms(p50)} / {ms(p99)} ms ({len(latencies)} calls)")
            return p99

        until = time.monotonic() + seconds
        unloaded = show("unloaded", _timed_while(method, lambda: time.monotonic() < until, least))

        held: list[socket.socket] = []
        opened = threading.Event()
        rss_before = procfs.proc_status(daemon.pid)["VmRSS"]
        opener = threading.Thread(
            target=_hold_idle_connections, args=(path, IDLE_CONNECTIONS, held, opened)
        )
        opener.start()
        try:
            until = time.monotonic() + HOLD_SECONDS
            latencies = _timed_while(
                method, lambda: not opened.is_set() or time.monotonic() < until, least
            )
            show(f"(a) {IDLE_CONNECTIONS:,} idle connections held", latencies)
            during = procfs.proc_status(daemon.pid)["VmRSS"]
            fds = procfs.open_fds(daemon.pid)
        finally:
            opener.join()
            _close_all(held)
        # Connections the daemon kept are closed by it for silence; then it is idle again.
        time.sleep(FIRST_REQUEST_TIMEOUT + 1)
        after = procfs.proc_status(daemon.pid)["VmRSS"]
        report.add(
            "  VmRSS before / during (a) / after",
            f"{mib(rss_before)} / {mib(during)} / {mib(after)}; {fds} fds open during",
        )
        figures["idle_connections_rss_kib"] = [rss_before, during, after]

        with _hostile("large", str(path), str(seconds)) as large:
            latencies = _timed_while(method, lambda: large.poll() is None, least)
            sent, refused = _outcome(large)
        show("(b) 4 MiB messages in a loop", latencies)
        report.add("  4 MiB messages sent / refused INVALID_ARGUMENT", f"{sent} / {refused}")
        figures["large_messages"] = [sent, refused]

        with _hostile("metrics", str(port), str(seconds), str(FLOOD_RATE)) as flood:
            latencies = _timed_while(method, lambda: flood.poll() is None, least)
            sent, answered = _outcome(flood)
        flooded = show("(c) /metrics flooded", latencies)
        rate = answered / seconds
        report.add("  /metrics requests answered 200", f"{answered} of {sent}, {rate:.0f} a second")
        figures["metrics_flood"] = [sent, answered]
        report.check(
            "(c) p99 as a multiple of unloaded p99",
            f"{flooded / unloaded:.2f}x at {rate:.0f} scrapes/s",
            flooded / unloaded,
            FLOOD_P99_FACTOR,
            "x",
        )
    bench.stop(daemon)
    report.figures["hostile"] = figures


def peak_memory(bench: Bench, seconds: float) -> None:
    """Every input the daemon bounds, at its bound at once, for `seconds`: its VmHWM."""
    report = bench.report
    report.section(
        f"peak memory: every bounded input at its bound at once, {PEAK_DEVICES:,} devices"
    )
    daemon, endpoint = bench.start(f"--resource-count={PEAK_DEVICES}", devices=PEAK_DEVICES)
    port = metrics_port(daemon)
    path = bench.socket(endpoint)
    before = procfs.proc_status(daemon.pid)["VmRSS"]
    held: list[socket.socket] = []
    opened = threading.Event()
    opener = threading.Thread(
        target=_hold_idle_connections, args=(path, IDLE_CONNECTIONS, held, opened)
    )
    # The stalled streams get a connection of their own, which their unread lists fill.
    stalled_channel = grpc.insecure_channel(
        f"unix:{path}",
        options=[("grpc.default_authority", "localhost"), ("grpc.use_local_subchannel_pool", 1)],
    )
    flaps = allocates = 0
    with contextlib.ExitStack() as stack, plugin_channel(path) as channel:
        stack.callback(stalled_channel.close)
        law = stalled_channel.unary_stream(
            LIST_AND_WATCH, request_serializer=bytes, response_deserializer=bytes
        )
        for stream in [law(b"", timeout=WAIT) for _ in range(STALLED_STREAMS)]:
            next(stream)  # the first list, then never read again
        senders = [
            stack.enter_context(_hostile("large", str(path), str(seconds)))
            for _ in range(LARGE_SENDERS)
        ]
        stack.enter_context(_hostile("metrics", str(port), str(seconds), str(FLOOD_RATE)))
        opener.start()
        stack.callback(_close_all, held)
        stack.callback(opener.join)
        method = allocate_method(channel)
        while any(sender.poll() is None for sender in senders):
            # Each flap sends the 10,000-device list to kubelet's stream and the stalled ones.
            bench.node.device.unlink()
            time.sleep(FLAP_SECONDS)
            bench.node.device.symlink_to("/dev/null")
            time.sleep(FLAP_SECONDS)
            flaps += 1
            allocates += len(timed_allocates(method, 10))
        peak = procfs.proc_status(daemon.pid)
    bench.stop(daemon)
    report.add("VmRSS before / at the end", f"{mib(before)} / {mib(peak['VmRSS'])}")
    report.check(
        "peak resident (VmHWM)",
        mib(peak["VmHWM"]),
        peak["VmHWM"] / 1024,
        _requested_memory_mib(),
        "MiB",
    )
    report.add(
        "  meanwhile",
        f"{flaps} health flaps, {allocates} Allocates answered, {IDLE_CONNECTIONS:,} idle "
        f"connections, {STALLED_STREAMS} stalled streams, {LARGE_SENDERS} 4 MiB senders, "
        f"/metrics at {FLOOD_RATE:.0f}/s",
    )
    report.figures["peak_memory_kib"] = {
        "before": before, "end": peak["VmRSS"], "hwm": peak["VmHWM"],
    }  # fmt: skip


def _requested_memory_mib() -> float:
    """The plugin container's memory request in manifests/base, in MiB."""
    (daemonset,) = yaml.safe_load_all(DAEMONSET.read_text())
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    request: str = container["resources"]["requests"]["memory"]
    if not request.endswith("Mi"):
        raise ValueError(f"{DAEMONSET}: memory request {request!r} is not in Mi")
    return float(request.removesuffix("Mi"))


def _close_all(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()
