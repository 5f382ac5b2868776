"""A rolling update with two instances on one node, under both kinds of kubelet."""

from __future__ import annotations

import re
import signal

import pytest
import trio
from daemon_support import HEALTHY_16, RESOURCE, WAIT, log_line, serving

from pcc_plugin.sim import FakeNode, SimKubelet, StartDaemon, run_blocking

INSTANCE = re.compile(r"pcc-(\d+-[0-9a-f]{6})-\d+\.sock")


def instance(endpoint: str | None) -> str:
    match = INSTANCE.fullmatch(endpoint or "")
    assert match is not None, endpoint
    return match.group(1)


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

        def older_serves() -> bool:
            endpoint = kubelet.active_endpoint(RESOURCE)
            return (
                endpoint is not None
                and instance(endpoint) == instance(first)
                and kubelet.stream_open(RESOURCE)
                and kubelet.devices(RESOURCE) == HEALTHY_16
            )

        await run_blocking(kubelet.wait_for, older_serves, WAIT)
        await serving(kubelet, registrations=3)
        response = await run_blocking(kubelet.allocate, RESOURCE, [["pcc-4"]], WAIT)
        assert len(response.container_responses) == 1
    # Once: no storm of registrations.
    assert kubelet.register_calls == 3
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

        def new_serves() -> bool:
            endpoint = kubelet.active_endpoint(RESOURCE)
            return (
                endpoint is not None
                and instance(endpoint) == instance(second)
                and kubelet.stream_open(RESOURCE)
                and kubelet.devices(RESOURCE) == HEALTHY_16
            )

        await run_blocking(kubelet.wait_for, new_serves, WAIT)
        response = await run_blocking(kubelet.allocate, RESOURCE, [["pcc-5"]], WAIT)
        assert len(response.container_responses) == 1
    # Older kubelets drop the new instance when the old one's stream ends: it registers once
    # more, at once. Newer kubelets need nothing more.
    assert kubelet.register_calls == (2 if kubelet.key_by == "endpoint" else 3)
    # The new instance never took the old one for a newer one.
    assert "Following" not in new.log_text()
