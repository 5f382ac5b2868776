"""Start the real daemon against the simulated kubelet and print one table of figures.

    nox -s bench                         # the full run: about two minutes on 2 cores
    python -m bench.run --quick          # fewer repetitions: checks the script, not the daemon
    python -m bench.run --json out.json  # also write the raw figures

Every daemon is ``python -m pcc_plugin`` on a fake node in a temporary directory under /tmp,
talking over unix sockets to :class:`pcc_plugin.sim.SimKubelet`, which runs on grpcio in this
process; the gRPC clients below are grpcio too. Each figure is compared with its target from
issue 4 (written for a 2-core machine) and marked PASS or MISS; the exit code is 0 either way
unless ``--strict`` is given. BENCHMARKS.md records a run and explains every miss.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import grpc

from pcc_plugin.sim import Daemon, FakeNode, SimKubelet
from pcc_plugin.sim._pb import deviceplugin_v1beta1_pb2 as pb
from pcc_plugin.sim.rules import ALLOCATE, LIST_AND_WATCH
from pcc_plugin.sim.state import Registration

ROOT = Path(__file__).resolve().parent.parent
RESOURCE = "tke.cloud.tencent.com/pcc-device"
MIB = 1024 * 1024
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
WAIT = 30.0

# Imported cumulatively in this order, each step in a fresh interpreter: roughly the order in
# which `python -m pcc_plugin` imports them. A step lists modules separated by commas.
IMPORT_STEPS: tuple[tuple[str, str], ...] = (
    ("attrs", "attrs"),
    ("ssl (libssl, libcrypto)", "ssl"),
    ("asyncio", "asyncio"),
    ("trio", "trio"),
    ("trio_asyncio (+ greenlet)", "trio_asyncio"),
    ("grpclib client+server (+ h2, hpack, multidict)", "grpclib.client,grpclib.server"),
    ("importlib.metadata (+ email, zipfile, csv)", "importlib.metadata"),
    ("betterproto2", "betterproto2"),
    ("generated v1beta1 code", "pcc_plugin._proto.v1beta1"),
    ("asyncinotify (+ ctypes, ctypes.util)", "asyncinotify"),
    ("rest of the daemon (pcc_plugin.supervisor)", "pcc_plugin.main,pcc_plugin.supervisor"),
    ("prometheus_client (metrics on)", "prometheus_client"),
    ("pcc_plugin.http_server", "pcc_plugin.http_server"),
)
_REPORT_RSS = (
    "for _line in open('/proc/self/status'):\n"
    "    if _line.startswith('VmRSS:'):\n"
    "        print(_line.split()[1])\n"
)


# /proc readings


def proc_status(pid: int) -> dict[str, int]:
    """The kB figures of /proc/<pid>/status (VmRSS, VmHWM, ...)."""
    figures: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                figures[name] = int(parts[0])
    return figures


def cpu_ticks(pid: int) -> int:
    """utime + stime of the whole process, in clock ticks, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    # After the command name: state is field 3, utime field 14 and stime field 15.
    return int(fields[11]) + int(fields[12])


def _tasks(pid: int) -> list[Path]:
    return list(Path(f"/proc/{pid}/task").iterdir())


def cpu_ns(pid: int) -> int:
    """CPU time of every thread in ns (schedstat): finer than the 10 ms ticks of /proc/pid/stat."""
    total = 0
    for task in _tasks(pid):
        with contextlib.suppress(FileNotFoundError):
            total += int((task / "schedstat").read_text().split()[0])
    return total


def wakeups(pid: int) -> int:
    """Context switches of every thread: each is a wake-up or a preemption."""
    total = 0
    for task in _tasks(pid):
        with contextlib.suppress(FileNotFoundError):
            for line in (task / "status").read_text().splitlines():
                if "ctxt_switches:" in line:
                    total += int(line.split()[1])
    return total


# Statistics


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100 * len(ordered)))
    return ordered[rank - 1]


def ms(seconds: float) -> str:
    value = seconds * 1000
    return f"{value:.2f}" if value < 10 else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def mib(kib: float) -> str:
    return f"{kib / 1024:.1f} MiB"


# The report


@attrs.define
class Row:
    figure: str
    value: str
    target: str = ""
    verdict: str = ""


@attrs.define
class Report:
    rows: list[Row | str] = attrs.Factory(list)
    figures: dict[str, Any] = attrs.Factory(dict)
    misses: list[str] = attrs.Factory(list)

    def section(self, title: str) -> None:
        self.rows.append(title)

    def add(self, figure: str, value: str) -> None:
        self.rows.append(Row(figure, value))

    def check(self, figure: str, value: str, measured: float, limit: float, unit: str) -> None:
        verdict = "PASS" if measured <= limit else "MISS"
        if verdict == "MISS":
            self.misses.append(figure)
        self.rows.append(Row(figure, value, f"<= {limit:g} {unit}", verdict))

    def render(self, header: Sequence[str]) -> str:
        rows = [row for row in self.rows if isinstance(row, Row)]
        widths = [
            max([len(title)] + [len(getattr(row, field)) for row in rows])
            for title, field in (
                ("figure", "figure"),
                ("value", "value"),
                ("target", "target"),
                ("", "verdict"),
            )
        ]
        total = sum(widths) + 3 * (len(widths) - 1)
        out = [*header, "", "=" * total]
        titles = ("figure", "value", "target", "result")
        out.append("   ".join(t.ljust(w) for t, w in zip(titles, widths, strict=True)).rstrip())
        for row in self.rows:
            if isinstance(row, str):
                out += ["-" * total, row]
                continue
            cells = (row.figure, row.value, row.target, row.verdict)
            out.append("   ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
        out.append("=" * total)
        passed = sum(1 for row in rows if row.verdict == "PASS")
        out.append(
            f"{passed} of {passed + len(self.misses)} targets met"
            + (f"; missed: {', '.join(self.misses)}" if self.misses else "")
        )
        return "\n".join(out)


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """No cyclic GC pauses in this process (client and simulated kubelet) while timing."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


# Talking to the daemon


def _as_is(data: bytes) -> bytes:
    return data


def accepted(kubelet: SimKubelet) -> list[Registration]:
    return [registration for registration in kubelet.registrations if registration.accepted]


@contextlib.contextmanager
def plugin_channel(node: FakeNode, endpoint: str) -> Iterator[Any]:
    channel = grpc.insecure_channel(
        f"unix:{node.plugin_dir / endpoint}", options=[("grpc.default_authority", "localhost")]
    )
    try:
        yield channel
    finally:
        channel.close()


def allocate_method(channel: Any) -> Any:
    return channel.unary_unary(
        ALLOCATE,
        request_serializer=pb.AllocateRequest.SerializeToString,
        response_deserializer=pb.AllocateResponse.FromString,
    )


def timed_allocates(method: Any, count: int) -> list[float]:
    """Round trips of `count` Allocate calls as kubelet makes them: one container request."""
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=["pcc-0"])]
    )
    latencies = []
    for _ in range(count):
        started = time.perf_counter()
        response = method(request, timeout=WAIT)
        latencies.append(time.perf_counter() - started)
        if len(response.container_responses) != 1:
            raise RuntimeError(f"unexpected Allocate answer: {response}")
    return latencies


# What-ifs: the daemon patched by a prelude run before its main(), to measure a change before
# making it. Nothing here is what ships.

RUN_DAEMON = "\nfrom pcc_plugin.main import main\n\nmain()\n"
TRIM_ON_SIGUSR1 = """
import ctypes, signal
signal.signal(signal.SIGUSR1, lambda *_: ctypes.CDLL(None).malloc_trim(0))
"""


def without_importlib_metadata() -> str:
    """A prelude that answers the two version lookups the daemon makes from constants."""
    from importlib.metadata import version

    versions = {name: version(name) for name in ("betterproto2", "pcc-device-plugin")}
    return f"""
import sys, types

_versions = {versions!r}

class PackageNotFoundError(ModuleNotFoundError):
    pass

def version(name):
    try:
        return _versions[name]
    except KeyError:
        raise PackageNotFoundError(name) from None

_metadata = types.ModuleType("importlib.metadata")
_metadata.version, _metadata.PackageNotFoundError = version, PackageNotFoundError
sys.modules["importlib.metadata"] = _metadata
"""


def bytecode_env(cache: Path) -> dict[str, str]:
    """Compiled bytecode in `cache`, as the image has it (pip compiles what it installs).

    Without it, a checkout with PYTHONDONTWRITEBYTECODE=1 (as here) compiles the daemon's own
    modules at every start, which the image never does.
    """
    env = {"PYTHONPYCACHEPREFIX": str(cache), "PYTHONDONTWRITEBYTECODE": ""}
    for flags in ([], ["-OO"]):
        subprocess.run(
            [sys.executable, *flags, "-c", "import pcc_plugin.main, pcc_plugin.supervisor, "
             "pcc_plugin.http_server"],
            check=True, cwd=ROOT, env={**os.environ, **env}, timeout=WAIT,
        )  # fmt: skip
    return env


@attrs.define
class Bench:
    node: FakeNode
    kubelet: SimKubelet
    cleanup: contextlib.ExitStack
    report: Report
    env: dict[str, str]
    logs: int = 0

    def spawn(self, *extra: str, prelude: str = "", flags: Sequence[str] = ()) -> Daemon:
        """Start the daemon; with a prelude or Python flags, a patched one (what-ifs)."""
        self.logs += 1
        args = [*self.node.daemon_args(verbosity=0), *extra]
        log_path = self.node.root / f"daemon-{self.logs}.log"
        if prelude or flags:
            argv = [sys.executable, *flags, "-c", prelude + RUN_DAEMON, *args]
            daemon = Daemon(argv, log_path, self.env)
        else:
            daemon = Daemon.spawn_plugin(args, log_path, self.env)
        self.cleanup.callback(daemon.close)
        return daemon

    def registered(self, after: int, devices: int = 16) -> Registration:
        """Wait for accepted registration number `after` + 1 and a full list on a live stream."""

        def ready() -> bool:
            return (
                len(accepted(self.kubelet)) > after
                and self.kubelet.stream_open(RESOURCE)
                and len(self.kubelet.devices(RESOURCE)) == devices
            )

        self.kubelet.wait_for(ready, WAIT)
        return accepted(self.kubelet)[after]

    def stop(self, daemon: Daemon) -> None:
        code = daemon.terminate(signal.SIGTERM, WAIT)
        if code != 0:
            raise RuntimeError(f"daemon {daemon.pid} exited {code}; log:\n{daemon.log_text()}")

    # start -> registered

    def start_to_registered(self, runs: int) -> None:
        self.report.section(f"start -> registered: {runs} process starts, metrics on")
        times = []
        for _ in range(runs):
            before = len(accepted(self.kubelet))
            started = time.monotonic()
            daemon = self.spawn()
            registration = self.registered(before)
            times.append(registration.answered_at - started)
            self.stop(daemon)
        median = statistics.median(times)
        self.report.figures["start_to_registered_s"] = times
        self.report.check(
            "start -> registered, median",
            f"{ms(median)} ms (min {ms(min(times))}, max {ms(max(times))})",
            median * 1000,
            400,
            "ms",
        )

    # idle

    def idle(self, daemon: Daemon, seconds: float, label: str, *, cpu: bool) -> None:
        # Let the start settle (first stream, first health look) before calling it idle.
        time.sleep(2)
        status = proc_status(daemon.pid)
        key = label.replace(" ", "_")
        self.report.figures[f"idle_{key}_kib"] = status
        self.report.check(
            f"idle VmRSS, {label}", mib(status["VmRSS"]), status["VmRSS"] / 1024, 32, "MiB"
        )
        self.report.add(
            "  of which anonymous / file-backed",
            f"{mib(status['RssAnon'])} / {mib(status['RssFile'])} (libpython, libcrypto, ...)",
        )
        self.report.add(f"peak VmHWM, {label}", mib(status["VmHWM"]))
        if not cpu:
            return
        ticks, ns, switches = cpu_ticks(daemon.pid), cpu_ns(daemon.pid), wakeups(daemon.pid)
        started = time.monotonic()
        time.sleep(seconds)
        elapsed = time.monotonic() - started
        ticks = cpu_ticks(daemon.pid) - ticks
        ns = cpu_ns(daemon.pid) - ns
        switches = wakeups(daemon.pid) - switches
        millicores = ticks / CLOCK_TICKS / elapsed * 1000
        fine = ns / 1e9 / elapsed * 1000
        self.report.figures["idle_cpu"] = {
            "seconds": elapsed,
            "ticks": ticks,
            "ns": ns,
            "context_switches": switches,
        }
        self.report.check(
            f"idle CPU over {elapsed:.0f} s (/proc/<pid>/stat)",
            f"{millicores:.2f} millicores ({ticks} ticks of {1000 // CLOCK_TICKS} ms)",
            millicores,
            0.5,
            "millicores",
        )
        self.report.add(
            "  same, from schedstat (ns)", f"{fine:.3f} millicores, {switches} context switches"
        )

    # Allocate

    def allocate(self, pid: int, endpoint: str, calls: int, callers: int) -> None:
        self.report.section("Allocate round trip, grpcio client, one container request")
        with plugin_channel(self.node, endpoint) as channel:
            method = allocate_method(channel)

            def timed(count: int) -> list[float]:
                with no_gc():
                    return timed_allocates(method, count)

            timed(min(200, calls))
            busy = cpu_ns(pid)
            sequential = timed(calls)
            busy = cpu_ns(pid) - busy
            p99 = percentile(sequential, 99)
            self.report.figures["allocate_sequential_s"] = sequential
            self.report.add(
                f"{calls} sequential calls: p50",
                f"{ms(percentile(sequential, 50))} ms",
            )
            self.report.check(
                f"{calls} sequential calls: p99", f"{ms(p99)} ms", p99 * 1000, 2, "ms"
            )
            rounds = [sequential[start : start + 1000] for start in range(0, calls, 1000)]
            self.report.add(
                "  p99 of each 1,000 calls in turn",
                ", ".join(ms(percentile(part, 99)) for part in rounds) + " ms",
            )
            self.report.add("  daemon CPU per call", f"{busy / 1e3 / calls:.0f} us")

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
                started, busy = time.perf_counter(), cpu_ns(pid)
                for thread in threads:
                    thread.join()
                wall = time.perf_counter() - started
                busy = cpu_ns(pid) - busy
            concurrent = [latency for latencies in results for latency in latencies]
            if len(concurrent) != per_caller * callers:
                raise RuntimeError("a concurrent caller failed; see the traceback above")
            self.report.figures["allocate_concurrent_s"] = concurrent
            self.report.add(
                f"{callers} concurrent callers x {per_caller}: p50 / p99",
                f"{ms(percentile(concurrent, 50))} / {ms(percentile(concurrent, 99))} ms",
            )
            self.report.add(
                f"{callers} concurrent callers: throughput",
                f"{len(concurrent) / wall:,.0f} calls/s, daemon busy {busy / 1e9 / wall:.0%} "
                f"of a core ({busy / 1e3 / len(concurrent):.0f} us of CPU a call)",
            )

    # What-ifs

    def what_if_memory(self) -> None:
        self.report.section(
            "What if (patched at start, not what ships): idle VmRSS, then after malloc_trim(0)"
        )
        bare = without_importlib_metadata()
        off = ("--metrics-bind-address=",)
        variants: list[tuple[str, str, tuple[str, ...], tuple[str, ...]]] = [
            ("as shipped, metrics on", "", (), ()),
            ("as shipped, metrics off", "", off, ()),
            ("metrics on, no importlib.metadata", bare, (), ()),
            ("metrics off, no importlib.metadata", bare, off, ()),
            ("metrics on, no importlib.metadata, python -OO", bare, (), ("-OO",)),
            ("metrics off, no importlib.metadata, python -OO", bare, off, ("-OO",)),
        ]
        figures = {}
        for label, prelude, extra, flags in variants:
            before = len(accepted(self.kubelet))
            daemon = self.spawn(*extra, prelude=prelude + TRIM_ON_SIGUSR1, flags=flags)
            self.registered(before)
            time.sleep(2)
            rss = proc_status(daemon.pid)["VmRSS"]
            os.kill(daemon.pid, signal.SIGUSR1)
            time.sleep(0.5)
            trimmed = proc_status(daemon.pid)["VmRSS"]
            self.stop(daemon)
            figures[label] = [rss, trimmed]
            self.report.add(label, f"{mib(rss)}, trimmed {mib(trimmed)}")
        self.report.figures["what_if_rss_kib"] = figures

    # Re-registration

    def restarts(self, daemon: Daemon, count: int) -> None:
        self.report.section(f"kubelet restart -> re-registered: {count} restarts in a row")
        before_fds, before_rss = daemon.open_fds(), proc_status(daemon.pid)["VmRSS"]
        calls_before = self.kubelet.register_calls
        reregister, sim_restart = [], []
        with no_gc():
            for _ in range(count):
                before = len(accepted(self.kubelet))
                started = time.monotonic()
                self.kubelet.restart()
                kubelet_up = time.monotonic()
                registration = self.registered(before)
                reregister.append(registration.answered_at - kubelet_up)
                sim_restart.append(kubelet_up - started)
        # Whatever a last restart set in motion has settled once the stream is open again.
        after_fds, after_rss = daemon.open_fds(), proc_status(daemon.pid)["VmRSS"]
        calls = self.kubelet.register_calls - calls_before
        self.report.figures["reregister_s"] = reregister
        self.report.figures["sim_restart_s"] = sim_restart
        p50, p99, worst = (percentile(reregister, 50), percentile(reregister, 99), max(reregister))
        self.report.check("re-register p50", f"{ms(p50)} ms", p50 * 1000, 50, "ms")
        self.report.add("re-register p99", f"{ms(p99)} ms")
        self.report.check("re-register max", f"{ms(worst)} ms", worst * 1000, 200, "ms")
        self.report.add(
            "  simulated kubelet's own restart (not included)",
            f"p50 {ms(percentile(sim_restart, 50))} ms, max {ms(max(sim_restart))} ms",
        )
        self.report.add("Register calls per restart", f"{calls / count:.2f} ({calls} calls)")
        self.report.add("open fds before -> after", f"{before_fds} -> {after_fds}")
        self.report.add("VmRSS before -> after", f"{mib(before_rss)} -> {mib(after_rss)}")
        self.report.figures["restarts"] = {
            "fds": [before_fds, after_fds],
            "rss_kib": [before_rss, after_rss],
            "register_calls": calls,
        }

    # ListAndWatch

    def list_and_watch(self, counts: Sequence[int], streams: int, repeats: int) -> None:
        self.report.section(
            f"ListAndWatch first message (kubelet's stream open too; {repeats} tries each)"
        )
        for count in counts:
            before = len(accepted(self.kubelet))
            daemon = self.spawn(f"--resource-count={count}")
            endpoint = self.registered(before, devices=count).endpoint
            with plugin_channel(self.node, endpoint) as channel:
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
                change_one = self._change_reaches(law, 1)
                change = self._change_reaches(law, streams)
            self.stop(daemon)
            single, all_of_them = statistics.median(singles), statistics.median(many)
            self.report.figures[f"list_and_watch_{count}"] = {
                "bytes": size,
                "one_stream_s": singles,
                f"{streams}_streams_s": many,
                "change_to_one_stream_s": change_one,
                "change_to_all_streams_s": change,
            }
            self.report.add(f"{count:,} devices: message size", f"{size:,} bytes")
            self.report.add(f"{count:,} devices: 1 stream", f"{ms(single)} ms")
            figure = f"{count:,} devices: {streams} streams opened at once, all served"
            if count >= 10_000:
                self.report.check(figure, f"{ms(all_of_them)} ms", all_of_them * 1000, 100, "ms")
            else:
                self.report.add(figure, f"{ms(all_of_them)} ms")
            shown = [
                "failed" if taken is None else f"{ms(taken)} ms" for taken in (change_one, change)
            ]
            self.report.add(
                f"{count:,} devices: health change -> 1 / {streams} streams",
                f"{shown[0]} / {shown[1]}",
            )

    def _change_reaches(self, law: Callable[..., Any], streams: int) -> float | None:
        """Remove the device: time until every open stream has the Unhealthy list; put it back."""
        calls = [law(b"", timeout=WAIT) for _ in range(streams)]
        try:
            for call in calls:
                next(call)
            started = time.perf_counter()
            self.node.device.unlink()
            try:
                for call in calls:
                    while b"Unhealthy" not in next(call):
                        pass
                return time.perf_counter() - started
            except grpc.RpcError:
                return None
            finally:
                self.node.device.symlink_to("/dev/null")
                self.kubelet.wait_for(
                    lambda: set(self.kubelet.devices(RESOURCE).values()) == {"Healthy"}, WAIT
                )
        finally:
            for call in calls:
                call.cancel()


# Memory of each import


def import_rss(modules: Sequence[str], runs: int, env: dict[str, str]) -> float:
    """VmRSS in kB of a fresh interpreter after importing `modules`, lowest of `runs`."""
    source = "".join(f"import {module}\n" for module in modules) + _REPORT_RSS
    figures = []
    for _ in range(runs):
        output = subprocess.run(
            [sys.executable, "-c", source],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
            env={**os.environ, **env},
            timeout=WAIT,
        ).stdout
        figures.append(float(output))
    return min(figures)


def import_table(report: Report, runs: int, env: dict[str, str]) -> None:
    report.section("VmRSS of imports, fresh interpreters: 'adds' cumulative in this order, 'alone'")
    bare = import_rss([], runs, env)
    report.add("bare interpreter (this venv, site on)", mib(bare))
    cumulative: list[str] = []
    previous = bare
    table = {"bare": bare}
    for label, modules in IMPORT_STEPS:
        cumulative += modules.split(",")
        total = import_rss(cumulative, runs, env)
        alone = import_rss(modules.split(","), runs, env)
        report.add(
            f"+ {label}",
            f"adds {(total - previous) / 1024:+.1f}, alone {(alone - bare) / 1024:+.1f}, "
            f"total {mib(total)}",
        )
        table[label] = total
        previous = total
    report.figures["imports_kib"] = table


# Putting it together


def machine() -> list[str]:
    usable = len(os.sched_getaffinity(0))
    return [
        "pcc-device-plugin benchmark: the real daemon against the simulated kubelet",
        f"machine: {os.cpu_count()} cores ({usable} usable), {platform.machine()}, "
        f"Linux {platform.release()}",
        f"python: {platform.python_implementation()} {platform.python_version()} "
        f"({sys.executable})",
        "daemon: python -m pcc_plugin --v=0 --metrics-bind-address=127.0.0.1:0 on a fake node; "
        "kubelet: pcc_plugin.sim.SimKubelet (grpcio) in the benchmark's process",
        "bytecode: compiled once into a temporary PYTHONPYCACHEPREFIX, as in the image",
        "load average (1, 5, 15 min) at the start: "
        + ", ".join(f"{load:.2f}" for load in os.getloadavg()),
    ]


def run(args: argparse.Namespace) -> Report:
    report = Report()
    quick = args.quick
    node = FakeNode.create()
    try:
        env = bytecode_env(node.root / "pycache")
        with contextlib.ExitStack() as cleanup, SimKubelet(node.plugin_dir) as kubelet:
            bench = Bench(node, kubelet, cleanup, report, env)
            bench.start_to_registered(3 if quick else 10)

            report.section("idle: after registering, kubelet's stream open, nothing asked")
            before = len(accepted(kubelet))
            quiet = bench.spawn("--metrics-bind-address=")
            bench.registered(before)
            bench.idle(quiet, 0, "metrics off", cpu=False)
            bench.stop(quiet)
            before = len(accepted(kubelet))
            daemon = bench.spawn()
            endpoint = bench.registered(before).endpoint
            bench.idle(daemon, 3 if quick else args.idle_seconds, "metrics on (default)", cpu=True)

            bench.allocate(daemon.pid, endpoint, 500 if quick else 5000, 50)
            bench.restarts(daemon, 20 if quick else args.restarts)
            bench.stop(daemon)
            bench.list_and_watch((16, 1000, 10_000), 20, 2 if quick else 5)
            bench.what_if_memory()
        import_table(report, 1 if quick else 3, env)
    finally:
        node.remove()
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    parser.add_argument("--restarts", type=int, default=200, help="kubelet restarts (200)")
    parser.add_argument("--idle-seconds", type=float, default=30.0, help="idle CPU window (30)")
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    started = time.monotonic()
    header = machine()
    report = run(args)
    header.append(
        f"took {time.monotonic() - started:.0f} s; load average at the end: "
        + ", ".join(f"{load:.2f}" for load in os.getloadavg())
    )
    header.append(f"command: {' '.join(sys.argv)}")
    print(report.render(header))
    if args.json:
        args.json.write_text(json.dumps({"machine": header, **report.figures}, indent=1))
    return 1 if args.strict and report.misses else 0


if __name__ == "__main__":
    sys.exit(main())
