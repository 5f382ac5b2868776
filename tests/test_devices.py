"""The device list and Allocate answers, checked with protobuf's own decoder."""

from __future__ import annotations

from pathlib import Path

import pytest

from pcc_plugin._proto import v1beta1 as api
from pcc_plugin.config import Config
from pcc_plugin.devices import HEALTHY, UNHEALTHY, DevicePlugin, DeviceUnavailable, RequestError
from pcc_plugin.resources import pcc_resource
from pcc_plugin.sim._pb import deviceplugin_v1beta1_pb2 as pb
from pcc_plugin.stats import ResourceStats


def plugin(config: Config | None = None, *, pre_start_check: bool = False) -> DevicePlugin:
    config = config or Config()
    return DevicePlugin(pcc_resource(config), config.host_root, ResourceStats(), pre_start_check)


def allocate(shares: DevicePlugin, *containers: list[str]) -> pb.AllocateResponse:
    request = api.AllocateRequest(
        container_requests=[api.ContainerAllocateRequest(devices_ids=ids) for ids in containers]
    )
    response: pb.AllocateResponse = pb.AllocateResponse.FromString(bytes(shares.allocate(request)))
    return response


def test_listing_has_every_share_with_stable_ids() -> None:
    listing = pb.ListAndWatchResponse.FromString(plugin().shares.listing(HEALTHY))
    assert [device.ID for device in listing.devices] == [f"pcc-{i}" for i in range(16)]
    assert {device.health for device in listing.devices} == {"Healthy"}
    assert plugin().shares.ids == plugin().shares.ids


def test_listing_follows_resource_count_and_health() -> None:
    listing = pb.ListAndWatchResponse.FromString(
        plugin(Config(resource_count=10_000)).shares.listing(UNHEALTHY)
    )
    assert len(listing.devices) == 10_000
    assert listing.devices[-1].ID == "pcc-9999"
    assert {device.health for device in listing.devices} == {"Unhealthy"}


def test_options_offer_nothing_unimplemented() -> None:
    options = pb.DevicePluginOptions.FromString(bytes(plugin().options()))
    assert not options.pre_start_required
    assert not options.get_preferred_allocation_available


def test_allocate_gives_the_host_device_and_pcc_dir() -> None:
    shares = plugin(
        Config(pcc_device="/dev/sev-guest0", pcc_socket_path="/run/pcc", host_root="/host")
    )
    response = allocate(shares, ["pcc-3"])
    assert len(response.container_responses) == 1
    (container,) = response.container_responses
    assert [(d.container_path, d.host_path, d.permissions) for d in container.devices] == [
        ("/dev/sev-guest", "/dev/sev-guest0", "rw")
    ]
    assert [(m.container_path, m.host_path, m.read_only) for m in container.mounts] == [
        ("/var/run/pcc", "/run/pcc", False)
    ]
    assert not container.envs
    assert not container.annotations


def test_several_shares_give_the_device_and_mount_once() -> None:
    (container,) = allocate(plugin(), ["pcc-0", "pcc-1", "pcc-15"]).container_responses
    assert len(container.devices) == 1
    assert len(container.mounts) == 1


def test_one_response_per_container_request() -> None:
    response = allocate(plugin(), ["pcc-0"], ["pcc-1", "pcc-2"], ["pcc-3"])
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
def test_bad_requests_name_the_problem(containers: list[list[str]], message: str) -> None:
    request = api.AllocateRequest(
        container_requests=[api.ContainerAllocateRequest(devices_ids=ids) for ids in containers]
    )
    with pytest.raises(RequestError, match=message.replace("(", r"\(")):
        plugin().allocate(request)


def test_pre_start_container_checks_ids() -> None:
    shares = plugin()
    shares.pre_start_container(api.PreStartContainerRequest(devices_ids=["pcc-1"]))
    with pytest.raises(RequestError, match="unknown device IDs 'nope'"):
        shares.pre_start_container(api.PreStartContainerRequest(devices_ids=["nope"]))


def test_allocate_fails_with_the_reason_while_unhealthy() -> None:
    shares = plugin()
    shares.set_problem("detect device /dev/sev-guest failed: No such file or directory")
    request = api.AllocateRequest(
        container_requests=[api.ContainerAllocateRequest(devices_ids=["pcc-0"])]
    )
    with pytest.raises(DeviceUnavailable, match="is unhealthy: detect device /dev/sev-guest"):
        shares.allocate(request)
    shares.set_problem(None)
    assert len(shares.allocate(request).container_responses) == 1
    assert shares.stats.allocations == {"unavailable": 1, "ok": 1}


def test_pre_start_check_looks_at_the_node_again(tmp_path: Path) -> None:
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "sev-guest").symlink_to("/dev/null")
    checked = plugin(Config(host_root=str(tmp_path)), pre_start_check=True)
    assert checked.options().pre_start_required
    request = api.PreStartContainerRequest(devices_ids=["pcc-0"])
    with pytest.raises(DeviceUnavailable, match=f"detect socket path {tmp_path}/var/run/pcc"):
        checked.pre_start_container(request)
    (tmp_path / "var" / "run" / "pcc").mkdir(parents=True)
    checked.pre_start_container(request)
