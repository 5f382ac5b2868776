"""/metrics, /livez and /readyz over plain HTTP, served by trio in the daemon's process.

Imported only when `--metrics-bind-address` is set: prometheus_client and
the collectors cost memory that a plugin run without metrics should not pay.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

import trio
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from pcc_plugin import __version__
from pcc_plugin.plugin import DevicePlugin

log = logging.getLogger(__name__)

MAX_REQUEST_HEAD = 8192
REQUEST_TIMEOUT = 5.0


class PluginCollector(Collector):
    """Reads the daemon's plain counters at scrape time."""

    def __init__(self, plugins: Sequence[DevicePlugin]) -> None:
        self._plugins = plugins
        self._version = __version__

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | InfoMetricFamily]:
        info = InfoMetricFamily("pcc_device_plugin_build", "Build information.")
        info.add_metric([], {"version": self._version})
        yield info
        registrations = CounterMetricFamily(
            "pcc_device_plugin_registrations",
            "Successful registrations with kubelet, by what caused them.",
            labels=["resource", "cause"],
        )
        restarts = CounterMetricFamily(
            "pcc_device_plugin_kubelet_restarts", "Kubelet restarts seen.", labels=["resource"]
        )
        allocations = CounterMetricFamily(
            "pcc_device_plugin_allocations", "Allocate calls, by result.",
            labels=["resource", "result"],
        )  # fmt: skip
        devices = GaugeMetricFamily(
            "pcc_device_plugin_devices", "Advertised devices, by health.",
            labels=["resource", "health"],
        )  # fmt: skip
        streams = GaugeMetricFamily(
            "pcc_device_plugin_list_and_watch_streams", "Open ListAndWatch streams.",
            labels=["resource"],
        )  # fmt: skip
        ready = GaugeMetricFamily(
            "pcc_device_plugin_ready",
            "1 when registered with the current kubelet and its ListAndWatch stream is open.",
            labels=["resource"],
        )
        for plugin in self._plugins:
            name, stats = plugin.spec.name, plugin.stats
            for cause, count in sorted(stats.registrations.items()):
                registrations.add_metric([name, cause], count)
            restarts.add_metric([name], stats.kubelet_restarts)
            for result in ("ok", "invalid", "unavailable"):
                allocations.add_metric([name, result], stats.allocations[result])
            devices.add_metric([name, "Healthy"], stats.healthy_devices)
            devices.add_metric([name, "Unhealthy"], stats.unhealthy_devices)
            streams.add_metric([name], stats.streams_open)
            ready.add_metric([name], 0 if stats.not_ready_reason() else 1)
        yield from (registrations, restarts, allocations, devices, streams, ready)


def _response(status: str, body: bytes, content_type: str = "text/plain; charset=utf-8") -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def answer(path: str, plugins: Sequence[DevicePlugin], registry: CollectorRegistry) -> bytes:
    if path == "/metrics":
        return _response("200 OK", generate_latest(registry), "text/plain; version=0.0.4")
    if path == "/livez":
        # Answering at all shows the event loop runs; restarting the plugin
        # cannot fix a slow kubelet, so nothing else belongs here.
        return _response("200 OK", b"ok\n")
    if path == "/readyz":
        reasons = [
            f"{plugin.spec.name}: {reason}"
            for plugin in plugins
            if (reason := plugin.stats.not_ready_reason())
        ]
        if reasons:
            return _response("503 Service Unavailable", ("\n".join(reasons) + "\n").encode())
        return _response("200 OK", b"ok\n")
    return _response("404 Not Found", b"not found: try /metrics, /livez or /readyz\n")


async def _handle(
    stream: trio.SocketStream, plugins: Sequence[DevicePlugin], registry: CollectorRegistry
) -> None:
    async with stream:
        head = b""
        with trio.move_on_after(REQUEST_TIMEOUT):
            while b"\r\n\r\n" not in head and len(head) < MAX_REQUEST_HEAD:
                chunk = await stream.receive_some(MAX_REQUEST_HEAD)
                if not chunk:
                    break
                head += chunk
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or parts[0] not in (b"GET", b"HEAD"):
            response = _response("400 Bad Request", b"expected GET <path> HTTP/1.x\n")
        else:
            path = parts[1].decode("latin-1").split("?", 1)[0]
            response = answer(path, plugins, registry)
            if parts[0] == b"HEAD":
                response = response.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n"
        with contextlib.suppress(trio.BrokenResourceError):
            await stream.send_all(response)


async def serve(
    bind_address: str,
    plugins: Sequence[DevicePlugin],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until cancelled; a bind failure is one warning and the plugin goes on without."""
    host, _, port = bind_address.rpartition(":")
    registry = CollectorRegistry(auto_describe=True)
    registry.register(ProcessCollector(registry=None))
    registry.register(PluginCollector(plugins))
    try:
        listeners = await trio.open_tcp_listeners(int(port), host=host or None)
    except OSError as exc:
        log.warning(
            "Metrics and probes are off: cannot listen on %s: %s", bind_address, exc.strerror
        )
        task_status.started()
        return
    for listener in listeners:
        address = listener.socket.getsockname()
        log.info("Serving /metrics, /livez and /readyz on %s port %d", address[0], address[1])

    async def handle(stream: trio.SocketStream) -> None:
        await _handle(stream, plugins, registry)

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started()
