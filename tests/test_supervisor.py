"""The supervisor's decisions, on trio's MockClock: one resource failing leaves the others be."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio
import trio.testing

from pcc_plugin import supervisor
from pcc_plugin.errors import FatalError
from pcc_plugin.flags import Flags
from pcc_plugin.plugin import DevicePlugin
from pcc_plugin.registration import Backoff
from pcc_plugin.resource import ResourceSpec
from pcc_plugin.state import ResourceState

RESOURCE = "tke.cloud.tencent.com/pcc-device"


async def test_a_failing_resource_is_restarted_alone(
    host: Path,
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = Flags(host_root=str(host))
    broken = DevicePlugin(
        ResourceSpec(name="example.com/broken", count=1, socket_prefix="broken"),
        "",
        ResourceState("x"),
    )
    healthy = DevicePlugin(config.pcc_resource(), str(host), ResourceState("x"))
    attempts: dict[str, list[float]] = {"example.com/broken": [], RESOURCE: []}

    async def serve_resource(_: Flags, plugin: DevicePlugin, __: Backoff) -> None:
        attempts[plugin.spec.name].append(trio.current_time())
        if plugin is broken and len(attempts[plugin.spec.name]) < 3:
            raise RuntimeError("boom")
        await trio.sleep_forever()

    monkeypatch.setattr(supervisor, "serve_resource", serve_resource)
    with trio.move_on_after(600):
        async with trio.open_nursery() as nursery:
            for plugin in (broken, healthy):
                nursery.start_soon(
                    supervisor.supervise_resource, config, plugin, supervisor.serve_resource
                )
    assert len(attempts["example.com/broken"]) == 3
    first, second, third = attempts["example.com/broken"]
    assert 0.5 <= second - first <= 1.0  # backoff: 1 s with jitter
    assert 1.0 <= third - second <= 2.0
    assert len(attempts[RESOURCE]) == 1  # never disturbed
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 2
    assert errors[0].startswith("example.com/broken failed; restarting it in")


async def test_a_fatal_error_in_a_resource_stops_the_daemon(
    host: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def serve_resource(_: Flags, __: DevicePlugin, ___: Backoff) -> None:
        raise FatalError("cannot create the socket")

    monkeypatch.setattr(supervisor, "serve_resource", serve_resource)
    config = Flags(host_root=str(host))
    plugin = DevicePlugin(config.pcc_resource(), str(host), ResourceState("x"))
    with pytest.raises(FatalError):
        await supervisor.supervise_resource(config, plugin, supervisor.serve_resource)
