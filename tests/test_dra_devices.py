"""What the DRA driver says of its devices: their health to kubelet (the DRAResourceHealth
stream, for the pods' status), a taint on an unhealthy device where the API server serves
taints (else withdrawal), and the node's confidential-computing attributes. The real daemon
against the simulated kubelet's DRA side and the fake API server; units on trio's clock.

What a cluster adds (kubelet writing the health into a pod's status, the scheduler honouring
the taint and the DeviceClass selector of docs/dra.md) is `nox -s cluster`'s check 9
(tools/e2e/cluster_dra.py).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import grpc
import pytest
import trio
import trio.testing
import yaml
from daemon_support import log_line
from dra_support import DRIVER, NODE, SHARES, WAIT, DraNode, published, registered
from kernel_support import Sysfs

from pcc_plugin import flags
from pcc_plugin._proto import v1 as health_api
from pcc_plugin.dra import health, node_facts, slices, taints
from pcc_plugin.flags import PROG
from pcc_plugin.resource import Device, pcc_resource, take_inventory
from pcc_plugin.sim import FakeNode, StartDaemon, run_blocking
from pcc_plugin.sim.dra import SimDraKubelet

ROOT = Path(__file__).resolve().parent.parent
KEY = f"{DRIVER}/unhealthy"
PCC_DIR_GONE = "detect socket path {root}/var/run/pcc failed: No such file or directory"
SPEC = pcc_resource("tke.cloud.tencent.com/pcc-device", 16, "/dev/sev-guest", "/var/run/pcc")


async def every_device(kubelet: SimDraKubelet, health_now: str, message: str = "") -> None:
    """Until kubelet holds `health_now` (and `message`) for every share."""

    def done() -> bool:
        return all(
            kubelet.device_health(DRIVER, NODE, share) == (health_now, message) for share in SHARES
        )

    await run_blocking(kubelet.wait_for, done, WAIT)


def taints_of(dra: DraNode) -> dict[str, list[dict[str, Any]]]:
    return {
        device["name"]: device.get("taints", [])
        for obj in dra.slices()
        for device in obj["spec"]["devices"]
    }


# B: the health stream


async def test_kubelet_hears_each_devices_health_as_the_pcc_dir_goes_and_comes_back(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    dra = dra_node
    with trio.fail_after(30):
        daemon = start_daemon(*dra.daemon_args())
        await registered(dra)
        (registration,) = dra.kubelet.registrations
        # Kubelet 1.37 picks v1 of the health services the driver lists.
        assert registration.health_service == "v1.DRAResourceHealth"
        await every_device(dra.kubelet, "HEALTHY")
        await log_line(daemon, "Kubelet watches the devices' health (v1.DRAResourceHealth)")
        dra.node.pcc_dir.rmdir()
        gone = PCC_DIR_GONE.format(root=dra.node.host_root)
        await every_device(dra.kubelet, "UNHEALTHY", gone)
        dra.node.pcc_dir.mkdir()
        await every_device(dra.kubelet, "HEALTHY")
        assert "Traceback" not in daemon.log_text()


@pytest.mark.parametrize(
    ("knows", "watched"),
    [(("v1alpha1.DRAResourceHealth",), "v1alpha1.DRAResourceHealth"), ((), "")],
    ids=["before 1.37: v1alpha1", "ResourceHealthStatus off"],
)
async def test_older_kubelets_watch_v1alpha1_and_one_without_the_gate_watches_nothing(
    dra_node: DraNode, start_daemon: StartDaemon, knows: tuple[str, ...], watched: str
) -> None:
    dra = dra_node
    dra.kubelet.stop()
    with (
        trio.fail_after(30),
        SimDraKubelet(dra.registry, NODE, dra.api, health_services=knows) as kubelet,
    ):
        daemon = start_daemon(*dra.daemon_args())
        await run_blocking(kubelet.wait_for, lambda: bool(kubelet.instances(DRIVER)), WAIT)
        (registration,) = kubelet.instances(DRIVER)
        assert registration.health_service == watched
        if watched:
            await every_device(kubelet, "HEALTHY")
            dra.node.device.unlink()
            gone = f"detect device {dra.node.host_root}/dev/sev-guest failed: No such file or "
            await every_device(kubelet, "UNHEALTHY", gone + "directory")
        else:
            # Served all the same: the driver publishes and prepares without the stream.
            await published(dra, SHARES)
            assert kubelet.health_streams == {}
        assert "Traceback" not in daemon.log_text()


async def test_health_is_sent_at_once_at_each_change_and_again_every_30_s(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Kubelet trusts a report HEALTH_TIMEOUT and forgets a driver's reports when one of its
    streams ends: the resend keeps every report fresh, the change is not waited for."""
    feed = health.HealthFeed(NODE)
    devices = take_inventory(SPEC, "/nonexistent", {})
    sent: list[tuple[float, health_api.NodeWatchResourcesResponse]] = []

    async def send(payload: bytes) -> None:
        sent.append((trio.current_time(), health_api.NodeWatchResourcesResponse.parse(payload)))

    healthy = tuple(Device(d.id, d.group, d.nodes, None) for d in devices)
    feed.update(healthy)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(feed.stream, send)
        await trio.sleep(95)
        assert [at for at, _ in sent] == [0, 30, 60, 90]
        feed.update(devices)
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    at, last = sent[-1]
    assert at == 95
    assert len(last.devices) == 16
    first = last.devices[0]
    assert first.device is not None
    assert (first.device.pool_name, first.device.device_name) == (NODE, "pcc-0")
    assert first.health == health_api.HealthStatus.UNHEALTHY
    assert (
        first.message
        == "detect device /nonexistent/dev/sev-guest failed: No such file or directory"
    )
    assert first.health_check_timeout_seconds == health.HEALTH_TIMEOUT > 2 * health.RESEND_EVERY
    assert sent[0][1].devices[0].health == health_api.HealthStatus.HEALTHY


async def test_a_malformed_health_request_is_invalid_argument(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    dra = dra_node
    with trio.fail_after(30):
        daemon = start_daemon(*dra.daemon_args())
        await registered(dra)
        (instance,) = dra.kubelet.instances(DRIVER)

        def watch(path: str) -> tuple[grpc.StatusCode, str]:
            with grpc.insecure_channel(f"unix:{instance.endpoint}") as channel:
                try:
                    next(iter(channel.unary_stream(path)(b"\x0a\x01", timeout=WAIT)))
                except grpc.RpcError as failure:
                    return failure.code(), failure.details() or ""
            return grpc.StatusCode.OK, ""

        for path in health.PATHS:
            code, details = await run_blocking(watch, path)
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert "NodeWatchResourcesRequest" in details
        await every_device(dra.kubelet, "HEALTHY")
        assert "Traceback" not in daemon.log_text()


# C: taints where the API server serves them, else withdrawal


async def test_an_unhealthy_device_stays_listed_with_a_taint_that_says_why(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    dra = dra_node
    with trio.fail_after(40):
        daemon = start_daemon(*dra.daemon_args())
        await published(dra, SHARES, generation=1)
        assert taints_of(dra) == {key: [] for key in SHARES}
        dra.node.pcc_dir.rmdir()
        await published(dra, SHARES, generation=2)
        # Learnt from the answer to the first write with a taint.
        await log_line(
            daemon,
            f"Unhealthy devices will be tainted {KEY}=<cause>:NoSchedule: the API server "
            "serves device taints",
        )
        tainted = taints_of(dra)
        (taint,) = tainted["pcc-3"]
        assert {key: taint[key] for key in ("key", "value", "effect")} == {
            "key": KEY, "value": "var-run-pcc-missing", "effect": "NoSchedule"
        }  # fmt: skip
        assert tainted == {key: [taint] for key in SHARES}
        # A claim allocated before cannot be prepared on it; kubelet is told why. The slices
        # do not wait for kubelet's registration: this call does.
        await registered(dra)
        dra.claim("late", "uid-late")
        answer = await run_blocking(dra.kubelet.prepare, DRIVER, [("default", "late", "uid-late")])
        assert answer.claims["uid-late"].error.startswith("device pcc-3 is unhealthy: detect ")
        # Written again (kubelet's start deletes the slices): the taint keeps its time, from
        # which eviction and tolerationSeconds count.
        await run_blocking(dra.kubelet.restart)
        await published(dra, SHARES, generation=3)
        assert taints_of(dra) == tainted
        dra.node.pcc_dir.mkdir()
        await published(dra, SHARES, generation=4)
        assert taints_of(dra) == {key: [] for key in SHARES}
        assert "Traceback" not in daemon.log_text()


# As an earlier run of the driver wrote it, long before this one started.
EARLIER = "2026-01-01T00:00:00Z"


def slice_tainted_at(dra: DraNode, added: str, effect: str = "NoSchedule") -> None:
    """The node's slice as an earlier run left it: every share tainted since `added`."""
    taint = {"key": KEY, "value": "var-run-pcc-missing", "effect": effect, "timeAdded": added}
    pool = slices.Pool(DRIVER, NODE, dra.api.nodes[NODE]["metadata"]["uid"])
    devices = tuple(Device(f"pcc-{i}", "pcc", SPEC.device_nodes, None) for i in range(16))
    facts = node_facts.read_facts(str(dra.node.host_root))
    (obj,) = slices.desired(pool, SPEC, devices, node=facts)
    for device in obj["spec"]["devices"]:
        device["taints"] = [taint]
    obj["spec"]["pool"]["generation"] = 7
    dra.api.answer("POST", "/apis/resource.k8s.io/v1/resourceslices", {}, obj)


def with_config(dra: DraNode) -> list[str]:
    """The daemon's arguments with the PCC profile as a --config file: it starts whatever the
    node has (without, it waits for the device and the PCC directory)."""
    config = dra.node.root / "pcc.yaml"
    config.write_text("mode: dra\n" + (ROOT / "docs" / "examples" / "pcc.yaml").read_text())
    return [*dra.daemon_args(), f"--config={config}"]


async def test_a_restarted_driver_keeps_the_time_its_taint_was_added(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """A restart or a rollout does not restart the countdown of a NoExecute taint's
    tolerationSeconds: the time comes from the slice, as upstream's controller keeps it."""
    dra = dra_node
    dra.node.pcc_dir.rmdir()
    slice_tainted_at(dra, EARLIER)
    with trio.fail_after(30):
        daemon = start_daemon(*with_config(dra))
        await registered(dra)
        await run_blocking(dra.api.wait_for, lambda: bool(dra.api.watches), WAIT)
        # Kubelet's start deletes the slice: written again, the time still the earlier one's.
        await run_blocking(dra.kubelet.restart)
        await published(dra, SHARES)
        assert {taint["timeAdded"] for each in taints_of(dra).values() for taint in each} == {
            EARLIER
        }
        assert "Traceback" not in daemon.log_text()


async def test_no_execute_only_once_the_problem_lasted(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """The device gone is tainted NoSchedule at once (no new claim gets it), and NoExecute
    (its pods evicted) only once that lasted NO_EXECUTE_AFTER: taints.py says why. A slice of
    an earlier run, tainted long enough ago, is NoExecute at once, from then."""
    dra = dra_node
    with trio.fail_after(30):
        daemon = start_daemon(*dra.daemon_args(), "--unhealthy-taint-effect=NoExecute")
        await published(dra, SHARES, generation=1)
        dra.node.device.unlink()
        await published(dra, SHARES, generation=2)
        (taint,) = taints_of(dra)["pcc-0"]
        assert (taint["value"], taint["effect"]) == ("dev-sev-guest-missing", "NoSchedule")
        assert daemon.terminate() == 0
    dra.api.delete_slices(NODE)
    dra.node.device.symlink_to("/dev/null")
    dra.node.pcc_dir.rmdir()
    slice_tainted_at(dra, EARLIER)
    with trio.fail_after(30):
        start_daemon(*with_config(dra), "--unhealthy-taint-effect=NoExecute")

        def evicting() -> bool:
            return [(taint["effect"], taint["timeAdded"]) for taint in taints_of(dra)["pcc-0"]
                    ] == [("NoExecute", "2026-01-01T00:00:30Z")]  # fmt: skip

        await run_blocking(dra.api.wait_for, evicting, WAIT)


async def test_no_execute_waits_and_a_short_gap_never_evicts(
    autojump_clock: trio.testing.MockClock,
) -> None:
    unhealthy = taints.Unhealthy(DRIVER, "NoExecute")
    gone = Device("pcc-0", "pcc", (), "gone", "dev-sev-guest-missing")
    back = Device("pcc-0", "pcc", (), None)
    unhealthy.seen((gone,))
    assert unhealthy.taints(gone)[0]["effect"] == "NoSchedule"
    assert unhealthy.due_in() == taints.NO_EXECUTE_AFTER
    await trio.sleep(taints.NO_EXECUTE_AFTER - 1)
    unhealthy.seen((back,))
    assert unhealthy.due_in() is None
    unhealthy.seen((gone,))
    await trio.sleep(taints.NO_EXECUTE_AFTER - 1)
    assert unhealthy.taints(gone)[0]["effect"] == "NoSchedule"
    await trio.sleep(1)
    assert unhealthy.due_in() is None
    assert unhealthy.taints(gone)[0]["effect"] == "NoExecute"


async def test_without_device_taints_unhealthy_devices_are_withdrawn_and_it_is_said(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """An API server without DRADeviceTaints drops the field: the driver sees it dropped
    from the answer to its write, and withdraws the device at once (test_dra.py follows the
    withdrawal); NoExecute cannot be had, which is said too."""
    dra = dra_node
    dra.api.serves_taints = False
    with trio.fail_after(30):
        daemon = start_daemon(*dra.daemon_args(), "--unhealthy-taint-effect=NoExecute")
        await published(dra, SHARES, generation=1)
        dra.node.device.unlink()
        await log_line(
            daemon,
            "Unhealthy devices will be withdrawn from the ResourceSlices: the API server dropped "
            "a device taint it was sent (DRADeviceTaints is off)",
        )
        await published(dra, [])
        # Written right after the line above, each line a write of its own: waited for.
        await log_line(
            daemon,
            "--unhealthy-taint-effect=NoExecute cannot be honoured without device taints: pods "
            "keep running on a device that goes",
        )


async def test_an_api_server_that_stops_serving_taints_gets_the_device_withdrawn(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """DRADeviceTaints turned off in the API server after the driver found it on: the next
    taint is dropped, and the device withdrawn at once, not left allocatable (nor written
    again and again)."""
    dra = dra_node
    dra.node.pcc_dir.rmdir()
    with trio.fail_after(40):
        daemon = start_daemon(*with_config(dra))
        await published(dra, SHARES, generation=1)
        assert all(taints_of(dra).values())
        await log_line(daemon, "the API server serves device taints")
        dra.api.serves_taints = False
        dra.node.pcc_dir.mkdir()
        await published(dra, SHARES, generation=2)
        dra.node.pcc_dir.rmdir()
        await published(dra, [], generation=4)
        await log_line(daemon, "DRADeviceTaints is off")
        assert dra.api.slice_writes() == 4
        assert "Traceback" not in daemon.log_text()


async def test_an_api_server_that_serves_taints_again_is_asked_when_a_device_goes(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """DRADeviceTaints turned on after the driver found it off: a device that goes asks again
    (a dry run, only then), and is tainted."""
    dra = dra_node
    dra.api.serves_taints = False
    dra.node.pcc_dir.rmdir()
    with trio.fail_after(40):
        daemon = start_daemon(*with_config(dra))
        await published(dra, [], generation=2)
        dra.api.serves_taints = True
        dra.node.pcc_dir.mkdir()
        await published(dra, SHARES, generation=3)
        dra.node.pcc_dir.rmdir()
        await published(dra, SHARES, generation=4)
        assert all(taints_of(dra).values())
        assert "POST /apis/resource.k8s.io/v1/resourceslices" in dra.api.requests
        await log_line(daemon, "the API server serves device taints")
        assert "Traceback" not in daemon.log_text()


async def test_a_taint_keeps_its_time_while_its_cause_holds(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = iter([1767225600.0, 1767225660.0, 1767225720.0])
    monkeypatch.setattr(taints, "_now", lambda: next(clock))
    unhealthy = taints.Unhealthy(DRIVER, "NoSchedule", tainting=True)
    gone = Device("pcc-0", "pcc", (), "gone", "dev-sev-guest-missing")
    unhealthy.seen((gone,))
    unhealthy.seen((gone,))
    assert unhealthy.taints(gone)[0]["timeAdded"] == "2026-01-01T00:00:00Z"
    other = Device("pcc-0", "pcc", (), "not a directory", "var-run-pcc-not-a-directory")
    unhealthy.seen((other,))
    assert unhealthy.taints(other) == [{
        "key": KEY, "value": "var-run-pcc-not-a-directory", "effect": "NoSchedule",
        "timeAdded": "2026-01-01T00:02:00Z",
    }]  # fmt: skip


async def test_tainting_slices_hold_64_devices_whatever_their_health() -> None:
    spec = pcc_resource("tke.cloud.tencent.com/pcc-device", 130, "/dev/sev-guest", "/var/run/pcc")
    pool = slices.Pool(DRIVER, NODE, "node-uid")
    unhealthy = taints.Unhealthy(DRIVER, tainting=True)
    for problem in (None, "gone"):
        devices = tuple(Device(f"pcc-{i}", "pcc", (), problem, problem) for i in range(130))
        unhealthy.seen(devices)
        wanted = slices.desired(pool, spec, devices, unhealthy)
        assert [len(obj["spec"]["devices"]) for obj in wanted] == [64, 64, 2]
        assert all(bool(d.get("taints")) == bool(problem) for d in wanted[0]["spec"]["devices"])


@pytest.mark.parametrize(
    ("make", "cause"),
    [
        (lambda node: node.device.unlink(), "dev-sev-guest-missing"),
        (
            lambda node: (node.device.unlink(), node.device.mkdir()),
            "dev-sev-guest-not-a-char-device",
        ),
        (lambda node: (node.pcc_dir.rmdir(), node.pcc_dir.touch()), "var-run-pcc-not-a-directory"),
    ],
    ids=["device missing", "device a directory", "pcc dir a file"],
)
def test_a_problems_cause_names_the_path_and_what_is_wrong(
    fake_node: FakeNode, make: Any, cause: str
) -> None:
    make(fake_node)
    (device, *_) = take_inventory(SPEC, str(fake_node.host_root), {})
    assert device.cause == cause


def test_a_long_paths_cause_is_a_label_value_that_keeps_its_end(tmp_path: Path) -> None:
    deep = "/" + "/".join(["d" * 20] * 6) + "/sev-guest"
    spec = pcc_resource("tke.cloud.tencent.com/pcc-device", 1, deep, "/var/run/pcc")
    (device,) = take_inventory(spec, str(tmp_path), {})
    assert device.cause is not None
    assert len(device.cause) <= 63
    assert device.cause.endswith("dddd-sev-guest-missing")
    assert re.fullmatch(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?", device.cause)


def test_an_unreadable_path_is_not_permitted() -> None:
    assert cause_when_stat_fails(errno.EACCES) == "dev-sev-guest-not-permitted"
    assert cause_when_stat_fails(errno.EIO) == "dev-sev-guest-unreadable"


def cause_when_stat_fails(code: int) -> str | None:
    real_stat = os.stat

    def failing(path: Any, *args: Any, **kwargs: Any) -> Any:
        if str(path).endswith("sev-guest"):
            raise OSError(code, os.strerror(code), str(path))
        return real_stat(path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "stat", failing)
        (device, *_) = take_inventory(SPEC, "/", {})
    return device.cause


def test_the_taint_effect_is_one_that_keeps_claims_off(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        flags.parse(["--unhealthy-taint-effect=None"], PROG, "", "")
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        "pcc-device-plugin: --unhealthy-taint-effect: must be NoSchedule or NoExecute, got "
        "'None' (see --help)"
    )


# D: the node's confidential-computing attributes


def test_node_facts_are_read_from_the_hosts_sysfs_under_the_host_root(tmp_path: Path) -> None:
    node = FakeNode.create()
    try:
        root = str(node.host_root)
        assert node_facts.read_facts(root) == node_facts.NodeFacts("sev-snp", True)
        shutil.rmtree(node.host_root / "sys" / "kernel")
        os.rmdir(node.host_root / "sys" / "bus" / "platform" / "devices" / "sev-guest")
        assert node_facts.read_facts(root) == node_facts.NodeFacts(None, False)
        assert node_facts.read_facts(root).attributes() == {"tsmReport": {"bool": False}}
        # A TDX guest: the kernel set the tdx_guest CPU flag at boot.
        Sysfs(node.host_root).tdx_guest()
        assert node_facts.read_facts(root) == node_facts.NodeFacts("tdx", False)
        assert node_facts.read_facts(root).describe() == "teeType tdx, tsmReport false"
        shutil.rmtree(node.host_root / "sys")
        assert node_facts.read_facts(root).attributes() == {}
        assert node_facts.sysfs_missing(root) == f"{root}/sys"
    finally:
        node.remove()


async def test_the_node_attributes_follow_the_node_read_again_as_the_device_changes(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    dra = dra_node
    report = dra.node.host_root / "sys" / "kernel" / "config" / "tsm" / "report"
    report.rmdir()
    with trio.fail_after(30):
        daemon = start_daemon(*dra.daemon_args())
        await published(dra, SHARES, generation=1)
        attributes = dra.slices()[0]["spec"]["devices"][0]["attributes"]
        assert (attributes["teeType"], attributes["tsmReport"]) == (
            {"string": "sev-snp"}, {"bool": False}
        )  # fmt: skip
        # Loading sev-guest brings the device and the TSM provider at once.
        dra.node.device.unlink()
        await published(dra, SHARES, generation=2)
        report.mkdir()
        os.symlink("/dev/null", dra.node.device)
        await published(dra, SHARES, generation=3)
        attributes = dra.slices()[0]["spec"]["devices"][0]["attributes"]
        assert attributes["tsmReport"] == {"bool": True}
        await log_line(daemon, "Node attributes: teeType sev-snp, tsmReport true")


async def test_without_the_hosts_sysfs_the_node_attributes_are_left_out_and_it_is_said(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    dra = dra_node
    shutil.rmtree(dra.node.host_root / "sys")
    with trio.fail_after(30):
        daemon = start_daemon(*dra.daemon_args())
        await published(dra, SHARES)
        attributes = dra.slices()[0]["spec"]["devices"][0]["attributes"]
        assert not {"teeType", "tsmReport"} & set(attributes)
        await log_line(
            daemon,
            f"{dra.node.host_root}/sys does not exist: the devices get no attributes teeType and "
            "tsmReport; mount the host's /sys there, read-only (manifests/overlays/dra does)",
        )


def docs_device_class() -> dict[str, Any]:
    """The DeviceClass of docs/dra.md's "Selecting by what the node is" (the cluster check
    applies the same block)."""
    text = (ROOT / "docs" / "dra.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    classes = [doc for doc in map(yaml.safe_load, blocks) if doc.get("kind") == "DeviceClass"]
    (device_class,) = classes
    return dict(device_class)


def test_the_docs_device_class_selects_on_what_the_driver_publishes() -> None:
    device_class = docs_device_class()
    (selector,) = device_class["spec"]["selectors"]
    expression = selector["cel"]["expression"]
    named = set(re.findall(rf'device\.attributes\["{re.escape(DRIVER)}"\]\.(\w+)', expression))
    assert named == {"teeType", "tsmReport"}
    published_names = set(node_facts.NodeFacts("sev-snp", True).attributes())
    assert named <= published_names
    assert f'device.driver == "{DRIVER}"' in expression
    assert json.dumps(device_class)  # plain data, as kubectl takes it
