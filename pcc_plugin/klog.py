"""Log lines in klog's format, so operators read and grep them like the Go plugins' logs.

    I1202 09:12:43.705500    6476 supervisor.py:123] message

klog's verbosity maps onto logging levels: `--v=0` shows INFO and above,
`--v=1` adds V1 (each registration and Allocate step), `--v>=2` adds DEBUG and
grpclib's own messages.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

V1 = logging.INFO - 5
logging.addLevelName(V1, "V1")

_SEVERITY = {logging.WARNING: "W", logging.ERROR: "E", logging.CRITICAL: "F"}


class KlogFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        severity = _SEVERITY.get(record.levelno, "I")
        stamp = time.strftime("%m%d %H:%M:%S", time.localtime(record.created))
        micros = int((record.created % 1) * 1_000_000)
        line = (
            f"{severity}{stamp}.{micros:06d} {record.process:>7} "
            f"{record.filename}:{record.lineno}] {record.getMessage()}"
        )
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure(verbosity: int) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(KlogFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO if verbosity == 0 else V1 if verbosity == 1 else logging.DEBUG)
    # grpclib logs a cancelled ListAndWatch (kubelet went away) at INFO: noise
    # below --v=2, where operators debug the wire.
    logging.getLogger("grpclib").setLevel(logging.DEBUG if verbosity >= 2 else logging.CRITICAL)
    # HTTP/2 frame and header tracing is for debugging h2 itself, not the plugin.
    for name in ("h2", "hpack", "asyncio"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # --mode=dra: the API client logs every request at INFO; the driver says what matters.
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.DEBUG if verbosity >= 2 else logging.WARNING)
    accept_failures = logging.getLogger("trio.serve_listeners")
    accept_failures.filters[:] = [OneWarningPerBurst()]


class _Bursts:
    """Occurrences of one event, in bursts that end after `quiet` seconds without it."""

    def __init__(self, quiet: float) -> None:
        self._quiet = quiet
        self._last: float | None = None
        self._suppressed = 0

    def first_of_burst(self) -> str | None:
        """For an occurrence that begins a burst, what to add to its line (how many the
        previous burst held after its first); None for the rest of a burst."""
        now = time.monotonic()
        starts = self._last is None or now - self._last > self._quiet
        self._last = now
        if not starts:
            self._suppressed += 1
            return None
        suffix = f" ({self._suppressed} more in the previous burst)" if self._suppressed else ""
        self._suppressed = 0
        return suffix


class BurstLog:
    """One line per burst of the same event, not one per occurrence."""

    def __init__(self, logger: logging.Logger, level: int, quiet: float = 10.0) -> None:
        self._logger = logger
        self._level = level
        self._bursts = _Bursts(quiet)

    def log(self, message: str, *args: Any) -> None:
        suffix = self._bursts.first_of_burst()
        if suffix is not None:
            self._logger.log(self._level, message + suffix, *args)


class OneWarningPerBurst(logging.Filter):
    """Lets the first record of each burst through, as a warning without a traceback.

    trio's serve_listeners logs every accept() that fails for lack of descriptors or memory
    as an error with its traceback, ten times a second while it lasts; the daemon waits it
    out (README, "Limits") and says so once.
    """

    def __init__(self, quiet: float = 10.0) -> None:
        super().__init__()
        self._bursts = _Bursts(quiet)

    def filter(self, record: logging.LogRecord) -> bool:
        suffix = self._bursts.first_of_burst()
        if suffix is None:
            return False
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info = record.exc_text = None
        record.msg = f"{record.msg}{suffix}"
        return True
