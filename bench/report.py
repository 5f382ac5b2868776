"""The report: one table of figures, those with a target marked PASS or MISS; the raw figures."""

from __future__ import annotations

import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

import attrs


def report_header(title: str, *about: str) -> list[str]:
    """The first lines of a run's output: what it is, the machine, the interpreter, `about`
    (what runs), and the load average at the start (the machine is shared)."""
    usable = len(os.sched_getaffinity(0))
    return [
        title,
        f"machine: {os.cpu_count()} cores ({usable} usable), {platform.machine()}, "
        f"Linux {platform.release()}",
        f"python: {platform.python_implementation()} {platform.python_version()} "
        f"({sys.executable})",
        *about,
        "load average (1, 5, 15 min) at the start: "
        + ", ".join(f"{load:.2f}" for load in os.getloadavg()),
    ]


def report_footer(started: float) -> str:
    """How long a run took since `started` (time.monotonic()), and the load average now."""
    return f"took {time.monotonic() - started:.0f} s; load average at the end: " + ", ".join(
        f"{load:.2f}" for load in os.getloadavg()
    )


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
    unmeasured: list[str] = attrs.Factory(list)

    def section(self, title: str) -> None:
        self.rows.append(title)

    def add(self, figure: str, value: str) -> None:
        self.rows.append(Row(figure, value))

    def check(self, figure: str, value: str, measured: float, limit: float, unit: str) -> None:
        """A figure with its target: met when `measured` is at most `limit`."""
        met = measured <= limit
        if not met:
            self.misses.append(figure.strip())
        self.rows.append(Row(figure, value, f"<= {limit:g} {unit}", "PASS" if met else "MISS"))

    def not_measured(self, figure: str, reason: str, limit: float, unit: str) -> None:
        """A target that could not be judged here: neither met nor missed, and said so."""
        self.unmeasured.append(figure.strip())
        self.rows.append(Row(figure, f"not measured: {reason}", f"<= {limit:g} {unit}", "-"))

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
            + (f"; not measured: {', '.join(self.unmeasured)}" if self.unmeasured else "")
        )
        return "\n".join(out)
