"""/metrics, /livez and /readyz over HTTP/1.1, parsed by h11, served by trio in the daemon.

The port listens on every address of the pod, so any pod of the cluster can
reach it: no client may end the daemon, hold it, or crowd out kubelet's probes.

- Each connection is one request and one answer, within `Limits.http_timeout` in
  all; a request head over `Limits.http_request_head` bytes gets 431.
- At most `Limits.http_connections` at once; at the limit the oldest connection that has
  not sent a whole request head is closed to make room (pcc_plugin/connection_cap.py),
  so a flood of half requests cannot keep a probe out.
- A connection's end, however abrupt (a reset, a half request), ends only that
  connection; any other error in it is logged with its traceback and contained.

Imported only when `--metrics-bind-address` is set.
"""

from __future__ import annotations

import logging

import h11
import trio

from pcc_plugin import metrics
from pcc_plugin.connection_cap import ConnectionCap
from pcc_plugin.errors import FatalError
from pcc_plugin.klog import V1
from pcc_plugin.limits import DEFAULT, Limits
from pcc_plugin.state import DaemonState

log = logging.getLogger(__name__)

_TEXT = "text/plain; charset=utf-8"
_ENDED = (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError)


def answer(path: str, daemon: DaemonState) -> tuple[int, str, bytes]:
    """Status, content type and body for GET `path`."""
    if path == "/metrics":
        return 200, "text/plain; version=0.0.4; charset=utf-8", metrics.render(daemon)
    if path == "/livez":
        # Answering at all shows the event loop runs; restarting the plugin
        # cannot fix a slow kubelet, so nothing else belongs here.
        return 200, _TEXT, b"ok\n"
    if path == "/readyz":
        reasons = daemon.not_ready()
        if reasons:
            return 503, _TEXT, ("\n".join(reasons) + "\n").encode()
        return 200, _TEXT, b"ok\n"
    return 404, _TEXT, b"not found: try /metrics, /livez or /readyz\n"


class _Exchange:
    """One connection's request and answer, evicted by cancelling its scope."""

    def __init__(self, seconds: float) -> None:
        self.scope = trio.CancelScope(deadline=trio.current_time() + seconds)
        self.sent_request = False
        self.evicted = False

    def close(self) -> None:
        self.evicted = True
        self.scope.cancel()


class HttpServer:
    def __init__(self, daemon: DaemonState, limits: Limits) -> None:
        self._daemon = daemon
        self.limits = limits
        self.cap: ConnectionCap[_Exchange] = ConnectionCap(
            limits.http_connections, "HTTP connections", log
        )

    async def handle(self, stream: trio.SocketStream) -> None:
        """One connection. Never raises: its error must not end the server."""
        exchange = _Exchange(self.limits.http_timeout)
        if not self.cap.admit(exchange):
            return
        try:
            with exchange.scope:
                await self._exchange(stream, exchange)
            if exchange.evicted:
                log.log(V1, "HTTP connection closed to make room: it sent no request head")
            elif exchange.scope.cancelled_caught:
                log.log(V1, "HTTP connection closed: not done within %g s",
                        self.limits.http_timeout)  # fmt: skip
        except (*_ENDED, h11.ProtocolError) as exc:
            log.log(V1, "HTTP connection ended early: %s", exc or type(exc).__name__)
        except Exception:
            log.exception("HTTP connection failed unexpectedly; closed it")
        finally:
            self.cap.leave(exchange)

    async def _exchange(self, stream: trio.SocketStream, exchange: _Exchange) -> None:
        head = self.limits.http_request_head
        connection = h11.Connection(h11.SERVER, max_incomplete_event_size=head)
        received = 0
        while True:
            try:
                event = connection.next_event()
            except h11.RemoteProtocolError as exc:
                if connection.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    status = exc.error_status_hint
                    await self._send(stream, connection, status, _TEXT, f"{exc}\n".encode())
                return
            if isinstance(event, h11.ConnectionClosed):
                return
            exchange.sent_request |= isinstance(event, h11.Request)
            if received > head:
                body = f"request head over {head} bytes\n".encode()
                await self._send(stream, connection, 431, _TEXT, body)
                return
            if isinstance(event, h11.Request):
                break
            data = await stream.receive_some(head)
            received += len(data)
            connection.receive_data(data)
        method = event.method.decode("ascii", "replace")
        path = event.target.decode("ascii", "replace").split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            await self._send(stream, connection, 405, _TEXT, b"only GET and HEAD\n")
            return
        status, content_type, body = answer(path, self._daemon)
        await self._send(stream, connection, status, content_type, body, head_only=method == "HEAD")

    @staticmethod
    async def _send(
        stream: trio.SocketStream,
        connection: h11.Connection,
        status: int,
        content_type: str,
        body: bytes,
        *,
        head_only: bool = False,
    ) -> None:
        headers = [
            ("Content-Type", content_type),
            ("Content-Length", str(len(body))),
            ("Connection", "close"),
        ]
        data = connection.send(h11.Response(status_code=status, headers=headers)) or b""
        if not head_only:
            data += connection.send(h11.Data(data=body)) or b""
        data += connection.send(h11.EndOfMessage()) or b""
        await stream.send_all(data)


async def serve_http(
    bind_address: str,
    daemon: DaemonState,
    limits: Limits = DEFAULT,
    *,
    task_status: trio.TaskStatus[list[tuple[str, int]]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled; hands back the bound (address, port) pairs once listening.

    An address it cannot listen on is a FatalError: kubelet's probes, and whoever reads
    /readyz, would otherwise reach whatever else holds it, or nothing.
    """
    text, _, port = bind_address.rpartition(":")
    text = text.strip("[]")
    # As bytes: given a str, the socket module loads the IDNA codec and its Unicode
    # tables (1 MiB) to encode even "127.0.0.1".
    host = (text.encode() if text.isascii() else text) or None
    try:
        listeners = await trio.open_tcp_listeners(int(port), host=host)
    except OSError as exc:
        raise FatalError(
            f"cannot listen on {bind_address} for /metrics, /livez and /readyz: {exc.strerror}; "
            "free it, or give --metrics-bind-address another address (127.0.0.1:0 takes a free "
            "port, which the log names; on a node, the DaemonSet's probes' port too) or an empty "
            "one (no metrics or probes)"
        ) from None
    bound = [listener.socket.getsockname()[:2] for listener in listeners]
    server = HttpServer(daemon, limits)
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, server.handle, listeners)
        task_status.started(bound)
