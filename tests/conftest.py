"""Shared fixtures: a fake node, a simulated kubelet, and the daemon as a child process.

``fake_node``
    A :class:`~pcc_plugin.sim.FakeNode` in a short directory under /tmp (unix socket paths must
    fit in 107 bytes, pytest's ``tmp_path`` often does not): ``root``, ``host_root``, ``device``
    (a symlink to /dev/null, so a character device), ``pcc_dir``, and ``plugin_dir`` (not created:
    kubelet creates it). ``fake_node.daemon_args()`` gives the daemon's flags for it.

``kubelet``
    A started :class:`~pcc_plugin.sim.SimKubelet` on ``fake_node.plugin_dir``, stopped at
    teardown. By default a current kubelet; ask for another kind with indirect parametrisation::

        @pytest.mark.parametrize("kubelet", ["current", "resource-keyed"], indirect=True)

    Kinds: ``"current"`` (clients kept per endpoint, kubelet 1.37 on) and ``"resource-keyed"``
    (clients kept per resource name, kubelets before 1.37: 1.35 and 1.36 are still supported).

``any_kubelet``
    The same fixture parametrised over every kind: for behaviour that must hold against all
    kubelets. Use either ``kubelet`` or ``any_kubelet`` in a test, not both (one directory).

``host``
    A host filesystem tree in ``tmp_path`` for unit tests: ``dev/sev-guest`` (a symlink to
    /dev/null, so a character device) and the ``var/run/pcc`` directory; pass it as --host-root.

``dra_node``
    For the DRA mode: a :class:`dra_support.DraNode` on ``fake_node``, with a started fake API
    server (the Node ``node-a``) and the simulated kubelet's DRA side on its plugins_registry;
    ``dra_node.daemon_args()`` gives the daemon's flags for them.

``closing_socket``
    The path of a unix socket whose server closes every connection as soon as it accepts it,
    as a kubelet going down does; in a short directory under /tmp.

``start_daemon``
    ``start_daemon(*args, env=None) -> Daemon`` runs ``python -m pcc_plugin *args`` in its own
    session, with ``env`` merged into the environment and its output in a log file; the whole
    process group is killed at teardown, and the log printed (pytest shows it on failure).

Tests run under pytest-trio: a test (or module) marked ``asyncio_host`` runs under
``pcc_plugin.bridge.run``, with an asyncio loop for grpclib, as the daemon runs; the others under
``trio.run``. Call blocking helpers through
``await run_blocking(fn, *args)`` (``pcc_plugin.sim.run_blocking``), give them a timeout of
their own, and wrap every test that does I/O in ``with trio.fail_after(N):``.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import socket
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest
from dra_support import NODE, DraNode

from pcc_plugin import bridge
from pcc_plugin.sim import Daemon, FakeNode, SimKubelet, StartDaemon
from pcc_plugin.sim.apiserver import FakeApiServer
from pcc_plugin.sim.dra import SimDraKubelet

KUBELET_KINDS = ("current", "resource-keyed")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """pytest-trio runs a test with the runner of its first `trio` mark: put bridge.run's
    first for tests marked asyncio_host (trio_mode marks every async test with trio.run)."""
    for item in items:
        test = getattr(item, "obj", None)
        if item.get_closest_marker("asyncio_host") and inspect.iscoroutinefunction(test):
            item.add_marker(pytest.mark.trio(run=bridge.run), append=False)


def make_kubelet(fake_node: FakeNode, kind: str) -> SimKubelet:
    match kind:
        case "current":
            return SimKubelet(fake_node.plugin_dir)
        case "resource-keyed":
            return SimKubelet(fake_node.plugin_dir, key_by="resource")
    raise ValueError(f"unknown kubelet kind {kind!r}; known: {', '.join(KUBELET_KINDS)}")


@pytest.fixture
def host(tmp_path: Path) -> Path:
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "sev-guest").symlink_to("/dev/null")
    (tmp_path / "var" / "run" / "pcc").mkdir(parents=True)
    return tmp_path


@pytest.fixture
def fake_node() -> Iterator[FakeNode]:
    node = FakeNode.create()
    yield node
    node.remove()


@pytest.fixture
def kubelet(request: pytest.FixtureRequest, fake_node: FakeNode) -> Iterator[SimKubelet]:
    with make_kubelet(fake_node, getattr(request, "param", "current")) as sim:
        yield sim


@pytest.fixture(params=KUBELET_KINDS)
def any_kubelet(request: pytest.FixtureRequest, fake_node: FakeNode) -> Iterator[SimKubelet]:
    with make_kubelet(fake_node, request.param) as sim:
        yield sim


@pytest.fixture
def closing_socket() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="pcc-", dir="/tmp") as directory:
        path = Path(directory) / "closing.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        listener.listen(64)

        def close_each() -> None:
            with contextlib.suppress(OSError):  # the listener closed: done
                while True:
                    listener.accept()[0].close()

        closer = threading.Thread(target=close_each, name="closing-socket", daemon=True)
        closer.start()
        try:
            yield path
        finally:
            listener.shutdown(socket.SHUT_RDWR)
            listener.close()
            closer.join(timeout=5)


@pytest.fixture
def start_daemon(fake_node: FakeNode) -> Iterator[StartDaemon]:
    log_numbers = itertools.count()
    with contextlib.ExitStack() as cleanup:

        def start(
            *args: str, env: Mapping[str, str] | None = None, wrapper: Sequence[str] = ()
        ) -> Daemon:
            log_path = fake_node.root / f"daemon-{next(log_numbers)}.log"
            daemon = Daemon.spawn_plugin(args, log_path, env, wrapper)
            # Last in, first out: the log is printed once the process group is gone.
            cleanup.callback(print_log, daemon)
            cleanup.callback(daemon.close)
            return daemon

        yield start


def print_log(daemon: Daemon) -> None:
    print(f"--- daemon {daemon.pid}: {' '.join(daemon.argv)}\n{daemon.log_text()}")


@pytest.fixture
def dra_node(fake_node: FakeNode) -> Iterator[DraNode]:
    root = fake_node.root
    (root / "plugins").mkdir()
    with FakeApiServer() as api:
        api.add_node(NODE)
        with SimDraKubelet(root / "plugins_registry", NODE, api) as kubelet:
            yield DraNode(
                fake_node, api, kubelet, root / "plugins_registry", root / "plugins",
                root / "cdi", api.write_kubeconfig(root / "kubeconfig"),
            )  # fmt: skip
