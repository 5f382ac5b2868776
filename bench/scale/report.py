"""The scale benchmark's table: one row per figure, one column per kind of driver, and the
projection of the per-node figures to a pool of `FLEET` nodes."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from bench.scale.run import AT_ONCE, HERD_OVER, Figures

FLEET = 5000
Row = tuple[str, Callable[[dict[str, Any]], str]]


def _n(value: float, digits: int = 1) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    return f"{value:,.{digits}f}"


def _pair(value: tuple[float, float], digits: int = 1, unit: str = "") -> str:
    return f"{_n(value[0], digits)}{unit} (max {_n(value[1], digits)}{unit})"


def _gib(kib: float) -> str:
    return f"{kib / 1024**2:.2f} GiB"


def _growth(before: float, after: float, nodes: int) -> str:
    """Two readings in KiB, and what each node added."""
    each = (after - before) / 1024 / nodes
    return f"{before / 1024:.0f} MiB, {after / 1024:.0f} MiB ({each:+.2f} MiB per driver)"


def _codes(codes: dict[str, int]) -> str:
    return ", ".join(f"{count} x {code}" for code, count in codes.items()) or "none"


def _requests(whats: list[str]) -> str:
    if not whats:
        return "none"
    counted: dict[str, int] = {}
    for what in whats:
        counted[what] = counted.get(what, 0) + 1
    return f"{len(whats)}: " + ", ".join(
        f"{what}" + (f" x {count}" if count > 1 else "") for what, count in counted.items()
    )


def _change(key: str) -> Callable[[dict[str, Any]], str]:
    def cell(values: dict[str, Any]) -> str:
        found = values.get(key)
        if found is None:
            return "n/a: its devices never change"
        if isinstance(found, str):
            return found
        latency = found["latency"]
        written = (
            f"not written within {found['within']:.0f} s"
            if latency is None
            else f"written after {latency:.1f} s"
        )
        return f"{written}; requests {_requests(found['requests'])}; {found['cpu']:.3f} s CPU"

    return cell


def rows(nodes: int, settings: dict[str, float], whats: Sequence[str]) -> list[str | Row]:
    """The table's rows (a str is a section's title)."""
    idle = settings["idle"]
    return [
        "start",
        ("requests to its first published slice", lambda v: _pair(v["start.requests"], 0)),
        ("what they were (the most common order)", lambda v: v["start.sequence"]),
        ("CPU to its first published slice", lambda v: _pair(v["start.cpu"], 2, " s")),
        (
            f"time to it ({settings['concurrency']:.0f} drivers starting at once)",
            lambda v: _pair(v["start.seconds"], 1, " s"),
        ),
        ("first to last node published", lambda v: f"{v['start.spread']:.0f} s"),
        f"idle ({idle:.0f} s)",
        ("requests per node per hour, all", lambda v: _n(v["idle.rates"]["all"], 1)),
        *[
            (f"  {what}", lambda v, what=what: _n(v["idle.rates"].get(what, 0.0), 1))
            for what in whats
        ],
        ("answers", lambda v: _codes(v["idle.codes"])),
        (f"peak requests per second ({nodes} nodes)", lambda v: str(v["idle.peak"])),
        (f"most nodes within {AT_ONCE:.0f} s of each other", lambda v: str(v["idle.at_once"])),
        (
            "new connections (TLS handshakes) per node per hour",
            lambda v: (
                _n(v["idle.connections"], 1)
                + (
                    f" (+{v['idle.connections_unknown']} unattributed)"
                    if v["idle.connections_unknown"]
                    else ""
                )
            ),
        ),
        ("connections open per node", lambda v: _n(v["idle.established"], 2)),
        ("watches open on resourceslices (all nodes)", lambda v: str(v["idle.watches"])),
        ("driver CPU, median, % of a core", lambda v: _n(100 * v["idle.driver_cpu"], 3)),
        ("kube-apiserver CPU, % of a core", lambda v: _n(100 * v["idle.apiserver_cpu"], 2)),
        f"after a {settings['outage']:.0f} s outage of kube-apiserver",
        (
            "down (stopped to ready), of which its start",
            lambda v: f"{v['outage.down']:.1f} s, {v['outage.apiserver_start']:.1f} s",
        ),
        (
            "nodes' first requests, after ready",
            lambda v: (
                f"{v['outage.first'][0]:+.1f} s to {v['outage.first'][1]:+.1f} s "
                f"({v['outage.came_back']} nodes)"
            ),
        ),
        ("peak requests per second", lambda v: str(v["outage.peak"])),
        (
            f"requests per node in the herd (to {HERD_OVER:.0f} s after ready)",
            lambda v: _n(v["outage.herd_requests"], 1),
        ),
        ("new connections per node in the herd", lambda v: _n(v["outage.connections"], 1)),
        ("answers in the herd", lambda v: _codes(v["outage.codes"])),
        (
            "every node's slices written again, after ready",
            lambda v: (
                _pair(v["outage.consistent"], 1, " s")
                + (f"; {v['outage.never']} nodes never" if v["outage.never"] else "")
            ),
        ),
        (
            f"most nodes within {AT_ONCE:.0f} s, once every node was consistent",
            lambda v: f"{v['outage.later_at_once']} (in {v['outage.later_window']:.0f} s)",
        ),
        ("nodes whose slices are right at the end", lambda v: f"{v['outage.right']} of {nodes}"),
        "one change on one node",
        ("its device gone", _change("change.gone")),
        ("its device back", _change("change.back")),
        ("its slices deleted (as kubelet does at its start)", _change("change.deleted")),
        "memory (VmRSS)",
        ("driver, median", lambda v: _pair(tuple(k / 1024 for k in v["memory.driver"]), 1, " MiB")),
        (f"all {nodes} drivers", lambda v: _gib(v["memory.drivers_total"])),
        (
            "kube-apiserver, before the drivers and after idle",
            lambda v: _growth(v["memory.apiserver_before"], v["memory.apiserver"], nodes),
        ),
        (
            "kube-apiserver's Go heap in use, the same",
            lambda v: _growth(v["memory.apiserver_heap_before"], v["memory.apiserver_heap"], nodes),
        ),
        ("etcd", lambda v: f"{v['memory.etcd'] / 1024:.0f} MiB"),
        (
            "the run: drivers, kube-apiserver and etcd",
            lambda v: _gib(v["memory.drivers_total"] + v["memory.apiserver"] + v["memory.etcd"]),
        ),
        f"projected to {FLEET:,} nodes",
        ("requests per second, idle", lambda v: _n(v["idle.rates"]["all"] * FLEET / 3600, 1)),
        (
            "new TLS connections per second, idle",
            lambda v: _n(v["idle.connections"] * FLEET / 3600, 1),
        ),
        ("open watches", lambda v: _n(v["idle.watches"] * FLEET / nodes, 0)),
        (
            "peak requests per second after an outage",
            lambda v: _n(v["outage.peak"] * FLEET / nodes, 0),
        ),
    ]


def notes(nodes: int, settings: dict[str, float]) -> list[str]:
    """What the table's rows measure, said once under it."""
    return [
        f"start: from exec; {settings['concurrency']:.0f} drivers starting at once (the next "
        "when one has published); requests and CPU up to its first slice written.",
        f"idle: a window of {settings['idle']:.0f} s, {settings['settle']:.0f} s after the last "
        "driver published; connections from the kernel's table (each new one a TLS handshake).",
        f"outage: kube-apiserver stopped (SIGTERM) for {settings['outage']:.0f} s and started "
        "again; as soon as it was ready, every driver's slices were deleted (what changed while "
        "it was down); times are from ready; the herd is every request from the restart to "
        f"{HERD_OVER:.0f} s after ready; once every node is consistent again (and at least "
        f"{HERD_OVER:.0f} s after ready), nodes within {AT_ONCE:.0f} s of each other show a "
        "cycle in step.",
        f"projection: the per-node figures x {FLEET:,} (peaks: x {FLEET:,}/{nodes}, the herd's "
        "spread as measured: each node's retry and renewal timers are its own).",
    ]


def render(
    header: Sequence[str],
    titles: dict[str, str],
    results: dict[str, Figures],
    nodes: int,
    settings: dict[str, float],
) -> str:
    """The table as Markdown (readable as it is, and pasted as it is into docs)."""
    keys = [key for key in titles if key in results]
    whats = sorted(
        {what for key in keys for what in results[key].values["idle.rates"] if what != "all"}
    )
    table = [["per node unless said", *(titles[key] for key in keys)]]
    for row in rows(nodes, settings, whats):
        if isinstance(row, str):
            table.append([f"**{row}**", *[""] * len(keys)])
            continue
        label, cell = row
        table.append([label, *(cell(results[key].values) for key in keys)])
    widths = [max(len(line[column]) for line in table) for column in range(len(table[0]))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    out = [*header, "", line(table[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(cells) for cells in table[1:]]
    return "\n".join([*out, "", *notes(nodes, settings)])
