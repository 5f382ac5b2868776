"""What the drivers asked of the API server, read from its audit log, and the figures of it.

The API server writes one JSON line per stage of a request (`policy`: the
drivers' group at level Metadata, stage RequestReceived omitted, nobody else): a watch has a
ResponseStarted line when it begins and a ResponseComplete line when it ends, every other
request one ResponseComplete line. `AuditLog` reads the file as it grows and keeps one
`Request` per audit ID; the functions below are the figures, computed from requests alone so
that they can be checked on requests made up by a test.
"""

from __future__ import annotations

import collections
import datetime
import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import attrs

# Each driver is the user USER_PREFIX + its node's name, in GROUP.
USER_PREFIX = "scale:"
GROUP = "scale:drivers"
SLICES = "resourceslices"


def policy(*, users: Iterable[str] = (), groups: Iterable[str] = ()) -> str:
    """The API server's audit policy that records what `users` and `groups` ask (the request's
    metadata, every stage but RequestReceived) and nothing else: what `AuditLog` reads, the
    same for the benchmark's drivers (a group) and the cluster check's (its service account)."""
    who = "".join(
        f"    {field}: {json.dumps(list(names))}\n"
        for field, names in (("users", users), ("userGroups", groups))
        if names
    )
    return (
        "apiVersion: audit.k8s.io/v1\nkind: Policy\nomitStages: [RequestReceived]\nrules:\n"
        f"  - level: Metadata\n{who}  - level: None\n"
    )


def _seconds(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp).timestamp()


@attrs.frozen
class Request:
    """One request of a driver: who (its node), what, when (epoch seconds: the benchmark's own
    instants are time.time() on the same machine)."""

    node: str
    verb: str
    resource: str
    received: float
    # When the answer was complete (a watch: when it ended); the last stage seen so far.
    answered: float
    # None while a watch is still open (and for a request the API server never answered).
    code: int | None = None
    dry_run: bool = False
    name: str = ""

    @property
    def what(self) -> str:
        """``LIST resourceslices``, ``CREATE resourceslices (dry run)``."""
        return f"{self.verb.upper()} {self.resource}" + (" (dry run)" if self.dry_run else "")

    @property
    def ok(self) -> bool:
        return self.code is not None and 200 <= self.code < 300

    def writes_slices(self) -> bool:
        """A slice written for real, and the API server said yes."""
        return (
            self.resource == SLICES
            and self.verb in ("create", "update", "patch")
            and self.ok
            and not self.dry_run
        )


def node_of(event: dict[str, Any]) -> str | None:
    """The node of the driver that made the request: the benchmark's users name it
    (USER_PREFIX + node); on a cluster (nox -s cluster) it is the pod-bound service-account
    token's node. None for anyone else's request."""
    user = event.get("user") or {}
    name = user.get("username", "")
    if name.startswith(USER_PREFIX):
        return str(name.removeprefix(USER_PREFIX))
    nodes = (user.get("extra") or {}).get("authentication.kubernetes.io/node-name") or []
    return str(nodes[0]) if name.startswith("system:serviceaccount:") and nodes else None


def parse(event: dict[str, Any]) -> tuple[str, Request] | None:
    """(audit ID, request) of one audit event of a driver's; None for anyone else's."""
    node = node_of(event)
    if node is None:
        return None
    ref = event.get("objectRef") or {}
    resource = ref.get("resource", "") or event.get("requestURI", "").split("?")[0]
    if ref.get("subresource"):
        resource += f"/{ref['subresource']}"
    status = event.get("responseStatus") or {}
    complete = event.get("stage") == "ResponseComplete"
    # An open watch's ResponseStarted says 200; only its end says how it ended.
    code = status.get("code") if complete or event.get("verb") != "watch" else None
    request = Request(
        node=node,
        verb=event.get("verb", ""),
        resource=resource,
        received=_seconds(event["requestReceivedTimestamp"]),
        answered=_seconds(event["stageTimestamp"]),
        code=code,
        dry_run="dryRun=" in event.get("requestURI", ""),
        name=ref.get("name", ""),
    )
    return event["auditID"], request


@attrs.define
class AuditLog:
    """The audit log at `path`, read as it grows (the API server appends; a restarted one
    appends to the same file)."""

    path: Path
    _offset: int = 0
    _partial: bytes = b""
    _requests: dict[str, Request] = attrs.Factory(dict)

    def read(self) -> list[Request]:
        """Take in what was written since the last call: the requests new or changed."""
        try:
            with self.path.open("rb") as file:
                file.seek(self._offset)
                chunk = file.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        fresh = []
        for line in lines:
            found = parse(json.loads(line)) if line.strip() else None
            if found:
                self._requests[found[0]] = found[1]
                fresh.append(found[1])
        return fresh

    def requests(self) -> list[Request]:
        """Every request so far, in the order the API server received them."""
        self.read()
        return sorted(self._requests.values(), key=lambda request: request.received)


def between(requests: Iterable[Request], start: float, end: float) -> list[Request]:
    """The requests received in [start, end)."""
    return [request for request in requests if start <= request.received < end]


def per_node_hour(requests: Iterable[Request], nodes: int, seconds: float) -> dict[str, float]:
    """Requests per node per hour by what they were (`Request.what`), and "all"."""
    counts = collections.Counter(request.what for request in requests)
    scale = 3600 / seconds / nodes
    rates = {what: count * scale for what, count in sorted(counts.items())}
    rates["all"] = sum(counts.values()) * scale
    return rates


def peak_per_second(requests: Iterable[Request]) -> int:
    """The most requests received within one second (bins of whole seconds)."""
    bins = collections.Counter(math.floor(request.received) for request in requests)
    return max(bins.values(), default=0)


def most_nodes_within(requests: Iterable[Request], span: float) -> int:
    """The most distinct nodes whose requests fall within `span` seconds of each other:
    how many nodes come at once."""
    ordered = sorted(requests, key=lambda request: request.received)
    inside: collections.Counter[str] = collections.Counter()
    most = 0
    first = 0
    for request in ordered:
        inside[request.node] += 1
        while ordered[first].received < request.received - span:
            gone = ordered[first].node
            inside[gone] -= 1
            if not inside[gone]:
                del inside[gone]
            first += 1
        most = max(most, len(inside))
    return most


def first_per_node(requests: Iterable[Request], since: float) -> dict[str, float]:
    """Each node's first request received at or after `since`: when it came back."""
    first: dict[str, float] = {}
    for request in requests:
        if request.received >= since and request.received < first.get(request.node, math.inf):
            first[request.node] = request.received
    return first


def slices_written(requests: Iterable[Request], since: float) -> dict[str, float]:
    """When each node's first slice write received at or after `since` was answered."""
    written: dict[str, float] = {}
    for request in requests:
        if request.received >= since and request.writes_slices():
            written[request.node] = min(written.get(request.node, math.inf), request.answered)
    return written


def codes(requests: Iterable[Request]) -> dict[str, int]:
    """How many of the requests had each answer (``open`` for watches still open)."""
    counts = collections.Counter(
        "open" if request.code is None else str(request.code) for request in requests
    )
    return dict(sorted(counts.items()))


def by_node(requests: Iterable[Request]) -> dict[str, list[Request]]:
    grouped: dict[str, list[Request]] = collections.defaultdict(list)
    for request in requests:
        grouped[request.node].append(request)
    return grouped


def to_first_slice(requests: list[Request]) -> tuple[list[Request], float] | None:
    """One node's requests up to and including its first slice written, and when that write
    was answered; None if it wrote none."""
    for index, request in enumerate(requests):
        if request.writes_slices():
            return requests[: index + 1], request.answered
    return None


def spread(instants: Iterable[float]) -> float:
    """From the first to the last."""
    values = list(instants)
    return max(values) - min(values) if values else 0.0


def pairs(requests: Iterable[Request]) -> Iterator[tuple[str, int]]:
    """`what` and its count, most frequent first."""
    yield from collections.Counter(request.what for request in requests).most_common()
