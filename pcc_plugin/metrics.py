"""What /metrics says: the daemon's plain counters, read at scrape time, in Prometheus' format.

Imported only when `--metrics-bind-address` is set: prometheus_client and the
collectors cost memory that a plugin run without metrics should not pay.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from pcc_plugin import __version__
from pcc_plugin.configuration import Configuration
from pcc_plugin.plugin import DevicePlugin


class PluginCollector(Collector):
    """Reads the daemon's plain counters at scrape time."""

    def __init__(self, plugins: Sequence[DevicePlugin], configuration: Configuration) -> None:
        self._plugins = plugins
        self._configuration = configuration
        self._version = __version__

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | InfoMetricFamily]:
        info = InfoMetricFamily("pcc_device_plugin_build", "Build information.")
        info.add_metric([], {"version": self._version})
        yield info
        configuration = self._configuration
        config_info = InfoMetricFamily(
            "pcc_device_plugin_config",
            "The running configuration: its file (or 'flags') and the hash of its bytes.",
        )
        config_info.add_metric(
            [], {"source": str(configuration.path or "flags"), "hash": configuration.digest}
        )
        yield config_info
        yield GaugeMetricFamily(
            "pcc_device_plugin_config_generation",
            "Configurations applied: 1 at start, one more per successful reload.",
            value=configuration.generation,
        )
        yield GaugeMetricFamily(
            "pcc_device_plugin_config_last_reload_successful",
            "0 when the last reload was refused (the file was invalid), else 1.",
            value=0 if configuration.last_reload_failed else 1,
        )
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
        handler_errors = CounterMetricFamily(
            "pcc_device_plugin_handler_errors",
            "Unexpected errors in gRPC handlers and connections (bugs), by where.",
            labels=["resource", "where"],
        )
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
            for where, count in sorted(stats.handler_errors.items()):
                handler_errors.add_metric([name, where], count)
            ready.add_metric([name], 0 if stats.not_ready_reason() else 1)
        yield from (registrations, restarts, allocations, devices, streams, handler_errors, ready)


def registry(plugins: Sequence[DevicePlugin], configuration: Configuration) -> CollectorRegistry:
    collected = CollectorRegistry(auto_describe=True)
    collected.register(ProcessCollector(registry=None))
    collected.register(PluginCollector(plugins, configuration))
    return collected


def render(collected: CollectorRegistry) -> bytes:
    return generate_latest(collected)
