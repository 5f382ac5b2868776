"""Registering with kubelet, on trio's MockClock: retries, log levels, backoff, kubelet's stream."""

from __future__ import annotations

import itertools
import logging
import re
import socket
from pathlib import Path

import pytest
import trio
import trio.testing

from pcc_plugin import grpc_clients
from pcc_plugin._proto import v1beta1 as api
from pcc_plugin.fs import identity
from pcc_plugin.generations import RETRY_CAP, RETRY_FIRST
from pcc_plugin.plugin_dir import KUBELET_RESTARTED
from pcc_plugin.registration import (
    UNREACHABLE_GRACE,
    UNREACHABLE_REPEAT,
    Kubelet,
    KubeletLink,
    reregister_when_stream_ends,
)
from pcc_plugin.state import ResourceState

REQUEST = api.RegisterRequest(
    version="v1beta1", endpoint="pcc-1-abc-0.sock", resource_name="example.com/pcc"
)


def bind_socket(path: Path) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    return listener


def messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno == level]


async def test_register_retries_with_backoff_and_logs_each_refusal_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    answers = ["kubelet answered UNKNOWN: busy", "kubelet answered UNKNOWN: busy", "odd", None]
    calls: list[float] = []

    async def fake_register(path: Path, request: api.RegisterRequest, deadline: float) -> None:
        assert (path, request, deadline) == (tmp_path / "kubelet.sock", REQUEST, 15.0)
        calls.append(trio.current_time())
        answer = answers.pop(0)
        if answer:
            raise grpc_clients.RegisterFailed(answer)

    with bind_socket(tmp_path / "kubelet.sock"):
        state = ResourceState("x")
        link = KubeletLink(state)
        await Kubelet(state, fake_register).register(tmp_path, REQUEST, link, "start")
    assert state.registered
    assert link.register == "answered"
    assert state.registrations == {"start": 1}
    gaps = [later - earlier for earlier, later in itertools.pairwise(calls)]
    # Doubling from RETRY_FIRST, each wait between half and all of its ceiling.
    for retry, gap in enumerate(gaps):
        ceiling = min(RETRY_CAP, RETRY_FIRST * 2**retry)
        assert ceiling / 2 <= gap <= ceiling
    assert messages(caplog, logging.ERROR) == [
        "Registration with kubelet failed, retrying: kubelet answered UNKNOWN: busy",
        "Registration with kubelet failed, retrying: odd",
    ]


async def test_an_unreachable_kubelet_is_an_error_only_after_the_grace(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A restarting kubelet refuses for a moment: V1 lines; one that stays away: E lines."""
    caplog.set_level(logging.DEBUG)
    down_until = 200.0

    async def refuse_until(path: Path, request: api.RegisterRequest, deadline: float) -> None:
        if trio.current_time() < down_until:
            raise grpc_clients.Unreachable(f"cannot reach {path}: [Errno 111] Connection refused")

    with bind_socket(tmp_path / "kubelet.sock"):
        state = ResourceState("x")
        kubelet = Kubelet(state, refuse_until)
        # A normal restart: refused for a few seconds, then accepted.
        down_until = trio.current_time() + 3
        await kubelet.register(tmp_path, REQUEST, KubeletLink(state), "start")
        assert messages(caplog, logging.ERROR) == []
        assert any("Kubelet is not reachable yet" in m for m in messages(caplog, 15))
        assert not any("reachable again" in m for m in messages(caplog, logging.INFO))
        # Away for minutes: one E line after the grace, then one a minute.
        start = trio.current_time()
        down_until = start + UNREACHABLE_GRACE + 2.5 * UNREACHABLE_REPEAT
        await kubelet.register(tmp_path, REQUEST, KubeletLink(state), "start")
    errors = messages(caplog, logging.ERROR)
    # Retries come every few seconds (the backoff's cap), so the lines come a little later.
    reported = [int(re.fullmatch(r"Kubelet has been unreachable for (\d+) s, .*", m)[1])  # type: ignore[index]
                for m in errors]  # fmt: skip
    assert len(reported) == 3
    assert UNREACHABLE_GRACE <= reported[0] <= UNREACHABLE_GRACE + 6
    for earlier, later in itertools.pairwise(reported):
        assert UNREACHABLE_REPEAT <= later - earlier <= UNREACHABLE_REPEAT + 6
    assert "Connection refused" in errors[0]
    (back,) = [m for m in messages(caplog, logging.INFO) if "reachable again" in m]
    away = int(re.fullmatch(r"Kubelet is reachable again after (\d+) s", back)[1])  # type: ignore[index]
    # The line gives whole seconds, rounded: 180.00000000000003 s away reads 180.
    assert round(down_until - start) <= away <= down_until - start + 6


@pytest.mark.asyncio_host
async def test_a_kubelet_that_closes_the_connection_at_once_is_unreachable(
    closing_socket: Path,
) -> None:
    """A kubelet going down accepts, then closes: grpclib's client then fails either with a
    connection error or, when the close comes before the call's stream, an AttributeError of
    its own, which ended a generation as a fault and backed off (seen in the e2e's race)."""
    request = api.RegisterRequest(version="v1beta1", endpoint="pcc.sock", resource_name="a/b")
    with trio.fail_after(60):
        for _ in range(50):
            with pytest.raises(grpc_clients.Unreachable):
                await grpc_clients.register(closing_socket, request, 5.0)


async def test_register_waits_without_polling_while_kubelet_sock_is_missing(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async def must_not_be_called(*_: object) -> None:
        raise AssertionError("registered without kubelet.sock")

    state = ResourceState("x")
    with trio.move_on_after(3600) as waited:
        kubelet = Kubelet(state, must_not_be_called)
        await kubelet.register(tmp_path, REQUEST, KubeletLink(state), "start")
    assert waited.cancelled_caught
    assert (
        state.not_ready_reason() == f"waiting for kubelet: {tmp_path}/kubelet.sock does not exist"
    )


async def test_a_registration_with_a_new_kubelet_sock_counts_as_a_kubelet_restart(
    tmp_path: Path,
) -> None:
    async def accept(*_: object) -> None:
        pass

    state = ResourceState("x")
    kubelet = Kubelet(state, accept)
    for cause in ("start", "own socket was removed", "own socket was removed"):
        with bind_socket(tmp_path / "kubelet.sock"):
            await kubelet.register(tmp_path, REQUEST, KubeletLink(state), cause)
            if cause == "start":
                # Registering again with the same kubelet is no restart.
                link = KubeletLink(state)
                await kubelet.register(tmp_path, REQUEST, link, "ListAndWatch ended")
        (tmp_path / "kubelet.sock").unlink()
    assert state.registrations == {"start": 1, "ListAndWatch ended": 1, "kubelet restarted": 2}
    assert state.kubelet_restarts == 2


async def test_a_new_kubelet_sock_counts_as_a_restart_even_with_the_old_ones_identity(
    tmp_path: Path,
) -> None:
    """Inode numbers are reused and change times count in clock ticks: a kubelet that restarts
    quickly can leave a kubelet.sock that looks like the old one. The watcher saw it created."""

    async def accept(*_: object) -> None:
        pass

    state = ResourceState("x")
    kubelet = Kubelet(state, accept)
    with bind_socket(tmp_path / "kubelet.sock"):
        for cause in ("start", KUBELET_RESTARTED, KUBELET_RESTARTED):
            await kubelet.register(tmp_path, REQUEST, KubeletLink(state), cause)
    assert state.registrations == {"start": 1, KUBELET_RESTARTED: 2}
    assert state.kubelet_restarts == 2


@pytest.mark.parametrize("same_kubelet", [True, False], ids=["dropped", "restarted"])
async def test_stream_end_restarts_at_once_while_kubelet_listens(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, same_kubelet: bool
) -> None:
    """The kubelet registered with dropped the stream: a fault (the next one back to back
    waits). A new kubelet.sock listens already: a kubelet restart, never a fault."""
    link = KubeletLink(ResourceState("x"))
    reasons: list[str] = []
    with bind_socket(tmp_path / "kubelet.sock") as kubelet:
        kubelet.listen()
        if same_kubelet:
            link.kubelet = identity(tmp_path / "kubelet.sock")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reregister_when_stream_ends, tmp_path, link, reasons.append)
            await trio.sleep(10)
            assert reasons == []
            ended_at = trio.current_time()
            link.ended.set()
    expected = "kubelet's ListAndWatch stream ended" if same_kubelet else "kubelet restarted"
    assert reasons == [expected]
    assert trio.current_time() == ended_at


async def test_stream_end_waits_for_kubelet_while_it_restarts(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    """A killed kubelet leaves kubelet.sock behind; the new one's arrival restarts us."""
    stats = ResourceState("x", registered=True)
    link = KubeletLink(stats)
    reasons: list[str] = []
    with bind_socket(tmp_path / "kubelet.sock"):
        link.ended.set()
        with trio.move_on_after(3600):
            await reregister_when_stream_ends(tmp_path, link, reasons.append)
    assert reasons == []
    assert stats.not_ready_reason() == (
        f"waiting for kubelet: {tmp_path}/kubelet.sock takes no connections"
    )


def test_kubelets_stream_is_the_one_on_the_connection_that_read_options_during_register() -> None:
    stats = ResourceState("x")
    link = KubeletLink(stats)
    tool, kubelet, late_tool = object(), object(), object()
    # A tool that found the socket before Register: its options and stream are its own.
    link.options_called(tool)
    assert not link.stream_opened(tool)
    link.register = "in flight"
    # A tool's stream opened during Register, on a connection that read no options.
    assert not link.stream_opened(late_tool)
    link.options_called(kubelet)
    link.register = "answered"
    link.options_called(late_tool)
    assert link.stream_opened(kubelet)
    assert not link.stream_opened(kubelet)  # only the first stream on it
    assert stats.kubelet_stream_open
    assert stats.streams_open == 4
    link.stream_closed(False)
    link.connection_closed(late_tool)
    assert not link.ended.is_set()
    link.stream_closed(True)
    assert link.ended.is_set()
    assert not stats.kubelet_stream_open


def test_older_kubelets_read_options_after_register_answered() -> None:
    link = KubeletLink(ResourceState("x"))
    kubelet, tool = object(), object()
    link.register = "answered"
    link.options_called(kubelet)
    link.options_called(tool)
    assert not link.stream_opened(tool)
    assert link.stream_opened(kubelet)
    # And a current kubelet's call during a retried Register wins over an earlier one.
    link = KubeletLink(ResourceState("x"))
    link.register = "answered"
    link.options_called(tool)
    link.register = "in flight"
    link.options_called(kubelet)
    assert link.stream_opened(kubelet)


def test_kubelet_closing_its_connection_before_a_stream_counts_as_the_end() -> None:
    link = KubeletLink(ResourceState("x"))
    kubelet = object()
    link.register = "in flight"
    link.options_called(kubelet)
    link.connection_closed(kubelet)
    assert link.ended.is_set()
