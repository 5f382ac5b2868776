"""The DevicePlugin gRPC server: grpclib on a unix socket, answering for one resource."""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import grpclib.const
import grpclib.encoding.proto
import grpclib.exceptions
import grpclib.server
import trio

from pcc_plugin._betterproto2 import type_problem
from pcc_plugin._grpclib import ConnectionClosingServer
from pcc_plugin._proto import v1beta1 as api
from pcc_plugin.bridge import call_asyncio, call_trio
from pcc_plugin.plugin import DeviceUnavailable, RequestError

log = logging.getLogger(__name__)

Status = grpclib.const.Status


class _Codec(grpclib.encoding.proto.ProtoCodec):
    """Protobuf codec that answers undecodable requests with INVALID_ARGUMENT.

    grpclib's own codec lets a decode error escape as an application error
    (a logged traceback and status UNKNOWN). Pre-encoded bytes pass through,
    so one device list can be encoded once and sent on every stream.
    """

    def encode(self, message: Any, message_type: Any) -> bytes:
        if isinstance(message, bytes):
            return message
        return super().encode(message, message_type)

    def decode(self, data: bytes, message_type: Any) -> Any:
        try:
            message = message_type.FromString(data)
            problem = type_problem(message)
        except Exception as exc:
            problem = str(exc)
        if problem:
            raise grpclib.exceptions.GRPCError(
                Status.INVALID_ARGUMENT, f"cannot decode {message_type.__name__}: {problem}"
            )
        return message


class DevicePluginLogic(Protocol):
    """What the daemon answers for one resource; implemented by `plugin.DevicePlugin`."""

    def options(self) -> api.DevicePluginOptions: ...
    def allocate(self, request: api.AllocateRequest) -> api.AllocateResponse: ...
    def pre_start_container(
        self, request: api.PreStartContainerRequest
    ) -> api.PreStartContainerResponse: ...


Stream = grpclib.server.Stream[Any, Any]


class _DevicePluginService(api.DevicePluginBase):
    """grpclib handlers for the generated DevicePlugin paths.

    The generated handlers assert that a request arrived and let handler
    errors become UNKNOWN; these answer every bad request with
    INVALID_ARGUMENT instead, and run ListAndWatch as trio code.
    """

    def __init__(
        self,
        logic: DevicePluginLogic,
        list_and_watch: Callable[[Callable[[bytes], Awaitable[None]]], Awaitable[None]],
    ) -> None:
        self._logic = logic
        self._list_and_watch_trio = list_and_watch

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        own = {
            "/v1beta1.DevicePlugin/GetDevicePluginOptions": self._options,
            "/v1beta1.DevicePlugin/ListAndWatch": self._list_and_watch,
            "/v1beta1.DevicePlugin/GetPreferredAllocation": self._preferred_allocation,
            "/v1beta1.DevicePlugin/Allocate": self._allocate,
            "/v1beta1.DevicePlugin/PreStartContainer": self._pre_start_container,
        }
        return {
            path: handler._replace(func=own[path])
            for path, handler in super().__mapping__().items()
        }

    @staticmethod
    async def _request(stream: Stream) -> Any:
        request = await stream.recv_message()
        if request is None:
            raise grpclib.exceptions.GRPCError(Status.INVALID_ARGUMENT, "no request message")
        return request

    async def _unary(self, stream: Stream, answer: Callable[[Any], Any]) -> None:
        request = await self._request(stream)
        try:
            response = answer(request)
        except RequestError as exc:
            raise grpclib.exceptions.GRPCError(Status.INVALID_ARGUMENT, str(exc)) from None
        except DeviceUnavailable as exc:
            raise grpclib.exceptions.GRPCError(Status.FAILED_PRECONDITION, str(exc)) from None
        await stream.send_message(response)

    async def _options(self, stream: Stream) -> None:
        await self._unary(stream, lambda _: self._logic.options())

    async def _allocate(self, stream: Stream) -> None:
        await self._unary(stream, self._logic.allocate)

    async def _pre_start_container(self, stream: Stream) -> None:
        await self._unary(stream, self._logic.pre_start_container)

    async def _preferred_allocation(self, stream: Stream) -> None:
        await self._request(stream)
        raise grpclib.exceptions.GRPCError(
            Status.UNIMPLEMENTED,
            "GetPreferredAllocation is not offered: every share is the same device",
        )

    async def _list_and_watch(self, stream: Stream) -> None:
        await self._request(stream)

        async def send(payload: bytes) -> None:
            await call_asyncio(stream.send_message, payload)

        await call_trio(self._list_and_watch_trio, send)


async def serve(
    logic: DevicePluginLogic,
    list_and_watch: Callable[[Callable[[bytes], Awaitable[None]]], Awaitable[None]],
    socket_path: Path,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the DevicePlugin service on `socket_path` until cancelled.

    Started once the socket accepts connections. On the way out it closes
    every client connection and removes the socket file, unless someone else
    has replaced it in the meantime.
    """
    server = ConnectionClosingServer([_DevicePluginService(logic, list_and_watch)], codec=_Codec())
    # Shielded: asyncio's create_unix_server, cancelled in its last step, leaves
    # a listening socket that nothing references and nothing closes.
    with trio.CancelScope(shield=True):
        await call_asyncio(server.start, path=str(socket_path))
    own_inode = os.stat(socket_path).st_ino
    try:
        task_status.started()
        await trio.sleep_forever()
    finally:
        # Shielded: in a cancelled scope an unshielded await here would raise at
        # once and leak the listener and its connections on every restart.
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            server.close()
            server.close_connections()
            await call_asyncio(server.wait_closed)
        try:
            if os.stat(socket_path).st_ino == own_inode:
                os.unlink(socket_path)
        except FileNotFoundError:
            pass
