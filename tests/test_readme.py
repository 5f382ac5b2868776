"""The README's "Trying it by hand", run as written: its blocks in order, in one shell."""

from __future__ import annotations

import os
import re
import socket
import sys
import tempfile
from pathlib import Path

import trio

from pcc_plugin.sim import Daemon, run_blocking

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = "### Trying it by hand"
PORT = "127.0.0.1:8080"


def blocks() -> list[str]:
    """The section's shell blocks, in order."""
    text = README.read_text()
    start = text.index(f"\n{SECTION}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"^```sh\n(.*?)^```$", text[start:end], re.M | re.S)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def test_trying_it_by_hand_runs_as_written(tmp_path: Path) -> None:
    """As a newcomer pastes it: `python` is the development environment's (the test's), the
    scratch directory `mktemp -d` makes is short (under /tmp), and the metrics port is a free
    one rather than 8080, which anything on the machine may hold."""
    script = "\n".join(blocks())
    assert script.count(PORT) == 2, "the daemon's address and curl's"
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="p", dir="/tmp") as scratch:
        env = {
            **os.environ,
            "TMPDIR": scratch,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        }
        shell = [
            "bash",
            "-e",
            "-u",
            "-o",
            "pipefail",
            "-c",
            script.replace(PORT, f"127.0.0.1:{port}"),
        ]
        run = Daemon(shell, tmp_path / "by-hand.log", env=env)
        try:
            with trio.fail_after(120):
                code = await run_blocking(run.exited, 110)
        finally:
            run.close()
        said = run.log_text()
        assert code == 0, said
        assert not list(Path(scratch).iterdir()), "the blocks left their directory behind"
    assert "Traceback" not in said
    assert said.count("answered; the container gets:") == 2, said
    assert "device /dev/sev-guest (host /dev/sev-guest, permissions rw)" in said
    assert "\nok\n" in said  # /readyz
    assert "State on SIGUSR1" in said
    assert said.count("registered device plugin tke.cloud.tencent.com/pcc-device") == 2, said
    assert "Stopped" in said
