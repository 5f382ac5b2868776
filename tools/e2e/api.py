"""What the checks read from kubelet: its pod-resources gRPC API and its HTTPS API.

Pod resources: our own client of ``v1.PodResourcesLister`` (the devices of device plugins and
of DRA drivers) on ``/var/lib/kubelet/pod-resources/kubelet.sock`` (grpcio, messages from
``podresources.proto``), calling methods by their gRPC paths. Each call opens a fresh channel:
a kubelet restart replaces the socket, and a kept channel would reconnect with grpc's backoff,
which would count in the figures. Kubelet offers no watch there, so the checks poll it
(poll.wait_for).

HTTPS (port 10250, anonymous and AlwaysAllow): ``/pods`` lists the static pods with the status
kubelet keeps for them (there is no API server); ``/run/<namespace>/<pod>/<container>?cmd=``
runs a command in a container through the runtime's ExecSync, its arguments split on spaces;
``/metrics/probes`` counts probe results. Blocking calls run in worker threads with timeouts.
"""

from __future__ import annotations

import contextlib
import json
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs
import grpc
import trio

from ._pb import podresources_pb2 as pb
from .node import KUBELET_PORT, NODE_NAME, POD_RESOURCES_SOCKET
from .poll import Unavailable

Obj = dict[str, Any]
T = TypeVar("T")

LIST = "/v1.PodResourcesLister/List"
GET_ALLOCATABLE = "/v1.PodResourcesLister/GetAllocatableResources"
CALL_TIMEOUT = 5.0


def _call(method: str, request: Any, response_type: Any, socket: Path) -> Any:
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        stub = channel.unary_unary(
            method,
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=response_type.FromString,
        )
        try:
            return stub(request, timeout=CALL_TIMEOUT)
        except grpc.RpcError as error:
            if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise Unavailable(f"pod-resources {method}: {error.details()}") from None
            raise


async def _blocking(function: Callable[..., T], *args: Any) -> T:
    with trio.fail_after(CALL_TIMEOUT + 5):
        return await trio.to_thread.run_sync(function, *args, abandon_on_cancel=True)


async def allocatable(resource: str, socket: Path = POD_RESOURCES_SOCKET) -> list[str]:
    """The device IDs kubelet may allocate for `resource` now (healthy ones, in use or not);
    another node's kubelet through its `socket`, as seen from here (fleet.py)."""
    response = await _blocking(_call, GET_ALLOCATABLE, pb.AllocatableResourcesRequest(),
                               pb.AllocatableResourcesResponse, socket)  # fmt: skip
    return sorted(
        device_id
        for devices in response.devices
        if devices.resource_name == resource
        for device_id in devices.device_ids
    )


def _count(response: Any, resource: str) -> int:
    return sum(len(d.device_ids) for d in response.devices if d.resource_name == resource)


def _sample(
    resource: str, interval: float, stop: threading.Event, samples: list[tuple[float, int]]
) -> None:
    """GetAllocatableResources every `interval` seconds over one channel until `stop`:
    (CLOCK_BOOTTIME, allocatable count; -1 when kubelet did not answer)."""
    with grpc.insecure_channel(f"unix://{POD_RESOURCES_SOCKET}") as channel:
        stub = channel.unary_unary(
            GET_ALLOCATABLE,
            request_serializer=lambda message: message.SerializeToString(),
            response_deserializer=pb.AllocatableResourcesResponse.FromString,
        )
        while not stop.is_set():
            try:
                count = _count(stub(pb.AllocatableResourcesRequest(), timeout=1), resource)
            except grpc.RpcError:
                count = -1
            samples.append((time.clock_gettime(time.CLOCK_BOOTTIME), count))
            stop.wait(interval)


@contextlib.asynccontextmanager
async def sampling_allocatable(
    resource: str, interval: float
) -> AsyncIterator[list[tuple[float, int]]]:
    """Kubelet's allocatable count of `resource`, read every `interval` seconds while inside
    (the Node's status only refreshes every 10 s); the samples, (time, count)."""
    samples: list[tuple[float, int]] = []
    stop = threading.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, _sample, resource, interval, stop, samples)
        try:
            yield samples
        finally:
            stop.set()


async def _containers(socket: Path) -> list[tuple[str, str, Any]]:
    """Kubelet's List: (namespace, pod name, container's resources) of every container."""
    response = await _blocking(_call, LIST, pb.ListPodResourcesRequest(),
                               pb.ListPodResourcesResponse, socket)  # fmt: skip
    return [
        (pod.namespace, pod.name, container)
        for pod in response.pod_resources
        for container in pod.containers
    ]


async def assigned(
    resource: str, socket: Path = POD_RESOURCES_SOCKET
) -> dict[tuple[str, str, str], list[str]]:
    """(namespace, pod name, container) -> device IDs of `resource` that kubelet assigned."""
    found = {}
    for namespace, pod, container in await _containers(socket):
        ids = sorted(i for d in container.devices if d.resource_name == resource
                     for i in d.device_ids)  # fmt: skip
        if ids:
            found[namespace, pod, container.name] = ids
    return found


async def claimed(
    driver: str, socket: Path = POD_RESOURCES_SOCKET
) -> dict[tuple[str, str, str], list[tuple[str, list[str]]]]:
    """(namespace, pod name, container) -> (device, its CDI devices) of each of `driver`'s
    devices in the container's ResourceClaims, as kubelet prepared them (DRA)."""
    found = {}
    for namespace, pod, container in await _containers(socket):
        devices = sorted(
            (resource.device_name, [cdi.name for cdi in resource.cdi_devices])
            for claim in container.dynamic_resources
            for resource in claim.claim_resources
            if resource.driver_name == driver
        )
        if devices:
            found[namespace, pod, container.name] = devices
    return found


@attrs.frozen
class PodRef:
    """A static pod: its namespace and name as written; kubelet appends the node's name."""

    namespace: str
    name: str

    @property
    def full(self) -> str:
        return f"{self.name}-{NODE_NAME}"

    def __str__(self) -> str:
        return f"{self.namespace}/{self.full}"


def _https(method: str, path: str) -> bytes:
    context = ssl.create_default_context()
    # Kubelet's serving certificate is self-signed, made at its first start.
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    request = urllib.request.Request(f"https://127.0.0.1:{KUBELET_PORT}{path}", method=method)
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
    )
    try:
        with opener.open(request, timeout=CALL_TIMEOUT) as answer:
            body: bytes = answer.read()
            return body
    except urllib.error.HTTPError as error:
        detail = error.read().decode(errors="replace").strip()
        raise RuntimeError(f"kubelet {method} {path}: HTTP {error.code}: {detail}") from None
    except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
        raise Unavailable(f"kubelet {method} {path}: {error}") from None


async def pods() -> dict[str, Obj]:
    """Kubelet's pods by ``<namespace>/<name>-<node>``, each with the status kubelet keeps."""
    body = await _blocking(_https, "GET", "/pods")
    return {
        f"{pod['metadata']['namespace']}/{pod['metadata']['name']}": pod
        for pod in json.loads(body).get("items") or []
    }


async def pod(ref: PodRef) -> Obj | None:
    return (await pods()).get(str(ref))


async def run_in_container(ref: PodRef, container: str, *argv: str) -> str:
    """Run `argv` in the container (no argument may contain a space); its output."""
    assert not any(" " in arg for arg in argv), argv
    query = urllib.parse.urlencode({"cmd": " ".join(argv)})
    body = await _blocking(_https, "POST", f"/run/{ref}/{container}?{query}")
    return body.decode()


async def probe_results(ref: PodRef, probe_type: str) -> dict[str, float]:
    """Kubelet's count of `probe_type` probe results for the pod, by result."""
    text = (await _blocking(_https, "GET", "/metrics/probes")).decode()
    labels_of_pod = (f'namespace="{ref.namespace}"', f'pod="{ref.full}"')
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("prober_probe_total{") and all(x in line for x in labels_of_pod):
            labels, value = line.rsplit(" ", 1)
            if f'probe_type="{probe_type}"' in labels:
                result = labels.split('result="', 1)[1].split('"', 1)[0]
                counts[result] = counts.get(result, 0) + float(value)
    return counts


def container_status(pod: Obj, container: str) -> Obj | None:
    for status in pod.get("status", {}).get("containerStatuses", []):
        if status["name"] == container:
            found: Obj = status
            return found
    return None


def condition(pod: Obj, kind: str) -> str | None:
    for entry in pod.get("status", {}).get("conditions", []):
        if entry["type"] == kind:
            status: str = entry["status"]
            return status
    return None


def _http_get(url: str) -> tuple[int, str]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=CALL_TIMEOUT) as answer:
            return answer.status, answer.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")
    except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
        raise Unavailable(f"GET {url}: {error}") from None


async def http_get(url: str) -> tuple[int, str]:
    """(status, body) of a plain HTTP GET, e.g. the plugin's /readyz on the node's address."""
    return await _blocking(_http_get, url)
