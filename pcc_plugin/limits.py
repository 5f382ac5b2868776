"""Every bound the daemon keeps against what its clients send, in one frozen `Limits`.

The servers take one for what a connection may do (`grpc_server.Server`,
`http_server.HttpServer`), the services for what a request may hold (`service.DevicePlugin`,
the DRA mode's `claims.Preparer`, whose deadlines are here too). What each
guards against is the README's "Limits" table, which a test checks against `Limits()`. A test
that needs a shorter deadline builds its own `Limits`.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Limits:
    # The gRPC sockets: connections and calls at once; seconds to the HTTP/2 preface and a
    # first call, and without an open call.
    connections: int = 32
    calls_per_connection: int = 32
    first_request_timeout: float = 5.0
    idle_timeout: float = 60.0
    # Bytes of a message; of a flow-control window; of messages larger than a window, read at
    # once across every connection.
    message_bytes: int = 4 * 1024 * 1024
    window: int = 65_535
    large_message_budget: int = 8 * 1024 * 1024
    # Seconds to receive a request, and to answer a unary call; connections pending accept();
    # seconds a torn-down socket's calls get to end.
    receive_timeout: float = 10.0
    unary_timeout: float = 30.0
    backlog: int = 64
    teardown_grace: float = 1.0
    # The client connects, then may call nothing for long (kubelet on a DRA socket): its
    # connection is kept from its HTTP/2 preface on, however long it is idle.
    idle_client: bool = False
    # An Allocate's container requests and a DRA call's claims: kubelet sends one pod's, far
    # fewer. A claim's bytes: a namespace (63 at most), a name (253) and a UID (36), with keys
    # and lengths some 360.
    container_requests: int = 128
    claims: int = 128
    claim_bytes: int = 1024
    # Seconds: reading the claims of one DRA call from the API server, before the lock is
    # taken (a stalled read holds up no other call); the whole call answered, inside
    # `unary_timeout`, itself inside kubelet's 45 s: kubelet always hears why a claim failed.
    read_claims_timeout: float = 20.0
    answer_within: float = 25.0
    # The HTTP port: connections at once; seconds for the whole exchange; bytes of a request
    # head.
    http_connections: int = 16
    http_timeout: float = 5.0
    http_request_head: int = 8192


DEFAULT = Limits()
# kubelet's DRA socket: connected when the driver registers, idle between claims.
DRA_SOCKET = attrs.evolve(DEFAULT, idle_client=True)
