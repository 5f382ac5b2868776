"""Readings of a process from /proc: memory, CPU time, wake-ups, descriptors."""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
_LIBC = ctypes.CDLL(None, use_errno=True)


def _kib_fields(path: str) -> dict[str, int]:
    figures: dict[str, int] = {}
    with open(path) as lines:
        for line in lines:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                figures[name] = int(parts[0])
    return figures


def proc_status(pid: int) -> dict[str, int]:
    """The kB figures of /proc/<pid>/status (VmRSS, VmHWM, RssAnon, RssFile, ...)."""
    return _kib_fields(f"/proc/{pid}/status")


def memory(pid: int) -> dict[str, int]:
    """VmRSS and its anonymous and file-backed parts, VmHWM, and PSS with its parts, in kB.

    PSS divides each shared page by the processes that map it: what the process costs a node
    where other processes (other Python programs) share its libraries.
    """
    status = proc_status(pid)
    rollup = _kib_fields(f"/proc/{pid}/smaps_rollup")
    return {
        "VmRSS": status["VmRSS"],
        "VmHWM": status["VmHWM"],
        "RssAnon": status["RssAnon"],
        "RssFile": status["RssFile"],
        "Pss": rollup["Pss"],
        "Pss_Anon": rollup.get("Pss_Anon", 0),
        "Pss_File": rollup.get("Pss_File", 0),
    }


def cpu_ticks(pid: int) -> int:
    """utime + stime of the whole process, in clock ticks, from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rpartition(")")[2].split()
    # After the command name: state is field 3, utime field 14 and stime field 15.
    return int(fields[11]) + int(fields[12])


def _tasks(pid: int) -> list[Path]:
    return list(Path(f"/proc/{pid}/task").iterdir())


def cpu_ns(pid: int) -> int:
    """CPU time of every thread in ns, the exited ones' too: finer than the 10 ms ticks of
    /proc/pid/stat.

    This is the process's CPU clock (clock_getcpuclockid(3)), the sum of its threads'
    schedstat run times and of those its exited threads had. Summing
    /proc/<pid>/task/*/schedstat would lose a thread's time when it exits (trio's worker
    threads do, 10 s after their last job), and a window in which one exits would read less.
    """
    clock = ctypes.c_int()
    error = _LIBC.clock_getcpuclockid(pid, ctypes.byref(clock))
    if error:
        raise OSError(error, f"clock_getcpuclockid({pid}): {os.strerror(error)}")
    return time.clock_gettime_ns(clock.value)


def run_delay_ns(pid: int) -> int:
    """How long the live threads of `pid` have waited for a CPU while ready to run, in ns
    (schedstat's second field): what a loaded machine adds to every latency."""
    total = 0
    for task in _tasks(pid):
        with contextlib.suppress(FileNotFoundError):
            total += int((task / "schedstat").read_text().split()[1])
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


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))
