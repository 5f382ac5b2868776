"""klog lines with their instants: kubelet's own log (``--v=2``), and a container's log as kubelet
keeps it (the plugin's, the yardstick's), read for when each did what.

klog writes ``I1203 19:45:01.123456  1234 server.go:87] "message" key=value``: month, day and
time of day in the writer's local time, no year and no zone. Every instant here is an epoch time
(seconds, CLOCK_REALTIME), so that kubelet's lines and a container's compare: they are stamped
from the same clock of the same machine, each by its writer as it writes them.

- Kubelet's zone is this process's (kubelet runs in its environment); the year is this one, or
  the last one for a stamp that would lie ahead. The node's Daemon marks each start of kubelet
  with a ``===== pcc-e2e: start <n>`` line; the lines of one start are those after its marker.
- A container's zone is its image's. Kubelet's container log prefixes each line with the
  runtime's own stamp (RFC 3339 with its zone, taken as the line arrived from the pipe: a little
  later than the line's klog stamp, never earlier); the zone of the klog stamp is the multiple of
  15 minutes that brings it nearest to that.

The messages are kubelet v1.37's (pkg/kubelet/cm/devicemanager and pkg/kubelet/kubelet.go).
"""

from __future__ import annotations

import calendar
import re
import time
from pathlib import Path

import attrs

REGISTRATION_SERVER = "Starting device plugin registration server"
REGISTRATION_REQUEST = "Got registration request from device plugin with resource"
# Logged once kubelet has the plugin's options (its dial-back and GetDevicePluginOptions done),
# right before it opens the ListAndWatch stream.
CONNECTED = "Connected to new client"
DEVICE_UPDATES = "Processed device updates for resource"
POD_ADDED = '"SyncLoop ADD"'
KLOG = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d)(\.\d+)\s")
# containerd's CRI log line: RFC 3339 time, stream, P(artial) or F(ull), the text.
CRI = re.compile(
    r"^(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d) \S+ [PF] (.*)$"
)
START = "===== pcc-e2e: start "
DAY = 86400.0
ZONE_STEP = 900.0


@attrs.frozen
class Line:
    """A line's instant (its stamp), its text, and the latest stamp of the lines written before
    it (`past`: a line written after one stamped later was written, and its writer went on,
    no earlier than that)."""

    seconds: float
    text: str
    past: float = attrs.field()

    @past.default
    def _stamped(self) -> float:
        return self.seconds


def _fields(stamp: re.Match[str]) -> tuple[int, int, int, int, int, float]:
    month, day, hours, minutes, seconds, fraction = stamp.groups()
    return int(month), int(day), int(hours), int(minutes), int(seconds), float(fraction)


def local_klog_time(stamp: re.Match[str], now: float) -> float:
    """A klog stamp written in this process's zone, as an epoch time near `now`."""
    month, day, hours, minutes, seconds, fraction = _fields(stamp)
    year = time.localtime(now).tm_year
    for candidate in (year, year - 1):
        at = time.mktime((candidate, month, day, hours, minutes, seconds, 0, 0, -1)) + fraction
        if at <= now + DAY:
            return at
    return at


def lines_of_start(log: Path, start: int, now: float | None = None) -> list[Line]:
    """Kubelet's klog lines of start number `start`, each with its epoch time."""
    now = time.time() if now is None else now
    found: list[Line] = []
    inside = False
    with log.open(errors="replace") as text:
        for line in text:
            if line.startswith(START):
                inside = line.startswith(f"{START}{start}:")
                continue
            stamp = KLOG.match(line) if inside else None
            if stamp:
                at = local_klog_time(stamp, now)
                found.append(Line(at, line, max(at, found[-1].past) if found else at))
    return found


def container_lines(log: Path) -> list[Line]:
    """The klog lines of one container's log file as kubelet keeps it
    (/var/log/pods/<namespace>_<pod>_<uid>/<container>/<restarts>.log), each with its epoch
    time from its own klog stamp; lines without one are left out."""
    found: list[Line] = []
    with log.open(errors="replace") as text:
        for line in text:
            cri = CRI.match(line.rstrip("\n"))
            stamp = cri and KLOG.match(cri[9])
            if not cri or not stamp:
                continue
            year, month, day, hours, minutes, seconds = (int(cri[i]) for i in range(1, 7))
            arrived = calendar.timegm((year, month, day, hours, minutes, seconds)) + float(
                cri[7] or 0
            )
            zone = cri[8]
            if zone != "Z":
                sign = 1 if zone[0] == "+" else -1
                arrived -= sign * (int(zone[1:3]) * 3600 + int(zone[4:6]) * 60)
            month, day, hours, minutes, seconds, fraction = _fields(stamp)
            # The klog stamp read as if it were UTC, in the year of the runtime's stamp, or the
            # one before or after when the two stamps lie either side of New Year.
            naive = min(
                (calendar.timegm((y, month, day, hours, minutes, seconds)) + fraction
                 for y in (year - 1, year, year + 1)),
                key=lambda candidate: abs(candidate - arrived),
            )  # fmt: skip
            offset = round((arrived - naive) / ZONE_STEP) * ZONE_STEP
            found.append(Line(naive + offset, cri[9]))
    return found


def first(lines: list[Line], *words: str, after: float = 0.0) -> Line | None:
    """The first line at or after `after` that contains every one of `words`."""
    return next(
        (line for line in lines if line.seconds >= after and all(w in line.text for w in words)),
        None,
    )


def last(lines: list[Line], *words: str, before: float) -> Line | None:
    """The last line at or before `before` that contains every one of `words`."""
    return next(
        (line for line in reversed(lines)
         if line.seconds <= before and all(w in line.text for w in words)),
        None,
    )  # fmt: skip
