"""gRPC clients: kubelet's Register, and the doctor's probes of kubelet and of a plugin
or DRA driver."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, ParamSpec, TypeVar

import grpclib.client
import grpclib.const
import grpclib.encoding.proto
import grpclib.exceptions

from pcc_plugin import _grpclib
from pcc_plugin._proto import v1beta1 as api
from pcc_plugin.bridge import call_asyncio

if TYPE_CHECKING:
    from pcc_plugin._proto import pluginregistration

P = ParamSpec("P")
T = TypeVar("T")

# The peer is not there, or went away mid-call.
_UNREACHABLE = (
    OSError,
    grpclib.exceptions.StreamTerminatedError,
    grpclib.exceptions.ProtocolError,
)


async def _call(function: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
    """`function` (grpclib's, or ours on a grpclib channel) run on the asyncio side; a
    connection the peer closed before the call began fails as a connection error."""
    try:
        return await call_asyncio(function, *args, **kwargs)
    except AttributeError as exc:
        if _grpclib.lost_before_the_call(exc):
            raise ConnectionResetError("the connection was closed before the call began") from None
        raise


def _channel(socket_path: Path) -> contextlib.closing[grpclib.client.Channel]:
    """A channel to the socket, closed as the block ends."""
    # Given a codec, grpclib does not try to import googleapis' status protos for error
    # details (never read here): 12 ms before the first Register where google's protobuf is.
    codec = grpclib.encoding.proto.ProtoCodec()
    return contextlib.closing(grpclib.client.Channel(path=str(socket_path), codec=codec))


class RegisterFailed(Exception):
    """Kubelet did not accept the registration; the message says why."""


class Unreachable(RegisterFailed):
    """Kubelet did not answer at all (not listening yet, gone, or too slow)."""


async def register(kubelet_socket: Path, request: api.RegisterRequest, deadline: float) -> None:
    """Call kubelet's Register; raise RegisterFailed with kubelet's reason otherwise.

    The deadline (seconds) travels as grpc-timeout, so kubelet stops waiting too.
    """
    with _channel(kubelet_socket) as channel:
        try:
            await _call(api.RegistrationStub(channel).register, request, timeout=deadline)
        except grpclib.exceptions.GRPCError as exc:
            raise RegisterFailed(f"kubelet answered {exc.status.name}: {exc.message}") from None
        except TimeoutError:
            raise Unreachable(f"kubelet did not answer within {deadline:g} s") from None
        except _UNREACHABLE as exc:
            raise Unreachable(f"cannot reach {kubelet_socket}: {exc}") from None


class CallFailed(Exception):
    """A device plugin did not answer as kubelet expects; the message says how."""


async def probe_unimplemented(socket_path: Path, method: str, deadline: float) -> str | None:
    """Call `method`, which the server must not offer: None if it answers UNIMPLEMENTED.

    Shows that a gRPC server answers on the socket without changing anything
    there; otherwise returns what happened instead. The deadline (seconds)
    travels as grpc-timeout.
    """
    with _channel(socket_path) as channel:
        call = grpclib.client.UnaryUnaryMethod(channel, method, api.Empty, api.Empty)
        try:
            await _call(call, api.Empty(), timeout=deadline)
        except grpclib.exceptions.GRPCError as exc:
            if exc.status is grpclib.const.Status.UNIMPLEMENTED:
                return None
            return f"answered {exc.status.name}: {exc.message}"
        except TimeoutError:
            return f"no answer within {deadline:g} s"
        except _UNREACHABLE as exc:
            return f"cannot reach {socket_path}: {exc}"
    return f"answered OK to {method}, which it should not offer"


async def read_device_plugin(
    socket_path: Path, deadline: float
) -> tuple[api.DevicePluginOptions, api.ListAndWatchResponse]:
    """GetDevicePluginOptions, then ListAndWatch's first device list, as kubelet reads them.

    The stream is closed after its first message. Raises CallFailed naming the step.
    """
    step = "GetDevicePluginOptions"
    with _channel(socket_path) as channel:
        try:
            stub = api.DevicePluginStub(channel)
            options = await _call(stub.get_device_plugin_options, api.Empty(), timeout=deadline)
            step = "ListAndWatch"
            listings: list[api.ListAndWatchResponse] = []
            await _call(_list_and_watch, channel, listings, deadline)
        except (grpclib.exceptions.GRPCError, TimeoutError, *_UNREACHABLE) as exc:
            raise _call_failed(step, exc, deadline) from None
    if not listings:
        raise CallFailed("ListAndWatch ended without sending a device list")
    return options, listings[0]


async def read_plugin_info(socket_path: Path, deadline: float) -> pluginregistration.PluginInfo:
    """GetInfo on a plugin registration socket, as kubelet's plugin watcher asks it.

    Raises CallFailed.
    """
    # Only the doctor asks this: the daemon does not load these messages for it.
    from pcc_plugin._proto import pluginregistration as registration

    with _channel(socket_path) as channel:
        try:
            stub = registration.RegistrationStub(channel)
            return await _call(stub.get_info, registration.InfoRequest(), timeout=deadline)
        except (grpclib.exceptions.GRPCError, TimeoutError, *_UNREACHABLE) as exc:
            raise _call_failed("GetInfo", exc, deadline) from None


def _call_failed(step: str, exc: BaseException, deadline: float) -> CallFailed:
    if isinstance(exc, grpclib.exceptions.GRPCError):
        return CallFailed(f"{step} answered {exc.status.name}: {exc.message}")
    if isinstance(exc, TimeoutError):
        return CallFailed(f"{step} got no answer within {deadline:g} s")
    return CallFailed(f"{step} failed: {exc}")


async def follow_list_and_watch(socket_path: Path) -> tuple[bool, str]:
    """Hold a ListAndWatch stream to the plugin at `socket_path` until it ends.

    Returns whether a device list came (the plugin was alive), and how it ended. A
    held stream ends the moment the serving process does, however it dies.
    """
    received: list[api.ListAndWatchResponse] = []
    with _channel(socket_path) as channel:
        try:
            await _call(_list_and_watch, channel, received)
        except grpclib.exceptions.GRPCError as exc:
            return bool(received), f"its stream ended with {exc.status.name}"
        except _UNREACHABLE as exc:
            return bool(received), f"its connection ended ({exc})"
        except Exception as exc:
            # Whatever the other end did (it is another process, maybe a dying one), the
            # stream is over; that is all the caller needs to know.
            return bool(received), f"its stream failed ({type(exc).__name__}: {exc})"
    return bool(received), "its stream ended"


async def _list_and_watch(
    channel: grpclib.client.Channel,
    received: list[api.ListAndWatchResponse],
    first_within: float | None = None,
) -> None:
    """Keep the last device list of a ListAndWatch stream in `received` until the stream ends;
    with `first_within` (seconds), end it after the first list (as soon as it came)."""
    method = grpclib.client.UnaryStreamMethod(
        channel, "/v1beta1.DevicePlugin/ListAndWatch", api.Empty, api.ListAndWatchResponse
    )
    async with method.open(timeout=first_within) as stream:
        await stream.send_message(api.Empty(), end=True)
        while (listing := await stream.recv_message()) is not None:
            received[:] = [listing]
            if first_within is not None:
                # One list is all that is read: end the stream now, not when the channel closes.
                await stream.cancel()
                return
