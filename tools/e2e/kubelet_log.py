"""Kubelet's own log (``--v=2``), read for when its device manager did what.

Kubelet writes klog lines, ``I1203 19:45:01.123456  1234 server.go:87] "message" key=value``;
the times are kubelet's clock, so differences between them measure kubelet's view alone. The
node's Daemon marks each start of kubelet with a ``===== pcc-e2e: start <n>`` line; the lines
of one start are those after its marker. The messages are kubelet v1.37's
(pkg/kubelet/cm/devicemanager and pkg/kubelet/kubelet.go).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import attrs

REGISTRATION_SERVER = "Starting device plugin registration server"
REGISTRATION_REQUEST = "Got registration request from device plugin with resource"
DEVICE_UPDATES = "Processed device updates for resource"
POD_ADDED = '"SyncLoop ADD"'
KLOG = re.compile(r"^[IWEF]\d{4} (\d\d):(\d\d):(\d\d\.\d+)\s")
START = "===== pcc-e2e: start "
DAY = 86400.0


@attrs.frozen
class Line:
    seconds: float
    text: str


def time_of_day(epoch: float) -> float:
    """`epoch` (time.time()) as klog writes it: local time of day, in seconds."""
    local = time.localtime(epoch)
    return local.tm_hour * 3600 + local.tm_min * 60 + local.tm_sec + epoch % 1


def lines_of_start(log: Path, start: int) -> list[Line]:
    """Kubelet's klog lines of start number `start`, each with its time of day in seconds (past
    midnight, the next day's times go on counting from 86400)."""
    found: list[Line] = []
    inside = False
    with log.open(errors="replace") as text:
        for line in text:
            if line.startswith(START):
                inside = line.startswith(f"{START}{start}:")
                continue
            stamp = KLOG.match(line) if inside else None
            if stamp:
                hours, minutes, seconds = stamp.groups()
                at = int(hours) * 3600 + int(minutes) * 60 + float(seconds)
                if found and at < found[-1].seconds - DAY / 2:
                    at += DAY
                found.append(Line(at, line))
    return found


def first(lines: list[Line], *words: str, after: float = 0.0) -> Line | None:
    """The first line at or after `after` that contains every one of `words`."""
    return next(
        (line for line in lines if line.seconds >= after and all(w in line.text for w in words)),
        None,
    )
