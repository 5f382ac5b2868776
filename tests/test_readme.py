"""The README's "Trying it by hand", run as written: its blocks in order, in one shell."""

from __future__ import annotations

import socket
from pathlib import Path

from pasted_support import run_pasted, section_blocks

README = Path(__file__).resolve().parent.parent / "README.md"
PORT = "127.0.0.1:8080"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def test_trying_it_by_hand_runs_as_written(tmp_path: Path) -> None:
    """As a newcomer pastes it (pasted_support), with a free metrics port rather than 8080,
    which anything on the machine may hold."""
    script = "\n".join(section_blocks(README, "### Trying it by hand"))
    assert script.count(PORT) == 2, "the daemon's address and curl's"
    run = await run_pasted(script.replace(PORT, f"127.0.0.1:{free_port()}"), tmp_path / "log")
    said = run.said
    assert run.code == 0, said
    assert run.left == [], "the blocks left their directory behind"
    assert "Traceback" not in said
    assert said.count("answered; the container gets:") == 2, said
    assert "device /dev/sev-guest (host /dev/sev-guest, permissions rw)" in said
    assert "\nok\n" in said  # /readyz
    assert "State on SIGUSR1" in said
    assert said.count("registered device plugin tke.cloud.tencent.com/pcc-device") == 2, said
    assert "Stopped" in said
