"""Reading the daemon's HTTP port, shared by the tests: its port from the log, /metrics parsed
by Prometheus' own parser."""

from __future__ import annotations

import urllib.error
import urllib.request

from daemon_support import RESOURCE, log_line
from prometheus_client.parser import text_string_to_metric_families

from pcc_plugin.sim import Daemon, run_blocking

# Plain urllib, ignoring any proxy settings of the environment: the daemon is on loopback.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _get(url: str) -> tuple[int, str, str]:
    try:
        with _OPENER.open(url, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as error:
        with error:
            return error.code, error.headers["Content-Type"], error.read().decode()


async def get(port: int, path: str) -> tuple[int, str, str]:
    """Status, content type and body of GET `path`, from an HTTP client independent of ours."""
    return await run_blocking(_get, f"http://127.0.0.1:{port}{path}")


async def scrape(port: int) -> Samples:
    status, content_type, body = await get(port, "/metrics")
    assert status == 200
    assert content_type.startswith("text/plain; version=0.0.4")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset({"resource": RESOURCE, **labels}.items()))]


async def metrics_port(daemon: Daemon) -> int:
    line = await log_line(daemon, "Serving /metrics, /livez and /readyz on 127.0.0.1 port ")
    return int(line.rsplit(" ", 1)[1])
