"""The DRA mode's side of the API server, as a pool of thousands of nodes needs it: what an idle
node costs (watches resumed where they were, renewed at random, one connection), a dead
connection found, and every failure of the API client (a credential plugin failing, hanging,
answering with what the driver cannot use) an outage of the API side only: kubelet's calls
that need no API server, and its health streams, go on.

The real daemon against the fake API server (which behaves as kube-apiserver 1.37 does where
these tests rely on it: pcc_plugin/sim/apiserver.py) and the simulated kubelet; the publishing
loop and the client also on trio's mock clock, for what only minutes show.
"""

from __future__ import annotations

import json
import os
import random
import socket
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dra_support
import httpx
import pytest
import trio
import trio.testing
from daemon_support import log_line
from dra_support import DRIVER, NODE, SHARES, WAIT, DraNode, published, registered
from metrics_support import get, metrics_port

from pcc_plugin.dra import kube, slices, taints
from pcc_plugin.resource import Device, pcc_resource
from pcc_plugin.sim import Daemon, StartDaemon, run_blocking
from pcc_plugin.sim.apiserver import FakeApiServer
from pcc_plugin.state import ResourceState

SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def with_plugin(dra: DraNode, mode: dict[str, Any] | None = None) -> tuple[list[str], Path]:
    """The daemon's arguments with a kubeconfig whose user runs an exec credential plugin, and
    the plugin's script (its `.mode` file beside it says how it behaves)."""
    kubeconfig = dra.api.write_kubeconfig(dra.node.root / "exec.json", kube.EXEC_V1)
    plugin = dra.node.root / "exec-credential-plugin.py"
    set_mode(plugin, mode or {})
    args = [arg for arg in dra.daemon_args() if not arg.startswith("--kubeconfig=")]
    return [*args, f"--kubeconfig={kubeconfig}"], plugin


def set_mode(plugin: Path, mode: dict[str, Any]) -> None:
    plugin.with_name(plugin.name + ".mode").write_text(json.dumps(mode))


def plugin_runs(plugin: Path) -> list[int]:
    runs = plugin.with_name(plugin.name + ".runs")
    return [int(line) for line in runs.read_text().split()] if runs.exists() else []


async def readyz(daemon: Daemon) -> tuple[int, str]:
    status, _, body = await get(await metrics_port(daemon), "/readyz")
    return status, body


# An idle node


async def test_an_idle_node_renews_its_watch_where_it_was_and_asks_nothing_else(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """One list at start; then only watches, each resumed from the resource version the last
    one got to (bookmarks move it on), over the connections already open: no list, no read of
    the Node, no new connection while the watch is healthy. (The API server ends each watch
    after 2.1 s here, and sends its bookmark after 0.1 s, where kube-apiserver ends it after
    the 5 to 10 minutes the driver asks and sends one each minute.)"""
    dra = dra_node
    dra.api.max_watch_seconds = 2.1
    dra.api.bookmark_every = 0.1
    with trio.fail_after(40):
        daemon = start_daemon(*dra.daemon_args())
        await published(dra, SHARES, generation=1)
        await run_blocking(dra.api.wait_for, lambda: len(dra.api.watches) >= 1, WAIT)
        connections, first = dra.api.connections, len(dra.api.requests)
        # Some unrelated write moves the resource version on, as the cluster's do.
        dra.api.put_claim("default", "unrelated", None)
        await run_blocking(dra.api.wait_for, lambda: len(dra.api.watches) >= 3, 2 * WAIT)
        assert set(dra.api.requests[first:]) == {"WATCH resourceslices"}
        assert dra.api.connections == connections
        versions = [int(watch["resourceVersion"]) for watch in dra.api.watches]
        assert versions == sorted(versions)
        assert versions[-1] > versions[0]
        assert all(watch["allowWatchBookmarks"] == "true" for watch in dra.api.watches)
        assert [request.split()[0] for request in dra.api.requests].count("GET") == 1 + 1
        assert "Traceback" not in daemon.log_text()


class RenewalApi(dra_support.SliceWatcher):
    """kube.Api's slice calls in memory, each watch lasting the seconds it asks for."""

    def __init__(self) -> None:
        self.lists = 0
        self.watches: list[tuple[float, int]] = []

    async def list_slices(self, fields: dict[str, str]) -> tuple[list[dict[str, Any]], str]:
        self.lists += 1
        return [], "1"

    async def node_uid(self, name: str) -> str:
        return "node-uid"

    async def create_slice(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj["metadata"]["resourceVersion"] = "2"
        return obj

    async def watch(
        self, version: str, seconds: int, event: dra_support.Event, opened: Callable[[], None]
    ) -> None:
        self.watches.append((trio.current_time(), seconds))
        opened()
        await trio.sleep(seconds)


SPEC = pcc_resource("tke.cloud.tencent.com/pcc-device", 2, "/dev/sev-guest", "/var/run/pcc")
DEVICES = tuple(Device(f"pcc-{i}", "pcc", SPEC.device_nodes, None) for i in range(2))


def publishing(nursery: trio.Nursery, api: Any, rng: random.Random) -> None:
    state = ResourceState("x", needs_stream=False, registered=True)
    me = slices.Instance("2026-01-01T00:00:00.000000Z", "me")
    nursery.start_soon(
        slices.publish, api, slices.Pool(DRIVER, NODE, ""), me, lambda other: False,
        lambda pool: slices.desired(pool, SPEC, DEVICES), trio.Event, state,
        taints.Unhealthy(DRIVER), rng,
    )  # fmt: skip


async def test_watches_are_renewed_at_random_so_that_nodes_never_go_in_step(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Each watch asks to end after a random 5 to 10 minutes, as client-go's reflector does:
    two nodes that started (or came back from an outage) together drift apart at once, and
    none lists again."""
    nodes = [RenewalApi(), RenewalApi()]
    async with trio.open_nursery() as nursery:
        # Seeded: how far apart draws of 5 to 10 minutes spread is chance's.
        for seed, api in enumerate(nodes):
            publishing(nursery, api, random.Random(seed))
        await trio.sleep(3 * 3600)
        nursery.cancel_scope.cancel()
    for api in nodes:
        asked = [seconds for _, seconds in api.watches]
        assert api.lists == 1
        assert 18 <= len(asked) <= 36
        assert all(
            slices.WATCH_SECONDS[0] <= seconds <= slices.WATCH_SECONDS[1] for seconds in asked
        )
        assert statistics.stdev(asked) > 50
    # Renewed at moments of their own.
    first, second = ([at for at, _ in api.watches[1:]] for api in nodes)
    assert first[:5] != second[:5]


# A dead connection


async def test_a_watch_the_api_server_does_not_end_is_taken_for_dead(
    mock_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    """An API server that hangs with its connection up sends nothing and never ends the watch
    it was asked to end: WATCH_GRACE after that, the watch has failed. (Silence alone says
    nothing: kube-apiserver sends no bookmark while its cache has not moved past the watch's
    resource version.) On trio's clock, against the fake API server."""
    # Real time until the watch is open (the fake server answers from a thread: a clock
    # that jumped while it did would time the request out), then only trio's.
    mock_clock.rate = 1.0
    opened: list[float] = []

    def watch_opened() -> None:
        mock_clock.rate = 0.0
        mock_clock.autojump_threshold = 0.0
        opened.append(trio.current_time())

    with FakeApiServer() as server:
        server.add_node(NODE)
        server.mute_watches = True
        api = kube.open_client(str(server.write_kubeconfig(tmp_path / "kubeconfig")))
        try:
            with trio.fail_after(2000), pytest.raises(kube.RequestFailed) as failed:
                await api.watch_slices(
                    {"spec.nodeName": NODE}, "1", 600, lambda kind, obj: None, watch_opened
                )
        finally:
            server.mute_watches = False
            await api.close()
    assert "did not end the watch of ResourceSlices 30 s after the 600 s" in str(failed.value)
    assert trio.current_time() - opened[0] == pytest.approx(600 + kube.WATCH_GRACE)


def keepalive_timers(pid: int, port: int) -> list[tuple[int, float]]:
    """For each TCP connection of process `pid` to 127.0.0.1:`port`: its timer (2 is
    keepalive, /proc/net/tcp's `tr`) and the seconds until it fires."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ticks = os.sysconf("SC_CLK_TCK")
    found = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote, state, timer, inode = fields[2], fields[3], fields[5], fields[9]
        if inode in inodes and state == "01" and int(remote.split(":")[1], 16) == port:
            kind, when = timer.split(":")
            found.append((int(kind, 16), int(when, 16) / ticks))
    return found


async def test_connections_to_the_api_server_probe_a_peer_that_went_away(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """A peer gone without a word (a node or a load balancer lost, a partition) never closes
    the connection, and the watch on it would wait for ever: TCP keepalive probes it after
    KEEPALIVE_IDLE seconds without a packet and closes it DEAD_PEER_WITHIN after (the kernel's
    own timer, seen here in /proc/net/tcp)."""
    dra = dra_node
    with trio.fail_after(30):
        daemon = start_daemon(*dra.daemon_args())
        await published(dra, SHARES, generation=1)
        await run_blocking(dra.api.wait_for, lambda: bool(dra.api.watches), WAIT)
        timers = keepalive_timers(daemon.pid, dra.api.port)
        assert timers
        assert all(kind == 2 and when <= kube.KEEPALIVE_IDLE for kind, when in timers), timers
    assert kube.DEAD_PEER_WITHIN < 60


# Credentials


async def test_a_failing_credential_plugin_is_an_outage_of_the_api_side_only(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """The exec credential plugin starts failing with claims prepared, as the API server's
    token changes (so the plugin is run again) and kubelet deletes the node's slices. Kubelet
    keeps the driver registered, its health stream open, and gets NodeUnprepareResources of a
    prepared claim done; a claim to prepare fails with why; the slices are published again
    once the plugin works again."""
    dra = dra_node
    args, plugin = with_plugin(dra)
    with trio.fail_after(60 + kube.API_RETRY_CAP):
        daemon = start_daemon(*args)
        await registered(dra)
        await published(dra, SHARES, generation=1)
        for name in ("one", "two"):
            dra.claim(name, f"uid-{name}")
            await run_blocking(dra.kubelet.prepare, DRIVER, [("default", name, f"uid-{name}")])
        set_mode(plugin, {"fail": True})
        dra.api.token = "rotated"
        dra.api.delete_slices(NODE)
        await log_line(daemon, "exited with 1: the identity provider is down")
        (instance,) = dra.kubelet.instances(DRIVER)
        gone = await run_blocking(dra.kubelet.unprepare, DRIVER, [("default", "one", "uid-one")])
        assert gone.claims["uid-one"].error == ""
        dra.claim("three", "uid-three", device="pcc-5")
        three = [("default", "three", "uid-three")]
        refused = await run_blocking(dra.kubelet.prepare, DRIVER, three)
        assert "the identity provider is down" in refused.claims["uid-three"].error
        status, body = await readyz(daemon)
        assert status == 503
        assert "the exec credential plugin" in body
        assert "exited with 1" in body
        # Registered once, never deregistered; the health stream still the first one.
        assert len(dra.kubelet.registrations) == 1
        assert dra.kubelet.instances(DRIVER) == [instance]
        assert dra.kubelet.health_streams[instance.endpoint] == ["open"]
        set_mode(plugin, {})
        dra.api.token = "sim-token"
        # The publisher may be in a retry's wait: as long as API_RETRY_CAP.
        await published(dra, SHARES, within=kube.API_RETRY_CAP + WAIT)
        answer = await run_blocking(dra.kubelet.prepare, DRIVER, three)
        assert answer.claims["uid-three"].error == ""
        assert "Traceback" not in daemon.log_text()


async def test_tokens_are_taken_again_before_they_expire(
    dra_node: DraNode, start_daemon: StartDaemon
) -> None:
    """The plugin's expirationTimestamp is honoured: a request after it carries a new token,
    not the old one to be refused (and counted against the node by the API server)."""
    dra = dra_node
    # 2 to 3 s (the timestamp has whole seconds): taken again a second or more before.
    args, plugin = with_plugin(dra, {"lifetime": 3})
    with trio.fail_after(30):
        daemon = start_daemon(*args)
        await published(dra, SHARES, generation=1)
        runs = len(plugin_runs(plugin))
        # The token's lifetime passes (the time itself, not a wait for the daemon).
        await trio.sleep(3.5)
        dra.node.pcc_dir.rmdir()
        await published(dra, SHARES, generation=2)
        assert len(plugin_runs(plugin)) > runs
        assert dra.api.unauthorized == 0
        assert "Traceback" not in daemon.log_text()


async def plugin_token(mode: dict[str, Any], tmp_path: Path) -> str:
    """What the ExecPlugin of the fake API server's script makes of `mode`."""
    server = FakeApiServer()
    kubeconfig = json.loads(
        server.write_kubeconfig(tmp_path / "exec.json", kube.EXEC_V1).read_text()
    )
    plugin = tmp_path / "exec-credential-plugin.py"
    set_mode(plugin, mode)
    source = kube.exec_plugin(kubeconfig["users"][0]["user"]["exec"], {})
    return await source.token()


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ({"fail": True}, "exited with 1: the identity provider is down"),
        ({"certificate": True}, "gave a client certificate; this driver needs a token"),
        ({"hang": True}, "did not answer within 1 s: killed"),
    ],
    ids=["fails", "a client certificate", "hangs"],
)
async def test_what_a_credential_plugin_does_wrong_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: dict[str, Any], says: str
) -> None:
    monkeypatch.setattr(kube, "EXEC_TIMEOUT", 1.0)
    with trio.fail_after(10), pytest.raises(kube.CredentialError) as failed:
        await plugin_token(mode, tmp_path)
    assert says in str(failed.value)
    # A plugin that hung was killed, not left behind.
    for pid in plugin_runs(tmp_path / "exec-credential-plugin.py"):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize(
    ("fault", "says"),
    [
        (KeyError("status"), "KeyError: 'status'"),
        (OSError(2, "No such file or directory"), "[Errno 2] No such file or directory"),
        (RuntimeError("a bug"), "RuntimeError: a bug"),
    ],
    ids=["KeyError", "OSError", "anything"],
)
async def test_whatever_the_client_fails_with_is_a_failed_request(
    fault: Exception, says: str, caplog: pytest.LogCaptureFixture
) -> None:
    """lightkube's exec credential path raised KeyError, OSError and ConfigError out of the DRA
    mode; every failure on the way to the API server is one RequestFailed (an outage of the
    API side), an unexpected one logged with its traceback once."""

    def answer(request: httpx.Request) -> httpx.Response:
        raise fault

    api = kube.Api(httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://x"))
    for _ in range(2):
        with trio.fail_after(5), pytest.raises(kube.RequestFailed) as failed:
            await api.get_node(NODE)
        assert str(failed.value).endswith(says)
        assert failed.value.code is None
    unexpected = [record for record in caplog.records if record.exc_info]
    assert len(unexpected) == (0 if isinstance(fault, OSError) else 1)


def test_the_keepalive_options_are_ones_this_kernel_takes() -> None:
    with socket.socket() as probe:
        for level, option, setting in kube.KEEPALIVE:
            probe.setsockopt(level, option, setting)
            assert probe.getsockopt(level, option) == setting
