"""What the DRA driver says of its devices: their health to kubelet (the DRAResourceHealth
stream, for the pods' status), a taint on an unhealthy device where the API server serves
taints (else withdrawal), and the node's confidential-computing attributes. The real daemon
against the simulated kubelet's DRA side and the fake API server; units on trio's clock.

What a cluster adds (kubelet writing the health into a pod's status, the scheduler honouring
the taint and the DeviceClass selector of docs/dra.md) is `nox -s cluster`'s check 9
(tools/e2e/cluster_dra.py).
"""

from __future__ import annotations

import grpc
import pytest
import trio
import trio.testing
from daemon_support import log_line
from dra_support import DRIVER, NODE, SHARES, WAIT, DraNode, published, registered

from pcc_plugin._proto import v1 as health_api
from pcc_plugin.dra import health
from pcc_plugin.resource import Device, pcc_resource, take_inventory
from pcc_plugin.sim import StartDaemon, run_blocking
from pcc_plugin.sim.dra import SimDraKubelet

PCC_DIR_GONE = "detect socket path {root}/var/run/pcc failed: No such file or directory"
SPEC = pcc_resource("tke.cloud.tencent.com/pcc-device", 16, "/dev/sev-guest", "/var/run/pcc")


async def every_device(kubelet: SimDraKubelet, health_now: str, message: str = "") -> None:
    """Until kubelet holds `health_now` (and `message`) for every share."""

    def done() -> bool:
        return all(
            kubelet.device_health(DRIVER, NODE, share) == (health_now, message) for share in SHARES
        )

    await run_blocking(kubelet.wait_for, done, WAIT)


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
