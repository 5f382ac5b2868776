"""Hostile clients of the daemon, and its peak memory with every bounded input at its bound.

The 4 MiB sender and the /metrics flood run in processes of their own
(`bench.hostile_clients`), so that they do not share the timed client's GIL; the idle
connections are held by a thread. `bench.scenarios` times Allocate beside each of them.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import time
from pathlib import Path

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
    python_module,
    timed_allocates,
)
from bench.report import mib

IDLE_CONNECTIONS = 1000
FLOOD_RATE = 250.0
# Peak memory: the most devices a resource may have, ListAndWatch streams that stop reading,
# enough 4 MiB senders to exhaust the large-message budget, health flapping all the while.
PEAK_DEVICES = 10_000
STALLED_STREAMS = 20
LARGE_SENDERS = 4
FLAP_SECONDS = 0.25
# The peak is printed beside the memory the manifests request and allow.
DAEMONSET = ROOT / "manifests" / "base" / "daemonset.yaml"


def client(*args: str) -> contextlib.AbstractContextManager[subprocess.Popen[str]]:
    """One of `bench.hostile_clients`, started and ready; killed at the end if still running."""
    return python_module("bench.hostile_clients", *args, ready="ready")


def outcome(process: subprocess.Popen[str]) -> tuple[int, int]:
    """What a finished hostile client reports: requests made, and answered as expected."""
    assert process.stdout is not None
    sent, answered = process.stdout.read().split()
    return int(sent), int(answered)


def _hold(path: Path, held: list[socket.socket], done: threading.Event) -> None:
    try:
        for _ in range(IDLE_CONNECTIONS):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            held.append(sock)
            # Blocking: waits for room in the listen backlog, as a determined client would.
            sock.connect(str(path))
    except OSError:
        pass  # the daemon refused us: we hold what we got
    finally:
        done.set()


def idle_connections(
    path: Path, held: list[socket.socket], done: threading.Event
) -> threading.Thread:
    """A started thread opening IDLE_CONNECTIONS connections to `path` into `held`, which
    sets `done` once it has them or is refused; they are closed with `close_all`."""
    opener = threading.Thread(target=_hold, args=(path, held, done))
    opener.start()
    return opener


def close_all(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


def peak_memory(bench: Bench, seconds: float) -> None:
    """Every input the daemon bounds, at its bound at once, for `seconds`: its VmHWM, which
    the manifests' memory request and limit are sized by."""
    report = bench.report
    report.section(
        f"peak memory: every bounded input at its bound at once, {PEAK_DEVICES:,} devices"
    )
    daemon, endpoint = bench.start(f"--resource-count={PEAK_DEVICES}", devices=PEAK_DEVICES)
    port = metrics_port(daemon)
    path = bench.socket(endpoint)
    before = procfs.proc_status(daemon.pid)["VmRSS"]
    held: list[socket.socket] = []
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
            stack.enter_context(client("large", str(path), str(seconds)))
            for _ in range(LARGE_SENDERS)
        ]
        stack.enter_context(client("metrics", str(port), str(seconds), str(FLOOD_RATE)))
        stack.callback(close_all, held)
        stack.callback(idle_connections(path, held, threading.Event()).join)
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
    request, limit = _manifest_memory()
    report.add("VmRSS before / at the end", f"{mib(before)} / {mib(peak['VmRSS'])}")
    report.add(
        "peak resident (VmHWM); the manifests' memory request / limit",
        f"{mib(peak['VmHWM'])}; {request} / {limit}",
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


def _manifest_memory() -> tuple[str, str]:
    """The plugin container's memory request and limit in manifests/base."""
    (daemonset,) = yaml.safe_load_all(DAEMONSET.read_text())
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    resources = container["resources"]
    return resources["requests"]["memory"], resources["limits"]["memory"]
