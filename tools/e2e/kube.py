"""The cluster as the checks reach it: ``kubectl`` for what an operator does, the API server's
REST API (as the administrator) for what the checks read.

:class:`Watch` follows a list of objects (pods, nodes, daemonsets) through the API server's
watch and keeps every version it saw with the time it saw it, so that a check can wait for a
state and later ask what happened on the way (a pod's last status before it was deleted, when
it was scheduled, whether it was ever rejected). The watch's blocking reads run in a worker
thread; everything else runs in trio.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import trio

from .control_plane import API_SERVER, ControlPlane
from .poll import Unavailable, wait_for
from .report import now

Obj = dict[str, Any]
T = TypeVar("T")
CALL_TIMEOUT = 10.0
# A watch ends after this long (the API server's limit); long enough for any session.
WATCH_SECONDS = 3600
# After a watch ended (the API server stopped, or it expired the watch), how long the list
# may take to answer again.
RELIST_WITHIN = 300


@attrs.define
class Api:
    control_plane: ControlPlane
    opener: urllib.request.OpenerDirector = attrs.field(init=False)
    # Without the administrator's certificate: for requests with a token of their own.
    token_opener: urllib.request.OpenerDirector = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        pki = self.control_plane.pki
        context = ssl.create_default_context(cafile=str(pki.ca.certificate))
        self.token_opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
        )
        context = ssl.create_default_context(cafile=str(pki.ca.certificate))
        credential = self.control_plane.admin_credential
        context.load_cert_chain(str(credential.certificate), str(credential.key))
        self.opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context)
        )

    def _call(self, method: str, path: str, body: Obj | None, token: str | None) -> Obj:
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        request = urllib.request.Request(
            f"{API_SERVER}{path}",
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers=headers,
        )
        opener = self.opener if token is None else self.token_opener
        try:
            with opener.open(request, timeout=CALL_TIMEOUT) as answer:
                found: Obj = json.load(answer)
                return found
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace").strip()
            raise RuntimeError(f"{method} {path}: HTTP {error.code}: {detail}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as error:
            raise Unavailable(f"{method} {path}: {error}") from None

    async def call(
        self, method: str, path: str, body: Obj | None = None, token: str | None = None
    ) -> Obj:
        """The API server's answer to `method` on `path` (with `body` as JSON), as the
        administrator or, given a `token`, as whoever it names."""
        with trio.fail_after(CALL_TIMEOUT + 5):
            return await trio.to_thread.run_sync(
                self._call, method, path, body, token, abandon_on_cancel=True
            )

    async def get(self, path: str) -> Obj:
        return await self.call("GET", path)

    async def kubectl(self, *args: str, stdin: str | None = None, within: float = 120) -> str:
        """`kubectl` as the administrator; its output. A failure raises with kubectl's words."""
        env = dict(os.environ, KUBECONFIG=str(self.control_plane.admin))
        with trio.fail_after(within):
            result = await trio.run_process(
                ["kubectl", *args],
                stdin=None if stdin is None else stdin.encode(),
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                env=env,
            )
        if result.returncode != 0:
            error = result.stderr.decode().strip()
            raise AssertionError(f"kubectl {' '.join(args)}: exit {result.returncode}: {error}")
        return result.stdout.decode()

    def stream(self, path: str) -> Any:
        """An open response of a watch (one JSON event per line)."""
        return self.opener.open(f"{API_SERVER}{path}", timeout=WATCH_SECONDS + 60)


def key(obj: Obj) -> str:
    metadata = obj["metadata"]
    return f"{metadata.get('namespace', '')}/{metadata['name']}"


class Expired(Exception):
    """The API server ended a watch with an error event (410 Gone: its version is too old)."""


@attrs.define
class Watch:
    """The objects of one list path, as the API server's watch reports them.

    ``current``: by namespace/name, the objects that exist now. ``history``: by UID, every
    version seen, (time seen, event type, object), deletions included.
    """

    api: Api
    path: str
    current: dict[str, Obj] = attrs.field(factory=dict)
    history: dict[str, list[tuple[float, str, Obj]]] = attrs.field(factory=dict)
    changed: trio.Event = attrs.field(factory=trio.Event)

    def _apply(self, kind: str, obj: Obj) -> None:
        self.history.setdefault(obj["metadata"]["uid"], []).append((now(), kind, obj))
        if kind == "DELETED":
            self.current.pop(key(obj), None)
        else:
            self.current[key(obj)] = obj
        self.changed.set()
        self.changed = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """List, then follow the watch from that list's version, until cancelled. When the
        watch ends (the API server stopped, or it expired the watch), list again once the API
        server answers, with what changed meanwhile as events, and follow on from there."""
        version = await self._list()
        task_status.started()
        while True:
            # Abandoned when cancelled: the thread ends with the process.
            with contextlib.suppress(OSError, http.client.HTTPException, ValueError, Expired):
                await trio.to_thread.run_sync(
                    self._follow, version, trio.lowlevel.current_trio_token(),
                    abandon_on_cancel=True,
                )  # fmt: skip
            version, _ = await wait_for(f"the API server lists {self.path} again",
                                        self._relisted, RELIST_WITHIN)  # fmt: skip

    async def _list(self) -> str:
        """The objects as listed now, changes since the last list applied; its version."""
        listed = await self.api.get(self.path)
        items = {key(item): item for item in listed["items"]}
        for name, obj in list(self.current.items()):
            if name not in items:
                self._apply("DELETED", obj)
        for name, item in items.items():
            old = self.current.get(name)
            if (
                old is None
                or old["metadata"]["resourceVersion"] != item["metadata"]["resourceVersion"]
            ):
                self._apply("ADDED" if old is None else "MODIFIED", item)
        return str(listed["metadata"]["resourceVersion"])

    async def _relisted(self) -> str | None:
        try:
            return await self._list()
        except RuntimeError:
            return None  # an error status while the API server starts

    def _follow(self, version: str, token: trio.lowlevel.TrioToken) -> None:
        separator = "&" if "?" in self.path else "?"
        watch = f"{self.path}{separator}watch=1&resourceVersion={version}"
        watch += f"&timeoutSeconds={WATCH_SECONDS}"
        with self.api.stream(watch) as answer:
            for line in answer:
                event = json.loads(line)
                if event["type"] == "ERROR":
                    raise Expired(f"watch {self.path}: {event['object']}")
                trio.from_thread.run_sync(self._apply, event["type"], event["object"],
                                          trio_token=token)  # fmt: skip

    async def until(self, what: str, found: Callable[[], T | None], within: float) -> T:
        """Wait until `found()` (asked after each change) is not None; that. AssertionError
        naming `what` after `within` seconds."""
        try:
            with trio.fail_after(within):
                while (result := found()) is None:
                    await self.changed.wait()
                return result
        except trio.TooSlowError:
            raise AssertionError(f"{what}: not within {within:.0f} s") from None

    def versions(self, obj: Obj) -> list[tuple[float, str, Obj]]:
        return self.history.get(obj["metadata"]["uid"], [])
