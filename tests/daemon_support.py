"""Waits shared by the tests that run the daemon against the simulated kubelet."""

from __future__ import annotations

import re
from pathlib import Path

import grpc

from pcc_plugin.sim import Daemon, Registration, SimKubelet, run_blocking
from pcc_plugin.sim._pb import deviceplugin_v1beta1_pb2 as pb

RESOURCE = "tke.cloud.tencent.com/pcc-device"
HEALTHY_16 = {f"pcc-{index}": "Healthy" for index in range(16)}
WAIT = 10.0
# The daemon's socket names: `pcc-<pid>-<token>-<generation>.sock`.
OWN_SOCKET = re.compile(r"pcc-(\d+-[0-9a-f]{6})-\d+\.sock")


def accepted(kubelet: SimKubelet) -> list[Registration]:
    return [registration for registration in kubelet.registrations if registration.accepted]


def _endpoints(kubelet: SimKubelet, resource: str) -> list[str]:
    """The endpoints of `resource`'s accepted registrations, oldest first."""
    return [r.endpoint for r in accepted(kubelet) if r.resource_name == resource]


def _newest_serves(
    kubelet: SimKubelet, endpoints: list[str], devices: dict[str, str], resource: str
) -> bool:
    return (
        kubelet.active_endpoint(resource) == endpoints[-1]
        and kubelet.stream_open(resource)
        and kubelet.devices(resource) == devices
    )


async def serving(
    kubelet: SimKubelet,
    registrations: int = 1,
    devices: dict[str, str] = HEALTHY_16,
    resource: str = RESOURCE,
) -> str:
    """Wait for `registrations` accepted ones of `resource` and its full list on a live stream;
    return the endpoint.

    Kubelet marks every device Unhealthy when its stream ends or it stops, so a Healthy list
    here is a list sent on the newest stream.
    """

    def ready() -> bool:
        endpoints = _endpoints(kubelet, resource)
        return len(endpoints) >= registrations and _newest_serves(
            kubelet, endpoints, devices, resource
        )

    await run_blocking(kubelet.wait_for, ready, WAIT)
    return _endpoints(kubelet, resource)[-1]


def instance(endpoint: str | None) -> str:
    """The `<pid>-<token>` part of a socket name: which daemon serves it."""
    own = OWN_SOCKET.fullmatch(endpoint or "")
    assert own is not None, endpoint
    return own.group(1)


def stream_ended(kubelet: SimKubelet, endpoint: str) -> bool:
    """Whether kubelet has seen the ListAndWatch stream of `endpoint` end."""
    return any(
        "ListAndWatch ended unexpectedly" in event and f"({endpoint})" in event
        for event in kubelet.events
    )


DROPPED = re.compile(r"disconnecting (\S+), .*because an older stream")


def dropped_by_kubelet(kubelet: SimKubelet, endpoint: str) -> int:
    """How many registrations of the daemon that served `endpoint` kubelet dropped because an
    older stream of their resource ended (kubelets before 1.37)."""
    dropped = (DROPPED.match(event) for event in kubelet.events)
    return sum(1 for match in dropped if match and instance(match[1]) == instance(endpoint))


async def settled(kubelet: SimKubelet, resource: str = RESOURCE) -> str:
    """Wait until kubelet has seen the stream of every registration of `resource` but the
    newest end, and the newest serves its full list; return its endpoint.

    Kubelets before 1.37 drop the newest registration when an older stream ends, however late
    they see it end: until they have seen every older one end, a registration that serves
    now can still be dropped, and the plugin registers once more.
    """

    def ready() -> bool:
        endpoints = _endpoints(kubelet, resource)
        return (
            bool(endpoints)
            and _newest_serves(kubelet, endpoints, HEALTHY_16, resource)
            and all(stream_ended(kubelet, endpoint) for endpoint in endpoints[:-1])
        )

    await run_blocking(kubelet.wait_for, ready, WAIT)
    return _endpoints(kubelet, resource)[-1]


# Kubelet went away leaving kubelet.sock behind: the daemon waits for it, or (if it saw the
# socket replaced first) retries Register against it; either way quietly (at --v=1).
KUBELET_GONE = re.compile("takes no connections|Kubelet is not reachable yet")


async def log_line(daemon: Daemon, text: str | re.Pattern[str], count: int = 1) -> str:
    return await run_blocking(daemon.wait_for_log, text, WAIT, count=count)


def open_tool_stream(socket_path: Path, timeout: float = WAIT) -> tuple[grpc.Channel, grpc.Future]:
    """A ListAndWatch stream as a tool would open one; returns once the first list came."""
    channel = grpc.insecure_channel(f"unix:{socket_path}")
    stream = channel.unary_stream(
        "/v1beta1.DevicePlugin/ListAndWatch",
        request_serializer=pb.Empty.SerializeToString,
        response_deserializer=pb.ListAndWatchResponse.FromString,
    )(pb.Empty(), timeout=timeout)
    next(stream)
    return channel, stream
