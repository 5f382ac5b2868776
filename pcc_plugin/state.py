"""The daemon's state, in one home: what /readyz, /metrics and SIGUSR1 read.

`DaemonState` is the configuration that runs and the resources served; each resource's
`ResourceState` changes only through its methods, each named for what happened. Plain
Python: counting costs nothing more when `--metrics-bind-address` is empty.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import trio

from pcc_plugin.resource import Device, ResourceSpec

log = logging.getLogger(__name__)

# Seconds, for kubelet's DRA calls: answered within 25 s (dra/claims.py), kubelet waits 45.
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0)
# The DRA mode's kubelet calls, as its metrics name them.
DRA_OPERATIONS = ("prepare", "unprepare")


@attrs.define
class Histogram:
    """Observations counted into `DURATION_BUCKETS` (each bucket counts those at most its
    bound, as Prometheus' do), with their sum."""

    counts: list[int] = attrs.Factory(lambda: [0] * len(DURATION_BUCKETS))
    total: float = 0.0
    observed: int = 0

    def observe(self, value: float) -> None:
        for index, bound in enumerate(DURATION_BUCKETS):
            if value <= bound:
                self.counts[index] += 1
        self.total += value
        self.observed += 1


@attrs.define(eq=False)
class ResourceState:
    """One resource: whether it is ready (and why not), and what it has done."""

    name: str
    # A device plugin is ready only while kubelet's ListAndWatch stream is open; a DRA driver
    # has no stream, and is ready only while its ResourceSlices are published.
    needs_stream: bool = True
    registered: bool = False
    kubelet_stream_open: bool = False
    # What keeps it from registering, each set by what happened and cleared by what ends it;
    # `not_ready_reason` alone says which one /readyz tells. A fixed path missing at start;
    # kubelet's directory; a filesystem fault in it; kubelet's socket; kubelet's refusal (or,
    # for a device plugin, a failed call); whether a generation serves and registers.
    path_missing: str | None = None
    directory_missing: Path | None = None
    serving_problem: str | None = None
    kubelet_problem: str | None = None
    refusal: str | None = None
    registering: bool = False
    # Why the DRA driver's ResourceSlices are not as the node is (None once they are).
    slices_problem: str | None = None
    # Generations served, why the last one ended, how long the last that ended in a fault
    # waited before the next, and all such waits together.
    generation: int = 0
    last_restart_reason: str = ""
    restart_delay: float = 0.0
    backoff_seconds: float = 0.0
    # Successful registrations, by what made the plugin register; kubelet restarts seen.
    registrations: collections.Counter[str] = attrs.Factory(collections.Counter)
    kubelet_restarts: int = 0
    streams_open: int = 0
    healthy_devices: int = 0
    unhealthy_devices: int = 0
    # Answers by result: Allocate calls (ok, invalid, unavailable); claims of
    # NodePrepareResources and NodeUnprepareResources (ok, failed).
    allocations: collections.Counter[str] = attrs.Factory(collections.Counter)
    prepares: collections.Counter[str] = attrs.Factory(collections.Counter)
    unprepares: collections.Counter[str] = attrs.Factory(collections.Counter)
    # Unexpected errors in gRPC handlers and connections, by where.
    handler_errors: collections.Counter[str] = attrs.Factory(collections.Counter)
    # The DRA mode's kubelet calls by operation: answered, in flight, how long they took; the
    # claims they failed, by why; the devices of the claims prepared now (the checkpoint's);
    # the requests it made of the API server, by verb, what they were about and the answer.
    dra_calls: collections.Counter[str] = attrs.Factory(collections.Counter)
    dra_in_flight: collections.Counter[str] = attrs.Factory(collections.Counter)
    dra_durations: dict[str, Histogram] = attrs.Factory(
        lambda: {operation: Histogram() for operation in DRA_OPERATIONS}
    )
    prepare_errors: collections.Counter[str] = attrs.Factory(collections.Counter)
    unprepare_errors: collections.Counter[str] = attrs.Factory(collections.Counter)
    prepared_devices: int = 0
    api_requests: collections.Counter[tuple[str, str, str]] = attrs.Factory(collections.Counter)
    _changed: trio.Event = attrs.field(factory=trio.Event, init=False)

    def not_ready_reason(self) -> str | None:
        """Each thing the resource waits for, `; ` between them; None when it is ready."""
        reasons = []
        if not self.registered:
            reasons.append(self._why_not_registered())
        elif self.needs_stream and not self.kubelet_stream_open:
            reasons.append("registered, but kubelet's ListAndWatch stream is not open")
        # The slices do not wait for kubelet: an API server out of reach is said meanwhile.
        if self.slices_problem:
            reasons.append(self.slices_problem)
        return "; ".join(reasons) or None

    def _why_not_registered(self) -> str:
        """What it waits for first: a missing path before its directory, before kubelet."""
        if self.path_missing:
            return f"waiting for {self.path_missing}"
        if self.directory_missing:
            return f"waiting for {self.directory_missing} to be created"
        if self.serving_problem:
            return self.serving_problem
        if self.kubelet_problem:
            return f"waiting for kubelet: {self.kubelet_problem}"
        if self.refusal:
            if self.needs_stream:
                return f"registration failed: {self.refusal}"
            return f"kubelet refused the registration: {self.refusal}"
        if self.registering:
            return "registering with kubelet" if self.needs_stream else (
                "waiting for kubelet to register the driver"
            )  # fmt: skip
        return "not registered with kubelet yet"

    def next_change(self) -> trio.Event:
        """Set at the next change of what readiness depends on."""
        return self._changed

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # Serving and registering

    def _unregistered(self) -> None:
        self.registered = False
        self._notify()

    def path_awaited(self, path: str, problem: str) -> None:
        """A path the resource hands out is missing at start: it waits for it."""
        self.path_missing = f"{path} ({problem})"
        self._unregistered()

    def paths_in_place(self) -> None:
        self.path_missing = None
        self._notify()

    def directory_awaited(self, directory: Path) -> None:
        """The next generation waits for kubelet's directory."""
        self.directory_missing = directory
        self._unregistered()

    def generation_started(self) -> None:
        """Serving afresh, in the directory: registering, with nothing refused yet."""
        self.generation += 1
        self.directory_missing = self.kubelet_problem = self.refusal = None
        self.registering = True
        self._unregistered()

    def kubelet_awaited(self, socket: Path, what: str) -> None:
        """kubelet's socket is not there to register with (`what` it is instead)."""
        self.kubelet_problem = f"{socket} {what}"
        self._unregistered()

    def registration_refused(self, error: str) -> None:
        self.refusal = error
        self._unregistered()

    def registered_with_kubelet(self, cause: str) -> None:
        self.registered = True
        self.kubelet_problem = self.refusal = None
        self.registrations[cause] += 1
        self._notify()

    def kubelet_restarted(self) -> None:
        self.kubelet_restarts += 1

    def generation_ended(self, reason: str, delay: float) -> None:
        """It ended for `reason`; the next waits `delay` (after a fault of the plugin's own)."""
        self.last_restart_reason = reason
        if delay:
            self.restart_delay = delay
            self.backoff_seconds += delay

    def cannot_serve(self, problem: str) -> bool:
        """Whether the problem is new (a retry of the same one is not said again)."""
        new = problem != self.serving_problem
        self.serving_problem = problem
        self._unregistered()
        return new

    def serving(self) -> str | None:
        """The problem that kept the sockets from being served until now, if one did."""
        problem, self.serving_problem = self.serving_problem, None
        return problem

    def stream_opened(self, kubelets: bool) -> None:
        self.streams_open += 1
        if kubelets:
            self.kubelet_stream_open = True
            self._notify()

    def stream_closed(self, kubelets: bool) -> None:
        self.streams_open -= 1
        if kubelets:
            self.kubelet_stream_open = False
            self._notify()

    def slices_published(self) -> None:
        self.slices_problem = None
        self._notify()

    def slices_not_published(self, problem: str) -> None:
        self.slices_problem = problem
        self._notify()

    # What the node has, and kubelet's calls

    def devices_seen(self, devices: tuple[Device, ...]) -> None:
        self.unhealthy_devices = sum(1 for device in devices if device.problem)
        self.healthy_devices = len(devices) - self.unhealthy_devices

    def allocated(self, result: str) -> None:
        self.allocations[result] += 1

    def prepared(self, result: str, claims: int = 1) -> None:
        self.prepares[result] += claims

    def unprepared(self, result: str, claims: int = 1) -> None:
        self.unprepares[result] += claims

    def prepare_failed(self, reason: str, claims: int = 1) -> None:
        self.prepared("failed", claims)
        self.prepare_errors[reason] += claims

    def unprepare_failed(self, reason: str, claims: int = 1) -> None:
        self.unprepared("failed", claims)
        self.unprepare_errors[reason] += claims

    @contextlib.contextmanager
    def dra_call(self, operation: str) -> Iterator[None]:
        """One of kubelet's DRA calls (`operation`), in flight while the block runs."""
        started = time.monotonic()
        self.dra_in_flight[operation] += 1
        try:
            yield
        finally:
            self.dra_in_flight[operation] -= 1
            self.dra_calls[operation] += 1
            self.dra_durations[operation].observe(time.monotonic() - started)

    def api_requested(self, verb: str, what: str, code: str) -> None:
        self.api_requests[(verb, what, code)] += 1

    def handler_failed(self, where: str, error: BaseException) -> None:
        """A bug showed in a gRPC handler or connection (`where`, a method's path or
        "connection"): said with its traceback at every verbosity, and counted."""
        where = where.rpartition("/")[2] or where
        self.handler_errors[where] += 1
        log.error("%s: %s failed unexpectedly", self.name, where, exc_info=error)

    def describe(self) -> list[str]:
        """Its lines in SIGUSR1's dump."""
        return [
            f"Resource {self.name}: registered={self.registered} "
            f"kubelet_stream_open={self.kubelet_stream_open} "
            f"generation={self.generation} restart_delay={self.restart_delay:.3f}s "
            f"last_restart_reason={self.last_restart_reason or '-'} "
            f"not_ready={self.not_ready_reason() or '-'}",
            f"  counters {self.name}: registrations={dict(sorted(self.registrations.items()))} "
            f"kubelet_restarts={self.kubelet_restarts} "
            f"allocations={dict(sorted(self.allocations.items()))} "
            f"handler_errors={dict(sorted(self.handler_errors.items()))} "
            f"devices={self.healthy_devices} healthy, {self.unhealthy_devices} unhealthy "
            f"streams_open={self.streams_open}",
        ]


@attrs.define(eq=False)
class DaemonState:
    """The configuration that runs (`generation` counts those applied, the first being 1) and
    the resources served."""

    specs: list[ResourceSpec]
    path: Path | None
    digest: str
    # "device-plugin" or "dra": which families /metrics has.
    mode: str = "device-plugin"
    generation: int = 1
    last_reload_failed: bool = False
    resources: list[ResourceState] = attrs.Factory(list)

    @contextlib.contextmanager
    def serving(self, resource: ResourceState) -> Iterator[None]:
        """While `resource` is served: /readyz, /metrics and SIGUSR1 show it."""
        self.resources.append(resource)
        try:
            yield
        finally:
            self.resources.remove(resource)

    def reload_applied(self, specs: list[ResourceSpec], digest: str) -> None:
        self.specs, self.digest = specs, digest
        self.generation += 1
        self.last_reload_failed = False

    def reload_unchanged(self) -> None:
        self.last_reload_failed = False

    def reload_refused(self) -> None:
        self.last_reload_failed = True

    def not_ready(self) -> list[str]:
        """For /readyz: `<resource>: <why>`, one for each resource that is not ready."""
        return [
            f"{resource.name}: {reason}"
            for resource in self.resources
            if (reason := resource.not_ready_reason())
        ]

    def describe(self) -> list[str]:
        """The configuration and each resource, as SIGUSR1 writes them to the log."""
        lines = [
            f"Configuration {self.generation} from {self.path or 'flags'} (hash {self.digest}"
            f"{', last reload failed' if self.last_reload_failed else ''})"
        ]
        for resource in self.resources:
            lines.extend(resource.describe())
        return lines
