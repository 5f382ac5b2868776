"""What the daemon has done, counted in plain Python; the metrics endpoint reads it.

Kept free of any metrics library so that counting costs nothing when
`--metrics-bind-address` is empty and the library is never imported.
"""

from __future__ import annotations

import collections

import attrs


@attrs.define
class ResourceStats:
    # Successful registrations, by what made the plugin register.
    registrations: collections.Counter[str] = attrs.Factory(collections.Counter)
    kubelet_restarts: int = 0
    # Allocate answers by result: ok, invalid, unavailable.
    allocations: collections.Counter[str] = attrs.Factory(collections.Counter)
    # Unexpected errors in gRPC handlers, by method.
    handler_errors: collections.Counter[str] = attrs.Factory(collections.Counter)
    # Generations served (sockets), and why the last one ended.
    generation: int = 0
    last_restart_reason: str = ""
    # Why the socket cannot be served (a filesystem fault), while it cannot.
    serving_problem: str | None = None
    # How long the last generation that ended in a fault waited before the next, and all such
    # waits together.
    restart_delay: float = 0.0
    backoff_seconds: float = 0.0
    healthy_devices: int = 0
    unhealthy_devices: int = 0
    streams_open: int = 0
    registered: bool = False
    # Which kubelet.sock the last registration went to (device, inode, ctime).
    kubelet: tuple[int, int, int] | None = None
    kubelet_stream_open: bool = False
    # Why the resource is not ready, while it is not.
    waiting_for: str = "not registered with kubelet yet"
    # A device plugin is ready only while kubelet's ListAndWatch stream is open; a DRA driver
    # has no stream, and is ready only while its ResourceSlices are published.
    kubelet_stream_needed: bool = True
    # Why the DRA driver's ResourceSlices are not as the node is (None once they are).
    slices_problem: str | None = None
    # NodePrepareResources and NodeUnprepareResources answers by result, per claim.
    prepares: collections.Counter[str] = attrs.Factory(collections.Counter)
    unprepares: collections.Counter[str] = attrs.Factory(collections.Counter)

    def counters(self) -> str:
        registrations = dict(sorted(self.registrations.items()))
        return (
            f"registrations={registrations} kubelet_restarts={self.kubelet_restarts} "
            f"allocations={dict(sorted(self.allocations.items()))} "
            f"handler_errors={dict(sorted(self.handler_errors.items()))} "
            f"devices={self.healthy_devices} healthy, {self.unhealthy_devices} unhealthy "
            f"streams_open={self.streams_open}"
        )

    def not_ready_reason(self) -> str | None:
        if not self.registered:
            return self.waiting_for
        if self.kubelet_stream_needed and not self.kubelet_stream_open:
            return "registered, but kubelet's ListAndWatch stream is not open"
        return self.slices_problem
