"""The e2e and cluster sessions' own machinery that runs without root or a kubelet.

The builds' recipes (a changed kubelet recipe would throw away every cached kubelet and cost CI
a ten-minute build), kubelet's log as the race check reads it, a daemon's output watched line by
line, and how the harness tells failed checks from its own errors.
"""

from __future__ import annotations

import copy
import re
import signal
import sys
from pathlib import Path

import pytest
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from e2e import __main__ as e2e_main
from e2e import builds, cluster_dra, harness, kubelet_log, pods
from e2e.node import Daemon, Node


def test_kubelets_recipe_is_the_one_cached_kubelets_were_built_by(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The keys and flags kubelet was built with before the other components came."""
    monkeypatch.setattr(builds, "_go_version", lambda go: "go1.26.8")
    kubelet = builds.COMPONENTS["kubelet"]
    version = kubelet.version()
    recipe = kubelet.recipe("go", version)
    minor = version.split(".")[1]
    assert recipe == {
        "version": version,
        "go": "go1.26.8",
        "gcflags": "all=-N -l -dwarf=false",
        "ldflags": (
            f"-s -w -X k8s.io/component-base/version.gitVersion={version} "
            f"-X k8s.io/component-base/version.gitMajor=1 "
            f"-X k8s.io/component-base/version.gitMinor={minor}"
        ),
        "go.sum": (kubelet.module / "go.sum").read_text(),
    }
    containerd = builds.COMPONENTS["containerd"]
    assert containerd.recipe("go", containerd.version())["tags"] == containerd.tags


def test_every_component_pins_its_module_and_names_its_commands() -> None:
    names = {name: component.binaries for name, component in builds.COMPONENTS.items()}
    assert names == {
        "containerd": ["containerd", "containerd-shim-runc-v2", "ctr"],
        "kubelet": ["kubelet"],
        "control-plane": ["kube-apiserver", "kube-controller-manager", "kube-scheduler"],
        "etcd": ["etcd"],
    }
    for component in builds.COMPONENTS.values():
        assert re.fullmatch(r"v\d+\.\d+\.\d+", component.version()), component.name
        assert (component.module / "go.sum").is_file(), component.name
    # The control plane runs at kubelet's version.
    assert builds.COMPONENTS["control-plane"].version() == builds.COMPONENTS["kubelet"].version()


KUBELET_LOG = """\

===== pcc-e2e: start 1: kubelet --v=2
I1203 23:59:58.100000    1 server.go:87] "Starting device plugin registration server"
I1203 23:59:58.200000    1 server.go:161] "Got registration request from device plugin with \
resource" resourceName="tke.cloud.tencent.com/pcc-device"

===== pcc-e2e: start 2: kubelet --v=2
I1203 23:59:59.900000    2 server.go:87] "Starting device plugin registration server"
a line of its own output that is not klog's
I1204 00:00:00.020000    2 server.go:161] "Got registration request from device plugin with \
resource" resourceName="tke.cloud.tencent.com/pcc-device"
I1204 00:00:00.031000    2 manager.go:345] "Processed device updates for resource" \
resourceName="tke.cloud.tencent.com/pcc-device" totalCount=16 healthyCount=16
"""


def test_kubelets_log_is_read_per_start_and_across_midnight(tmp_path: Path) -> None:
    log = tmp_path / "kubelet.log"
    log.write_text(KUBELET_LOG)
    lines = kubelet_log.lines_of_start(log, 2)
    assert len(lines) == 3
    server = kubelet_log.first(lines, kubelet_log.REGISTRATION_SERVER)
    register = kubelet_log.first(lines, kubelet_log.REGISTRATION_REQUEST, "pcc-device")
    devices = kubelet_log.first(lines, kubelet_log.DEVICE_UPDATES, "healthyCount=16")
    assert server is not None
    assert register is not None
    assert devices is not None
    assert register.seconds - server.seconds == pytest.approx(0.12)
    assert devices.seconds - register.seconds == pytest.approx(0.011)
    assert kubelet_log.first(lines, kubelet_log.REGISTRATION_SERVER, after=register.seconds) is None
    (first_start,) = [line for line in kubelet_log.lines_of_start(log, 1) if "Got" in line.text]
    assert first_start.seconds == pytest.approx(86398.2)


async def test_a_daemons_line_is_acted_on_once_as_it_is_written(tmp_path: Path) -> None:
    seen: list[str] = []
    acted, written = trio.Event(), trio.Event()
    async with trio.open_nursery() as nursery:
        daemon = Daemon(
            "sh",
            ["sh", "-c", "echo one; echo ready now; echo ready again; echo end; exec sleep 30"],
            tmp_path / "sh.log", nursery=nursery,
        )  # fmt: skip

        def act() -> None:
            seen.append(daemon.log.read_text())
            acted.set()

        daemon.on_line("ready", act)
        daemon.on_line("end", written.set)
        with trio.fail_after(10):
            await daemon.start()
            await acted.wait()
            await written.wait()  # every line out before it is stopped
            assert await daemon.stop() == -signal.SIGTERM
    # Once, at the first line with the words, which the log already held.
    assert len(seen) == 1
    assert "one\nready now\n" in seen[0]
    assert daemon.log.read_text().endswith("one\nready now\nready again\nend\n")


def test_failed_checks_are_told_from_errors_also_in_nurseries() -> None:
    failed = AssertionError("check failed")
    assert harness.check_failures(failed) == [failed]
    grouped = ExceptionGroup("nursery", [ExceptionGroup("inner", [failed])])
    assert [str(f) for f in harness.check_failures(grouped)] == ["check failed"]
    assert harness.check_failures(ExceptionGroup("nursery", [failed, KeyError("bug")])) == []
    assert harness.check_failures(RuntimeError("bug")) == []


def test_more_race_rounds_than_shares_for_kept_pods_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Kept, the 16th round's pod would find every share held and be refused for that."""
    with pytest.raises(SystemExit) as exited:
        e2e_main.main(["--plugin-image", "unused.tar", "--race=16"])
    assert exited.value.code == 2
    assert "--race: at most 15 with the race pods kept" in capsys.readouterr().err


def test_the_yardstick_runs_in_the_bases_pod_with_only_its_process_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The race's floor is fair only if kubelet and the kernel treat the yardstick as they treat
    the plugin: same pod name, resources, privileges and directory; only the process differs."""
    container: pods.Obj = {
        "name": pods.PLUGIN_CONTAINER,
        "image": "localhost/pcc-device-plugin:0.1.0",
        "args": ["--v=1"],
        "livenessProbe": {"httpGet": {"path": "/livez", "port": "metrics"}},
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "metrics"}},
        "ports": [{"containerPort": 8080, "name": "metrics"}],
        "resources": {"requests": {"cpu": "100m"}},
        "securityContext": {"privileged": True},
        "volumeMounts": [
            {"name": "device-plugins", "mountPath": "/var/lib/kubelet/device-plugins"}
        ],
    }
    base: pods.Obj = {
        "metadata": {"name": "pcc-device-plugin", "namespace": "kube-system"},
        "spec": {
            "containers": [container],
            "priorityClassName": "system-node-critical",
            "volumes": [{"name": "device-plugins", "hostPath": {"path": "/var/lib/kubelet"}}],
        },
    }
    monkeypatch.setattr(pods, "plugin_pod", lambda name: copy.deepcopy(base) if name == "plugin"
                        else pytest.fail(f"the yardstick's pod from {name}"))  # fmt: skip
    pod = pods.yardstick_pod(Path("/cache/e2e/yardstick-0123/yardstick"))
    (ran,) = pod["spec"]["containers"]
    assert ran["command"] == ["/yardstick/yardstick"]
    assert not {"args", "livenessProbe", "readinessProbe", "ports"} & set(ran)
    assert ran["volumeMounts"][-1] == {
        "name": "yardstick", "mountPath": "/yardstick", "readOnly": True,
    }  # fmt: skip
    assert pod["spec"]["volumes"][-1] == {
        "name": "yardstick",
        "hostPath": {"path": "/cache/e2e/yardstick-0123", "type": "Directory"},
    }
    for key in ("name", "image", "resources", "securityContext"):
        assert ran[key] == container[key]
    assert ran["volumeMounts"][:-1] == container["volumeMounts"]
    assert pod["metadata"] == base["metadata"]
    assert pod["spec"]["priorityClassName"] == base["spec"]["priorityClassName"]
    assert pod["spec"]["volumes"][:-1] == base["spec"]["volumes"]


async def test_a_task_whose_shim_exits_while_it_is_deleted_is_deleted_again(
    tmp_path: Path,
) -> None:
    """containerd answers "ttrpc: closed" when a task's shim exits during `ctr tasks delete`;
    the reset between two variants failed on it. The task is looked up and deleted again."""
    binaries, tasks, asked = tmp_path / "bin", tmp_path / "tasks", tmp_path / "asked"
    binaries.mkdir()
    tasks.write_text("c1 123 STOPPED\n")
    ctr = binaries / "ctr"
    ctr.write_text(f"""#!/bin/sh
shift 4  # --address SOCKET --namespace k8s.io
case "$1 $2" in
"tasks list") echo "TASK PID STATUS"; cat {tasks} ;;
"tasks delete")
    if [ ! -e {asked} ]; then touch {asked}; echo "ctr: ttrpc: closed" >&2; exit 1; fi
    : > {tasks} ;;
*) echo "unexpected: $*" >&2; exit 2 ;;
esac
""")
    ctr.chmod(0o755)
    async with trio.open_nursery() as nursery:
        node = Node(tmp_path / "state", tmp_path, tmp_path / "kubelet", binaries, nursery)
        with trio.fail_after(10):
            await node.stop_all_containers()
    assert asked.exists()
    assert tasks.read_text() == ""


def test_the_cluster_counts_slice_writes_against_the_drivers_own_bound() -> None:
    """Check 9.8 holds the rollout's writes to the bound the driver keeps (docs/dra.md)."""
    from pcc_plugin.dra import slices

    assert (cluster_dra.WRITE_BURST, cluster_dra.WRITE_EVERY) == (
        slices.WRITE_BURST,
        slices.WRITE_EVERY,
    )
    assert cluster_dra.SETTLE > slices.WRITE_EVERY
