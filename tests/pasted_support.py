"""Documentation's shell blocks run as a newcomer pastes them: in order, in one shell."""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import attrs
import trio

from pcc_plugin.sim import Daemon, run_blocking


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


async def run_pasted(
    script: str, log: Path, cleanup: Callable[[Path], Awaitable[None]] | None = None
) -> Pasted:
    """`script` in `bash -euo pipefail`, `python` being the one running the tests (the
    development environment) and TMPDIR a short scratch directory under /tmp (where `mktemp
    -d` makes the recipe's directory: unix socket paths must stay short); `cleanup(scratch)`
    stops what a failed run left serving."""
    with tempfile.TemporaryDirectory(prefix="p", dir="/tmp") as scratch:
        env = {
            **os.environ,
            "TMPDIR": scratch,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        }
        run = Daemon(["bash", "-e", "-u", "-o", "pipefail", "-c", script], log, env=env)
        try:
            with trio.fail_after(120):
                code = await run_blocking(run.exited, 110)
        finally:
            run.close()
            if cleanup is not None:
                await cleanup(Path(scratch))
        left = sorted(Path(scratch).rglob("*"))
        logs = "\n".join(f"{path}:\n{path.read_text()}" for path in left if path.suffix == ".log")
        return Pasted(code, run.log_text(), left, logs)
