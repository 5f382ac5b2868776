"""Two instances of one resource at once, as in a rolling update with maxSurge.

Kubelets before 1.37 keep one client per resource name: the instance that
registered last replaces the one before, and when the newest one's stream
ends, kubelet marks the resource unhealthy without a word to the older
instance, whose stream stays open and silent. So each instance follows every
instance of its resource that registers after it: it holds a ListAndWatch
stream to that instance's socket, which ends the moment that process goes,
however it goes; then it registers again. Newer kubelets keep a client per
socket and need none of this; registering again costs them nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import attrs
import trio

from pcc_plugin import grpc_clients
from pcc_plugin.generations import Backoff
from pcc_plugin.klog import V1
from pcc_plugin.plugin_dir import accepts_connections, is_own_socket
from pcc_plugin.registration import KubeletLink

log = logging.getLogger(__name__)

# A followed instance that did not answer while its socket still takes connections
# (not listening yet, or a killed process whose listener outlives its connections for a
# moment) is followed again soon, then less often: at once would spin, a flat second left a
# node at 0 allocatable that long.
REFOLLOW_FIRST = 0.02
REFOLLOW_CAP = 1.0
SUPERSEDER_GONE = "the instance that registered after this one is gone"


@attrs.define(eq=False)
class Followers:
    """Follows each socket of this resource that another instance creates once our Register
    was sent, in a task of the generation's nursery; when one's process is gone, `restart`
    (and so register again). Told of new files by the directory's watcher."""

    _nursery: trio.Nursery
    _plugin_dir: Path
    _prefix: str
    _own_stem: str
    _link: KubeletLink
    _restart: Callable[[str], None]
    _followed: set[str] = attrs.Factory(set)

    def appeared(self, names: list[str]) -> None:
        for name in names:
            if (
                self._link.register != "not sent"
                and is_own_socket(self._prefix, name)
                and not name.startswith(self._own_stem)
                and name not in self._followed
            ):
                self._followed.add(name)
                self._nursery.start_soon(follow, self._plugin_dir / name, self._restart)


async def follow(path: Path, restart: Callable[[str], None]) -> None:
    """Until the instance behind `path` serves no socket any more; then `restart`.

    Registering again when a newer instance was never registered costs one
    Register call; failing to when it was leaves the node at 0 allocatable.
    """
    log.log(V1, "Following %s, which registers after this instance", path.name)
    backoff = Backoff(first=REFOLLOW_FIRST, cap=REFOLLOW_CAP)
    while True:
        alive, how = await grpc_clients.follow_list_and_watch(path)
        serves, still_there = instance_serves(path)
        if not serves:
            log.warning("%s (%s, %s); registering again", SUPERSEDER_GONE, path.name, how)
            restart(SUPERSEDER_GONE)
            return
        if not still_there:
            return  # it serves on a new socket, which is followed in its turn
        if alive:
            backoff.reset()  # it served us, then closed an idle-looking connection
        else:
            log.log(V1, "Following %s again (%s)", path.name, how)
            await trio.sleep(backoff.next_delay())


def instance_serves(path: Path) -> tuple[bool, bool]:
    """Whether the instance behind `path` serves any socket (after a restart of its own,
    kubelet's say, it serves a new one, `<prefix>-<pid>-<token>-<n+1>.sock`), and whether
    `path` is still there, from one look at the directory."""
    stem = path.name.rsplit("-", 1)[0] + "-"
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return False, False  # the directory went: this generation restarts anyway
    serves = any(
        accepts_connections(entry)
        for entry in entries
        if entry.name.startswith(stem) and entry.name.endswith(".sock")
    )
    return serves, path in entries
