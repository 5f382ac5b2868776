"""A rolling update with two instances on one node, under both kinds of kubelet."""

from __future__ import annotations

import itertools
import signal
from pathlib import Path

import pytest
import trio
import trio.testing
from daemon_support import (
    HEALTHY_16,
    RESOURCE,
    WAIT,
    dropped_by_kubelet,
    instance,
    log_line,
    serving,
    settled,
)

from pcc_plugin import grpc_clients, rollout
from pcc_plugin.sim import FakeNode, SimKubelet, StartDaemon, run_blocking


async def served_by(kubelet: SimKubelet, endpoint: str) -> None:
    """Until kubelet uses the instance that served `endpoint`: its stream, all Healthy."""

    def serves() -> bool:
        active = kubelet.active_endpoint(RESOURCE)
        return (
            active is not None
            and instance(active) == instance(endpoint)
            and kubelet.stream_open(RESOURCE)
            and kubelet.devices(RESOURCE) == HEALTHY_16
        )

    await run_blocking(kubelet.wait_for, serves, WAIT)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
@pytest.mark.parametrize("kubelet", ["current", "resource-keyed"], indirect=True)
async def test_the_older_instance_serves_again_when_the_newest_goes(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon, how: str
) -> None:
    """Older kubelets mark the resource unhealthy when the newest instance's stream ends and
    tell the older one nothing: it must notice by itself, without polling, and register."""
    with trio.fail_after(40):
        older = start_daemon(*fake_node.daemon_args(verbosity=1))
        first = await serving(kubelet)
        newest = start_daemon(*fake_node.daemon_args(verbosity=1))
        await serving(kubelet, registrations=2)
        await log_line(older, "Following ")
        if how == "SIGKILL":
            newest.proc.kill()
            newest.proc.wait()
        else:
            assert await run_blocking(newest.terminate, signal.SIGTERM, WAIT) == 0
        await log_line(older, "the instance that registered after this one is gone")
        # Kubelet sees the newest instance's stream end in its own time. One that keys its
        # client by resource (before 1.37) and sees it after the older instance registered
        # again disconnects that registration too; the older one then registers once more.
        # (It may also disconnect the gone instance that way, when the older instance's
        # stream of its first registration ends first: that asks for nothing.)
        await settled(kubelet)  # which waits for the newest instance's stream end too
        await served_by(kubelet, first)
        response = await run_blocking(kubelet.allocate, RESOURCE, [["pcc-4"]], WAIT)
        assert len(response.container_responses) == 1
    # Once, and once more for each registration kubelet dropped as above: no storm.
    assert kubelet.register_calls == 3 + dropped_by_kubelet(kubelet, first)
    assert "Traceback" not in older.log_text()


@pytest.mark.parametrize("kubelet", ["current", "resource-keyed"], indirect=True)
async def test_a_rolling_update_hands_over_with_one_registration_each(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    """The usual order: the new instance is ready, then the old one stops."""
    with trio.fail_after(40):
        old = start_daemon(*fake_node.daemon_args(verbosity=1))
        await serving(kubelet)
        new = start_daemon(*fake_node.daemon_args(verbosity=1))
        second = await serving(kubelet, registrations=2)
        await log_line(old, "Following ")
        assert await run_blocking(old.terminate, signal.SIGTERM, WAIT) == 0
        # Older kubelets drop the new instance when the old one's stream ends (and may drop
        # its next registration too, if they see the stream of the one before end late): it
        # registers once more for each, at once. Newer kubelets need nothing more.
        await settled(kubelet)
        await served_by(kubelet, second)
        response = await run_blocking(kubelet.allocate, RESOURCE, [["pcc-5"]], WAIT)
        assert len(response.container_responses) == 1
    dropped = dropped_by_kubelet(kubelet, second)
    assert dropped == 0 if kubelet.key_by == "endpoint" else dropped >= 1
    assert kubelet.register_calls == 2 + dropped
    # The new instance never took the old one for a newer one.
    assert "Following" not in new.log_text()


async def test_a_followed_instance_that_does_not_answer_is_followed_again_soon_then_less_often(
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Refused four times, served once, refused once, then gone: retried after 20 ms doubling
    (with jitter), at once after it served, and registered again as soon as it is gone."""
    outcomes = [False, False, False, False, True, False, False]
    calls: list[float] = []

    async def follow_list_and_watch(path: Path) -> tuple[bool, str]:
        calls.append(trio.current_time())
        return outcomes[len(calls) - 1], "refused"

    monkeypatch.setattr(grpc_clients, "follow_list_and_watch", follow_list_and_watch)
    # Its socket stays in place until the instance is gone.
    monkeypatch.setattr(rollout, "instance_serves", lambda path: (len(calls) < len(outcomes), True))
    restarted: list[str] = []
    await rollout.follow(tmp_path / "pcc-1-abcdef-0.sock", restarted.append)
    gaps = [later - earlier for earlier, later in itertools.pairwise(calls)]
    assert 0.01 <= gaps[0] <= 0.02
    assert 0.02 <= gaps[1] <= 0.04
    assert 0.04 <= gaps[2] <= 0.08
    assert 0.08 <= gaps[3] <= 0.16
    assert gaps[4] == 0  # it served: followed again at once
    assert 0.01 <= gaps[5] <= 0.02  # and the backoff starts over
    assert restarted == [rollout.SUPERSEDER_GONE]
