"""The DevicePlugin service: kubelet's five calls, read strictly, answered by a DevicePlugin.

Requests are read by `wire` within limits that follow the resource: an
Allocate names at most as many device IDs as the resource advertises, in at
most `MAX_CONTAINER_REQUESTS` container requests (kubelet sends one). Client
mistakes are INVALID_ARGUMENT, a gone device FAILED_PRECONDITION.
"""

from __future__ import annotations

import functools
import logging

import grpclib.const
import grpclib.exceptions

from pcc_plugin import wire
from pcc_plugin._proto import v1beta1 as api
from pcc_plugin.grpc_server import Call, MethodSpec
from pcc_plugin.klog import V1
from pcc_plugin.plugin import DevicePlugin, DeviceUnavailable, RequestError
from pcc_plugin.registration import KubeletLink
from pcc_plugin.resource import Grant

log = logging.getLogger(__name__)

Status = grpclib.const.Status
GRPCError = grpclib.exceptions.GRPCError

SERVICE = "/v1beta1.DevicePlugin/"
# Kubelet sends one container request per Allocate; a pod is far from this many.
MAX_CONTAINER_REQUESTS = 128


class DevicePluginService:
    """The gRPC methods of one resource, for one generation (one socket)."""

    def __init__(self, plugin: DevicePlugin, link: KubeletLink) -> None:
        self._plugin = plugin
        self._link = link
        self._options = bytes(plugin.options())

    def methods(self) -> dict[str, MethodSpec]:
        return {
            SERVICE + "GetDevicePluginOptions": MethodSpec(self.get_device_plugin_options),
            SERVICE + "ListAndWatch": MethodSpec(stream=self.list_and_watch),
            SERVICE + "GetPreferredAllocation": MethodSpec(self.get_preferred_allocation),
            SERVICE + "Allocate": MethodSpec(self.allocate),
            SERVICE + "PreStartContainer": MethodSpec(self.pre_start_container),
        }

    # Unary methods answer a request's bytes with the response's (see grpc_server.MethodSpec).

    def get_device_plugin_options(self, data: bytes, call: Call) -> bytes:
        check_message(data, wire.EMPTY, "Empty")
        self._link.options_called(call.connection)
        return self._options

    async def list_and_watch(self, call: Call) -> None:
        check_message(await call.receive(), wire.EMPTY, "Empty")
        is_kubelet = self._link.stream_opened(call.connection)
        try:
            await self._plugin.feed.stream(call.send)
        finally:
            self._link.stream_closed(is_kubelet)

    def get_preferred_allocation(self, data: bytes, call: Call) -> bytes:
        check_message(data, wire.PREFERRED_ALLOCATION_REQUEST, "PreferredAllocationRequest")
        raise GRPCError(
            Status.UNIMPLEMENTED,
            "GetPreferredAllocation is not offered: every share is the same device",
        )

    def allocate(self, data: bytes, call: Call) -> bytes:
        try:
            containers = wire.read_allocate_request(
                data, MAX_CONTAINER_REQUESTS, len(self._plugin.devices), self._plugin.longest_id
            )
        except (wire.WireError, wire.TooMany, wire.TooLong) as exc:
            raise self._allocate_refused(self._unreadable("AllocateRequest", exc)) from None
        try:
            return encode_allocate_response(tuple(self._plugin.allocate(containers)))
        except (RequestError, DeviceUnavailable) as exc:
            raise self._allocate_refused(_refused(exc)) from None

    def _allocate_refused(self, error: GRPCError) -> GRPCError:
        """--v=1 logs each Allocate: a refused one with the reason kubelet is given."""
        log.log(V1, "Allocate %s refused, %s: %s", self._plugin.spec.name, error.status.name,
                error.message)  # fmt: skip
        return error

    def pre_start_container(self, data: bytes, call: Call) -> bytes:
        try:
            device_ids = wire.read_device_ids(
                data, len(self._plugin.devices), self._plugin.longest_id
            )
        except (wire.WireError, wire.TooMany, wire.TooLong) as exc:
            raise self._unreadable("PreStartContainerRequest", exc) from None
        try:
            self._plugin.pre_start_container(device_ids)
        except (RequestError, DeviceUnavailable) as exc:
            raise _refused(exc) from None
        return b""

    def _unreadable(
        self, name: str, exc: wire.WireError | wire.TooMany | wire.TooLong
    ) -> GRPCError:
        """A request that is malformed, or too large for this resource: INVALID_ARGUMENT."""
        if isinstance(exc, wire.TooManyContainers):
            why = f"{name} has more than {MAX_CONTAINER_REQUESTS} container requests"
        elif isinstance(exc, wire.TooMany):
            why = (
                f"{name} names more device IDs than the {len(self._plugin.devices)} "
                f"{self._plugin.spec.name} advertises"
            )
        elif isinstance(exc, wire.TooLong):
            why = (
                f"{name} names a device ID of {exc.size} bytes, longer than any of "
                f"{self._plugin.spec.name}'s ({self._plugin.longest_id} bytes at most)"
            )
        else:
            why = f"cannot decode {name}: {exc}"
        return GRPCError(Status.INVALID_ARGUMENT, why)


def _refused(exc: RequestError | DeviceUnavailable) -> GRPCError:
    """The plugin's refusals as gRPC statuses: a client's mistake, or a device gone."""
    if isinstance(exc, RequestError):
        return GRPCError(Status.INVALID_ARGUMENT, str(exc))
    return GRPCError(Status.FAILED_PRECONDITION, str(exc))


def check_message(data: bytes, schema: wire.Schema, name: str) -> None:
    try:
        wire.check(data, schema)
    except wire.WireError as exc:
        raise GRPCError(Status.INVALID_ARGUMENT, f"cannot decode {name}: {exc}") from None


@functools.lru_cache(maxsize=256)
def encode_allocate_response(grants: tuple[Grant, ...]) -> bytes:
    """An AllocateResponse, one ContainerAllocateResponse per grant.

    A grant is a pure function of the devices named, and kubelet names one share at a time:
    each answer is encoded once, as the device list is (betterproto2 takes some 100 µs).
    """
    return bytes(
        api.AllocateResponse(
            container_responses=[
                api.ContainerAllocateResponse(
                    envs=dict(given.envs),
                    mounts=[
                        api.Mount(
                            container_path=mount.container_path,
                            host_path=mount.host_path,
                            read_only=mount.read_only,
                        )
                        for mount in given.mounts
                    ],
                    devices=[
                        api.DeviceSpec(
                            container_path=node.container_path,
                            host_path=node.host_path,
                            permissions=node.permissions,
                        )
                        for node in given.device_nodes
                    ],
                    cdi_devices=[api.CdiDevice(name=name) for name in given.cdi_devices],
                )
                for given in grants
            ]
        )
    )
