"""Documentation's shell blocks run as a newcomer pastes them: in order, in one shell.

A run that fails says the first command that failed, and leaves nothing running: whatever the
blocks started (in the background, in a session of its own) is found by a mark in its
environment and killed before the scratch directory is removed.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import trio

from pcc_plugin.sim import Daemon, run_blocking

# In the environment of the shell and of everything it starts: what to stop after a run.
MARK = "PCC_PASTED_RUN"
# Said by the shell for the first command that fails (`set -e` stops there).
FAILED = "pasted: the first command that failed: "
# On the script's first line, so that $LINENO is the line of the pasted blocks.
ERR_TRAP = f"trap 'echo \"{FAILED}$BASH_COMMAND (line $LINENO, exit $?)\" >&2' ERR; "


def section_blocks(document: Path, heading: str) -> list[str]:
    """The ```sh blocks under `heading` (a whole line of `document`, level 2 or below), up to
    the next section of the same or a higher level, in order."""
    text = document.read_text()
    start = text.index(f"\n{heading}\n")
    # Sections of level 2 and below: a line that starts "# " is a shell comment in a block.
    level = len(heading.split(" ", 1)[0])
    ends = [text.find(f"\n{'#' * n} ", start + 1) for n in range(2, level + 1)]
    end = min((i for i in ends if i != -1), default=len(text))
    return re.findall(r"^```sh\n(.*?)^```$", text[start:end], re.M | re.S)


@attrs.frozen
class Pasted:
    code: int
    said: str
    # What the blocks left in their scratch directory (a recipe should leave nothing), and
    # the logs among it, read before it is removed.
    left: list[Path]
    logs: str
    # The command lines of what was still running when the shell ended, now killed.
    # What was still running and killed, by process ID: its command line as last read (a
    # forked shell not yet the program it runs shows the shell's).
    left_running: dict[int, str]

    @property
    def failed(self) -> str:
        """The first command that failed, with its line and exit code; else, for a shell that
        stopped without one (an unset variable), its last line; "" for a run that passed."""
        if self.code == 0:
            return ""
        lines = self.said.splitlines()
        said = [line.removeprefix(FAILED) for line in lines if line.startswith(FAILED)]
        return said[0] if said else f"the shell exited {self.code}: {lines[-1] if lines else ''}"

    def why(self) -> str:
        """What to read when the run did not pass: the failed command first."""
        running = [f"still running, killed: {command}" for command in self.left_running.values()]
        return "\n".join([f"failed: {self.failed}", *running, "the shell said:", self.said,
                          self.logs])  # fmt: skip


async def run_pasted(
    script: str, log: Path, cleanup: Callable[[Path], Awaitable[None]] | None = None
) -> Pasted:
    """`script` in `bash -euo pipefail`, `python` being the one running the tests (the
    development environment) and TMPDIR a short scratch directory under /tmp (where `mktemp
    -d` makes the recipe's directory: unix socket paths must stay short); `cleanup(scratch)`
    stops gently what a failed run left serving, before what is left is killed."""
    mark = secrets.token_hex(8)
    with tempfile.TemporaryDirectory(prefix="p", dir="/tmp") as scratch:
        env = {
            **os.environ,
            MARK: mark,
            "TMPDIR": scratch,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        }
        argv = ["bash", "-e", "-u", "-o", "pipefail", "-c", ERR_TRAP + script]
        run = Daemon(argv, log, env=env)
        try:
            with trio.fail_after(120):
                code = await run_blocking(run.proc.wait, 110)
        finally:
            if cleanup is not None:
                await cleanup(Path(scratch))
            # The shell too, if it outlived the wait; then its output is read to the end.
            left_running = await kill_marked(mark)
            # A process in the middle of an exec shows no environment for a moment: looked
            # for again while something still holds the shell's output.
            for _ in range(20):
                if await run_blocking(run.output_ended, 0.25):
                    break
                left_running |= await kill_marked(mark)
            run.close()
        left = sorted(Path(scratch).rglob("*"))
        logs = "\n".join(f"{path}:\n{path.read_text()}" for path in left if path.suffix == ".log")
        return Pasted(code, run.log_text(), left, logs, left_running)


def marked(mark: str) -> dict[int, str]:
    """The processes whose environment has MARK=`mark`: pid -> command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (command := _command_if_marked(int(entry.name), mark)):
            found[int(entry.name)] = command
    return found


def _command_if_marked(pid: int, mark: str) -> str | None:
    try:
        if f"{MARK}={mark}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        pass  # gone meanwhile, or not ours
    return None


async def kill_marked(mark: str) -> dict[int, str]:
    """Kill every process of `marked(mark)` and wait for each to end; their command lines."""
    killed = {}
    for pid, command in marked(mark).items():
        try:
            # A pidfd names this process, not whatever may take its number once it ends.
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            if _command_if_marked(pid, mark):  # the same process, opened before it ended
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                with trio.fail_after(10):
                    await trio.lowlevel.wait_readable(pidfd)  # readable once it has ended
                killed[pid] = command
        finally:
            os.close(pidfd)
    return killed
