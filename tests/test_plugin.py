"""Device lists and Allocate answers, checked with protobuf's own decoder."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpclib.const
import grpclib.exceptions
import pytest

from pcc_plugin.flags import Flags
from pcc_plugin.klog import V1
from pcc_plugin.resource import DeviceNode, HostMount, ResourceSpec
from pcc_plugin.service import (
    DevicePlugin,
    encode_allocate_response,
    encode_listing,
)
from pcc_plugin.sim._pb import deviceplugin_v1beta1_pb2 as pb
from pcc_plugin.state import ResourceState

RESOURCE = "tke.cloud.tencent.com/pcc-device"
Status = grpclib.const.Status
INVALID_ARGUMENT, FAILED_PRECONDITION = Status.INVALID_ARGUMENT, Status.FAILED_PRECONDITION


@contextlib.contextmanager
def refused(status: Status, match: str) -> Iterator[None]:
    with pytest.raises(grpclib.exceptions.GRPCError) as raised:
        yield
    assert raised.value.status is status
    assert re.search(match, raised.value.message or ""), raised.value.message


def pcc_plugin(host: Path, pre_start_check: bool = False, **flags: Any) -> DevicePlugin:
    config = Flags(host_root=str(host), **flags)
    return DevicePlugin(
        config.pcc_resource(), config.host_root, ResourceState("x"), pre_start_check=pre_start_check
    )


def listing(plugin: DevicePlugin) -> pb.ListAndWatchResponse:
    response: pb.ListAndWatchResponse = pb.ListAndWatchResponse.FromString(
        encode_listing(plugin.inventory.devices)
    )
    return response


def allocate(plugin: DevicePlugin, *containers: list[str]) -> pb.AllocateResponse:
    encoded = encode_allocate_response(tuple(plugin.grants(list(containers))))
    response: pb.AllocateResponse = pb.AllocateResponse.FromString(encoded)
    return response


def test_listing_has_every_share_with_stable_ids(host: Path) -> None:
    devices = listing(pcc_plugin(host)).devices
    assert [device.ID for device in devices] == [f"pcc-{i}" for i in range(16)]
    assert {device.health for device in devices} == {"Healthy"}
    assert pcc_plugin(host).inventory.devices == pcc_plugin(host).inventory.devices


def test_listing_follows_resource_count_and_health(host: Path) -> None:
    plugin = pcc_plugin(host, resource_count=10_000)
    (host / "dev" / "sev-guest").unlink()
    plugin.inventory.refresh()
    devices = listing(plugin).devices
    assert len(devices) == 10_000
    assert devices[-1].ID == "pcc-9999"
    assert {device.health for device in devices} == {"Unhealthy"}


def test_options_offer_nothing_unimplemented(host: Path) -> None:
    options = pb.DevicePluginOptions.FromString(bytes(pcc_plugin(host).options))
    assert not options.pre_start_required
    assert not options.get_preferred_allocation_available


def test_allocate_gives_the_host_paths_not_the_host_root_ones(host: Path) -> None:
    (host / "dev" / "sev-guest0").symlink_to("/dev/null")
    (host / "run" / "pcc").mkdir(parents=True)
    plugin = pcc_plugin(host, pcc_device="/dev/sev-guest0", pcc_socket_path="/run/pcc")
    (container,) = allocate(plugin, ["pcc-3"]).container_responses
    assert [(d.container_path, d.host_path, d.permissions) for d in container.devices] == [
        ("/dev/sev-guest", "/dev/sev-guest0", "rw")
    ]
    assert [(m.container_path, m.host_path, m.read_only) for m in container.mounts] == [
        ("/var/run/pcc", "/run/pcc", False)
    ]
    assert not container.envs
    assert not container.annotations
    assert not container.cdi_devices


def test_several_shares_give_the_device_and_mount_once(host: Path) -> None:
    (container,) = allocate(pcc_plugin(host), ["pcc-0", "pcc-1", "pcc-15"]).container_responses
    assert len(container.devices) == 1
    assert len(container.mounts) == 1


def test_one_response_per_container_request(host: Path) -> None:
    response = allocate(pcc_plugin(host), ["pcc-0"], ["pcc-1", "pcc-2"], ["pcc-3"])
    assert len(response.container_responses) == 3


@pytest.mark.parametrize(
    ("containers", "message"),
    [
        ([], "AllocateRequest has no container requests"),
        ([[]], "container request 0 names no device IDs"),
        ([["pcc-0"], ["pcc-16"]], "container request 1 names unknown device IDs 'pcc-16'"),
        ([["gpu-0", "pcc-1"]], "unknown device IDs 'gpu-0'; "),
        ([[f"x{i}" for i in range(8)]], "'x4' and 3 more"),
    ],
)
def test_bad_requests_name_the_problem(
    host: Path, containers: list[list[str]], message: str
) -> None:
    plugin = pcc_plugin(host)
    with refused(INVALID_ARGUMENT, message):
        plugin.grants(containers)
    assert plugin.state.allocations == {"invalid": 1}


def test_allocate_fails_with_the_reason_while_unhealthy(host: Path) -> None:
    plugin = pcc_plugin(host)
    request = [["pcc-0"]]
    (host / "dev" / "sev-guest").unlink()
    plugin.inventory.refresh()
    with refused(FAILED_PRECONDITION, r"pcc-0 is unhealthy: detect device .* failed"):
        plugin.grants(request)
    (host / "dev" / "sev-guest").symlink_to("/dev/null")
    plugin.inventory.refresh()
    assert len(plugin.grants(request)) == 1
    assert plugin.state.allocations == {"unavailable": 1, "ok": 1}
    assert (plugin.state.healthy_devices, plugin.state.unhealthy_devices) == (16, 0)


def test_pre_start_check_looks_at_the_node_again(host: Path) -> None:
    checked = pcc_plugin(host, pre_start_check=True)
    assert checked.options.pre_start_required
    request = _pre_start_request(["pcc-0"])
    assert checked.pre_start_container(request, None) == b""  # type: ignore[arg-type]
    (host / "var" / "run" / "pcc").rmdir()
    with refused(FAILED_PRECONDITION, f"detect socket path {host}/var/run/pcc"):
        checked.pre_start_container(request, None)  # type: ignore[arg-type]
    with refused(INVALID_ARGUMENT, "unknown device IDs 'nope'"):
        checked.pre_start_container(_pre_start_request(["nope"]), None)  # type: ignore[arg-type]


def _allocate_request(*containers: list[str]) -> bytes:
    return bytes(
        pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=ids) for ids in containers]
        ).SerializeToString()
    )


def _pre_start_request(ids: list[str]) -> bytes:
    return bytes(pb.PreStartContainerRequest(devices_ids=ids).SerializeToString())


@pytest.mark.parametrize(
    ("method", "request_bytes", "status", "details"),
    [
        ("allocate", b"\x0a", "INVALID_ARGUMENT", "cannot decode AllocateRequest: "),
        ("allocate", _allocate_request(*[[]] * 129), "INVALID_ARGUMENT",
         "AllocateRequest has more than 128 container requests"),
        ("allocate", _allocate_request(["pcc-0"] * 17), "INVALID_ARGUMENT",
         "AllocateRequest names more device IDs than the 16 tke.cloud.tencent.com/pcc-device "
         "advertises"),
        ("allocate", _allocate_request(["gpu-0"]), "INVALID_ARGUMENT",
         "unknown device IDs 'gpu-0'"),
        ("allocate", _allocate_request(["pcc-0"]), "FAILED_PRECONDITION", "pcc-0 is unhealthy"),
        ("pre_start_container", b"\x0a", "INVALID_ARGUMENT",
         "cannot decode PreStartContainerRequest: "),
        ("pre_start_container", _pre_start_request(["pcc-0"] * 17), "INVALID_ARGUMENT",
         "PreStartContainerRequest names more device IDs than the 16"),
        ("pre_start_container", _pre_start_request(["gpu-0"]), "INVALID_ARGUMENT",
         "unknown device IDs 'gpu-0'"),
        ("pre_start_container", _pre_start_request(["pcc-0"]), "FAILED_PRECONDITION",
         "cannot start the container: detect device"),
    ],
)  # fmt: skip
def test_service_answers_each_refusal_with_its_status(
    host: Path, method: str, request_bytes: bytes, status: str, details: str
) -> None:
    plugin = pcc_plugin(host, pre_start_check=True)
    (host / "dev" / "sev-guest").unlink()  # pcc-0 unhealthy, for FAILED_PRECONDITION
    plugin.inventory.refresh()
    with pytest.raises(grpclib.exceptions.GRPCError) as refused:
        getattr(plugin, method)(request_bytes, None)
    assert refused.value.status is grpclib.const.Status[status]
    assert refused.value.message is not None
    assert details in refused.value.message


@pytest.mark.parametrize(
    ("request_bytes", "reason"),
    [
        (_allocate_request(["pcc-0"], ["gpu-0"]),
         "INVALID_ARGUMENT: container request 1 names unknown device IDs 'gpu-0'; "
         "tke.cloud.tencent.com/pcc-device has pcc-0 to pcc-15"),
        (_allocate_request(["pcc-0"] * 17),
         "INVALID_ARGUMENT: AllocateRequest names more device IDs than the 16 "
         "tke.cloud.tencent.com/pcc-device advertises"),
        (b"\x0a", "INVALID_ARGUMENT: cannot decode AllocateRequest: "),
        (_allocate_request(["pcc-3"]),
         "FAILED_PRECONDITION: tke.cloud.tencent.com/pcc-device device pcc-3 is unhealthy: "
         "detect device "),
    ],
)  # fmt: skip
def test_a_refused_allocate_is_logged_at_v1_with_its_reason(
    host: Path, caplog: pytest.LogCaptureFixture, request_bytes: bytes, reason: str
) -> None:
    plugin = pcc_plugin(host)
    if reason.startswith("FAILED_PRECONDITION"):
        (host / "dev" / "sev-guest").unlink()
        plugin.inventory.refresh()
    caplog.set_level(V1)
    with pytest.raises(grpclib.exceptions.GRPCError):
        plugin.allocate(request_bytes, None)  # type: ignore[arg-type]  # it reads no call
    (record,) = [r for r in caplog.records if r.getMessage().startswith("Allocate ")]
    assert record.levelno == V1
    assert record.getMessage().startswith(f"Allocate {RESOURCE} refused, {reason}")


def test_globbed_devices_are_one_device_each_and_stay_listed_when_gone(host: Path) -> None:
    for name in ("vda", "vdb"):
        (host / "dev" / name).symlink_to("/dev/null")
    spec = ResourceSpec(
        name="example.com/disk",
        count=2,
        socket_prefix="disk",
        device_nodes=(DeviceNode("/dev/vd*", "", "rw", "char"),),
        mounts=(HostMount("/var/run/pcc", "/pcc", read_only=True),),
        envs=(("MODE", "shared"),),
    )
    plugin = DevicePlugin(spec, str(host), ResourceState("x"))
    assert [(d.id, d.healthy) for d in plugin.inventory.devices] == [
        ("vda-0", True), ("vda-1", True), ("vdb-0", True), ("vdb-1", True),
    ]  # fmt: skip
    (container,) = allocate(plugin, ["vdb-1", "vdb-0"]).container_responses
    assert [(d.container_path, d.host_path) for d in container.devices] == [
        ("/dev/vdb", "/dev/vdb")
    ]
    assert [(m.container_path, m.read_only) for m in container.mounts] == [("/pcc", True)]
    assert dict(container.envs) == {"MODE": "shared"}
    (host / "dev" / "vda").unlink()
    (host / "dev" / "vdc").symlink_to("/dev/null")
    plugin.inventory.refresh()
    assert [(d.id, d.healthy) for d in plugin.inventory.devices] == [
        ("vda-0", False), ("vda-1", False), ("vdb-0", True), ("vdb-1", True),
        ("vdc-0", True), ("vdc-1", True),
    ]  # fmt: skip
    with refused(FAILED_PRECONDITION, "vda-0 is unhealthy"):
        allocate(plugin, ["vda-0"])
