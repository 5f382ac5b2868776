"""A cap on open connections, shared by the gRPC socket and the HTTP port.

At the cap, a newcomer takes the place of the oldest connection that has not yet sent a whole
request: a client that connects and waits holds nothing a real client needs (kubelet sends
its request, and its probes their request heads, at once). If every connection is busy, the
newcomer is closed. Either is said once per burst.
"""

from __future__ import annotations

import logging
from typing import Generic, Protocol, TypeVar

from pcc_plugin.klog import BurstLog


class Capped(Protocol):
    @property
    def sent_request(self) -> bool: ...

    def close(self) -> None:
        """Close the connection, from outside its task."""


C = TypeVar("C", bound=Capped)


class ConnectionCap(Generic[C]):
    """At most `limit` connections; `open` holds them, oldest first."""

    def __init__(self, limit: int, what: str, log: logging.Logger) -> None:
        self.limit = limit
        self.open: list[C] = []
        self._what = what
        self._full = BurstLog(log, logging.WARNING)

    def admit(self, connection: C) -> bool:
        """Whether `connection` may be served (then it is in `open` until `leave`)."""
        if len(self.open) >= self.limit:
            waiting = next((each for each in self.open if not each.sent_request), None)
            if waiting is None:
                self._full.log("%d %s open, the limit, each busy: refusing new ones",
                               len(self.open), self._what)  # fmt: skip
                return False
            self._full.log("%d %s open, the limit: closing the oldest that sent no request",
                           len(self.open), self._what)  # fmt: skip
            self.open.remove(waiting)
            waiting.close()
        self.open.append(connection)
        return True

    def leave(self, connection: C) -> None:
        if connection in self.open:
            self.open.remove(connection)
