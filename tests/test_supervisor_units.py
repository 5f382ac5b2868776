"""Timing and decisions of the supervisor, on trio's MockClock and fake files."""

from __future__ import annotations

import itertools
import logging
import random
import socket
from pathlib import Path

import pytest
import trio
import trio.testing
from asyncinotify import Event, Mask

from pcc_plugin import grpc_clients, supervisor
from pcc_plugin._proto import v1beta1 as api
from pcc_plugin.errors import FatalError
from pcc_plugin.flags import Flags
from pcc_plugin.plugin import DeviceFeed, DevicePlugin
from pcc_plugin.plugin_dir import SocketNames, is_own_socket, remove_stale_sockets, restart_reason
from pcc_plugin.registration import (
    Backoff,
    KubeletStream,
    register_with_kubelet,
    reregister_when_stream_ends,
)
from pcc_plugin.resource import ResourceSpec
from pcc_plugin.stats import ResourceStats
from pcc_plugin.supervisor import Restart

RESOURCE = "tke.cloud.tencent.com/pcc-device"
REQUEST = api.RegisterRequest(
    version="v1beta1", endpoint="pcc-1-abc-0.sock", resource_name="example.com/pcc"
)


def test_backoff_doubles_with_jitter_up_to_the_cap() -> None:
    backoff = Backoff(first=0.1, cap=2.0, rng=random.Random(7))
    delays = [backoff.next_delay() for _ in range(10)]
    ceilings = [min(2.0, 0.1 * 2**n) for n in range(10)]
    for delay, ceiling in zip(delays, ceilings, strict=True):
        assert ceiling / 2 <= delay <= ceiling
    assert len(set(delays)) == len(delays)


def bind_socket(path: Path) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    return listener


async def test_register_retries_with_backoff_and_logs_each_reason_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    answers = ["kubelet answered UNKNOWN: busy", "kubelet answered UNKNOWN: busy", "timeout", None]
    calls: list[float] = []

    async def fake_register(path: Path, request: api.RegisterRequest, deadline: float) -> None:
        assert (path, request, deadline) == (tmp_path / "kubelet.sock", REQUEST, 15.0)
        calls.append(trio.current_time())
        answer = answers.pop(0)
        if answer:
            raise grpc_clients.RegisterFailed(answer)

    with bind_socket(tmp_path / "kubelet.sock"):
        backoff = Backoff(first=1.0, cap=2.0, rng=random.Random(1))
        expected = Backoff(first=1.0, cap=2.0, rng=random.Random(1))
        stats = ResourceStats()
        stream = KubeletStream(stats)
        await register_with_kubelet(
            tmp_path, REQUEST, stats, "start", stream, fake_register, backoff
        )
    assert stats.registered
    assert stream.register_sent
    assert stats.registrations == {"start": 1}

    gaps = [later - earlier for earlier, later in itertools.pairwise(calls)]
    assert gaps == pytest.approx([expected.next_delay() for _ in range(3)])
    failures = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert failures == [
        "Registration with kubelet failed, retrying: kubelet answered UNKNOWN: busy",
        "Registration with kubelet failed, retrying: timeout",
    ]
    assert any("Registered device plugin with Kubelet" in r.getMessage() for r in caplog.records)


async def test_register_waits_without_polling_while_kubelet_sock_is_missing(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async def must_not_be_called(*_: object) -> None:
        raise AssertionError("registered without kubelet.sock")

    with trio.move_on_after(3600) as waited:
        stats = ResourceStats()
        await register_with_kubelet(
            tmp_path, REQUEST, stats, "start", KubeletStream(stats), must_not_be_called
        )
    assert waited.cancelled_caught
    assert (
        stats.not_ready_reason() == f"waiting for kubelet: {tmp_path}/kubelet.sock does not exist"
    )


async def test_a_registration_with_a_new_kubelet_sock_counts_as_a_kubelet_restart(
    tmp_path: Path,
) -> None:
    async def accept(*_: object) -> None:
        pass

    stats = ResourceStats()
    for cause in ("start", "own socket removed", "own socket removed"):
        with bind_socket(tmp_path / "kubelet.sock"):
            await register_with_kubelet(
                tmp_path, REQUEST, stats, cause, KubeletStream(stats), accept
            )
            if cause == "start":
                # Registering again with the same kubelet is no restart.
                await register_with_kubelet(
                    tmp_path, REQUEST, stats, "ListAndWatch ended", KubeletStream(stats), accept
                )
        (tmp_path / "kubelet.sock").unlink()
    assert stats.registrations == {"start": 1, "ListAndWatch ended": 1, "kubelet restarted": 2}
    assert stats.kubelet_restarts == 2


async def test_stream_end_restarts_after_a_short_jitter(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stream = KubeletStream(ResourceStats())
    with trio.CancelScope() as scope:
        restart = Restart(scope)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reregister_when_stream_ends, stream, restart)
            await trio.sleep(10)
            assert restart.reason is None
            ended_at = trio.current_time()
            stream.ended.set()
            await trio.sleep_forever()
    assert restart.reason == "kubelet's ListAndWatch stream ended"
    assert 0.05 <= trio.current_time() - ended_at <= 0.25


async def test_only_the_first_stream_after_register_is_kubelets() -> None:
    stream = KubeletStream(ResourceStats())
    feed = DeviceFeed(b"devices")
    sent: list[bytes] = []

    async def send(payload: bytes) -> None:
        sent.append(payload)

    with trio.move_on_after(0):
        await stream.serve(feed, send)  # a tool's stream, before Register
    assert not stream.ended.is_set()
    sent.clear()
    stream.register_sent = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stream.serve, feed, send)
        nursery.start_soon(stream.serve, feed, send)
        await trio.testing.wait_all_tasks_blocked()
        assert sent == [b"devices", b"devices"]
        feed.publish(b"changed")
        await trio.testing.wait_all_tasks_blocked()
        assert sent[2:] == [b"changed", b"changed"]
        assert not stream.ended.is_set()
        nursery.cancel_scope.cancel()
    assert stream.ended.is_set()

    later = KubeletStream(ResourceStats(), register_sent=True, claimed=True)
    with trio.move_on_after(0):
        await later.serve(feed, send)
    assert not later.ended.is_set()


def test_socket_names_are_fresh_and_recognised() -> None:
    names = SocketNames("pcc")
    first, second = next(names), next(names)
    assert first != second
    assert is_own_socket("pcc", first)
    assert is_own_socket("pcc", second)
    assert not is_own_socket("pcc", "kubelet.sock")
    assert not is_own_socket("pcc", "pcc-other.sock")
    assert not is_own_socket("pcc", next(SocketNames("disk")))


def test_stale_sockets_are_removed_and_live_ones_kept(tmp_path: Path) -> None:
    with bind_socket(tmp_path / "pcc-1-aa-0.sock"):
        pass  # closed without unlinking: nothing serves it
    live = bind_socket(tmp_path / "pcc-2-bb-0.sock")
    live.listen()
    with bind_socket(tmp_path / "nvidia.sock"), live:
        (tmp_path / "pcc-3-cc-0.sock").write_text("not a socket")
        remove_stale_sockets(tmp_path, "pcc", keep="pcc-9-ff-0.sock")
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "nvidia.sock",
            "pcc-2-bb-0.sock",
            "pcc-3-cc-0.sock",
        ]


def event(name: str | None, mask: Mask) -> Event:
    return Event(watch=None, mask=mask, cookie=0, name=Path(name) if name else None)


def test_restart_reasons(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    own = "pcc-1-aa-0.sock"
    assert (
        restart_reason([event("kubelet_internal_checkpoint", Mask.CREATE)], tmp_path, own) is None
    )
    # kubelet.sock created and gone again in one batch: nothing to register with yet.
    created = [event("kubelet.sock", Mask.DELETE), event("kubelet.sock", Mask.CREATE)]
    assert restart_reason(created, tmp_path, own) is None
    with bind_socket(tmp_path / "kubelet.sock"):
        assert restart_reason(created, tmp_path, own) == "kubelet restarted"
        assert f"inotify: {tmp_path}/kubelet.sock created, restarting." in caplog.messages
        assert restart_reason([event("kubelet.sock", Mask.MOVED_TO)], tmp_path, own) == (
            "kubelet restarted"
        )
    assert restart_reason([event(own, Mask.DELETE)], tmp_path, own) == "own socket removed"
    assert restart_reason([event(None, Mask.Q_OVERFLOW)], tmp_path, own) == (
        "inotify queue overflow"
    )
    assert restart_reason([event(None, Mask.DELETE_SELF)], tmp_path, own) == (
        "device-plugin directory removed"
    )
    assert restart_reason([], tmp_path / "gone", own) == "device-plugin directory removed"


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
        ResourceStats(),
    )
    healthy = DevicePlugin(config.pcc_resource(), str(host), ResourceStats())
    attempts: dict[str, list[float]] = {"example.com/broken": [], RESOURCE: []}

    async def serve_resource(_: Flags, plugin: DevicePlugin) -> None:
        attempts[plugin.spec.name].append(trio.current_time())
        if plugin is broken and len(attempts[plugin.spec.name]) < 3:
            raise RuntimeError("boom")
        await trio.sleep_forever()

    monkeypatch.setattr(supervisor, "serve_resource", serve_resource)
    with trio.move_on_after(600):
        async with trio.open_nursery() as nursery:
            for plugin in (broken, healthy):
                nursery.start_soon(supervisor.supervise_resource, config, plugin)
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
    async def serve_resource(_: Flags, __: DevicePlugin) -> None:
        raise FatalError("cannot create the socket")

    monkeypatch.setattr(supervisor, "serve_resource", serve_resource)
    config = Flags(host_root=str(host))
    plugin = DevicePlugin(config.pcc_resource(), str(host), ResourceStats())
    with pytest.raises(FatalError):
        await supervisor.supervise_resource(config, plugin)
