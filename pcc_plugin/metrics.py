"""/metrics: the daemon's plain counters, read at scrape time, in Prometheus' text format 0.0.4.

Written here rather than with prometheus_client: the daemon has a dozen
families and one histogram, and the library (with the http.server, email and
wsgiref modules it imports) cost 2.5 MiB of every node's memory and 20 ms of
every start. tests/test_metrics.py parses the output with prometheus_client's
own parser.
"""

from __future__ import annotations

import functools
import operator
import os
import resource
from collections.abc import Iterable, Sequence

from pcc_plugin import __version__
from pcc_plugin.state import DRA_OPERATIONS, DURATION_BUCKETS, DaemonState, Histogram

Labels = Sequence[tuple[str, str]]
Sample = tuple[Labels, float]

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _number(value: float) -> str:
    return repr(float(value))  # "1.0", as prometheus_client writes it


@functools.cache
def _head(name: str, kind: str, help_text: str) -> tuple[str, list[str]]:
    sample_name = f"{name}_total" if kind == "counter" else name
    escaped_help = help_text.replace("\\", r"\\").replace("\n", r"\n")
    return sample_name, [f"# HELP {sample_name} {escaped_help}", f"# TYPE {sample_name} {kind}"]


def family(name: str, kind: str, help_text: str, samples: Iterable[Sample]) -> str:
    """One metric family: HELP, TYPE and its samples (a counter's carry `_total`)."""
    sample_name, head = _head(name, kind, help_text)
    lines = head.copy()
    for labels, value in samples:
        shown = ",".join(f'{key}="{_escape_label(text)}"' for key, text in labels)
        lines.append(f"{sample_name}{{{shown}}} {_number(value)}" if shown else
                     f"{sample_name} {_number(value)}")  # fmt: skip
    return "\n".join(lines) + "\n"


def _own_stat() -> list[str]:
    with open("/proc/self/stat") as stat:
        # After the command name, fields count from 3 (state): utime 14, stime 15,
        # starttime 22, vsize 23, rss 24.
        return stat.read().rpartition(")")[2].split()


@functools.cache
def _start_time() -> float:
    """When the process started, in seconds since the epoch; read once (/proc/stat is long)."""
    with open("/proc/stat") as system:
        boot = next(int(line.split()[1]) for line in system if line.startswith("btime "))
    return boot + int(_own_stat()[19]) / _CLOCK_TICKS


def process_families() -> list[str]:
    """The process_* figures Prometheus' client libraries export, from /proc/self."""
    utime, stime, vsize, rss = (
        int(field) for field in operator.itemgetter(11, 12, 20, 21)(_own_stat())
    )
    max_fds = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return [
        family("process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.",
               [((), vsize)]),
        family("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.",
               [((), rss * _PAGE_SIZE)]),
        family("process_start_time_seconds", "gauge",
               "Start time of the process since unix epoch in seconds.",
               [((), _start_time())]),
        family("process_cpu_seconds", "counter",
               "Total user and system CPU time spent in seconds.",
               [((), (utime + stime) / _CLOCK_TICKS)]),
        family("process_open_fds", "gauge", "Number of open file descriptors.",
               [((), len(os.listdir("/proc/self/fd")))]),
        family("process_max_fds", "gauge", "Maximum number of open file descriptors.",
               [((), max_fds)]),
    ]  # fmt: skip


def render(daemon: DaemonState) -> bytes:
    """Every family of the daemon's mode, read now from its state (a mode's own families are
    not emitted in the other)."""
    dra = daemon.mode == "dra"
    families = [
        *process_families(),
        family("pcc_device_plugin_build_info", "gauge", "Build information.",
               [((("version", __version__),), 1)]),
        family(
            "pcc_device_plugin_config_info", "gauge",
            "The running configuration: its file (or 'flags') and the hash of its bytes.",
            [((("source", str(daemon.path or "flags")), ("hash", daemon.digest)),
              1)],
        ),
        family("pcc_device_plugin_config_generation", "gauge",
               "Configurations applied: 1 at start, one more per successful reload.",
               [((), daemon.generation)]),
        family("pcc_device_plugin_config_last_reload_successful", "gauge",
               "0 when the last reload was refused (the file was invalid), else 1.",
               [((), 0 if daemon.last_reload_failed else 1)]),
        family("pcc_device_plugin_registrations", "counter",
               "Successful registrations with kubelet, by what caused them.",
               [((("resource", each.name), ("cause", cause)), count)
                for each in daemon.resources
                for cause, count in sorted(each.registrations.items())]),
        family("pcc_device_plugin_backoff_seconds", "counter",
               "Time waited before serving again after the plugin's own faults (never after a "
               "kubelet restart).",
               [((("resource", each.name),), each.backoff_seconds) for each in daemon.resources]),
        family("pcc_device_plugin_devices", "gauge", "Advertised devices, by health.",
               [sample for each in daemon.resources for sample in (
                   ((("resource", each.name), ("health", "Healthy")), each.healthy_devices),
                   ((("resource", each.name), ("health", "Unhealthy")), each.unhealthy_devices))]),
        family("pcc_device_plugin_handler_errors", "counter",
               "Unexpected errors in gRPC handlers and connections (bugs), by where.",
               [((("resource", each.name), ("where", where)), count)
                for each in daemon.resources
                for where, count in sorted(each.handler_errors.items())]),
        family("pcc_device_plugin_ready", "gauge",
               "1 when registered with the current kubelet and its ResourceSlices are published "
               "(--mode=dra) or its ListAndWatch stream is open.",
               [((("resource", each.name),), 0 if each.not_ready_reason() else 1)
                for each in daemon.resources]),
        *(_dra_families(daemon) if dra else _device_plugin_families(daemon)),
    ]  # fmt: skip
    return "".join(families).encode()


def _device_plugin_families(daemon: DaemonState) -> list[str]:
    return [
        family("pcc_device_plugin_kubelet_restarts", "counter", "Kubelet restarts seen.",
               [((("resource", each.name),), each.kubelet_restarts) for each in daemon.resources]),
        family("pcc_device_plugin_allocations", "counter", "Allocate calls, by result.",
               [((("resource", each.name), ("result", result)), each.allocations[result])
                for each in daemon.resources
                for result in ("ok", "invalid", "unavailable")]),
        family("pcc_device_plugin_list_and_watch_streams", "gauge", "Open ListAndWatch streams.",
               [((("resource", each.name),), each.streams_open) for each in daemon.resources]),
    ]  # fmt: skip


def _dra_families(daemon: DaemonState) -> list[str]:
    """The DRA driver's, as an operator of NVIDIA's DRA driver finds them there: calls, their
    duration and those in flight by operation, the prepared devices, the errors by stage."""
    resources = daemon.resources
    return [
        family("pcc_device_plugin_dra_claims", "counter",
               "Claims answered by NodePrepareResources and NodeUnprepareResources, by call and "
               "result.",
               [((("resource", each.name), ("call", call), ("result", result)), counter[result])
                for each in resources
                for call, counter in (("prepare", each.prepares),
                                      ("unprepare", each.unprepares))
                for result in ("ok", "failed")]),
        family("pcc_device_plugin_dra_requests", "counter",
               "NodePrepareResources and NodeUnprepareResources calls answered, by operation.",
               [((("resource", each.name), ("operation", operation)), each.dra_calls[operation])
                for each in resources for operation in DRA_OPERATIONS]),
        _histogram("pcc_device_plugin_dra_request_duration_seconds",
                   "Time to answer NodePrepareResources and NodeUnprepareResources, by "
                   "operation.",
                   [((("resource", each.name), ("operation", operation)),
                     each.dra_durations[operation])
                    for each in resources for operation in DRA_OPERATIONS]),
        family("pcc_device_plugin_dra_requests_in_flight", "gauge",
               "NodePrepareResources and NodeUnprepareResources calls being answered.",
               [((("resource", each.name), ("operation", operation)),
                 each.dra_in_flight[operation])
                for each in resources for operation in DRA_OPERATIONS]),
        family("pcc_device_plugin_dra_prepared_devices", "gauge",
               "Devices of the claims prepared on this node (the checkpoint's).",
               [((("resource", each.name),), each.prepared_devices) for each in resources]),
        family("pcc_device_plugin_dra_prepare_errors", "counter",
               "Claims NodePrepareResources failed, by why: api (the claim could not be read), "
               "claim (not allocated here, or recreated), unhealthy (its device), cdi (its "
               "spec), checkpoint, lock.",
               [((("resource", each.name), ("reason", reason)), count)
                for each in resources for reason, count in sorted(each.prepare_errors.items())]),
        family("pcc_device_plugin_dra_unprepare_errors", "counter",
               "Claims NodeUnprepareResources failed, by why: cdi, checkpoint, lock.",
               [((("resource", each.name), ("reason", reason)), count)
                for each in resources
                for reason, count in sorted(each.unprepare_errors.items())]),
        family("pcc_device_plugin_dra_api_requests", "counter",
               "Requests made of the API server, by verb, what they were about and the status "
               "it answered (none: no answer).",
               [((("resource", each.name), ("verb", verb), ("object", what), ("code", code)),
                 count)
                for each in resources
                for (verb, what, code), count in sorted(each.api_requests.items())]),
    ]  # fmt: skip


def _histogram(name: str, help_text: str, series: Iterable[tuple[Labels, Histogram]]) -> str:
    """One histogram family: per series its cumulative buckets, sum and count."""
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
    for labels, histogram in series:
        shown = ",".join(f'{key}="{_escape_label(text)}"' for key, text in labels)
        bounds = [*(repr(float(bound)) for bound in DURATION_BUCKETS), "+Inf"]
        for bound, count in zip(bounds, [*histogram.counts, histogram.observed], strict=True):
            lines.append(f'{name}_bucket{{{shown},le="{bound}"}} {_number(count)}')
        lines.append(f"{name}_sum{{{shown}}} {_number(histogram.total)}")
        lines.append(f"{name}_count{{{shown}}} {_number(histogram.observed)}")
    return "\n".join(lines) + "\n"
