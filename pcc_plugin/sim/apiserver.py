"""A fake API server: the few endpoints of the DRA mode, in memory, on 127.0.0.1, for tests.

It serves what the driver uses of kube-apiserver, in its JSON and with its status codes:
GET a Node and a ResourceClaim; list, watch (chunked, from a resource version), create,
replace and delete ResourceSlices, with field selectors on spec.nodeName and spec.driver.
Watches behave as kube-apiserver 1.37's (k8s.io/apiserver's cacher, read at v0.37.2): a
watch ends, cleanly, after its `timeoutSeconds` (without one, after a random 30 to 60
minutes, --min-request-timeout's default times 1 to 2); with `allowWatchBookmarks` it gets a
BOOKMARK every `bookmark_every` seconds (the cacher's bookmarkFrequency, a minute) and one 2 s
before its end, carrying the latest resource version; a resource version older than what the
watch cache holds gets an ERROR event 410 Expired, in a 200 answer; after a restart (`stop`,
`start`) the cache holds only what comes after. An HTTP/1.1 connection is kept alive after a
watch ends, as Go's net/http does; `connections` counts those accepted.
It checks the bearer token, and what kube-apiserver checks of a slice that a driver could get
wrong (at most 128 devices, 64 when one has a taint, a pool, names, taints). A create may be a
dry run (`dryRun=All`: checked and answered, not kept) and name only a `generateName`. Like
kube-apiserver 1.37 it serves device taints; `serves_taints = False` makes it drop them, as
one without the DRADeviceTaints feature does. Threads answer requests, so trio tests drive it
through `run_blocking` like the simulated kubelet; `wait_for` blocks until a predicate on its
state holds.

Faults: `stop` makes it unreachable (connections refused, open watches cut), `start` serves
again on the same port; the methods after `slices` give kube-apiserver's routine trouble on
demand (409 conflicts, 410 Gone watches, stalled requests, a Node recreated).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import random
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from pcc_plugin.sim.rules import is_dns_label, is_qualified_name
from pcc_plugin.sim.state import Simulator

Obj = dict[str, Any]

RESOURCE_API = "/apis/resource.k8s.io/v1"
# An exec credential plugin: prints the token it is given, in the ExecCredential of the API
# version client-go asked for in KUBERNETES_EXEC_INFO, and only to a non-interactive caller.
# A file beside it (<plugin>.mode, JSON) makes it fail, hang, answer with a client certificate
# instead, or give a token that expires after `lifetime` seconds (the token then carries its
# expiry, which the server checks); each run is a line in <plugin>.runs.
_CREDENTIAL_PLUGIN = """\
import json, os, sys, time
with open(sys.argv[0] + ".runs", "a") as runs:
    runs.write(f"{os.getpid()}\\n")
try:
    with open(sys.argv[0] + ".mode") as file:
        mode = json.load(file)
except FileNotFoundError:
    mode = {}
if mode.get("fail"):
    sys.exit("the identity provider is down")
if mode.get("hang"):
    time.sleep(3600)
info = json.loads(os.environ.get("KUBERNETES_EXEC_INFO") or "{}")
if info.get("kind") != "ExecCredential" or info.get("spec", {}).get("interactive") is not False:
    sys.exit(f"unexpected KUBERNETES_EXEC_INFO: {info}")
credential = {"kind": "ExecCredential", "apiVersion": info["apiVersion"]}
if mode.get("certificate"):
    credential["status"] = {"clientCertificateData": "x", "clientKeyData": "y"}
elif mode.get("lifetime"):
    expires = int(time.time() + mode["lifetime"])
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expires))
    credential["status"] = {"token": f"{sys.argv[1]}.{expires}", "expirationTimestamp": stamp}
else:
    credential["status"] = {"token": sys.argv[1]}
print(json.dumps(credential))
"""
# kube-apiserver's cacher sends a watch a bookmark this often (bookmarkFrequency), and one this
# long before the watch's end.
BOOKMARK_EVERY = 60.0
BOOKMARK_BEFORE_END = 2.0
# A watch without timeoutSeconds ends after this times 1 to 2 (--min-request-timeout).
MIN_REQUEST_TIMEOUT = 1800.0
MAX_DEVICES_PER_SLICE = 128
MAX_TAINTED_DEVICES_PER_SLICE = 64
MAX_TAINTS_PER_DEVICE = 16
TAINT_EFFECTS = ("None", "NoSchedule", "NoExecute")
_LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ")


class Rejected(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason


def status(code: int, reason: str, message: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Status",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }


def check_slice(obj: Obj) -> None:
    """What kube-apiserver refuses of a ResourceSlice that a driver could get wrong."""
    spec = obj.get("spec") or {}
    devices = spec.get("devices") or []
    problems = []
    if not spec.get("driver") or not spec.get("nodeName"):
        problems.append("spec.driver and spec.nodeName are required")
    pool = spec.get("pool") or {}
    if not pool.get("name") or pool.get("resourceSliceCount", 0) < 1:
        problems.append("spec.pool needs a name and a resourceSliceCount of at least 1")
    tainted = any(device.get("taints") for device in devices)
    most = MAX_TAINTED_DEVICES_PER_SLICE if tainted else MAX_DEVICES_PER_SLICE
    if len(devices) > most:
        problems.append(f"spec.devices: at most {most}, got {len(devices)}")
    for device in devices:
        if not is_dns_label(device.get("name", "")):
            problems.append(f"device name {device.get('name')!r} is not a DNS label")
        for value in (device.get("attributes") or {}).values():
            if len(str(value.get("string", ""))) > 64:
                problems.append("a string attribute is longer than 64 characters")
        problems.extend(_taint_problems(device.get("taints") or []))
    if problems:
        raise Rejected(422, "Invalid", "; ".join(problems))


def _taint_problems(taints: list[Obj]) -> list[str]:
    problems = [] if len(taints) <= MAX_TAINTS_PER_DEVICE else ["more than 16 taints"]
    for taint in taints:
        key, value = taint.get("key") or "", taint.get("value") or ""
        if not is_qualified_name(key):
            problems.append(f"taint key {key!r} is not a label name")
        if len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
            problems.append(f"taint value {value!r} is not a label value")
        if taint.get("effect") not in TAINT_EFFECTS:
            problems.append(f"taint effect {taint.get('effect')!r} is not one of {TAINT_EFFECTS}")
        if "timeAdded" in taint and not _TIME.fullmatch(str(taint["timeAdded"])):
            problems.append(f"taint timeAdded {taint['timeAdded']!r} is not a time")
    return problems


class FakeApiServer(Simulator):
    """kube-apiserver's DRA endpoints on http://127.0.0.1:<port>, with one bearer token."""

    def __init__(self) -> None:
        self.token = "sim-token"
        self.serves_taints = True
        self.bookmark_every = BOOKMARK_EVERY
        # While set, open watches say nothing, bookmarks included, and are not ended (a hung
        # server).
        self._mute_watches = False
        # Connections accepted, requests answered 401; each watch's query, in order.
        self.connections = 0
        self.unauthorized = 0
        self.watches: list[dict[str, str]] = []
        # Ends every watch after at most this many seconds (a test's minutes in seconds).
        self.max_watch_seconds: float | None = None
        self._started = False
        super().__init__()
        self._versions = itertools.count(1)
        self._version = 0
        self.nodes: dict[str, Obj] = {}
        self.claims: dict[tuple[str, str], Obj] = {}
        self._slices: dict[str, Obj] = {}
        self._events: list[tuple[int, str, Obj]] = []
        self.requests: list[str] = []
        # A watch from before this resource version ends with 410 Gone (expire_watches).
        self._oldest_watchable = 0
        self._conflict_armed = False
        # Requests (`METHOD path`) the predicate matches wait until release().
        self._stalled: Callable[[str], bool] | None = None
        self._released = threading.Event()
        # The requests held so far (`METHOD path`), oldest first.
        self.held: list[str] = []
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._connections: set[socket.socket] = set()
        self.port = 0

    # Lifecycle

    def start(self) -> None:
        """Serve; again after `stop`, as a restarted kube-apiserver: its watch cache holds
        only what comes after (a watch from before gets 410 Expired)."""
        handler = type("Handler", (_Handler,), {"api": self})
        server = ThreadingHTTPServer(("127.0.0.1", self.port), handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        thread = threading.Thread(target=server.serve_forever, name="fake-apiserver", daemon=True)
        with self._changed:
            self._server, self._thread = server, thread
            if self._started:
                self._oldest_watchable = self._version
            self._started = True
        thread.start()

    def stop(self) -> None:
        """Unreachable: new connections refused, open ones (watches) cut."""
        with self._changed:
            server, self._server = self._server, None
            self._changed.notify_all()
        if server is None:
            return
        server.shutdown()
        server.server_close()
        # Read once accepting has stopped: a connection accepted while it stopped (a client
        # coming back at once from its cut watch) is cut too, as a real outage would.
        with self._changed:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    @property
    def mute_watches(self) -> bool:
        return self._mute_watches

    @mute_watches.setter
    def mute_watches(self, muted: bool) -> None:
        with self._changed:
            self._mute_watches = muted
            self._changed.notify_all()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_kubeconfig(self, path: Path, exec_api_version: str | None = None) -> Path:
        """A kubeconfig for the daemon's --kubeconfig (JSON is YAML).

        With `exec_api_version`, its user gets the token from an exec credential plugin of that
        API version instead (a script written beside it, as cloud providers' kubeconfigs run a
        command): the plugin answers only as client-go would have run it, else exits 1.
        """
        user: Obj = {"token": self.token}
        if exec_api_version is not None:
            plugin = path.with_name(f"{path.stem}-credential-plugin.py")
            plugin.write_text(_CREDENTIAL_PLUGIN)
            user = {
                "exec": {
                    "apiVersion": exec_api_version,
                    "command": sys.executable,
                    "args": [str(plugin), self.token],
                    "interactiveMode": "Never",
                }
            }
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "sim", "cluster": {"server": self.url}}],
            "users": [{"name": "sim", "user": user}],
            "contexts": [{"name": "sim", "context": {"cluster": "sim", "user": "sim"}}],
            "current-context": "sim",
        }
        path.write_text(json.dumps(config))
        return path

    # State, as tests set and read it

    def add_node(self, name: str) -> Obj:
        node = {"apiVersion": "v1", "kind": "Node", "metadata": self._metadata(name)}
        with self._changed:
            self.nodes[name] = node
        return node

    def put_claim(
        self, namespace: str, name: str, devices: list[Obj] | None, uid: str | None = None
    ) -> Obj:
        """A ResourceClaim, allocated with these results (`driver`, `pool`, `device`,
        `request`), or not allocated (None)."""
        claim: Obj = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {**self._metadata(name), "namespace": namespace},
            "spec": {"devices": {"requests": []}},
        }
        if uid is not None:
            claim["metadata"]["uid"] = uid
        if devices is not None:
            claim["status"] = {"allocation": {"devices": {"results": devices}}}
        with self._changed:
            self.claims[(namespace, name)] = claim
        return claim

    def slices(self, node: str | None = None) -> list[Obj]:
        with self._changed:
            return [
                json.loads(json.dumps(obj))
                for obj in self._slices.values()
                if node is None or obj["spec"]["nodeName"] == node
            ]

    def delete_slices(self, node: str) -> None:
        """What kubelet does at its start: delete every slice of its node."""
        with self._changed:
            for name, obj in list(self._slices.items()):
                if obj["spec"]["nodeName"] == node:
                    del self._slices[name]
                    self._event("DELETED", obj)

    def slice_writes(self) -> int:
        """Requests that created, replaced or deleted a slice, answered or refused."""
        with self._changed:
            return sum(
                1
                for request in self.requests
                if request.split()[0] in ("POST", "PUT", "DELETE") and "/resourceslices" in request
            )

    def recreate_node(self, name: str) -> Obj:
        """The Node deleted and registered again (a new UID); the garbage collector deletes
        the slices the old Node owned."""
        with self._changed:
            node = self.add_node(name)
            self._collect_garbage()
        return node

    def conflict_next_write(self) -> None:
        """The next write of a slice finds that someone else wrote it first: 409."""
        with self._changed:
            self._conflict_armed = True

    def expire_watches(self) -> None:
        """Every open watch ends with 410 Gone, and so does a watch from before now."""
        with self._changed:
            # A list from now on gives a version a watch may start from.
            self._oldest_watchable = int(self._bump())
            self._changed.notify_all()

    def stall(self, matches: Callable[[str], bool]) -> None:
        """Hold each request whose `METHOD path` `matches` until `release`."""
        with self._changed:
            self._released.clear()
            self._stalled = matches

    def release(self) -> None:
        with self._changed:
            self._stalled = None
            self._released.set()

    def authorized(self, header: str) -> bool:
        """The token, or the token with an expiry that has not passed (an exec credential
        plugin's short-lived one, `<token>.<Unix time>`); counted if not."""
        token, _, expires = header.removeprefix("Bearer ").partition(".")
        valid = header.startswith("Bearer ") and token == self.token and (
            not expires or (expires.isdigit() and int(expires) > time.time())
        )  # fmt: skip
        if not valid:
            with self._changed:
                self.unauthorized += 1
        return valid

    def _hold(self, request: str) -> None:
        with self._changed:
            stalled = self._stalled is not None and self._stalled(request)
            if stalled:
                self.held.append(request)
                self._changed.notify_all()
        if stalled:
            self._released.wait()

    def _describe(self) -> str:
        return f"slices: {sorted(self._slices)}; last requests: {self.requests[-5:]}"

    # Inside: the caller holds the lock

    def _metadata(self, name: str) -> Obj:
        return {"name": name, "uid": str(uuid.uuid4()), "resourceVersion": self._bump()}

    def _bump(self) -> str:
        self._version = next(self._versions)
        return str(self._version)

    def _requested(self, request: str) -> None:
        self.requests.append(request)
        self._changed.notify_all()

    def _collect_garbage(self) -> None:
        """Delete the slices whose owning Node is gone (by UID), as the garbage collector does."""
        uids = {node["metadata"]["uid"] for node in self.nodes.values()}
        for name, obj in list(self._slices.items()):
            owners = obj["metadata"].get("ownerReferences") or []
            if any(o.get("kind") == "Node" and o.get("uid") not in uids for o in owners):
                del self._slices[name]
                self._event("DELETED", obj)

    def _conflict(self, name: str, body: Obj) -> None:
        """Someone else writes the slice just before this write (conflict_next_write)."""
        self._conflict_armed = False
        old = self._slices.get(name)
        if old is None:
            self._slices[name] = {**body, "metadata": {**body["metadata"], **self._metadata(name)}}
            self._event("ADDED", self._slices[name])
            return
        labels = {**(old["metadata"].get("labels") or {}), "touched-by": "someone-else"}
        old["metadata"] = {**old["metadata"], "labels": labels, "resourceVersion": self._bump()}
        self._event("MODIFIED", old)

    def _event(self, kind: str, obj: Obj) -> None:
        if kind == "DELETED":
            obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": self._bump()}}
        self._events.append((self._version, kind, json.loads(json.dumps(obj))))
        self._changed.notify_all()

    def answer(self, method: str, path: str, query: dict[str, str], body: Obj | None) -> Obj:
        """The answer to one request that is not a watch; Rejected for an error status."""
        with self._changed:
            self._requested(f"{method} {path}")
            if match := re.fullmatch(r"/api/v1/nodes/([^/]+)", path):
                return self._get(self.nodes, match[1], "nodes")
            if match := re.fullmatch(
                rf"{RESOURCE_API}/namespaces/([^/]+)/resourceclaims/([^/]+)", path
            ):
                return self._get(
                    self.claims, (match[1], match[2]), "resourceclaims.resource.k8s.io"
                )
            if path == f"{RESOURCE_API}/resourceslices" and method == "GET":
                return {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceSliceList",
                    "metadata": {"resourceVersion": str(self._version)},
                    "items": [obj for obj in self._slices.values() if _selected(obj, query)],
                }
            if path == f"{RESOURCE_API}/resourceslices" and method == "POST":
                if self._conflict_armed and body:
                    self._conflict(body["metadata"].get("name", ""), body)
                dry_run = query.get("dryRun") == "All"
                return self._after_write(self._create(body or {}, dry_run=dry_run))
            if match := re.fullmatch(rf"{RESOURCE_API}/resourceslices/([^/]+)", path):
                if self._conflict_armed and method == "PUT" and body:
                    self._conflict(match[1], body)
                return self._after_write(self._slice(method, match[1], body))
        raise Rejected(404, "NotFound", f"the server could not find the requested resource {path}")

    def _after_write(self, obj: Obj) -> Obj:
        """The answer to a write; a slice whose Node is gone is then collected."""
        answer: Obj = json.loads(json.dumps(obj))
        self._collect_garbage()
        return answer

    def _get(self, store: dict[Any, Obj], key: Any, kind: str) -> Obj:
        if key not in store:
            raise Rejected(404, "NotFound", f'{kind} "{key}" not found')
        return store[key]

    def _create(self, obj: Obj, dry_run: bool = False) -> Obj:
        metadata = obj["metadata"]
        name = metadata.get("name") or metadata.get("generateName", "") + uuid.uuid4().hex[:5]
        metadata["name"] = name
        check_slice(obj)
        if name in self._slices:
            raise Rejected(409, "AlreadyExists", f'resourceslices "{name}" already exists')
        self._served(obj)
        if dry_run:
            return obj
        obj["metadata"] = {**metadata, **self._metadata(name)}
        self._slices[name] = obj
        self._event("ADDED", obj)
        return obj

    def _served(self, obj: Obj) -> None:
        """The fields as kube-apiserver keeps them: taints dropped, or given the time now."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        for device in (obj.get("spec") or {}).get("devices") or []:
            if not self.serves_taints:
                device.pop("taints", None)
            for taint in device.get("taints") or []:
                taint.setdefault("timeAdded", now)

    def _slice(self, method: str, name: str, body: Obj | None) -> Obj:
        old = self._get(self._slices, name, "resourceslices.resource.k8s.io")
        if method == "GET":
            return old
        if method == "DELETE":
            del self._slices[name]
            self._event("DELETED", old)
            return old
        if method != "PUT" or body is None:
            raise Rejected(405, "MethodNotAllowed", f"{method} is not allowed here")
        check_slice(body)
        if body["metadata"].get("resourceVersion") != old["metadata"]["resourceVersion"]:
            raise Rejected(409, "Conflict", "the object has been modified")
        if body["spec"]["nodeName"] != old["spec"]["nodeName"]:
            raise Rejected(422, "Invalid", "spec.nodeName: field is immutable")
        self._served(body)
        # The writer's metadata (annotations, owners), the server's identity of the object.
        identity = {"name": name, "uid": old["metadata"]["uid"], "resourceVersion": self._bump()}
        body["metadata"] = {**body["metadata"], **identity}
        self._slices[name] = body
        self._event("MODIFIED", body)
        return body

    def _news(self, server: ThreadingHTTPServer | None, since: int) -> bool:
        """Stopped since `server` began, events after `since`, or the watch expired."""
        return (
            self._server is not server
            or since < self._oldest_watchable
            or bool(self._events and self._events[-1][0] > since and not self._mute_watches)
        )

    def check_watch(self, query: dict[str, str]) -> None:
        with self._changed:
            self.watches.append(query)
            self._requested("WATCH resourceslices")

    def watch(self, query: dict[str, str], send: Callable[[bytes], None]) -> None:
        """Send the slice events after the query's resource version, and bookmarks if asked,
        until its timeout or a stop."""
        since = int(query.get("resourceVersion") or 0)
        seconds = float(query.get("timeoutSeconds") or 0) or (
            MIN_REQUEST_TIMEOUT * (1 + random.random())
        )  # fmt: skip
        start = time.monotonic()
        end = start + min(seconds, self.max_watch_seconds or seconds)

        def next_bookmark_after(now: float) -> float | None:
            # As the cacher schedules them: a minute on, or 2 s before the end if sooner;
            # none once that is past (a watch shorter than 2 s gets none).
            at = min(now + self.bookmark_every, end - BOOKMARK_BEFORE_END)
            return at if at > now else None

        bookmark = (
            next_bookmark_after(start) if query.get("allowWatchBookmarks") == "true" else None
        )
        with self._changed:
            server = self._server
            if since > self._version:
                # The cacher waits 3 s for a version it has not seen, then says so.
                late = status(504, "Timeout", f"Too large resource version: {since}")
                send(json.dumps({"type": "ERROR", "object": late}).encode() + b"\n")
                return
        while True:
            with self._changed:
                now = time.monotonic()
                wake = min(end, bookmark or end)
                self._changed.wait_for(
                    functools.partial(self._news, server, since),
                    None if self._mute_watches else max(0.0, wake - now),
                )
                if self._server is not server:
                    return
                if since < self._oldest_watchable:
                    gone = status(410, "Expired", f"too old resource version: {since}")
                    send(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
                    return
                muted = self._mute_watches
                pending = [] if muted else [event for event in self._events if event[0] > since]
                version = self._version
            for event_version, kind, obj in pending:
                since = event_version
                if _selected(obj, query):
                    send(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
            now = time.monotonic()
            if now >= end and not muted:
                return
            if bookmark is not None and now >= bookmark:
                bookmark = next_bookmark_after(now)
                if not muted:
                    since = max(since, version)
                    mark = {"kind": "ResourceSlice", "apiVersion": "resource.k8s.io/v1",
                            "metadata": {"resourceVersion": str(since)}}  # fmt: skip
                    send(json.dumps({"type": "BOOKMARK", "object": mark}).encode() + b"\n")


def _selected(obj: Obj, query: dict[str, str]) -> bool:
    for term in filter(None, query.get("fieldSelector", "").split(",")):
        field, _, value = term.partition("=")
        found: Any = obj
        for part in field.split("."):
            found = found.get(part) if isinstance(found, dict) else None
        if found != value:
            return False
    return True


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # Its headers and body are written apart: with Nagle's algorithm the body waited for the
    # client's delayed ACK of the headers, 40 ms on every answer.
    disable_nagle_algorithm = True
    api: FakeApiServer

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        super().setup()
        with self.api._changed:
            self.api._connections.add(self.connection)
            self.api.connections += 1
            stopped = self.api._server is not self.server
        if stopped:
            # Accepted as the server stopped, set up after `stop` cut the others.
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_RDWR)

    def finish(self) -> None:
        with self.api._changed:
            self.api._connections.discard(self.connection)
        with contextlib.suppress(OSError):
            super().finish()

    def do_GET(self) -> None:
        method = self.command
        url = urlsplit(self.path)
        query = {key: values[-1] for key, values in parse_qs(url.query).items()}
        size = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(size)) if size else None
        try:
            if not self.api.authorized(self.headers.get("Authorization") or ""):
                raise Rejected(401, "Unauthorized", "Unauthorized")
            self.api._hold(f"{method} {url.path}")
            if query.get("watch") in ("true", "1"):
                self._watch(query)
                return
            self._send(200, self.api.answer(method, url.path, query, body))
        except Rejected as rejected:
            self._send(rejected.code, status(rejected.code, rejected.reason, str(rejected)))

    do_POST = do_PUT = do_DELETE = do_GET

    def _send(self, code: int, obj: Obj) -> None:
        payload = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _watch(self, query: dict[str, str]) -> None:
        self.api.check_watch(query)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

        def send(line: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            self.wfile.flush()

        try:
            self.api.watch(query, send)
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
        except OSError:
            self.close_connection = True
