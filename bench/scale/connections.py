"""The drivers' TCP connections to the API server, from /proc/net/tcp, each one's owner.

The API server's audit log and metrics say nothing of connections, so the benchmark looks at
the kernel's table every `INTERVAL` seconds (a thread of its own): a client side whose remote
port is the API server's and whose local port was not there at the last look is a new
connection, so a new TLS handshake. A connection stays in the table as long as it is open and
about a minute more in TIME_WAIT, so none is missed but one that is opened and reset (no
TIME_WAIT) within one interval. Its owner is the driver process holding its socket (the
socket's inode among that process's descriptors), looked up when it is new; one seen only in
TIME_WAIT has no inode left and counts as `unknown`.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable

import attrs

INTERVAL = 1.0
ESTABLISHED = "01"


@attrs.frozen
class Connection:
    port: int
    opened: float
    # The node whose driver holds it; "" when no driver does (the benchmark's own, or unknown).
    node: str


def client_sides(table: str, server_port: int) -> dict[int, tuple[str, int]]:
    """Local port -> (state, inode) of each socket in `table` (/proc/net/tcp's text) whose
    remote port is `server_port`."""
    found = {}
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        local, remote, state, inode = fields[1], fields[2], fields[3], fields[9]
        if int(remote.rpartition(":")[2], 16) == server_port:
            found[int(local.rpartition(":")[2], 16)] = (state, int(inode))
    return found


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    return inodes


@attrs.define
class Connections:
    """Every connection to the API server's `port` seen since `start()`. `owners()` names the
    node of each driver process (pid -> node), read again whenever an owner is looked up."""

    port: int
    owners: Callable[[], dict[int, str]]
    opened: list[Connection] = attrs.Factory(list)
    _live: dict[int, Connection] = attrs.Factory(dict)
    _established: dict[int, str] = attrs.Factory(dict)
    _lock: threading.Lock = attrs.Factory(threading.Lock)
    _stop: threading.Event = attrs.Factory(threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="connections", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL):
            self.look()

    def look(self) -> None:
        with open("/proc/net/tcp") as table:
            sides = client_sides(table.read(), self.port)
        now = time.time()
        unknown = {inode for port, (_, inode) in sides.items() if port not in self._live and inode}
        inode_node: dict[int, str] = {}
        if unknown:
            for pid, node in self.owners().items():
                for inode in socket_inodes(pid) & unknown:
                    inode_node[inode] = node
        with self._lock:
            for port in set(self._live) - set(sides):
                del self._live[port]
            established = {}
            for port, (state, inode) in sides.items():
                if port not in self._live:
                    connection = Connection(port, now, inode_node.get(inode, ""))
                    self._live[port] = connection
                    self.opened.append(connection)
                if state == ESTABLISHED:
                    established[port] = self._live[port].node
            self._established = established

    def opened_between(self, start: float, end: float) -> list[Connection]:
        with self._lock:
            return [c for c in self.opened if start <= c.opened < end]

    def established(self) -> dict[int, str]:
        """Port -> node of each connection open at the last look."""
        with self._lock:
            return dict(self._established)
