"""The one place where trio meets asyncio: grpclib's server and client run here.

grpclib runs on asyncio; trio-asyncio runs an asyncio loop inside trio. Every
grpclib object is built and awaited in this module, and everything else in
the daemon is trio code that calls the functions below.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Protocol

import betterproto2
import grpclib.client
import grpclib.const
import grpclib.encoding.proto
import grpclib.exceptions
import grpclib.protocol
import grpclib.server
import trio
import trio_asyncio

from pcc_plugin._proto import v1beta1 as api
from pcc_plugin.devices import DeviceUnavailable, RequestError

log = logging.getLogger(__name__)

Status = grpclib.const.Status


@asynccontextmanager
async def asyncio_loop() -> AsyncIterator[None]:
    """The single asyncio loop of the process; grpclib objects exist only inside it."""
    async with trio_asyncio.open_loop():
        yield


# The peer is not there, or went away mid-call.
_UNREACHABLE = (
    OSError,
    grpclib.exceptions.StreamTerminatedError,
    grpclib.exceptions.ProtocolError,
)


class RegisterFailed(Exception):
    """Kubelet did not accept the registration; the message says why."""


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
            problem = _type_problem(message)
        except Exception as exc:
            problem = str(exc)
        if problem:
            raise grpclib.exceptions.GRPCError(
                Status.INVALID_ARGUMENT, f"cannot decode {message_type.__name__}: {problem}"
            )
        return message


_PYTHON_TYPES: dict[str, type] = {
    betterproto2.TYPE_STRING: str,
    betterproto2.TYPE_BYTES: bytes,
    betterproto2.TYPE_BOOL: bool,
    betterproto2.TYPE_INT32: int,
    betterproto2.TYPE_INT64: int,
}


def _type_problem(message: betterproto2.Message) -> str | None:
    """Which field holds a value of the wrong type, or None.

    betterproto2 decodes a field sent with the wrong wire type into a value of
    the wrong type (an int where a message belongs); the handlers must never
    see one.
    """
    metadata: Any = type(message)._betterproto  # type: ignore[arg-type]
    message_classes: dict[str, type[betterproto2.Message]] = metadata.cls_by_field
    for field in dataclasses.fields(message):  # type: ignore[arg-type]
        meta = betterproto2.FieldMetadata.get(field)
        value = getattr(message, field.name)
        if meta.repeated and not isinstance(value, list):
            return f"field {field.name} is not a list"
        items: list[Any] = value if meta.repeated else [value]
        for item in items:
            if meta.proto_type == betterproto2.TYPE_MESSAGE:
                if item is None and not meta.repeated:
                    continue
                if not isinstance(item, message_classes[field.name]):
                    return f"field {field.name} holds {type(item).__name__}, not a message"
                problem = _type_problem(item)
                if problem:
                    return problem
            elif not isinstance(item, _PYTHON_TYPES.get(meta.proto_type, object)):
                return f"field {field.name} holds {type(item).__name__}, not {meta.proto_type}"
    return None


class DevicePluginLogic(Protocol):
    """What the daemon answers for one resource; implemented by `devices.DevicePlugin`."""

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
            await trio_asyncio.aio_as_trio(stream.send_message)(payload)

        await trio_asyncio.trio_as_aio(self._list_and_watch_trio)(send)


class _Server(grpclib.server.Server):
    """grpclib's Server, plus closing the client connections it leaves open.

    `Server.close()` cancels handlers but keeps connections, so a client
    holding ListAndWatch would hang instead of seeing the stream end. This
    relies on grpclib's private `_protocol_factory` (grpclib 0.4), and
    tests/test_bridge.py checks that a client really sees the end.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._protocols: weakref.WeakSet[grpclib.protocol.H2Protocol] = weakref.WeakSet()

    def _protocol_factory(self) -> grpclib.protocol.H2Protocol:
        protocol = super()._protocol_factory()
        self._protocols.add(protocol)
        return protocol

    def close_connections(self) -> None:
        for protocol in list(self._protocols):
            connection = getattr(protocol, "connection", None)
            if connection is not None:
                connection.close()


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
    server = _Server([_DevicePluginService(logic, list_and_watch)], codec=_Codec())
    # Shielded: asyncio's create_unix_server, cancelled in its last step, leaves
    # a listening socket that nothing references and nothing closes.
    with trio.CancelScope(shield=True):
        await trio_asyncio.aio_as_trio(server.start)(path=str(socket_path))
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
            await trio_asyncio.aio_as_trio(server.wait_closed)()
        try:
            if os.stat(socket_path).st_ino == own_inode:
                os.unlink(socket_path)
        except FileNotFoundError:
            pass


async def register(kubelet_socket: Path, request: api.RegisterRequest, deadline: float) -> None:
    """Call kubelet's Register; raise RegisterFailed with kubelet's reason otherwise.

    The deadline (seconds) travels as grpc-timeout, so kubelet stops waiting too.
    """
    channel = grpclib.client.Channel(path=str(kubelet_socket))
    try:
        stub = api.RegistrationStub(channel)
        await trio_asyncio.aio_as_trio(stub.register)(request, timeout=deadline)
    except grpclib.exceptions.GRPCError as exc:
        raise RegisterFailed(f"kubelet answered {exc.status.name}: {exc.message}") from None
    except TimeoutError:
        raise RegisterFailed(f"kubelet did not answer within {deadline:g} s") from None
    except _UNREACHABLE as exc:
        raise RegisterFailed(f"cannot reach {kubelet_socket}: {exc}") from None
    finally:
        channel.close()


class CallFailed(Exception):
    """A device plugin did not answer as kubelet expects; the message says how."""


async def probe_unimplemented(socket_path: Path, method: str, deadline: float) -> str | None:
    """Call `method`, which the server must not offer: None if it answers UNIMPLEMENTED.

    Shows that a gRPC server answers on the socket without changing anything
    there; otherwise returns what happened instead. The deadline (seconds)
    travels as grpc-timeout.
    """
    channel = grpclib.client.Channel(path=str(socket_path))
    call = grpclib.client.UnaryUnaryMethod(channel, method, api.Empty, api.Empty)
    try:
        await trio_asyncio.aio_as_trio(call)(api.Empty(), timeout=deadline)
    except grpclib.exceptions.GRPCError as exc:
        if exc.status is Status.UNIMPLEMENTED:
            return None
        return f"answered {exc.status.name}: {exc.message}"
    except TimeoutError:
        return f"no answer within {deadline:g} s"
    except _UNREACHABLE as exc:
        return f"cannot reach {socket_path}: {exc}"
    finally:
        channel.close()
    return f"answered OK to {method}, which it should not offer"


async def read_device_plugin(
    socket_path: Path, deadline: float
) -> tuple[api.DevicePluginOptions, api.ListAndWatchResponse]:
    """GetDevicePluginOptions, then ListAndWatch's first device list, as kubelet reads them.

    The stream is closed after its first message. Raises CallFailed naming the step.
    """
    channel = grpclib.client.Channel(path=str(socket_path))
    stub = api.DevicePluginStub(channel)
    step = "GetDevicePluginOptions"
    try:
        options = await trio_asyncio.aio_as_trio(stub.get_device_plugin_options)(
            api.Empty(), timeout=deadline
        )
        step = "ListAndWatch"
        listing = await trio_asyncio.aio_as_trio(_first_listing)(channel, deadline)
    except grpclib.exceptions.GRPCError as exc:
        raise CallFailed(f"{step} answered {exc.status.name}: {exc.message}") from None
    except TimeoutError:
        raise CallFailed(f"{step} got no answer within {deadline:g} s") from None
    except _UNREACHABLE as exc:
        raise CallFailed(f"{step} failed: {exc}") from None
    finally:
        channel.close()
    if listing is None:
        raise CallFailed("ListAndWatch ended without sending a device list")
    return options, listing


async def _first_listing(
    channel: grpclib.client.Channel, deadline: float
) -> api.ListAndWatchResponse | None:
    method = grpclib.client.UnaryStreamMethod(
        channel, "/v1beta1.DevicePlugin/ListAndWatch", api.Empty, api.ListAndWatchResponse
    )
    async with method.open(timeout=deadline) as stream:
        await stream.send_message(api.Empty(), end=True)
        listing = await stream.recv_message()
        if listing is not None:
            # One list is all we read: end the stream now, not when the channel closes.
            await stream.cancel()
    return listing
