"""The README's "Trying it by hand", run as written: its blocks in order, in one shell."""

from __future__ import annotations

import re
import shutil
import socket
from pathlib import Path

import pytest
from pasted_support import run_pasted, section_blocks

README = Path(__file__).resolve().parent.parent / "README.md"
SECTION = "### Trying it by hand"
PORT = "127.0.0.1:8080"
# The shell's own: what a POSIX shell has without any program installed.
BUILTINS = {"kill", "wait", "cd", "echo", "export", "set", "test", "trap"}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def commands(script: str) -> set[str]:
    """The programs `script` runs: each command's first word (after a line's start, `&&`,
    `||`, `|`, `;`, `&` or `$(`), assignments and comments left out."""
    joined = re.sub(r"\\\n", " ", script)
    lines = [line.split("#", 1)[0] for line in joined.splitlines()]
    head = r"(?:^|&&|\|\||[;|&]|\$\()\s*([A-Za-z_][\w.-]*)(?=\s|$|\))"
    return {word for line in lines for word in re.findall(head, line)}


def needs() -> set[str]:
    """The programs the README says its blocks need: in backticks, in its sentence that starts
    "The blocks need"."""
    text = " ".join(README.read_text().split())
    sentence = re.search(r"The blocks need (.*?)\.(?: |$)", text)
    assert sentence, 'the README does not say what its blocks need ("The blocks need ...")'
    return set(re.findall(r"`([\w.-]+)`", sentence[1]))


def test_the_readme_names_every_program_its_blocks_run() -> None:
    script = "\n".join(section_blocks(README, SECTION))
    used = commands(script)
    assert {"python", "curl", "mktemp"} <= used  # the walk finds commands
    assert used - BUILTINS <= needs(), f"the blocks run {sorted(used - BUILTINS - needs())} too"


async def test_trying_it_by_hand_runs_as_written(tmp_path: Path) -> None:
    """As a newcomer pastes it (pasted_support), with a free metrics port rather than 8080,
    which anything on the machine may hold."""
    missing = sorted(name for name in needs() if shutil.which(name) is None and name != "python")
    if missing:
        pytest.skip(f"the README's blocks need {', '.join(missing)}, which this machine lacks")
    script = "\n".join(section_blocks(README, SECTION))
    assert script.count(PORT) == 2, "the daemon's address and curl's"
    run = await run_pasted(script.replace(PORT, f"127.0.0.1:{free_port()}"), tmp_path / "log")
    said = run.said
    assert run.code == 0, run.why()
    assert run.left == [], "the blocks left their directory behind"
    assert run.left_running == {}, "the blocks left processes running"
    assert "Traceback" not in said
    assert said.count("answered; the container gets:") == 2, said
    assert "device /dev/sev-guest (host /dev/sev-guest, permissions rw)" in said
    assert "\nok\n" in said  # /readyz
    assert "State on SIGUSR1" in said
    assert said.count("registered device plugin tke.cloud.tencent.com/pcc-device") == 2, said
    assert "Stopped" in said


async def test_a_failed_paste_says_its_first_failed_command_and_leaves_nothing_running(
    tmp_path: Path,
) -> None:
    """As on a machine without curl: the shell stops at the command, whose line the result
    names first; what the blocks started in the background (here in a session of its own, as
    the DRA simulator runs) is killed, and the scratch directory goes."""
    script = (
        'dir=$(mktemp -d)\n'
        # Made before the job: a job killed before its redirection ran would leave none.
        ': >"$dir/sleep.log"\n'
        'setsid sleep 300 >>"$dir/sleep.log" 2>&1 &\n'
        'alone=$!\n'
        'sleep 301 &\n'
        'echo "pids: $alone $!"\n'
        'no-such-program-pcc -s 127.0.0.1:8080/readyz\n'
        'echo never\n'
    )  # fmt: skip
    run = await run_pasted(script, tmp_path / "log")
    assert run.code == 127
    assert run.failed == "no-such-program-pcc -s 127.0.0.1:8080/readyz (line 7, exit 127)"
    assert run.why().startswith(f"failed: {run.failed}\n")
    assert "never" not in run.said
    (pids,) = re.findall(r"^pids: (\d+) (\d+)$", run.said, re.M)
    # By process: a background job may not have become `sleep` yet when it is killed.
    assert set(run.left_running) == set(map(int, pids))
    for pid in map(int, pids):
        assert _ended(pid), f"{pid} still runs"
    # Nothing wrote into the scratch directory any more when it was removed.
    assert {path.name for path in run.left if path.suffix == ".log"} == {"sleep.log"}


def _ended(pid: int) -> bool:
    """Gone, or a zombie its new parent has yet to reap."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True
