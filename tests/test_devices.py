"""The device list and Allocate answers, checked with protobuf's own decoder."""

from __future__ import annotations

import pytest

from pcc_plugin._proto import v1beta1 as api
from pcc_plugin.config import Config
from pcc_plugin.devices import HEALTHY, UNHEALTHY, RequestError, Shares
from pcc_plugin.sim._pb import deviceplugin_v1beta1_pb2 as pb


def allocate(shares: Shares, *containers: list[str]) -> pb.AllocateResponse:
    request = api.AllocateRequest(
        container_requests=[api.ContainerAllocateRequest(devices_ids=ids) for ids in containers]
    )
    response: pb.AllocateResponse = pb.AllocateResponse.FromString(bytes(shares.allocate(request)))
    return response


def test_listing_has_every_share_with_stable_ids() -> None:
    listing = pb.ListAndWatchResponse.FromString(Shares(Config()).listing(HEALTHY))
    assert [device.ID for device in listing.devices] == [f"pcc-{i}" for i in range(16)]
    assert {device.health for device in listing.devices} == {"Healthy"}
    assert Shares(Config()).ids == Shares(Config()).ids


def test_listing_follows_resource_count_and_health() -> None:
    listing = pb.ListAndWatchResponse.FromString(
        Shares(Config(resource_count=10_000)).listing(UNHEALTHY)
    )
    assert len(listing.devices) == 10_000
    assert listing.devices[-1].ID == "pcc-9999"
    assert {device.health for device in listing.devices} == {"Unhealthy"}


def test_options_offer_nothing_unimplemented() -> None:
    options = pb.DevicePluginOptions.FromString(bytes(Shares(Config()).options()))
    assert not options.pre_start_required
    assert not options.get_preferred_allocation_available


def test_allocate_gives_the_host_device_and_pcc_dir() -> None:
    shares = Shares(
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
    (container,) = allocate(Shares(Config()), ["pcc-0", "pcc-1", "pcc-15"]).container_responses
    assert len(container.devices) == 1
    assert len(container.mounts) == 1


def test_one_response_per_container_request() -> None:
    response = allocate(Shares(Config()), ["pcc-0"], ["pcc-1", "pcc-2"], ["pcc-3"])
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
        Shares(Config()).allocate(request)


def test_pre_start_container_checks_ids() -> None:
    shares = Shares(Config())
    shares.pre_start_container(api.PreStartContainerRequest(devices_ids=["pcc-1"]))
    with pytest.raises(RequestError, match="unknown device IDs 'nope'"):
        shares.pre_start_container(api.PreStartContainerRequest(devices_ids=["nope"]))
