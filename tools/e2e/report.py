"""What a session prints: checks passed, facts observed, figures; each line with its time."""

from __future__ import annotations

import time

import attrs


def now() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


@attrs.define
class Report:
    """What the run prints: checks passed, facts observed, figures; each line with the time
    since the start and its `variant` (the pod template, or the check). The table of figures
    has a column per `column` (the variant, unless set)."""

    figures: dict[str, dict[str, float]] = attrs.field(factory=dict)
    counts: set[str] = attrs.field(factory=set)
    facts: list[str] = attrs.field(factory=list)
    failures: list[str] = attrs.field(factory=list)
    variant: str = ""
    column: str | None = None
    started: float = attrs.field(factory=now)

    def say(self, kind: str, text: str) -> None:
        print(f"{now() - self.started:6.1f}s {kind:<5} [{self.variant}] {text}", flush=True)

    def check(self, text: str) -> None:
        self.say("PASS", text)

    def fail(self, text: str) -> None:
        """A check failed that the checks after it do not depend on: said now, and the session
        fails at its end."""
        self.say("FAIL", text)
        self.failures.append(f"[{self.variant}] {text}")

    def note(self, text: str) -> None:
        self.say("NOTE", text)
        self.facts.append(f"[{self.variant}] {text}")

    def figure(self, name: str, seconds: float) -> None:
        self.figures.setdefault(name, {})[self.column or self.variant] = seconds
        self.say("TIME", f"{name}: {seconds:.3f} s")

    def count(self, name: str, number: int) -> None:
        """A figure that is a number of things, not seconds."""
        self.counts.add(name)
        self.figures.setdefault(name, {})[self.column or self.variant] = number
        self.say("TIME", f"{name}: {number}")

    def table(self) -> str:
        variants = list(dict.fromkeys(v for row in self.figures.values() for v in row))
        width = max((len(name) for name in self.figures), default=28)
        lines = [f"{'figure (seconds, or a count)':<{width}}  "
                 + "  ".join(f"{v:>15}" for v in variants)]  # fmt: skip
        for name, row in self.figures.items():
            shown = "{:>15.0f}" if name in self.counts else "{:>15.3f}"
            cells = (shown.format(row[v]) if v in row else f"{'-':>15}" for v in variants)
            lines.append(f"{name:<{width}}  " + "  ".join(cells))
        return "\n".join(lines)
