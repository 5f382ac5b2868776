"""A check's result, and the check every other builds on: is this path the right kind of file."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Literal

import attrs

AS_ROOT = "run the doctor as root, as the daemon runs"
DAEMON_LOG = "kubectl -n kube-system logs <the plugin's pod on this node>"


@attrs.frozen
class Result:
    status: Literal["PASS", "WARN", "FAIL", "SKIP"]
    check: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        text = f"{self.status}  {self.check}: {self.detail}"
        return f"{text}; fix: {self.fix}" if self.fix else text


def passed(check: str, detail: str) -> Result:
    return Result("PASS", check, detail)


def warned(check: str, detail: str, fix: str) -> Result:
    """Works, but not as it should: the exit code stays 0."""
    return Result("WARN", check, detail, fix)


def failed(check: str, detail: str, fix: str) -> Result:
    return Result("FAIL", check, detail, fix)


def skipped(check: str, detail: str) -> Result:
    return Result("SKIP", check, detail)


def kind(mode: int) -> str:
    for test, word in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISFIFO, "a FIFO"),
    ):
        if test(mode):
            return word
    return "an unknown kind of file"


def expect_kind(
    check: str, path: str | Path, wanted: str, missing_fix: str, wrong_fix: str
) -> Result | None:
    """A FAIL when `path` is missing, cannot be looked at, or is not `wanted`; else None."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return failed(check, f"{path} does not exist", missing_fix)
    except OSError as exc:
        return failed(check, f"cannot look at {path}: {exc.strerror}", AS_ROOT)
    if kind(mode) != wanted:
        return failed(check, f"{path} is {kind(mode)}, not {wanted}", wrong_fix)
    return None
