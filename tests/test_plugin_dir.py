"""Kubelet's directory: our socket names, stale sockets, and what calls for a restart."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import pytest
from asyncinotify import Event, Mask

from pcc_plugin.fs import identity
from pcc_plugin.klog import V1
from pcc_plugin.plugin_dir import (
    SocketNames,
    is_own_socket,
    own_sockets,
    remove_stale_sockets,
    restart_reason,
)


def bind_socket(path: Path) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    return listener


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
        remove_stale_sockets(own_sockets(tmp_path, "pcc", keep="pcc-9-ff-0.sock"))
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "nvidia.sock",
            "pcc-2-bb-0.sock",
            "pcc-3-cc-0.sock",
        ]


def test_a_live_socket_of_this_process_is_not_called_another_instances(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """After a reload restarts a resource, its previous run's socket still serves a moment."""
    caplog.set_level(V1)
    previous, current = next(SocketNames("pcc")), next(SocketNames("pcc"))
    # Another pod's instance: the same PID (1 in each pod), its own token.
    token = previous.split("-")[2]
    others = f"pcc-{os.getpid()}-{int(token, 16) ^ 1:06x}-0.sock"
    with bind_socket(tmp_path / previous) as mine, bind_socket(tmp_path / others) as theirs:
        mine.listen()
        theirs.listen()
        remove_stale_sockets(own_sockets(tmp_path, "pcc", keep=current), SocketNames("pcc").stem)
    assert len(caplog.records) == 2
    assert {record.getMessage() for record in caplog.records} == {
        f"Leaving {tmp_path / others}: another instance serves it",
        f"Leaving {tmp_path / previous}: this instance's previous socket, closing",
    }


def test_names_never_repeat_in_a_process(tmp_path: Path) -> None:
    """A resource started again by a reload takes fresh names, under this process's stem."""
    first, again = SocketNames("pcc"), SocketNames("pcc")
    assert first.stem == again.stem
    names = [next(first), next(again), next(first)]
    assert len(set(names)) == 3


def event(name: str | None, mask: Mask) -> Event:
    return Event(watch=None, mask=mask, cookie=0, name=Path(name) if name else None)


def test_restart_reasons(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    own_name = "pcc-1-aa-0.sock"
    with bind_socket(tmp_path / own_name):
        own = identity(tmp_path / own_name)
        assert own is not None
        checkpoint = [event("kubelet_internal_checkpoint", Mask.CREATE)]
        assert restart_reason(checkpoint, tmp_path, own_name, own, None) is None
        # kubelet.sock created and gone again in one batch: nothing to register with yet.
        created = [event("kubelet.sock", Mask.DELETE), event("kubelet.sock", Mask.CREATE)]
        assert restart_reason(created, tmp_path, own_name, own, None) is None
        with bind_socket(tmp_path / "kubelet.sock"):
            new = restart_reason(created, tmp_path, own_name, own, None)
            assert new == "kubelet restarted"
            assert f"inotify: {tmp_path}/kubelet.sock created, restarting." in caplog.messages
            moved = [event("kubelet.sock", Mask.MOVED_TO)]
            assert restart_reason(moved, tmp_path, own_name, own, None) == "kubelet restarted"
            # The kubelet.sock the generation saw when it began: the event came before.
            seen = identity(tmp_path / "kubelet.sock")
            assert restart_reason(moved, tmp_path, own_name, own, seen) is None
        # Our own socket, still ours: an event about its name is no reason.
        ours = [event(own_name, Mask.CREATE)]
        assert restart_reason(ours, tmp_path, own_name, own, None) is None
    overflow = [event(None, Mask.Q_OVERFLOW)]
    assert restart_reason(overflow, tmp_path, own_name, own, None) == "inotify queue overflow"
    gone = [event(None, Mask.DELETE_SELF)]
    assert restart_reason(gone, tmp_path, own_name, own, None) == (
        "device-plugin directory removed"
    )
    assert restart_reason([], tmp_path / "gone", own_name, own, None) == (
        "device-plugin directory removed"
    )


@pytest.mark.parametrize("replacement", ["nothing", "a regular file", "another socket"])
def test_own_socket_is_known_by_identity_not_name(
    tmp_path: Path, replacement: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    own_name = "pcc-1-aa-0.sock"
    path = tmp_path / own_name
    with bind_socket(path):
        own = identity(path)
        assert own is not None
        os.unlink(path)
        if replacement == "a regular file":
            path.write_text("")
        events = [event(own_name, Mask.DELETE), event(own_name, Mask.CREATE)]
        if replacement == "another socket":
            with bind_socket(path):
                reason = restart_reason(events, tmp_path, own_name, own, None)
        else:
            reason = restart_reason(events, tmp_path, own_name, own, None)
    expected = "was removed" if replacement == "nothing" else "was replaced by another file"
    assert reason == f"own socket {expected}"
    # Removed is what kubelet does to every socket when it restarts; replaced is no routine.
    (record,) = caplog.records
    assert record.getMessage() == f"inotify: own socket {path} {expected}, restarting."
    assert record.levelno == (logging.INFO if replacement == "nothing" else logging.WARNING)
