"""grpclib's private parts, used here and nowhere else.

tests/test_library_contracts.py pins what this relies on, so that an upgrade
of grpclib fails there and only there.
"""

from __future__ import annotations

import weakref
from typing import Any

import grpclib.protocol
import grpclib.server


class ConnectionClosingServer(grpclib.server.Server):
    """grpclib's Server, plus closing the client connections it leaves open.

    `Server.close()` cancels handlers but keeps connections, so a client
    holding ListAndWatch would hang instead of seeing the stream end. This
    relies on grpclib's private `_protocol_factory` (grpclib 0.4), and
    tests/test_bridge.py checks that a client really sees the end.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._protocols: weakref.WeakSet[grpclib.protocol.H2Protocol] = weakref.WeakSet()

    def _protocol_factory(self) -> grpclib.protocol.H2Protocol:
        protocol = super()._protocol_factory()
        self._protocols.add(protocol)
        return protocol

    def close_connections(self) -> None:
        for protocol in list(self._protocols):
            connection = getattr(protocol, "connection", None)
            if connection is not None:
                connection.close()
