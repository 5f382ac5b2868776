"""Faults from the node and from the operator, against the real daemon: one line, no
traceback, recovered once fixed; signals; socket identity; live configuration."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio
from daemon_support import RESOURCE, WAIT, accepted, log_line, serving

from pcc_plugin.sim import FakeNode, SimKubelet, StartDaemon, run_blocking

ROOT = Path(__file__).resolve().parent.parent


def _can_unshare_mounts() -> bool:
    if shutil.which("unshare") is None or shutil.which("setpriv") is None:
        return False
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False, timeout=10)
    return probe.returncode == 0


@pytest.mark.skipif(
    not _can_unshare_mounts(), reason="needs root, unshare -m and setpriv (util-linux)"
)
@pytest.mark.parametrize("fault", ["read-only", "full", "permission denied"])
async def test_a_filesystem_fault_is_one_line_retried_and_recovered(fault: str) -> None:
    def play() -> dict[str, object]:
        scenario = subprocess.run(
            ["unshare", "-m", "--propagation", "private", sys.executable,
             str(ROOT / "tests" / "fs_fault_scenario.py"), fault],
            capture_output=True, text=True, timeout=90, check=False,
        )  # fmt: skip
        assert scenario.returncode == 0, scenario.stderr[-3000:]
        result: dict[str, object] = json.loads(scenario.stdout.splitlines()[-1])
        return result

    with trio.fail_after(100):
        result = await run_blocking(play)
    errno_words = {"read-only": "Read-only file system", "full": "No space left on device",
                   "permission denied": "Permission denied"}[fault]  # fmt: skip
    errors = result["error_lines"]
    assert isinstance(errors, list)
    assert len(errors) == 1, result["log"]
    assert "cannot serve in " in errors[0]
    assert f"] {errno_words}; retrying" in errors[0]
    assert not result["traceback"], result["log"]
    assert isinstance(result["retries"], int)
    assert result["retries"] >= 9
    # No descriptor kept per retry. The first count may catch the next attempt's (immediate)
    # directory scan and socket still open; later retries wait first.
    assert isinstance(result["fds_after_retries"], int)
    assert isinstance(result["fds_at_first_retry"], int)
    assert result["fds_after_retries"] <= result["fds_at_first_retry"]
    assert result["registered"]


async def test_the_plugin_dir_replaced_by_a_file(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    plugin_dir = fake_node.plugin_dir
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        await serving(kubelet)
        await run_blocking(kubelet.stop)
        # Moved away in one step: the daemon may be serving a fresh socket in it meanwhile.
        gone = plugin_dir.with_name("gone")
        plugin_dir.rename(gone)
        shutil.rmtree(gone)
        await log_line(daemon, f"Waiting for {plugin_dir} to be created")
        # What it waits for changed: it says so.
        plugin_dir.write_text("not a directory")
        await log_line(daemon, f"Waiting for {plugin_dir} to be a directory: it is a file now")
        plugin_dir.unlink()
        await run_blocking(kubelet.start)
        await serving(kubelet, registrations=2)
    text = daemon.log_text()
    assert "Traceback" not in text
    assert not [line for line in text.splitlines() if line.startswith("E")]


@pytest.mark.parametrize("replacement", ["nothing", "a regular file", "another socket"])
async def test_own_socket_is_known_by_identity(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon, replacement: str
) -> None:
    """Deleted or replaced, it is served again on a fresh name; what stands there is left."""
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        first = await serving(kubelet)
        path = fake_node.plugin_dir / first
        impostor = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # Renamed over: one event, and the path is never missing.
            staged = fake_node.plugin_dir / "staged"
            if replacement == "a regular file":
                staged.write_text("someone else's")
                staged.rename(path)
            elif replacement == "another socket":
                impostor.bind(str(staged))
                impostor.listen()
                staged.rename(path)
            else:
                path.unlink()
            await log_line(daemon, f"own socket {path}")
            second = await serving(kubelet, registrations=2)
            assert second != first
            if replacement == "a regular file":
                assert path.read_text() == "someone else's"
            elif replacement == "another socket":
                assert path.is_socket()
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                    probe.connect(str(path))
            else:
                assert not path.exists()
        finally:
            impostor.close()
    assert "Traceback" not in daemon.log_text()


# Signals


async def test_sighup_without_a_config_file_changes_nothing(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        endpoint = await serving(kubelet)
        daemon.proc.send_signal(signal.SIGHUP)
        await log_line(daemon, "Nothing to reload (SIGHUP): the resources come from flags")
        assert (fake_node.plugin_dir / endpoint).is_socket()
        response = await run_blocking(kubelet.allocate, RESOURCE, [["pcc-0"]], WAIT)
        assert len(response.container_responses) == 1
        assert kubelet.register_calls == 1


async def test_sigusr1_writes_the_task_tree_and_state_and_goes_on(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        endpoint = await serving(kubelet)
        # Kubelet's stream opens inside Register; the daemon marks itself registered when
        # Register returns, a moment later.
        await log_line(daemon, "Registered device plugin with Kubelet")
        daemon.proc.send_signal(signal.SIGUSR1)
        await log_line(daemon, "Task tree:")
        # The tree's last line: it is written depth first, each nursery's tasks in name order,
        # the generation's nursery last.
        await log_line(daemon, "registration.reregister_when_stream_ends")
        text = daemon.log_text()
        # It says what it is, then the configuration comes.
        messages = [line.split("] ", 1)[1] for line in text.splitlines()]
        header = messages.index(
            "State on SIGUSR1: the configuration, each resource with its counters, and the task "
            "tree"
        )
        assert messages[header + 1] == "Configuration 1 from flags (hash flags)"
        # Kubelet's stream opens inside Register, a moment before the plugin hears it accepted.
        assert re.search(
            f"Resource {RESOURCE}: registered=(True|False) kubelet_stream_open=True generation=",
            text,
        )
        assert f"counters {RESOURCE}: registrations=" in text
        # Kubelet's connection is served by one of trio.serve_listeners' handler tasks.
        for task in ("handle_signals", "supervise_resource", "watch_health", "watch_plugin_dir",
                     "Server.serve", "serve_listeners._run_handler",
                     "forget_faults_when_stable", "reregister_when_stream_ends"):  # fmt: skip
            assert task in text
        assert (fake_node.plugin_dir / endpoint).is_socket()
        assert kubelet.stream_open(RESOURCE)


@pytest.mark.parametrize("signum", [signal.SIGQUIT, signal.SIGTERM, signal.SIGINT])
async def test_stopping_signals_remove_the_socket_and_exit_0(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon, signum: int
) -> None:
    with trio.fail_after(30):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0))
        endpoint = await serving(kubelet)
        assert await run_blocking(daemon.terminate, signum, WAIT) == 0
    assert not (fake_node.plugin_dir / endpoint).exists()
    assert daemon.log_text().rstrip().endswith("Stopped")


# Live configuration

PROFILE = """\
resources:
  - name: example.com/kept
    count: 2
    socketPrefix: kept
    mounts: [{{hostPath: /var/run/pcc}}]
  - name: example.com/changed
    count: {changed_count}
    socketPrefix: changed
    mounts: [{{hostPath: /var/run/pcc}}]
{extra}"""
ADDED = """\
  - name: example.com/added
    socketPrefix: added
    mounts: [{hostPath: /var/run/pcc}]
"""


class ConfigMapVolume:
    """A directory as kubelet writes a ConfigMap volume: files are symlinks into `..data`,
    a symlink to a timestamped directory, replaced in one rename on each update."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir()
        self.version = 0

    @property
    def file(self) -> Path:
        return self.root / "profiles.yaml"

    def write(self, text: str) -> None:
        self.version += 1
        data = self.root / f"..2026_12_02_{self.version:04d}"
        data.mkdir()
        (data / "profiles.yaml").write_text(text)
        staged = self.root / "..data_tmp"
        staged.symlink_to(data.name)
        staged.rename(self.root / "..data")
        if not self.file.is_symlink():
            self.file.symlink_to("..data/profiles.yaml")


def endpoints(kubelet: SimKubelet, resource: str) -> list[str]:
    return [r.endpoint for r in accepted(kubelet) if r.resource_name == resource]


async def test_a_configmap_update_restarts_only_what_changed(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    volume = ConfigMapVolume(fake_node.root / "config")
    volume.write(PROFILE.format(changed_count=1, extra=""))
    kept, changed, added = "example.com/kept", "example.com/changed", "example.com/added"
    with trio.fail_after(60):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0), f"--config={volume.file}")
        await serving(kubelet, devices={"kept-0": "Healthy", "kept-1": "Healthy"}, resource=kept)
        await serving(kubelet, devices={"changed-0": "Healthy"}, resource=changed)
        kept_endpoint = endpoints(kubelet, kept)
        volume.write(PROFILE.format(changed_count=2, extra=ADDED))
        await log_line(daemon, "Configuration 2 applied from")
        await serving(kubelet, 2, devices={"changed-0": "Healthy", "changed-1": "Healthy"},
                      resource=changed)  # fmt: skip
        await serving(kubelet, devices={"added-0": "Healthy"}, resource=added)
        # The unchanged resource kept its socket and kubelet's stream: kubelet saw no gap.
        assert endpoints(kubelet, kept) == kept_endpoint
        assert kubelet.stream_open(kept)
        assert kubelet.devices(kept) == {"kept-0": "Healthy", "kept-1": "Healthy"}
        assert not [e for e in kubelet.events if "ended unexpectedly" in e and "kept" in e]
        # An invalid file is refused whole; what runs keeps running.
        volume.write("resources:\n  - name: example.com/kept\n    count: zero\n")
        line = await log_line(daemon, "Configuration not reloaded, the running one stays")
        assert line.startswith("E")
        assert f"{volume.file}: resources[0].count" in line
        assert kubelet.stream_open(kept)
        assert kubelet.stream_open(added)
        # Removing a resource stops it alone; SIGHUP applies the file on demand too.
        volume.write(PROFILE.format(changed_count=2, extra=""))
        await log_line(daemon, "Configuration 3 applied from")
        await run_blocking(kubelet.wait_for, lambda: not kubelet.stream_open(added), WAIT)
        response = await run_blocking(kubelet.allocate, kept, [["kept-1"]], WAIT)
        assert len(response.container_responses) == 1
    assert endpoints(kubelet, kept) == kept_endpoint
    assert "Traceback" not in daemon.log_text()


async def test_sighup_applies_an_edited_file(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    config = fake_node.root / "profiles.yaml"
    config.write_text(PROFILE.format(changed_count=1, extra=""))
    with trio.fail_after(60):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=1), f"--config={config}")
        await serving(kubelet, devices={"changed-0": "Healthy"}, resource="example.com/changed")
        # Written in place, as `cat > file` does; SIGHUP or the write itself applies it.
        with config.open("w") as file:
            file.write(textwrap.dedent(PROFILE.format(changed_count=3, extra="")))
        daemon.proc.send_signal(signal.SIGHUP)
        await serving(kubelet, 2, devices={f"changed-{i}": "Healthy" for i in range(3)},
                      resource="example.com/changed")  # fmt: skip
        await log_line(daemon, "Configuration 2 applied from")
        # Once applied, a SIGHUP finds nothing new and restarts nothing.
        daemon.proc.send_signal(signal.SIGHUP)
        await log_line(daemon, "Configuration unchanged (SIGHUP)")
    assert "Configuration 3 applied" not in daemon.log_text()
    # The changed resource's previous socket, still closing, is this instance's own.
    assert "another instance serves it" not in daemon.log_text()


HOLD_AT_IMPORT = """
import importlib.abc, os, sys

class HoldAt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == os.environ["PCC_TEST_HOLD_AT"]:
            sys.meta_path.remove(self)
            os.write(int(os.environ["PCC_TEST_READY_FD"]), b"x")
            os.read(int(os.environ["PCC_TEST_GO_FD"]), 1)  # the signal comes meanwhile
        return None

sys.meta_path.insert(0, HoldAt())
"""


def stop_while_importing(argv: list[str], hooks: Path, module: str, signum: int) -> tuple[int, str]:
    """Run `argv` held at the import of `module`, send `signum` then; its exit code and output."""
    ready_read, ready_write = os.pipe()
    go_read, go_write = os.pipe()
    env = {
        **os.environ,
        "PYTHONPATH": str(hooks),
        "PCC_TEST_HOLD_AT": module,
        "PCC_TEST_READY_FD": str(ready_write),
        "PCC_TEST_GO_FD": str(go_read),
    }
    try:
        with subprocess.Popen(
            argv, env=env, pass_fds=(ready_write, go_read),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        ) as process:  # fmt: skip
            os.close(ready_write)
            os.close(go_read)
            try:
                assert os.read(ready_read, 1) == b"x"
                process.send_signal(signum)
                output, _ = process.communicate(timeout=20)
            finally:
                process.kill()
            return process.returncode, output.decode()
    finally:
        os.close(ready_read)
        os.close(go_write)


@pytest.mark.parametrize("module", ["pcc_plugin.flags", "trio", "pcc_plugin.supervisor"])
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_a_stop_signal_while_importing_ends_with_0(
    fake_node: FakeNode, tmp_path: Path, module: str, signum: int
) -> None:
    """Held at the import of `module` (a hook in sitecustomize), the daemon gets the signal."""
    (tmp_path / "sitecustomize.py").write_text(HOLD_AT_IMPORT)
    argv = [sys.executable, "-m", "pcc_plugin", *fake_node.daemon_args(verbosity=0)]
    with trio.fail_after(30):
        returncode, output = await run_blocking(
            stop_while_importing, argv, tmp_path, module, signum
        )
    assert returncode == 0, output
    assert "Traceback" not in output
