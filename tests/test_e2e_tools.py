"""The e2e and cluster sessions' own machinery that runs without root or a kubelet.

The builds' recipes (a changed kubelet recipe would throw away every cached kubelet and cost CI
a ten-minute build), kubelet's log as the race check reads it, a daemon's output watched line by
line, and how the harness tells failed checks from its own errors.
"""

from __future__ import annotations

import copy
import datetime
import itertools
import re
import signal
import statistics
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest
import trio

# The root too: the cluster's checks read the audit log with the scale benchmark's code
# (bench/scale/audit.py), as `python -m e2e` does from the root.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from e2e import __main__ as e2e_main
from e2e import builds, cluster_dra, harness, kubelet_log, legs, pods
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
        "kubectl": ["kubectl"],
        "kubelet-1.35": ["kubelet"],
    }
    for component in builds.COMPONENTS.values():
        assert re.fullmatch(r"v\d+\.\d+\.\d+", component.version()), component.name
        assert (component.module / "go.sum").is_file(), component.name
    # The control plane, its kubectl and node A's kubelet are one version; node B's kubelet is
    # of the minor its component is named after.
    versions = {name: component.version() for name, component in builds.COMPONENTS.items()}
    assert versions["control-plane"] == versions["kubelet"] == versions["kubectl"]
    assert versions["kubelet-1.35"].startswith("v1.35.")


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


@pytest.fixture
def zone(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process in a zone 5 h 30 min east of UTC (a POSIX TZ string: no tzdata needed)."""
    monkeypatch.setenv("TZ", "IST-5:30")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def epoch(stamp: str) -> float:
    """An ISO time with its zone as an epoch time."""
    return datetime.datetime.fromisoformat(stamp).timestamp()


@pytest.mark.usefixtures("zone")
def test_kubelets_log_is_read_per_start_in_its_zone_and_across_midnight(tmp_path: Path) -> None:
    log = tmp_path / "kubelet.log"
    log.write_text(KUBELET_LOG)
    now = epoch("2026-12-04T00:05:00+05:30")
    lines = kubelet_log.lines_of_start(log, 2, now)
    assert len(lines) == 3
    server = kubelet_log.first(lines, kubelet_log.REGISTRATION_SERVER)
    register = kubelet_log.first(lines, kubelet_log.REGISTRATION_REQUEST, "pcc-device")
    devices = kubelet_log.first(lines, kubelet_log.DEVICE_UPDATES, "healthyCount=16")
    assert server is not None
    assert register is not None
    assert devices is not None
    assert server.seconds == pytest.approx(epoch("2026-12-03T23:59:59.9+05:30"))
    assert register.seconds - server.seconds == pytest.approx(0.12, abs=1e-6)
    assert devices.seconds - register.seconds == pytest.approx(0.011, abs=1e-6)
    assert kubelet_log.first(lines, kubelet_log.REGISTRATION_SERVER, after=register.seconds) is None
    first_start = kubelet_log.lines_of_start(log, 1, now)
    assert first_start[1].seconds == pytest.approx(epoch("2026-12-03T23:59:58.2+05:30"))
    # Read on New Year's Day, December's lines are last year's.
    (last_year,) = kubelet_log.lines_of_start(log, 1, epoch("2027-01-01T00:01:00+05:30"))[1:]
    assert last_year.seconds == pytest.approx(epoch("2026-12-03T23:59:58.2+05:30"))


@pytest.mark.usefixtures("zone")
def test_a_kubelet_line_written_late_is_past_when_the_lines_before_it_were_stamped(
    tmp_path: Path,
) -> None:
    """Kubelet's goroutine stamped its line, then waited to write it behind others: it went on
    no earlier than the latest stamp written before it."""
    log = tmp_path / "kubelet.log"
    log.write_text(
        "===== pcc-e2e: start 1: kubelet\n"
        'I1204 20:36:09.291733    1 manager.go:250] "Device plugin connected"\n'
        'I1204 20:36:09.314341    1 setters.go:269] "Updated capacity for device plugin"\n'
        f'I1204 20:36:09.291759    1 handler.go:89] "{kubelet_log.CONNECTED}" resource="x"\n'
    )
    now = epoch("2026-12-04T20:37:00+05:30")
    *_, connected = kubelet_log.lines_of_start(log, 1, now)
    assert connected.seconds == pytest.approx(epoch("2026-12-04T20:36:09.291759+05:30"))
    assert connected.past == pytest.approx(epoch("2026-12-04T20:36:09.314341+05:30"))
    # Kubelet opened ListAndWatch after 100.030, not at 100.016: the plugin sent its list 2 ms
    # after that.
    connected_line = kubelet_log.Line(100.016, f"{connected.text} {RESOURCE}", past=100.030)
    lines = kubelet_restart()
    restart = legs.Restart.read(
        [lines[0], lines[1], connected_line, lines[3]], plugin_restart(opened=100.032),
        RESOURCE, 16, None,
    )  # fmt: skip
    assert restart.list_leg == pytest.approx(0.002)


# The plugin's container log as kubelet keeps it: containerd's stamp (here in UTC) as each line
# arrived, then the line, whose klog stamp is in the container's zone (here UTC-3:30).
CONTAINER_LOG = """\
2026-12-31T23:59:59.990000123Z stderr F I1231 20:29:59.985000       6 main.go:1] Starting
2027-01-01T00:00:00.004000000Z stderr F I1231 20:30:00.001500       6 registration.py:195] \
Registering tke.cloud.tencent.com/pcc-device at kubelet.sock with endpoint pcc.sock
2027-01-01T00:00:00.004100000Z stdout F a line of its own that is not klog's
2027-01-01T05:30:00.020000000+05:30 stderr F I1231 20:30:00.019000       6 registration.py:115] \
Kubelet dialled in on <connection 3>
"""


def test_a_containers_log_is_read_in_the_containers_zone_whatever_it_is(tmp_path: Path) -> None:
    log = tmp_path / "0.log"
    log.write_text(CONTAINER_LOG)
    lines = kubelet_log.container_lines(log)
    assert [line.text.split("] ")[1] for line in lines] == [
        "Starting",
        "Registering tke.cloud.tencent.com/pcc-device at kubelet.sock with endpoint pcc.sock",
        "Kubelet dialled in on <connection 3>",
    ]
    # The klog stamps' own instants, not containerd's (a little later), across New Year.
    assert [line.seconds for line in lines] == pytest.approx(
        [
            epoch("2026-12-31T23:59:59.985+00:00"),
            epoch("2027-01-01T00:00:00.0015+00:00"),
            epoch("2027-01-01T00:00:00.019+00:00"),
        ],
        abs=1e-6,
    )


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

        daemon.on_line(act, "ready")
        daemon.on_line(written.set, "end")
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
        node = Node(tmp_path / "state", tmp_path, tmp_path / "kubelet", binaries,
                    tmp_path / "runc", nursery)  # fmt: skip
        with trio.fail_after(10):
            await node.stop_all_containers()
    assert asked.exists()
    assert tasks.read_text() == ""


RESOURCE = "tke.cloud.tencent.com/pcc-device"


def kubelet_restart(
    server: float = 100.0,
    read: float | None = 100.010,
    connected: float = 100.016,
    processed: float = 100.021,
) -> list[kubelet_log.Line]:
    """Kubelet's lines of one start, at these instants (epoch seconds)."""
    resource = f'resourceName="{RESOURCE}"'
    lines = [(server, f'"{kubelet_log.REGISTRATION_SERVER}"')]
    if read is not None:
        lines += [
            (read, f'"{kubelet_log.REGISTRATION_REQUEST}" {resource}'),
            (connected, f'"{kubelet_log.CONNECTED}" resource="{RESOURCE}" socketPath="x"'),
            (processed, f'"{kubelet_log.DEVICE_UPDATES}" {resource} healthyCount=16'),
        ]
    return [kubelet_log.Line(at, text) for at, text in lines]


def plugin_restart(
    sent: float = 100.007, dialled: float = 100.013, opened: float = 100.018
) -> list[kubelet_log.Line]:
    """The plugin's lines of one kubelet restart, with the refused Register it sent to the old
    kubelet.sock before kubelet cleared the directory."""
    registering = f"Registering {RESOURCE} at /var/lib/kubelet/device-plugins/kubelet.sock"
    return [
        kubelet_log.Line(99.999, registering),
        kubelet_log.Line(100.004, "inotify: kubelet.sock created, restarting."),
        kubelet_log.Line(sent, registering),
        kubelet_log.Line(dialled, "Kubelet dialled in on <connection 7>"),
        kubelet_log.Line(opened, "ListAndWatch stream opened on <connection 7> (kubelet's)"),
    ]


def test_the_plugins_legs_are_read_from_its_log_and_kubelets() -> None:
    restart = legs.Restart.read(kubelet_restart(), plugin_restart(), RESOURCE, 16, 100.002)
    # kubelet.sock's change time, after kubelet's line, is when it was created; the Register
    # that counts is the last one before kubelet read one.
    assert restart.created == 100.002
    assert restart.register_sent == 100.007
    assert restart.register_leg == pytest.approx(0.005)
    # From kubelet's "Connected to new client" (it has the options and opens ListAndWatch),
    # 3 ms after the plugin's dial-in, to the plugin's stream opened: kubelet's turn is not
    # the plugin's.
    assert restart.list_leg == pytest.approx(0.002)
    assert restart.kubelet_read == pytest.approx(0.003)
    assert restart.kubelet_dial == pytest.approx(0.003)
    assert restart.kubelet_turn == pytest.approx(0.003)
    assert restart.kubelet_processed == pytest.approx(0.003)
    assert restart.missing() == []
    # A change time before kubelet's line (its clock is coarse) or after kubelet read the
    # Register (the socket changed since) does not move the creation.
    for changed in (99.997, 100.5, None):
        again = legs.Restart.read(kubelet_restart(), plugin_restart(), RESOURCE, 16, changed)
        assert again.created == 100.0


def test_a_leg_is_judged_less_the_plugins_wait_for_a_cpu_in_it() -> None:
    """Kept off a CPU by the machine, the plugin is not late; kept by itself, it is."""
    slow = legs.Restart.read(
        kubelet_restart(read=100.045, connected=100.05, processed=100.06),
        plugin_restart(sent=100.040, dialled=100.047, opened=100.052),
        RESOURCE, 16, None,
    )  # fmt: skip
    waited = attrs.evolve(slow, register_wait=0.030, list_wait=0.001)
    assert waited.own("register_leg") == pytest.approx(0.010)
    assert waited.own("list_leg") == pytest.approx(0.001)
    assert legs.over_bounds([waited] * 10) == []
    assert legs.why_refused(waited, 100.030).startswith("kubelet admitted the pod")
    # A wait longer than the leg (it includes a probe answered meanwhile) leaves 0, not less.
    assert attrs.evolve(slow, register_wait=0.5).own("register_leg") == 0
    (problem,) = legs.over_bounds([attrs.evolve(slow, register_wait=0.010)] * 10)
    assert "register leg (kubelet.sock created → Register sent), its own part: above" in problem
    assert "above its bound of 20 ms in 10 of 10 restarts (30.0, 30.0," in problem


def test_a_wait_is_counted_back_from_when_the_kernel_counts_it() -> None:
    """The kernel adds a thread's wait for a CPU to its count when the wait ends: 5 ms counted
    by the sample at 100.008 were waited from 100.003 on."""
    rows = [(100.0 + i / 1000, i / 1000, 0.0) for i in range(8)]
    rows += [(100.0 + i / 1000, i / 1000, 0.005) for i in range(8, 12)]
    samples = legs.Samples(rows)
    assert samples.waited(100.005, 100.010) == pytest.approx(0.003)
    assert samples.waited(100.0, 100.004) == pytest.approx(0.001)
    assert samples.waited(100.0, 100.011) == pytest.approx(0.005)
    assert samples.ran(100.002, 100.006) == pytest.approx(0.004)
    # Not sampled from before the start to after the end: unknown.
    assert samples.waited(99.0, 100.004) is None
    assert samples.waited(100.0, 101.0) is None
    assert samples.waited(None, 100.004) is None
    assert legs.Samples.parse("100.000000 0.5 0.25\n100.001000 0.5005 0.25\n").rows == [
        (100.0, 0.5, 0.25),
        (100.001, 0.5005, 0.25),
    ]


def test_the_plugin_is_idle_until_it_first_runs_or_waits_to() -> None:
    """Blocked from 100.000 on; the sample at 100.011 counted 2 ms of waiting and some running:
    it woke at 100.008 at the latest, so it was idle 6 ms from 100.002."""
    rows = [(100.0 + i / 1000, 1.0, 0.5) for i in range(11)]
    rows += [(100.0 + i / 1000, 1.0005, 0.502) for i in range(11, 14)]
    samples = legs.Samples(rows)
    assert samples.idle(100.002, 100.013) == pytest.approx(0.006)
    # Never woke before the end: idle all along; the end came first: idle to it.
    assert samples.idle(100.002, 100.005) == pytest.approx(0.003)
    assert samples.idle(99.0, 100.005) is None
    restart = legs.Restart.read(kubelet_restart(), plugin_restart(opened=100.036), RESOURCE, 16,
                                None)  # fmt: skip
    assert restart.list_leg == pytest.approx(0.020)
    judged = attrs.evolve(restart, list_wait=0.002, list_idle=0.006)
    assert judged.own("list_leg") == pytest.approx(0.012)


async def test_the_sampler_follows_a_process_every_millisecond() -> None:
    """A process always runnable (a busy loop) runs or waits for a CPU all the time it is
    sampled, whoever else wants the machine."""
    with trio.fail_after(30):
        busy = await trio.lowlevel.open_process([sys.executable, "-c", "while True: pass"])
        try:
            sampler = legs.Sampler(busy.pid)
            await sampler.start()
            await trio.sleep(0.5)  # the time to sample, not a synchronisation
            samples = await sampler.stop()
        finally:
            busy.kill()
            await busy.wait()
    assert samples is not None
    rows = samples.rows
    # Every millisecond or so: it samples at real-time priority.
    assert len(rows) > 100
    assert statistics.median(b[0] - a[0] for a, b in itertools.pairwise(rows)) < 0.003
    assert all(a[1] <= b[1] and a[2] <= b[2] for a, b in itertools.pairwise(rows))
    (first, ran, waited), *_, (last, ran_last, waited_last) = rows
    assert ran_last > ran
    # What was counted in the span, less what of it was waited before its first sample.
    counted = samples.waited(first, last)
    assert counted is not None
    assert counted <= waited_last - waited + 1e-4  # sums of differences of epoch floats


def test_a_register_kubelet_refused_while_starting_is_the_plugins_first() -> None:
    """The register leg ends at the plugin's first Register to the new kubelet.sock; kubelet,
    not ready yet, refused it and took the next one 27 ms later."""
    plugin = plugin_restart()
    registering = plugin[0].text
    plugin.insert(2, kubelet_log.Line(100.003, registering))
    plugin[3] = kubelet_log.Line(100.030, registering)
    restart = legs.Restart.read(
        kubelet_restart(read=100.032, connected=100.036, processed=100.04),
        [*plugin[:4], kubelet_log.Line(100.034, plugin[4].text),
         kubelet_log.Line(100.038, plugin[5].text)],
        RESOURCE, 16, 100.002,
    )  # fmt: skip
    assert restart.register_sent == 100.003
    assert restart.register_taken == 100.030
    assert restart.register_leg == pytest.approx(0.001)
    assert restart.kubelet_read == pytest.approx(0.029)
    assert restart.missing() == []


def sampled(restart: legs.Restart) -> legs.Restart:
    """`restart` with the plugin sampled and never kept off a CPU nor idle."""
    return attrs.evolve(restart, register_wait=0.0, list_wait=0.0, list_idle=0.0)


def test_a_plugin_that_never_registers_or_is_slow_fails_the_bounds() -> None:
    fast = sampled(legs.Restart.read(kubelet_restart(), plugin_restart(), RESOURCE, 16, None))
    assert legs.over_bounds([fast] * 20) == []
    never = legs.Restart.read(kubelet_restart(read=None), plugin_restart(), RESOURCE, 16, None)
    assert never.register_leg is None
    (problem,) = legs.over_bounds([fast] * 19 + [never])
    assert problem.startswith("restart 20: the plugin's log shows no Register sent")
    slow = legs.Restart.read(
        kubelet_restart(read=100.045, connected=100.05, processed=100.06),
        plugin_restart(sent=100.040, dialled=100.047, opened=100.052),
        RESOURCE, 16, None,
    )  # fmt: skip
    assert slow.register_leg == pytest.approx(0.040)
    # One slow Register in ten is a stall of the machine's; two are the plugin's.
    assert legs.over_bounds([fast] * 9 + [sampled(slow)]) == []
    assert legs.within_bounds([fast] * 9 + [sampled(slow)]).startswith(
        "the plugin's register leg, its own part, median 7.0 ms, slowest 40.0 ms, above 20 ms "
        "in 1 of 10; "
    )
    (problem,) = legs.over_bounds([fast] * 18 + [sampled(slow)] * 3)
    assert problem == (
        "the plugin's register leg (kubelet.sock created → Register sent), its own part: above "
        "its bound of 20 ms in 3 of 21 restarts (40.0, 40.0, 40.0 ms; median 7.0 ms), more "
        "than 2 allowed"
    )
    # A run of fewer than ten allows one.
    assert legs.over_bounds([fast, sampled(slow)]) == []
    assert len(legs.over_bounds([fast] + [sampled(slow)] * 2)) == 1
    # Not sampled: not judged, and said.
    (problem,) = legs.over_bounds([fast] * 9 + [slow])
    assert problem == (
        "restart 10: the plugin's CPU was not sampled over it (e2e.sampler): its legs cannot "
        "be judged"
    )


def test_a_refused_pod_is_put_down_to_the_plugin_or_to_kubelet() -> None:
    def why(kubelet: list[kubelet_log.Line], plugin: list[kubelet_log.Line], added: float) -> str:
        restart = legs.Restart.read(kubelet, plugin, RESOURCE, 16, None)
        return legs.why_refused(sampled(restart), added)

    # The plugin's Register 40 ms after kubelet.sock appeared.
    late = plugin_restart(sent=100.040, dialled=100.047, opened=100.052)
    slow_kubelet = kubelet_restart(read=100.045, connected=100.05, processed=100.06)
    assert why(slow_kubelet, late, 100.030).startswith(
        "plugin late: register leg, its own part, 40 ms > 20 ms"
    )
    # Kubelet took the pod before the plugin (in time) sent its Register, and while it lay
    # unread in kubelet's socket.
    assert why(kubelet_restart(), plugin_restart(), 100.003).startswith(
        "kubelet admitted the pod before its own server could read the request: kubelet took "
        "the pod 3 ms after kubelet.sock appeared, before the plugin's Register (7 ms)"
    )
    unread = kubelet_restart(read=100.150, connected=100.16, processed=100.17)
    assert why(unread, plugin_restart(100.007, 100.153, 100.161), 100.133).startswith(
        "kubelet admitted the pod before its own server could read the request: the plugin's "
        "Register sent at 7 ms, kubelet took the pod at 133 ms and read the Register at 150 ms"
    )
    # Kubelet read the Register in time, then dialled back and processed the list too late.
    assert why(kubelet_restart(), plugin_restart(), 100.012).startswith(
        "kubelet late: it read the Register at 10 ms and took the pod at 12 ms"
    )


async def test_containerd_runs_its_own_shim_and_the_runc_named_whatever_is_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """containerd 2.x looks for its shim on PATH before beside itself: with Debian's
    containerd 1.6 installed it started that one's shim, which cannot serve it."""
    monkeypatch.setenv("PATH", "/usr/bin:/usr/sbin")
    binaries = tmp_path / "containerd-v2"
    async with trio.open_nursery() as nursery:
        node = Node(tmp_path / "state", tmp_path, tmp_path / "kubelet", binaries,
                    Path("/usr/sbin/runc"), nursery)  # fmt: skip
    node.write_containerd_config("localhost/pause:1")
    config = tomllib.loads((tmp_path / "state" / "containerd.toml").read_text())
    runc = config["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["runc"]
    assert runc["runtime_path"] == str(binaries / "containerd-shim-runc-v2")
    assert runc["options"] == {"BinaryName": "/usr/sbin/runc"}
    assert node.containerd.env is not None
    assert node.containerd.env["PATH"] == f"{binaries}:/usr/bin:/usr/sbin"


def test_a_cni_plugin_that_does_not_speak_the_configs_version_is_named(tmp_path: Path) -> None:
    old = tmp_path / "bridge"
    old.write_text('#!/bin/sh\necho \'{"cniVersion":"0.4.0","supportedVersions":["0.4.0"]}\'\n')
    old.chmod(0o755)
    assert e2e_main.cni_problem(old) == (
        f"CNI plugin {old} speaks CNI 0.4.0, not 1.0.0: containernetworking-plugins 1.0 or "
        f"newer in {tmp_path}"
    )
    assert e2e_main.cni_problem(tmp_path / "loopback").startswith("no CNI plugin loopback in")


def test_the_cluster_counts_slice_writes_against_the_drivers_own_bound() -> None:
    """Check 9.8 holds the rollout's writes to the bound the driver keeps (docs/dra.md)."""
    from pcc_plugin.dra import slices

    assert (cluster_dra.WRITE_BURST, cluster_dra.WRITE_EVERY) == (
        slices.WRITE_BURST,
        slices.WRITE_EVERY,
    )
    assert cluster_dra.SETTLE > slices.WRITE_EVERY
