"""docs/dra.md's "Try it on a laptop", run as written, and the simulator's DRA commands
(`python -m pcc_plugin.sim dra|prepare|unprepare|stop`, pcc_plugin/sim/dra_commands.py) given
what a user gets wrong: one line each, naming the fix, a non-zero exit, no traceback."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import trio
from pasted_support import run_pasted, section_blocks

from pcc_plugin.sim import FakeNode, StartDaemon, run_blocking

DOCS = Path(__file__).resolve().parent.parent / "docs" / "dra.md"
SECTION = "## Try it on a laptop"
SIM = "python -m pcc_plugin.sim"
CDI_ID = "pcc.tke.cloud.tencent.com/claim="


def recipe() -> list[str]:
    return section_blocks(DOCS, SECTION)


async def stop_simulators_under(directory: Path) -> None:
    """What a failed run left serving: `dra` runs in a session of its own."""
    for control in directory.glob("**/sim.sock"):
        await sim("stop", "--dir", str(control.parent))


async def test_the_laptop_recipe_runs_as_written(tmp_path: Path) -> None:
    blocks = recipe()
    assert len(blocks) == 5, blocks
    # /tmp/pXXXXXXXX/tmp.XXXXXXXXXX/plugins_registry fits in the driver's 48 bytes, as
    # /tmp/tmp.XXXXXXXXXX/plugins_registry does on a laptop.
    run = await run_pasted("\n".join(blocks), tmp_path / "recipe.log", stop_simulators_under)
    said = run.said
    assert run.code == 0, run.why()
    assert run.left == [], "the recipe left its directory behind"
    assert run.left_running == {}, "the recipe left processes running"
    assert "Traceback" not in said
    assert "The simulator serves in" in said
    # prepare: the allocation, kubelet's answer and the spec, naming the node's device and mount
    (uid,) = re.findall(
        r"default/app \(UID ([0-9a-f-]{36})\): allocated pcc-0 of pool node-a", said
    )
    assert f"pcc-0 of pool node-a for request pcc: CDI device {CDI_ID}{uid}" in said
    assert f'"name": "{uid}"' in said
    assert '"path": "/dev/sev-guest"' in said
    assert '"containerPath": "/var/run/pcc"' in said
    # unprepare, the logs, and the stops
    assert f"defines {CDI_ID}{uid} any more." in said
    assert "Registered DRA driver pcc.tke.cloud.tencent.com with kubelet" in said
    assert "registered DRA driver pcc.tke.cloud.tencent.com at " in said
    assert re.search(r"The simulator in \S+ \(pid \d+\) stopped\.", said)


async def sim(*args: str) -> tuple[int, str, str]:
    argv = [sys.executable, "-m", "pcc_plugin.sim", *args]
    done = await trio.run_process(argv, capture_stdout=True, capture_stderr=True, check=False)
    return done.returncode, done.stdout.decode(), done.stderr.decode()


def refused(outcome: tuple[int, str, str], command: str, words: str, code: int = 1) -> str:
    """The command's one line to stderr, which says `words`."""
    returncode, out, err = outcome
    assert "Traceback" not in out + err
    assert returncode == code, (out, err)
    (line,) = err.splitlines()
    assert line.startswith(f"{SIM} {command}: "), line
    assert words in line, line
    return line


def served(outcome: tuple[int, str, str]) -> str:
    returncode, out, err = outcome
    assert returncode == 0, (out, err)
    assert not err, err
    return out


def driver_args(directory: Path, node: FakeNode) -> list[str]:
    """The recipe's flags for the driver, on the fake node."""
    return [
        "--mode=dra",
        "--node-name=node-a",
        f"--kubeconfig={directory / 'kubeconfig'}",
        f"--kubelet-registry-path={directory / 'plugins_registry'}",
        f"--kubelet-plugins-path={directory / 'plugins'}",
        f"--cdi-spec-dir={directory / 'cdi'}",
        f"--host-root={node.host_root}",
        "--metrics-bind-address=127.0.0.1:0",
        "--v=1",
    ]


async def test_what_a_user_gets_wrong_is_one_line_naming_the_fix(
    fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    directory = fake_node.root / "sim"
    where = str(directory)
    a_file = fake_node.root / "a-file"
    a_file.write_text("")
    try:
        with trio.fail_after(150):
            # Before the simulator: where to start it.
            refused(
                await sim("prepare", "--dir", where, "app"),
                "prepare",
                f"no simulator serves in {where}: start one with {SIM} dra --dir {where}",
            )
            refused(
                await sim("dra", "--dir", str(a_file)),
                "dra",
                f"--dir {a_file}: File exists; give a directory you can write",
            )
            long_dir = "/tmp/" + "d" * 27
            refused(
                await sim("dra", "--dir", long_dir),
                "dra",
                f"--dir {long_dir}: the driver's --kubelet-registry-path, {long_dir}/"
                "plugins_registry, would be 49 bytes, more than the 48 its unix sockets leave; "
                "give a shorter directory",
            )
            assert not Path(long_dir).exists()
            # Usage: one line too, exit 2, before anything is asked.
            refused(
                await sim("prepare", "--dir", where, "App_1"),
                "prepare",
                "CLAIM: 'App_1' is not a DNS subdomain: lowercase letters",
                code=2,
            )
            refused(
                await sim("unprepare", "--dir", where, "--timeout", "0", "app"),
                "unprepare",
                "--timeout: 0 is not a number of seconds above 0",
                code=2,
            )

            assert "The simulator serves in" in served(await sim("dra", "--dir", where))
            refused(
                await sim("dra", "--dir", where),
                "dra",
                f"serves in {where} already: stop it with {SIM} stop --dir {where}",
            )
            # No driver yet: waited for, then said.
            refused(
                await sim("prepare", "--dir", where, "--timeout", "0.5", "app"),
                "prepare",
                "the DRA driver pcc.tke.cloud.tencent.com has not registered with the simulated "
                f"kubelet within 0.5 s: start it with --kubelet-registry-path={where}/",
            )

            daemon = start_daemon(*driver_args(directory, fake_node))
            refused(
                await sim("prepare", "--dir", where, "--device", "pcc-99", "app"),
                "prepare",
                "pcc-99 is not a device of the Node node-a's ResourceSlices (pcc-0 to pcc-15): "
                "name one of them",
            )
            prepared = served(await sim("prepare", "--dir", where, "--device", "pcc-2", "app"))
            assert "allocated pcc-2 of pool node-a" in prepared
            refused(
                await sim("prepare", "--dir", where, "--device", "pcc-2", "other"),
                "prepare",
                "pcc-2 is allocated to default/app: unprepare that claim first",
            )
            refused(
                await sim("prepare", "--dir", where, "--device", "pcc-3", "app"),
                "prepare",
                "default/app is allocated pcc-2 already: unprepare it first",
            )
            # Prepared again (the driver answers from its checkpoint), looked up elsewhere.
            refused(
                await sim("prepare", "--dir", where, "--cdi-spec-dir", str(a_file.parent), "app"),
                "prepare",
                f"no CDI spec in {a_file.parent} defines {CDI_ID}",
            )
            refused(
                await sim("unprepare", "--dir", where, "nope"),
                "unprepare",
                "there is no ResourceClaim default/nope: prepare it first (claims: default/app)",
            )
            # The device gone: the driver taints every device (the fake API server serves
            # taints, as 1.37's does), and nothing can be allocated.
            fake_node.pcc_dir.rmdir()
            await run_blocking(daemon.wait_for_log, "Published 16 devices", 10, count=2)
            refused(
                await sim("prepare", "--dir", where, "--timeout", "1", "late"),
                "prepare",
                "the DRA driver pcc.tke.cloud.tencent.com has published no device for the Node "
                "node-a within 1 s: its log says why",
            )
            assert "stopped." in served(await sim("stop", "--dir", where))
            refused(
                await sim("stop", "--dir", where),
                "stop",
                f"no simulator serves in {where}: start one with {SIM} dra --dir {where}",
            )
            assert "Traceback" not in daemon.log_text()
    finally:
        await stop_simulators_under(fake_node.root)
