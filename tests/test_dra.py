"""The DRA mode: the real daemon, as a process, against the simulated kubelet's DRA side
(grpcio) and the fake API server (both in pcc_plugin/sim).

What a cluster adds (the scheduler allocating from the slices, the extended-resource path,
containerd reading the CDI specs, the admission policy) is `nox -s cluster`'s check 8
(tools/e2e/cluster_dra.py); docs/dra.md says what each shows.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dra_support
import grpc
import grpclib.const
import grpclib.exceptions
import hypothesis
import hypothesis.strategies
import pytest
import trio
import trio.testing
from daemon_support import log_line
from dra_support import DRIVER, NODE, SHARES, WAIT, DraNode, published, registered
from metrics_support import get, metrics_port, scrape, value
from raw_clients import closed_by_server, connect

from pcc_plugin import configuration, flags
from pcc_plugin.dra import claims, kube, slices, taints
from pcc_plugin.dra import service as dra_service
from pcc_plugin.dra.checkpoint import Checkpoint, Claims, PreparedClaim, PreparedDevice
from pcc_plugin.dra.sockets import earlier_sockets, socket_paths, state_dir
from pcc_plugin.flags import PROG, Flags
from pcc_plugin.inventory import Inventory
from pcc_plugin.limits import DEFAULT
from pcc_plugin.plugin_dir import remove_stale_sockets
from pcc_plugin.resource import Device, pcc_resource
from pcc_plugin.sim import FakeNode, StartDaemon, run_blocking
from pcc_plugin.sim import rules as sim_rules
from pcc_plugin.sim.dra import SimDraKubelet
from pcc_plugin.state import ResourceState

V1_PREPARE = "NodePrepareResources"
CDI_ID = f"{DRIVER}/claim="


def cdi_spec(dra: DraNode, uid: str) -> Path:
    return dra.cdi / f"{DRIVER}-claim_{uid}.json"


def devices_of(response: object, uid: str) -> list[tuple[list[str], str, str, list[str]]]:
    answer = response.claims[uid]  # type: ignore[attr-defined]
    assert answer.error == ""
    return [
        (list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids))
        for d in answer.devices
    ]


async def test_registers_publishes_and_prepares_a_claim_idempotently(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    dra = dra_node
    with trio.fail_after(30):
        daemon = start_daemon(*dra.daemon_args())
        await registered(dra)
        (registration,) = dra.kubelet.registrations
        # Kubelet's view: a DRA plugin of this driver, v1 first, its DRA socket already served.
        assert registration.driver == DRIVER
        assert registration.supported == (
            "v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth",
            "v1alpha1.DRAResourceHealth",
        )  # fmt: skip
        assert registration.service == "v1.DRAPlugin"
        assert registration.endpoint_served
        assert Path(registration.endpoint).parent == dra.state
        assert re.fullmatch(
            rf"{re.escape(DRIVER)}-\d+-[0-9a-f]{{6}}-reg\.sock", registration.socket
        )
        await published(dra, SHARES, generation=1)
        (one,) = dra.slices()
        assert one["spec"]["driver"] == DRIVER
        assert one["spec"]["nodeName"] == NODE
        assert one["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
        assert one["metadata"]["ownerReferences"][0]["kind"] == "Node"
        assert one["spec"]["devices"][3] == {
            "name": "pcc-3",
            "attributes": {
                "kind": {"string": "pcc-device"},
                "resourceName": {"string": "tke.cloud.tencent.com/pcc-device"},
                "share": {"int": 3},
                "hostPath": {"string": "/dev/sev-guest"},
                "mountPath": {"string": "/var/run/pcc"},
                "teeType": {"string": "sev-snp"},
                "tsmReport": {"bool": True},
            },
        }

        dra.claim("app", "uid-1")
        expected = [(["pcc"], NODE, "pcc-3", [CDI_ID + "uid-1"])]
        first = await run_blocking(dra.kubelet.prepare, DRIVER, [("default", "app", "uid-1")])
        assert devices_of(first, "uid-1") == expected
        spec = json.loads(cdi_spec(dra, "uid-1").read_text())
        assert spec["kind"] == f"{DRIVER}/claim"
        (device,) = spec["devices"]
        assert device["name"] == "uid-1"
        assert device["containerEdits"]["deviceNodes"] == [
            {"path": "/dev/sev-guest", "hostPath": "/dev/sev-guest", "permissions": "rw"}
        ]
        assert device["containerEdits"]["mounts"] == [
            {
                "hostPath": "/var/run/pcc",
                "containerPath": "/var/run/pcc",
                "options": ["rbind", "rw"],
            }
        ]
        assert dra.checkpoint()["uid-1"]["devices"] == [
            {"requests": ["pcc"], "pool": NODE, "device": "pcc-3"}
        ]
        # Kubelet may ask again (a restart, a reboot): the same whole answer, without the API
        # server, and the spec written again if it was lost (/var/run/cdi is a tmpfs).
        cdi_spec(dra, "uid-1").unlink()
        dra.api.claims.clear()
        again = await run_blocking(dra.kubelet.prepare, DRIVER, [("default", "app", "uid-1")])
        assert devices_of(again, "uid-1") == expected
        assert json.loads(cdi_spec(dra, "uid-1").read_text()) == spec

        for _ in range(2):
            gone = await run_blocking(dra.kubelet.unprepare, DRIVER, [("default", "app", "uid-1")])
            assert gone.claims["uid-1"].error == ""
            assert not cdi_spec(dra, "uid-1").exists()
            assert dra.checkpoint() == {}
        # Ready (registered, slices published), and counted. The API server has the slices
        # before the driver has its answer: ready once it says so.
        await run_blocking(daemon.wait_for_log, "Published 16 devices", WAIT)
        port = await metrics_port(daemon)
        assert (await get(port, "/readyz"))[0] == 200
        samples = await scrape(port)
        for call in ("prepare", "unprepare"):
            assert value(samples, "pcc_device_plugin_dra_claims_total", call=call, result="ok") == 2
        # SIGTERM: both sockets removed, exit 0.
        assert daemon.terminate(signal.SIGTERM) == 0
        assert not list(dra.registry.glob("*.sock"))
        assert not list(dra.state.glob("*.sock"))
        assert "Traceback" not in daemon.log_text()


async def test_an_operator_reads_the_driver_in_prometheus(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """What an operator of NVIDIA's DRA driver looks for: calls answered, their duration (a
    histogram) and those in flight by operation, the devices prepared, the claims failed by
    why; and what the node costs the API server. The device plugin's families are not there
    (nor the DRA mode's in the device plugin's, tests/test_metrics.py)."""
    dra = dra_node
    with trio.fail_after(30):
        daemon = start_daemon(*dra.daemon_args())
        await registered(dra)
        await published(dra, SHARES)
        port = await metrics_port(daemon)
        before = await scrape(port)
        for operation in ("prepare", "unprepare"):
            assert value(before, "pcc_device_plugin_dra_requests_total", operation=operation) == 0
            assert value(before, "pcc_device_plugin_dra_requests_in_flight",
                         operation=operation) == 0  # fmt: skip
            assert value(before, "pcc_device_plugin_dra_request_duration_seconds_count",
                         operation=operation) == 0  # fmt: skip
        assert value(before, "pcc_device_plugin_dra_prepared_devices") == 0
        assert not [name for name, _ in before if "allocations" in name or "list_and_watch" in
                    name or "kubelet_restarts" in name]  # fmt: skip
        dra.claim("app", "uid-1")
        dra.api.put_claim("default", "waiting", None, uid="uid-2")
        claims = [("default", "app", "uid-1"), ("default", "waiting", "uid-2")]
        await run_blocking(dra.kubelet.prepare, DRIVER, claims)
        samples = await scrape(port)
        assert value(samples, "pcc_device_plugin_dra_requests_total", operation="prepare") == 1
        assert value(samples, "pcc_device_plugin_dra_request_duration_seconds_count",
                     operation="prepare") == 1  # fmt: skip
        assert value(samples, "pcc_device_plugin_dra_request_duration_seconds_bucket",
                     operation="prepare", le="+Inf") == 1  # fmt: skip
        assert value(samples, "pcc_device_plugin_dra_prepared_devices") == 1
        assert value(samples, "pcc_device_plugin_dra_prepare_errors_total", reason="claim") == 1
        assert value(samples, "pcc_device_plugin_dra_api_requests_total", verb="list",
                     object="resourceslices", code="200") == 1  # fmt: skip
        assert value(samples, "pcc_device_plugin_dra_api_requests_total", verb="get",
                     object="resourceclaims", code="200") == 2  # fmt: skip
        await run_blocking(dra.kubelet.unprepare, DRIVER, claims[:1])
        samples = await scrape(port)
        assert value(samples, "pcc_device_plugin_dra_requests_total", operation="unprepare") == 1
        assert value(samples, "pcc_device_plugin_dra_prepared_devices") == 0


async def test_v1beta1_is_served_to_a_kubelet_that_knows_only_it(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    dra = dra_node
    dra.kubelet.stop()
    with (
        trio.fail_after(30),
        SimDraKubelet(dra.registry, NODE, services=("v1beta1.DRAPlugin",)) as older,
    ):
        start_daemon(*dra.daemon_args())
        await run_blocking(older.wait_for, lambda: bool(older.instances(DRIVER)), WAIT)
        assert older.instances(DRIVER)[0].service == "v1beta1.DRAPlugin"
        await published(dra, SHARES)
        dra.claim("app", "uid-b", device="pcc-0")
        answer = await run_blocking(older.prepare, DRIVER, [("default", "app", "uid-b")])
        assert type(answer).__module__.endswith("dra_v1beta1_pb2")
        assert devices_of(answer, "uid-b") == [(["pcc"], NODE, "pcc-0", [CDI_ID + "uid-b"])]


async def test_a_claim_that_cannot_be_prepared_fails_alone(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    dra = dra_node
    with trio.fail_after(30):
        daemon = start_daemon(*dra.daemon_args())
        await registered(dra)
        await published(dra, SHARES)
        dra.claim("good", "uid-good")
        dra.api.put_claim("default", "pending", None, uid="uid-pending")
        dra.claim("recreated", "uid-new")
        dra.claim("elsewhere", "uid-else", pool="node-b")
        dra.claim("unknown", "uid-unknown", device="pcc-99")
        claims = [
            ("default", "good", "uid-good"),
            ("default", "pending", "uid-pending"),
            ("default", "recreated", "uid-old"),
            ("default", "elsewhere", "uid-else"),
            ("default", "unknown", "uid-unknown"),
            ("default", "missing", "uid-missing"),
        ]
        answer = await run_blocking(dra.kubelet.prepare, DRIVER, claims)
        errors = {uid: answer.claims[uid].error for _, _, uid in claims}
        assert errors == {
            "uid-good": "",
            "uid-pending": "the ResourceClaim is not allocated",
            "uid-old": "the ResourceClaim has UID uid-new, not uid-old: it was deleted and "
            "created again",
            "uid-else": f"device pcc-3 is allocated from pool node-b, not from this node's pool "
            f"{NODE}",
            "uid-unknown": "device pcc-99 is not one of this node's",
            "uid-missing": "the ResourceClaim does not exist",
        }
        assert set(dra.checkpoint()) == {"uid-good"}
        assert sorted(path.name for path in dra.cdi.iterdir()) == [f"{DRIVER}-claim_uid-good.json"]
        assert "Traceback" not in daemon.log_text()


MALFORMED = [
    (b"\x0a\x03\x12\x01", "cannot decode NodePrepareResourcesRequest"),
    (b"\x0a\x04\x12\x02\xff\xfe", "cannot decode NodePrepareResourcesRequest"),
    (b"\x0a\x03\x12\x01u", "names a claim without namespace, name or UID"),
]


async def test_malformed_requests_are_invalid_argument(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    dra = dra_node
    with trio.fail_after(30):
        daemon = start_daemon(*dra.daemon_args())
        await registered(dra)
        for payload, details in MALFORMED:
            code, message = await run_blocking(dra.kubelet.call_raw, DRIVER, V1_PREPARE, payload)
            assert code == grpc.StatusCode.INVALID_ARGUMENT
            assert details in message
        assert "Traceback" not in daemon.log_text()


async def test_devices_withdrawn_while_the_pcc_dir_is_gone_and_back_after(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """Where the API server serves no device taints (test_dra_devices.py: where it does). The
    driver learns it from the first write with a taint (generation 2): the API server drops
    them."""
    dra = dra_node
    dra.api.serves_taints = False
    with trio.fail_after(30):
        start_daemon(*dra.daemon_args())
        await registered(dra)
        await published(dra, SHARES, generation=1)
        pcc_dir = dra.node.pcc_dir
        pcc_dir.rmdir()
        await published(dra, [], generation=3)
        # A claim allocated before cannot be prepared on a gone device; kubelet is told why.
        dra.claim("late", "uid-late")
        answer = await run_blocking(dra.kubelet.prepare, DRIVER, [("default", "late", "uid-late")])
        assert answer.claims["uid-late"].error.startswith("device pcc-3 is unhealthy: detect ")
        pcc_dir.mkdir()
        await published(dra, SHARES, generation=4)


async def test_kubelet_restart_wipes_the_slices_and_the_driver_publishes_them_again(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    dra = dra_node
    with trio.fail_after(30):
        daemon = start_daemon(*dra.daemon_args())
        await registered(dra)
        await published(dra, SHARES, generation=1)
        await run_blocking(dra.kubelet.restart)
        # Registered again from the socket kubelet found, slices written again.
        await registered(dra, count=2)
        await published(dra, SHARES, generation=2)
        assert "Traceback" not in daemon.log_text()


async def test_kubelets_connection_to_the_dra_socket_stays_open_between_calls(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """Kubelet connects to the DRA socket when the driver registers, calls only when a pod
    needs a claim, and takes a closed connection for the driver gone. On a cluster the daemon
    closed it after 5 s without a call, and kubelet connected again, every 5 s. A connection
    that sends nothing is still closed (`Limits.first_request_timeout`)."""
    dra = dra_node
    with trio.fail_after(30):
        daemon = start_daemon(*dra.daemon_args())
        await registered(dra)
        (instance,) = dra.kubelet.instances(DRIVER)

        def connected() -> bool:
            return dra.kubelet.connections.get(instance.endpoint, [])[-1:] == [True]

        await run_blocking(dra.kubelet.wait_for, connected, WAIT)
        # Connected after kubelet's: closed once kubelet's would have been, and said after it.
        with connect(Path(instance.endpoint)) as silent:
            assert await run_blocking(closed_by_server, silent)
        # Its log reaches us through a pipe and a reader thread: the line may be on its way.
        await log_line(daemon, "Closing connection")
        closed = re.findall(r"Closing connection \d+: (.*)", daemon.log_text())
        assert closed == ["no HTTP/2 preface within 5 s"]
        dra.claim("app", "uid-1")
        answer = await run_blocking(dra.kubelet.prepare, DRIVER, [("default", "app", "uid-1")])
        assert devices_of(answer, "uid-1")
        history = dra.kubelet.connections[instance.endpoint]
        assert history[history.index(True) :] == [True], "kubelet's connection was closed"
        assert "Traceback" not in daemon.log_text()


async def test_a_removed_registration_socket_is_served_again(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    dra = dra_node
    with trio.fail_after(30):
        daemon = start_daemon(*dra.daemon_args())
        await registered(dra)
        (first,) = dra.kubelet.registrations
        (dra.registry / first.socket).unlink()
        await registered(dra, count=2)
        second = dra.kubelet.registrations[-1]
        assert second.endpoint_served
        assert (dra.registry / second.socket).is_socket()
        await run_blocking(daemon.wait_for_log, "serving again", WAIT)


def test_claims_are_read_within_the_answer_deadline_within_kubelets() -> None:
    """Kubelet hears each claim's own error rather than the whole call's deadline."""
    assert DEFAULT.read_claims_timeout < DEFAULT.unary_timeout < sim_rules.CALL_TIMEOUT


async def test_api_server_unreachable_for_a_while_then_back(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    await outage(dra_node, start_daemon, seconds=1.0)


@pytest.mark.slow
async def test_api_server_unreachable_for_a_minute_then_back(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    await outage(dra_node, start_daemon, seconds=60.0)


async def outage(dra: DraNode, start_daemon: StartDaemon, seconds: float) -> None:
    """The API server goes; kubelet restarts meanwhile (wiping the slices); it comes back."""
    with trio.fail_after(seconds + kube.API_RETRY_CAP + 40):
        daemon = start_daemon(*dra.daemon_args())
        await published(dra, SHARES, generation=1)
        dra.api.stop()
        dra.api.delete_slices(NODE)
        # Waiting for the daemon to notice: its watch is cut, its next list refused.
        await run_blocking(daemon.wait_for_log, "ResourceSlices not published", WAIT)
        await trio.sleep(seconds)  # the outage itself, not a synchronisation
        dra.api.start()
        # The driver's next attempt may be a whole backoff away.
        await published(dra, SHARES, generation=2, within=kube.API_RETRY_CAP + WAIT)
        await run_blocking(daemon.wait_for_log, "The API server answers again", WAIT)
        assert daemon.proc.poll() is None
        assert "Traceback" not in daemon.log_text()


async def test_a_rolling_update_and_a_restarted_driver_unprepare_what_was_prepared(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """Two instances by pod UID (maxSurge): kubelet uses the newest; the old one removes its
    own sockets on SIGTERM; the new one unprepares what the old one prepared."""
    dra = dra_node
    with trio.fail_after(40):
        old = start_daemon(*dra.daemon_args(), "--pod-uid=0a0a0a0a-1111-2222-3333-444444444444")
        await registered(dra)
        await published(dra, SHARES)
        dra.claim("app", "uid-r")
        await run_blocking(dra.kubelet.prepare, DRIVER, [("default", "app", "uid-r")])
        new = start_daemon(*dra.daemon_args(), "--pod-uid=0b0b0b0b-1111-2222-3333-444444444444")
        await run_blocking(
            dra.kubelet.wait_for, lambda: len(dra.kubelet.instances(DRIVER)) == 2, WAIT
        )
        old_socket, newest = (one.socket for one in dra.kubelet.instances(DRIVER))
        assert "0a0a0a0a" in old_socket
        assert "0b0b0b0b" in newest
        assert old.terminate() == 0
        assert not (dra.registry / old_socket).exists()
        assert sorted(path.name for path in dra.state.glob("*.sock")) == [
            "dra-0b0b0b0b-1111-2222-3333-444444444444.sock"
        ]
        await run_blocking(
            dra.kubelet.wait_for, lambda: len(dra.kubelet.instances(DRIVER)) == 1, WAIT
        )
        gone = await run_blocking(dra.kubelet.unprepare, DRIVER, [("default", "app", "uid-r")])
        assert gone.claims["uid-r"].error == ""
        assert not cdi_spec(dra, "uid-r").exists()
        assert dra.checkpoint() == {}
        await run_blocking(new.wait_for_log, "unprepared", WAIT)


@pytest.mark.slow
async def test_more_shares_than_a_slice_holds_are_split_across_slices_of_one_pool(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """64 to a slice where the API server serves device taints (a slice that may hold one
    does); 128 where it does not (test_desired_slices_hold_128_devices_each_in_one_pool)."""
    dra = dra_node
    with trio.fail_after(30):
        start_daemon(*dra.daemon_args(), "--resource-count=300")
        await published(dra, [f"pcc-{index}" for index in range(300)], generation=1)
        pools = [obj["spec"]["pool"] for obj in dra.slices()]
        assert pools == [{"name": NODE, "generation": 1, "resourceSliceCount": 5}] * 5
        assert [len(obj["spec"]["devices"]) for obj in dra.slices()] == [64, 64, 64, 64, 44]


# Units: the slices, the socket names, the flags


def test_desired_slices_withdraw_unhealthy_devices_and_keep_the_pool() -> None:
    spec = pcc_resource("tke.cloud.tencent.com/pcc-device", 3, "/dev/sev-guest", "/var/run/pcc")
    pool = slices.Pool(DRIVER, NODE, "node-uid")
    devices = tuple(Device(f"pcc-{i}", "pcc", spec.device_nodes, "gone") for i in range(3))
    (empty,) = slices.desired(pool, spec, devices)
    assert empty["spec"]["devices"] == []
    assert empty["spec"]["pool"]["resourceSliceCount"] == 1
    assert empty["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "node-uid"}
    ]


def test_desired_slices_hold_128_devices_each_in_one_pool() -> None:
    spec = pcc_resource("tke.cloud.tencent.com/pcc-device", 300, "/dev/sev-guest", "/var/run/pcc")
    pool = slices.Pool(DRIVER, NODE, "node-uid")
    devices = tuple(Device(f"pcc-{i}", "pcc", spec.device_nodes, None) for i in range(300))
    wanted = slices.desired(pool, spec, devices)
    assert [len(obj["spec"]["devices"]) for obj in wanted] == [128, 128, 44]
    assert {obj["spec"]["pool"]["resourceSliceCount"] for obj in wanted} == {3}
    assert len({obj["metadata"]["name"] for obj in wanted}) == 3
    assert [d["name"] for obj in wanted for d in obj["spec"]["devices"]] == [d.id for d in devices]


def test_slice_names_fit_kubernetes() -> None:
    long_node = "n" * 250
    name = slices.slice_name(slices.Pool(DRIVER, long_node, "u"), 7)
    assert len(name) <= 253
    assert name.endswith("-7")


def test_socket_names_are_the_pods_own_and_fit_a_unix_socket() -> None:
    uid = "0a0a0a0a-1111-2222-3333-444444444444"
    registration, dra = socket_paths(Flags(pod_uid=uid))
    assert registration == Path(f"/var/lib/kubelet/plugins_registry/{DRIVER}-{uid}-reg.sock")
    assert dra == Path(f"/var/lib/kubelet/plugins/{DRIVER}/dra-{uid}.sock")
    long_driver = "d" * 30 + "." + "e" * 30
    registration, dra = socket_paths(Flags(pod_uid=uid, driver_name=long_driver))
    assert len(os.fsencode(registration)) <= 107
    assert re.fullmatch(r"[0-9a-f]{16}-reg\.sock", registration.name)


def test_dead_registration_sockets_are_removed_hashed_names_too(fake_node: FakeNode) -> None:
    """A killed instance leaves its sockets; one with a driver name too long for a plain
    socket name left a hashed one, which kubelet's plugin watcher would keep dialling."""
    registry, plugins = fake_node.root / "registry", fake_node.root / "plugins"
    long_driver = "d" * 30 + "." + "e" * 30
    config = Flags(driver_name=long_driver, kubelet_registry_path=str(registry),
                   kubelet_plugins_path=str(plugins))  # fmt: skip
    state_dir(config).mkdir(parents=True)
    registry.mkdir()
    dead = [
        registry / f"{long_driver}-dead-reg.sock",
        registry / "0123456789abcdef-reg.sock",
        state_dir(config) / "dra-dead.sock",
    ]
    for path in dead:
        with socket.socket(socket.AF_UNIX) as listener:
            listener.bind(str(path))  # closed without unlinking: nothing serves it
    kept = [registry / "fedcba9876543210-reg.sock", registry / "other.example.com-x-reg.sock"]
    with socket.socket(socket.AF_UNIX) as live, socket.socket(socket.AF_UNIX) as other:
        live.bind(str(kept[0]))
        live.listen()
        other.bind(str(kept[1]))  # another driver's: not ours to judge
        (registry / "ffffffffffffffff-reg.sock").write_text("not a socket")
        kept.append(registry / "ffffffffffffffff-reg.sock")
        remove_stale_sockets(earlier_sockets(config))
    left = [p for d in (registry, plugins) for p in d.rglob("*") if not p.is_dir()]
    assert sorted(left) == sorted(kept)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--mode=dra"], "--node-name: required with --mode=dra"),
        (["--mode=dra", "--node-name=n", "--cdi"], "--cdi: not used with --mode=dra"),
        (
            ["--mode=dra", "--node-name=n", "--driver-name=" + "d" * 60 + ".x",
             "--kubelet-plugins-path=/" + "p" * 46],
            "--driver-name: /ppp",
        ),
    ],
)  # fmt: skip
def test_what_the_dra_mode_cannot_serve_is_one_line_naming_the_flag(
    argv: list[str], expected: str
) -> None:
    with pytest.raises(configuration.ConfigError) as refused:
        configuration.read(flags.parse(argv, PROG, "", "")[0])
    assert str(refused.value).startswith(expected)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--mode=kubevirt"], "--mode: must be device-plugin or dra, got 'kubevirt'"),
        (
            ["--mode=dra", "--node-name=n", "--driver-name=PCC"],
            "--driver-name: must be a lowercase",
        ),
        (["--mode=dra", "--node-name=n", "--pod-uid=../x"], "--pod-uid: must be a pod UID"),
    ],
)
def test_dra_usage_errors_are_one_line_exit_2(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        flags.parse(argv, PROG, "", "")
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"pcc-device-plugin: {expected}")


def test_the_config_files_mode_and_the_flag_must_agree(tmp_path: Path) -> None:
    profile = Path(__file__).parent.parent / "docs" / "examples" / "pcc.yaml"
    config = tmp_path / "profiles.yaml"
    config.write_text("mode: dra\n" + profile.read_text())
    argv = [f"--config={config}", "--mode=device-plugin"]
    with pytest.raises(configuration.ConfigError, match="--mode: device-plugin disagrees with "
                       "mode dra in"):  # fmt: skip
        configuration.read(flags.parse(argv, PROG, "", "")[0])
    # The file alone chooses the mode.
    served = configuration.read(
        flags.parse([f"--config={config}", "--node-name=n"], PROG, "", "")[0]
    )
    assert served.mode == "dra"


ME = slices.Instance("2026-01-01T00:00:00.000000Z", "me")


class FlakyApi(dra_support.SliceWatcher):
    """kube.Api's slice calls in memory; refuses connections while `down`."""

    def __init__(self) -> None:
        self.down = True
        self.slices: dict[str, dict[str, Any]] = {}
        self.attempts = 0
        self.version = 0
        self.changed = trio.Event()

    def _answer(self) -> None:
        self.attempts += 1
        if self.down:
            raise kube.RequestFailed("connection refused")

    async def node_uid(self, name: str) -> str:
        self._answer()
        return "node-uid"

    async def list_slices(self, fields: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
        self._answer()
        return [json.loads(json.dumps(obj)) for obj in self.slices.values()], str(self.version)

    async def watch(
        self, version: str, seconds: int, event: dra_support.Event, opened: Callable[[], None]
    ) -> None:
        self._answer()
        opened()
        await self.changed.wait()

    async def create_slice(self, obj: dict[str, Any]) -> dict[str, Any]:
        self._answer()
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        self.slices[obj["metadata"]["name"]] = obj
        return obj

    replace_slice = create_slice

    async def delete_slice(self, name: str) -> None:
        self._answer()
        del self.slices[name]


async def test_publishing_retries_with_capped_backoff_and_says_so_once_a_minute(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Pure timing, on trio's clock: an API server down for ten minutes is asked about once
    per RETRY_CAP at most, said to be down once a minute, and published to once it is back."""
    caplog.set_level(logging.INFO, logger="pcc_plugin.dra.slices")
    api: Any = FlakyApi()
    spec = pcc_resource("tke.cloud.tencent.com/pcc-device", 2, "/dev/sev-guest", "/var/run/pcc")
    devices = tuple(Device(f"pcc-{i}", "pcc", spec.device_nodes, None) for i in range(2))
    stats = ResourceState("x", needs_stream=False, registered=True)
    change = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            slices.publish, api, slices.Pool(DRIVER, NODE, ""), ME, lambda other: False,
            lambda pool: slices.desired(pool, spec, devices), lambda: change, stats,
            taints.Unhealthy(DRIVER), random.Random(47),
        )  # fmt: skip
        await trio.sleep(600)
        assert "connection refused" in str(stats.not_ready_reason())
        # Doubling from RETRY_FIRST to RETRY_CAP, each a random part of its ceiling: a few
        # quick tries, then one per half the cap on average (the waits seeded: a run of short
        # ones may come, rarely, and the bound would then be luck's).
        assert 600 / kube.API_RETRY_CAP <= api.attempts <= 1.5 * 600 / (kube.API_RETRY_CAP / 2)
        # Once a minute: at the first retry a minute or more after the last report.
        errors = [r for r in caplog.records if r.levelname == "ERROR"]
        every = kube.REPORT_EVERY
        assert 600 / (every + kube.API_RETRY_CAP) <= len(errors) <= 600 / every + 1
        api.down = False
        await trio.sleep(kube.API_RETRY_CAP)
        assert stats.not_ready_reason() is None
        assert [obj["spec"]["pool"]["generation"] for obj in api.slices.values()] == [1]
        assert "The API server answers again after" in caplog.text
        nursery.cancel_scope.cancel()


async def test_devices_are_offered_only_once_kubelet_can_be_served(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """A driver that cannot serve its DRA socket publishes no slices (a device offered there
    would take pods kubelet can never prepare), and publishes them once it serves."""
    dra = dra_node
    dra.plugins.mkdir(parents=True, exist_ok=True)
    dra.state.write_text("")  # where the driver's own directory goes
    with trio.fail_after(40):
        daemon = start_daemon(*dra.daemon_args())
        await log_line(daemon, f"cannot serve in {dra.plugins}: [Errno 17] File exists")
        # Tried again and again, the waits growing (some 0.9 s in all): the slices would have
        # been listed long before.
        await log_line(daemon, "Restarting the DRA driver's sockets: cannot serve", count=8)
        assert [r for r in dra.api.requests if "resourceslices" in r] == []
        dra.state.unlink()
        await registered(dra)
        await published(dra, SHARES, generation=1, within=30)
        assert "Traceback" not in daemon.log_text()


async def test_a_checkpoint_that_cannot_be_written_fails_the_claims_not_the_call(
    tmp_path: Path, host: Path
) -> None:
    """Kubelet hears why for each claim (and retries) instead of an INTERNAL error."""
    spec = pcc_resource("tke.cloud.tencent.com/pcc-device", 4, "/dev/sev-guest", "/var/run/pcc")
    state = ResourceState(spec.name, needs_stream=False)
    inventory = Inventory(spec, str(host), state)
    not_a_directory = tmp_path / "state"
    not_a_directory.write_text("")

    async def get_claim(namespace: str, name: str) -> dict[str, Any]:
        result = {"request": "pcc", "driver": DRIVER, "pool": NODE, "device": "pcc-3"}
        allocation = {"devices": {"results": [result]}}
        return {"metadata": {"uid": "uid-1"}, "status": {"allocation": allocation}}

    checkpoint = Checkpoint(not_a_directory, DRIVER)
    preparer = claims.Preparer(
        DRIVER, NODE, inventory, state, checkpoint, tmp_path / "cdi", "owner", get_claim
    )
    claim = claims.ClaimRef("default", "app", "uid-1")
    with trio.fail_after(10):
        prepared = await preparer.prepare([claim])
        unprepared = await preparer.unprepare([claim])
    for answer in (prepared["uid-1"], unprepared["uid-1"]):
        assert isinstance(answer, str)
        assert answer.startswith(f"cannot record prepared claims in {not_a_directory}: ")
    assert state.prepares["failed"] == state.unprepares["failed"] == 1


class FullDisk(Checkpoint):
    """Read as ever; written, the disk is full."""

    def write(self, claims: Claims) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


async def test_a_claim_is_said_prepared_only_once_it_is_recorded(
    tmp_path: Path, host: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The log says what kubelet heard: a claim whose record could not be written was not
    prepared, and one whose record could not be dropped was not unprepared."""
    spec = pcc_resource("tke.cloud.tencent.com/pcc-device", 4, "/dev/sev-guest", "/var/run/pcc")
    state = ResourceState(spec.name, needs_stream=False)
    inventory = Inventory(spec, str(host), state)

    async def get_claim(namespace: str, name: str) -> dict[str, Any]:
        result = {"request": "pcc", "driver": DRIVER, "pool": NODE, "device": "pcc-3"}
        allocation = {"devices": {"results": [result]}}
        return {"metadata": {"uid": "uid-1"}, "status": {"allocation": allocation}}

    claim = claims.ClaimRef("default", "app", "uid-1")
    caplog.set_level(logging.DEBUG)
    state_dir = tmp_path / "state"
    state_dir.mkdir()

    def preparer(checkpoint: Checkpoint) -> claims.Preparer:
        return claims.Preparer(DRIVER, NODE, inventory, state, checkpoint, tmp_path / "cdi",
                               "owner", get_claim)  # fmt: skip

    with trio.fail_after(10):
        unrecorded = await preparer(FullDisk(state_dir, DRIVER)).prepare([claim])
        prepared = await preparer(Checkpoint(state_dir, DRIVER)).prepare([claim])
        kept = await preparer(FullDisk(state_dir, DRIVER)).unprepare([claim])
    for answer in unrecorded["uid-1"], kept["uid-1"]:
        assert isinstance(answer, str)
        assert answer.startswith(f"cannot record prepared claims in {state_dir}: ")
    assert isinstance(prepared["uid-1"], PreparedClaim)
    said = [r.getMessage() for r in caplog.records if "Resources " in r.getMessage()]
    assert said == ["NodePrepareResources default/app (uid-1): pcc-3"]


# As the driver has written it since the DRA mode came (json.dump, indent 1, sorted keys).
CHECKPOINT_V1 = """{
 "claims": {
  "uid-1": {
   "devices": [
    {
     "device": "pcc-3",
     "pool": "node-a",
     "requests": [
      "pcc"
     ]
    }
   ],
   "name": "app",
   "namespace": "default"
  }
 },
 "driver": "pcc.tke.cloud.tencent.com",
 "version": 1
}"""


def test_a_checkpoint_of_version_1_is_read_typed_and_written_as_it_was(tmp_path: Path) -> None:
    """A driver upgraded in place (or rolled back) reads what the other wrote."""
    (tmp_path / "checkpoint.json").write_text(CHECKPOINT_V1)
    checkpoint = Checkpoint(tmp_path, DRIVER)
    prepared = checkpoint.read()
    assert prepared == {
        "uid-1": PreparedClaim("default", "app", (PreparedDevice(("pcc",), NODE, "pcc-3"),))
    }
    checkpoint.write(prepared)
    assert (tmp_path / "checkpoint.json").read_text() == CHECKPOINT_V1


@pytest.mark.parametrize(
    "text",
    ["{not json", CHECKPOINT_V1.replace('"version": 1', '"version": 2'), '{"version": 1}'],
    ids=["not JSON", "another version", "no claims"],
)
def test_an_unreadable_checkpoint_is_kept_aside_and_rebuilt_from_what_else_records_it(
    tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Moved aside (an operator can see it), and written again from the claims' CDI specs
    (test_dra_resilience.py: the daemon's own), here none."""
    (tmp_path / "checkpoint.json").write_text(text)
    assert Checkpoint(tmp_path, DRIVER).read() == {}
    assert (tmp_path / "checkpoint.json.unreadable").read_text() == text
    assert Checkpoint(tmp_path, DRIVER).read() == {}
    (record,) = caplog.records
    assert record.levelno == logging.ERROR
    assert record.getMessage().startswith(
        f"Checkpoint {tmp_path / 'checkpoint.json'} was unreadable"
    )
    assert record.getMessage().endswith("0 prepared claims taken from their CDI specs")


async def test_missing_credentials_are_one_line_and_exit_1(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    args = [arg for arg in dra_node.daemon_args() if not arg.startswith("--kubeconfig=")]
    with trio.fail_after(20):
        daemon = start_daemon(*args, f"--kubeconfig={dra_node.node.root / 'missing'}")
        assert await run_blocking(daemon.exited, 15) == 1
    (line,) = [line for line in daemon.log_text().splitlines() if line.startswith("E")]
    assert line.endswith(
        f"cannot read API server credentials from --kubeconfig {dra_node.node.root / 'missing'}: "
        f"Configuration file {dra_node.node.root / 'missing'} not found; give a readable "
        "kubeconfig file"
    )
    assert "Traceback" not in daemon.log_text()


@pytest.mark.parametrize("version", [kube.EXEC_V1, kube.EXEC_V1BETA1])
async def test_an_exec_credential_plugin_of_either_version_gets_the_token(
    dra_node: DraNode, start_daemon: StartDaemon, version: str
) -> None:
    """A kubeconfig whose user runs a command (as cloud providers' do), told what client-go
    tells it."""
    kubeconfig = dra_node.api.write_kubeconfig(dra_node.node.root / "exec.json", version)
    args = [arg for arg in dra_node.daemon_args() if not arg.startswith("--kubeconfig=")]
    with trio.fail_after(30):
        daemon = start_daemon(*args, f"--kubeconfig={kubeconfig}")
        await published(dra_node, SHARES)
    assert "Traceback" not in daemon.log_text()


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (
            {"apiVersion": "client.authentication.k8s.io/v1alpha1"},
            "its exec credential plugin has apiVersion client.authentication.k8s.io/v1alpha1; "
            "use client.authentication.k8s.io/v1 or client.authentication.k8s.io/v1beta1",
        ),
        (
            {"interactiveMode": "Always"},
            "its exec credential plugin needs a terminal (interactiveMode: Always), which a "
            "daemon has not; use a plugin with interactiveMode Never or IfAvailable",
        ),
    ],
)
async def test_an_exec_credential_plugin_the_driver_cannot_run_is_one_line_and_exit_1(
    dra_node: DraNode, start_daemon: StartDaemon, change: dict[str, str], says: str
) -> None:
    kubeconfig = dra_node.api.write_kubeconfig(dra_node.node.root / "exec.json", kube.EXEC_V1)
    config = json.loads(kubeconfig.read_text())
    config["users"][0]["user"]["exec"].update(change)
    kubeconfig.write_text(json.dumps(config))
    args = [arg for arg in dra_node.daemon_args() if not arg.startswith("--kubeconfig=")]
    with trio.fail_after(20):
        daemon = start_daemon(*args, f"--kubeconfig={kubeconfig}")
        assert await run_blocking(daemon.exited, 15) == 1
    (line,) = [line for line in daemon.log_text().splitlines() if line.startswith("E")]
    assert line.endswith(f"cannot use the credentials of --kubeconfig {kubeconfig}: {says}")
    assert "Traceback" not in daemon.log_text()


def test_docs_quote_the_drivers_own_words() -> None:
    root = Path(__file__).resolve().parent.parent
    source = "\n".join(path.read_text() for path in sorted((root / "pcc_plugin").glob("**/*.py")))
    text = (root / "docs" / "dra.md").read_text()
    for words in (
        "cannot read API server credentials from ",
        "ResourceSlices not published: ",
        "does not exist: check --node-name",
        "The API server answers again after ",
        "Kubelet refused the registration of DRA driver ",
        "the ResourceClaim is not allocated",
        "cannot record prepared claims in ",
        "Kubelet watches the devices' health (",
        "Unhealthy devices will be ",
        "the API server serves device taints",
        "the API server dropped a device taint it was sent (DRADeviceTaints is off)",
        "Node attributes: ",
        " does not exist: the devices get no attributes teeType and tsmReport; ",
        "--unhealthy-taint-effect",
    ):
        assert words in source, f"the driver no longer says {words!r}"
        assert words in text, f"docs/dra.md does not quote {words!r}"


# too_slow: how fast examples are made is the machine's (a busy one is slow), not the driver's.
@hypothesis.settings(
    max_examples=300, deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow]
)
@hypothesis.given(hypothesis.strategies.binary(max_size=300))
def test_any_bytes_are_claims_or_invalid_argument(data: bytes) -> None:
    """What reaches NodePrepareResources and NodeUnprepareResources is read strictly: claims
    with every field, or INVALID_ARGUMENT, never another error."""
    status = grpclib.const.Status.OK
    read: list[claims.ClaimRef] = []
    try:
        read = dra_service.read_claims(data, "NodePrepareResourcesRequest", DEFAULT)
    except grpclib.exceptions.GRPCError as refused:
        status = refused.status
    assert status in (grpclib.const.Status.OK, grpclib.const.Status.INVALID_ARGUMENT)
    assert all(claim.uid and claim.namespace and claim.name for claim in read)
