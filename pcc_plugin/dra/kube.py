"""The API server: the few requests the DRA mode makes, over httpx on trio, objects as JSON.

One client per driver, one connection to the API server: HTTP/2 where the server offers it
(kube-apiserver does, over TLS), as client-go speaks, so the open watch, the claims' reads and
the slices' writes share it and a watch's renewal opens nothing new; HTTP/1.1 otherwise, its
connections kept alive (`KEEPALIVE_EXPIRY`, as client-go's idle connections). TCP keepalive
probes (`KEEPALIVE`) close a connection whose peer went away without a word (a node or load
balancer gone, a partition) within `DEAD_PEER_WITHIN`: what client-go finds with HTTP/2 pings,
which httpx does not send. A watch is not judged by its silence: kube-apiserver sends a
bookmark only once its cache has moved past the watch's resource version, which a quiet
cluster may not do for many minutes; a watch the API server does not end when it was asked to
(`WATCH_GRACE` after) is dead.

Every request has a deadline of its own (`REQUEST_TIMEOUT`), credentials included: the
service account's token file is read again when kubelet rotates it (or the API server refuses
it), an exec credential plugin runs under `EXEC_TIMEOUT` (killed after it) and its token is
used until shortly before its `expirationTimestamp`. Whatever goes wrong on the way (no
answer, an error status, a credential plugin failing or hanging, a malformed answer, a bug
here) is one `RequestFailed`: to the driver an outage of the API server, never of its sockets.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import json
import logging
import os
import random
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Generator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import attrs
import httpx
import trio

from pcc_plugin import __version__
from pcc_plugin.errors import FatalError
from pcc_plugin.generations import Backoff, Outage

# One request, from its start (credentials included) to its whole answer.
REQUEST_TIMEOUT = 10.0
# An exec credential plugin's run; killed after it.
EXEC_TIMEOUT = 10.0
# After a failed request the next waits up to this long, doubling to the cap, jittered over
# the whole range: the nodes of a pool that lost the API server together come back spread
# over about API_RETRY_CAP (docs/dra.md, "What each mode costs").
API_RETRY_FIRST = 1.0
API_RETRY_CAP = 45.0
# An error line while the API server cannot be reached, at most this often.
REPORT_EVERY = 60.0
# A response being closed: its stream's reset (HTTP/2) or its connection's close is all left.
CLOSE_TIMEOUT = 1.0
# The API server ends a watch at the timeout it was given (its handler's context); one still
# open this long after is dead (an API server that hangs with its connection up).
WATCH_GRACE = 30.0
# TCP keepalive: probes after this many seconds without a packet, then every interval; the
# connection is closed once DEAD_PEER_WITHIN passes unanswered (TCP_USER_TIMEOUT also bounds
# data the peer never acknowledges).
KEEPALIVE_IDLE = 15
KEEPALIVE_INTERVAL = 5
KEEPALIVE_PROBES = 3
DEAD_PEER_WITHIN = KEEPALIVE_IDLE + KEEPALIVE_INTERVAL * KEEPALIVE_PROBES
KEEPALIVE = [
    (socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1),
    (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE),
    (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL),
    (socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES),
    (socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, DEAD_PEER_WITHIN * 1000),
]
# An idle HTTP/1.1 connection is kept this long (client-go's IdleConnTimeout).
KEEPALIVE_EXPIRY = 90.0
# What an answer may hold: a watch event (one slice, 64 or 128 devices, some 100 KiB), a
# list or an object. etcd keeps objects of 1.5 MiB at most.
MAX_ANSWER_BYTES = 8 << 20
# What of a credential plugin's output is read.
MAX_CREDENTIAL_BYTES = 1 << 20
# A plugin's token is taken again this long before it expires (at most half its lifetime).
REFRESH_BEFORE = 60.0

# The exec credential API versions client-go speaks; both answer with an ExecCredential whose
# status carries the token.
EXEC_V1 = "client.authentication.k8s.io/v1"
EXEC_V1BETA1 = "client.authentication.k8s.io/v1beta1"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
RESOURCE_API = "/apis/resource.k8s.io/v1"
SLICES = f"{RESOURCE_API}/resourceslices"
FIELD_MANAGER = "pcc-device-plugin"

Obj = dict[str, Any]
log = logging.getLogger(__name__)


class RequestFailed(Exception):
    """A request that did not succeed: `code` is the status the API server answered with (in
    a watch's ERROR event too), None if it did not answer; the message is one line."""

    def __init__(self, message: str, code: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason


class CredentialError(Exception):
    """No credentials now (a token file unreadable, a plugin failing): one line."""


class Api:
    """The requests the driver makes; every one returns JSON objects or raises RequestFailed.

    Runs on trio (httpx's connections through httpcore's trio backend)."""

    def __init__(self, client: httpx.AsyncClient, auth: BearerAuth | None = None) -> None:
        self._client = client
        self._auth = auth
        # Told of each request: its verb, what it is about, and the status (or "none").
        self.counted: Callable[[str, str, str], None] = lambda verb, what, code: None
        # Kinds of unexpected error already logged with their traceback (a bug: once each).
        self._unexpected: set[str] = set()

    async def get_node(self, name: str) -> Obj:
        return await self._json("get", "nodes", "GET", f"/api/v1/nodes/{quote(name, safe='')}")

    async def node_uid(self, name: str) -> str:
        return str((await self.get_node(name)).get("metadata", {}).get("uid", ""))

    async def get_claim(self, namespace: str, name: str) -> Obj:
        where = f"namespaces/{quote(namespace, safe='')}/resourceclaims/{quote(name, safe='')}"
        return await self._json("get", "resourceclaims", "GET", f"{RESOURCE_API}/{where}")

    async def list_slices(self, fields: dict[str, str]) -> tuple[list[Obj], str]:
        """The slices the field selector picks, and the list's resource version."""
        answer = await self._json(
            "list", "resourceslices", "GET", SLICES, params={"fieldSelector": _selector(fields)}
        )
        items = answer.get("items") or []
        return list(items), str((answer.get("metadata") or {}).get("resourceVersion", ""))

    async def watch_slices(
        self,
        fields: dict[str, str],
        version: str,
        seconds: int,
        event: Callable[[str, Obj], None],
        opened: Callable[[], None] = lambda: None,
    ) -> None:
        """Call `opened` once the API server took the watch, then pass each event after
        `version` to `event` (bookmarks too), until the API server ends the watch after
        `seconds`; RequestFailed if it breaks, is still open WATCH_GRACE after that (dead),
        or ends in an ERROR event (410 Gone once `version` is too old)."""
        params = {
            "fieldSelector": _selector(fields),
            "watch": "true",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(seconds),
        }
        async with self._streamed("watch", "resourceslices", SLICES, params) as lines:
            opened()
            with trio.move_on_after(seconds + WATCH_GRACE):
                async for line in lines:
                    try:
                        decoded = json.loads(line)
                        kind, obj = str(decoded["type"]), decoded["object"]
                    except (ValueError, KeyError, TypeError) as exc:
                        raise RequestFailed(f"a watch event is not JSON: {exc}") from None
                    if kind == "ERROR":
                        raise _status_failure(obj, 500)
                    event(kind, obj)
                return
            raise RequestFailed(
                f"the API server did not end the watch of ResourceSlices {WATCH_GRACE:.0f} s "
                f"after the {seconds} s it was asked for: its connection is dead"
            )

    async def create_slice(self, obj: Obj, *, dry_run: bool = False) -> Obj:
        params = {"fieldManager": FIELD_MANAGER} | ({"dryRun": "All"} if dry_run else {})
        return await self._json("create", "resourceslices", "POST", SLICES, params, obj)

    async def replace_slice(self, obj: Obj) -> Obj:
        name = quote(obj["metadata"]["name"], safe="")
        path, params = f"{SLICES}/{name}", {"fieldManager": FIELD_MANAGER}
        return await self._json("update", "resourceslices", "PUT", path, params, obj)

    async def delete_slice(self, name: str) -> None:
        await self._json("delete", "resourceslices", "DELETE", f"{SLICES}/{quote(name, safe='')}")

    async def close(self) -> None:
        await self._client.aclose()

    async def _json(
        self,
        verb: str,
        what: str,
        method: str,
        path: str,
        params: dict[str, str] | None = None,
        body: Obj | None = None,
    ) -> Obj:
        """One request's answer, whole, within REQUEST_TIMEOUT."""
        with self._failures(verb, what, path):
            await self._credentials()
            with trio.fail_after(REQUEST_TIMEOUT):
                response = await self._client.request(method, path, params=params, json=body)
                self.counted(verb, what, str(response.status_code))
                content = response.content
            if len(content) > MAX_ANSWER_BYTES:
                raise RequestFailed(f"the answer is larger than {MAX_ANSWER_BYTES} bytes")
            answer = json.loads(content) if content else {}
            if response.status_code >= 400:
                raise _status_failure(answer, response.status_code)
            if not isinstance(answer, dict):
                raise RequestFailed("the answer is not a JSON object")
            return answer

    @contextlib.asynccontextmanager
    async def _streamed(
        self, verb: str, what: str, path: str, params: dict[str, str]
    ) -> AsyncIterator[AsyncIterator[bytes]]:
        """A GET's answer read as it comes, line by line; its head within REQUEST_TIMEOUT."""
        with self._failures(verb, what, path):
            await self._credentials()
            with trio.fail_after(REQUEST_TIMEOUT):
                request = self._client.build_request("GET", path, params=params)
                response = await self._client.send(request, stream=True)
                self.counted(verb, what, str(response.status_code))
            try:
                if response.status_code >= 400:
                    with trio.fail_after(REQUEST_TIMEOUT):
                        content = await _bounded(response.aiter_bytes())
                    raise _status_failure(_loads(content), response.status_code)
                yield _stream_lines(response.aiter_bytes())
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
                    await response.aclose()

    async def _credentials(self) -> None:
        """The token the request will carry, got now, within its own deadline (a plugin's
        run), so that the request's deadline is the request's alone."""
        if self._auth is not None:
            await self._auth.ready()

    @contextlib.contextmanager
    def _failures(self, verb: str, what: str, path: str) -> Generator[None, None, None]:
        """Whatever a request fails with, as RequestFailed; one without an answer counted."""
        try:
            yield
            return
        except RequestFailed as exc:
            failed = exc
        except trio.TooSlowError:
            failed = RequestFailed(f"no answer within {REQUEST_TIMEOUT:.0f} s")
        except CredentialError as exc:
            failed = RequestFailed(f"no credentials: {exc}")
        except httpx.RemoteProtocolError as exc:
            # h2's own words for a GOAWAY or a reset are its events' reprs.
            failed = RequestFailed(f"the API server closed the connection ({exc})")
        except (httpx.HTTPError, OSError, ssl.SSLError, ValueError) as exc:
            failed = RequestFailed(_first_line(exc))
        except Exception as exc:
            kind = type(exc).__name__
            if kind not in self._unexpected:
                self._unexpected.add(kind)
                log.error("%s %s failed unexpectedly (taken for an API server outage)",
                          verb, path, exc_info=exc)  # fmt: skip
            failed = RequestFailed(f"{kind}: {_first_line(exc)}")
        if failed.code is None:
            self.counted(verb, what, "none")
        raise failed from None


def _selector(fields: dict[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in fields.items())


def _first_line(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    return text.splitlines()[0]


def _loads(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return {}


def _status_failure(status: Any, code: int) -> RequestFailed:
    """The API server's Status (or what stands in its place) as RequestFailed."""
    status = status if isinstance(status, dict) else {}
    code = int(status.get("code") or code)
    reason = str(status.get("reason") or "")
    message = _first_line(Exception(str(status.get("message") or "")))
    return RequestFailed(f"{code} {reason or 'Error'}: {message}", code, reason)


async def _bounded(chunks: AsyncIterator[bytes]) -> bytes:
    content = b""
    async for chunk in chunks:
        content += chunk
        if len(content) > MAX_ANSWER_BYTES:
            raise RequestFailed(f"the answer is larger than {MAX_ANSWER_BYTES} bytes")
    return content


async def _stream_lines(chunks: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
    """The lines of a streamed answer (a watch's events), each at most MAX_ANSWER_BYTES."""
    pending = b""
    async for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.strip():
                yield line
        if len(pending) > MAX_ANSWER_BYTES:
            raise RequestFailed(f"a watch event is larger than {MAX_ANSWER_BYTES} bytes")
    if pending.strip():
        yield pending


# Credentials


class TokenSource:
    """Where a bearer token comes from; `token(refused)` gives a newer one than `refused`
    (which the API server refused) if there is one."""

    async def token(self, refused: str | None = None) -> str:
        raise NotImplementedError


@attrs.define
class StaticToken(TokenSource):
    value: str

    async def token(self, refused: str | None = None) -> str:
        return self.value


@attrs.define
class TokenFile(TokenSource):
    """A token file (the service account's, which kubelet rotates): read again when it
    changes, or when the API server refused what it held."""

    path: Path
    _value: str | None = None
    _seen: tuple[int, int, int] | None = None

    async def token(self, refused: str | None = None) -> str:
        try:
            stat = self.path.stat()
            seen = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
            if self._value is None or seen != self._seen or self._value == refused:
                self._value, self._seen = self.path.read_text().strip(), seen
        except OSError as exc:
            raise CredentialError(
                f"cannot read the token file {self.path}: {exc.strerror}"
            ) from None
        return self._value


@attrs.define
class ExecPlugin(TokenSource):
    """A kubeconfig's exec credential plugin: run when there is no token, when the one it gave
    is about to expire or was refused; one run at a time, each within EXEC_TIMEOUT."""

    command: str
    args: list[str]
    env: dict[str, str]
    _value: str | None = None
    # Wall-clock time (the plugin's expirationTimestamp is one) after which it is run again.
    _renew_at: float = 0.0
    _lock: trio.Lock = attrs.Factory(trio.Lock)

    async def token(self, refused: str | None = None) -> str:
        async with self._lock:
            if self._value is None or self._value == refused or time.time() >= self._renew_at:
                self._value, self._renew_at = await self._run()
            return self._value

    async def _run(self) -> tuple[str, float]:
        output = await self._output()
        try:
            status = json.loads(output)["status"]
            token = status.get("token")
            expires = status.get("expirationTimestamp")
        except (ValueError, KeyError, TypeError, AttributeError):
            raise CredentialError(
                f"the exec credential plugin {self.command} printed no ExecCredential"
            ) from None
        if not isinstance(token, str) or not token:
            what = "a client certificate" if status.get("clientCertificateData") else "no token"
            raise CredentialError(
                f"the exec credential plugin {self.command} gave {what}; this driver needs a "
                "token: use a plugin that prints status.token"
            )
        if not expires:
            return token, float("inf")
        try:
            at = datetime.datetime.fromisoformat(str(expires).replace("Z", "+00:00")).timestamp()
        except ValueError:
            raise CredentialError(
                f"the exec credential plugin {self.command} gave an expirationTimestamp that is "
                f"not a time: {expires}"
            ) from None
        now = time.time()
        return token, at - min(REFRESH_BEFORE, max(0.0, at - now) / 2)

    async def _output(self) -> bytes:
        """The plugin's standard output, at most MAX_CREDENTIAL_BYTES of it; killed after
        EXEC_TIMEOUT (or as the caller gives up)."""
        output, errors = bytearray(), bytearray()

        async def drain(stream: trio.abc.ReceiveStream | None, into: bytearray) -> None:
            assert stream is not None
            async for chunk in stream:
                into += chunk[: MAX_CREDENTIAL_BYTES - len(into)]

        try:
            process = await trio.lowlevel.open_process(
                [self.command, *self.args], env={**os.environ, **self.env},
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            )  # fmt: skip
        except OSError as exc:
            raise CredentialError(
                f"cannot run the exec credential plugin {self.command}: {exc.strerror}"
            ) from None
        try:
            with trio.move_on_after(EXEC_TIMEOUT) as deadline:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(drain, process.stdout, output)
                    nursery.start_soon(drain, process.stderr, errors)
                await process.wait()
        finally:
            with trio.CancelScope(shield=True):
                if process.returncode is None:
                    process.kill()
                await process.wait()
                for stream in (process.stdout, process.stderr):
                    if stream is not None:
                        await stream.aclose()
        if deadline.cancelled_caught:
            raise CredentialError(
                f"the exec credential plugin {self.command} did not answer within "
                f"{EXEC_TIMEOUT:.0f} s: killed"
            )
        if process.returncode != 0:
            said = errors.decode(errors="replace").strip().splitlines()
            raise CredentialError(
                f"the exec credential plugin {self.command} exited with {process.returncode}"
                + (f": {said[-1]}" if said else "")
            )
        return bytes(output)


class BearerAuth(httpx.Auth):
    """A bearer token from `source` on every request; once again with a newer one if the API
    server answers 401 (a token rotated under it)."""

    def __init__(self, source: TokenSource) -> None:
        self._source = source

    async def ready(self) -> None:
        await self._source.token()

    def sync_auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, Any, None]:
        raise RuntimeError("the API client is asynchronous only")

    async def async_auth_flow(
        self, request: httpx.Request
    ) -> AsyncGenerator[httpx.Request, httpx.Response]:
        token = await self._source.token()
        request.headers["Authorization"] = f"Bearer {token}"
        response = yield request
        if response.status_code != 401:
            return
        fresh = await self._source.token(refused=token)
        if fresh != token:
            request.headers["Authorization"] = f"Bearer {fresh}"
            yield request


# Configuration


@attrs.frozen
class ApiServer:
    """Where the API server is and how to talk to it."""

    server: str
    context: ssl.SSLContext
    auth: httpx.Auth | None


def open_client(kubeconfig: str) -> Api:
    """A client for the API server; FatalError (one line) without credentials."""
    try:
        found = _from_kubeconfig(Path(kubeconfig)) if kubeconfig else _in_cluster()
    except ExecPluginRefused as exc:
        raise FatalError(
            f"cannot use the credentials of --kubeconfig {kubeconfig}: {exc}"
        ) from None
    except (CredentialsUnreadable, OSError, ValueError, ssl.SSLError) as exc:
        if kubeconfig:
            where, fix = f"--kubeconfig {kubeconfig}", "give a readable kubeconfig file"
        else:
            where = "the pod's service account"
            fix = "mount its token (automountServiceAccountToken: true, as manifests/overlays/dra)"
        raise FatalError(
            f"cannot read API server credentials from {where}: {_first_line(exc)}; {fix}"
        ) from None
    transport = httpx.AsyncHTTPTransport(
        verify=found.context,
        http2=True,
        socket_options=KEEPALIVE,
        limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY),
    )
    auth = found.auth
    return Api(
        httpx.AsyncClient(
            base_url=found.server,
            auth=found.auth,
            transport=transport,
            headers={
                "User-Agent": f"pcc-device-plugin/{__version__}",
                "Accept": "application/json",
            },
            # Deadlines are the Api's own (they cover the credentials too); these only make
            # httpx wait no longer.
            timeout=httpx.Timeout(REQUEST_TIMEOUT, read=None),
        ),
        auth if isinstance(auth, BearerAuth) else None,
    )


class CredentialsUnreadable(Exception):
    """The credentials cannot be read: one line."""


class ExecPluginRefused(CredentialsUnreadable):
    """An exec credential plugin the driver cannot run; the message says why and what to use."""


def _in_cluster() -> ApiServer:
    """The pod's service account, as client-go's rest.InClusterConfig reads it."""
    host, port = (
        os.environ.get("KUBERNETES_SERVICE_HOST"),
        os.environ.get("KUBERNETES_SERVICE_PORT"),
    )
    if not host or not port:
        raise CredentialsUnreadable(
            "KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set"
        )
    token = SERVICE_ACCOUNT / "token"
    # Read once now: a pod without a token is refused at start, with the fix.
    token.read_text()
    context = ssl.create_default_context(cafile=str(SERVICE_ACCOUNT / "ca.crt"))
    host = f"[{host}]" if ":" in host else host
    return ApiServer(f"https://{host}:{port}", context, BearerAuth(TokenFile(token)))


def _from_kubeconfig(path: Path) -> ApiServer:
    """The current context of a kubeconfig: its cluster, and its user's credentials."""
    if not path.expanduser().is_file():
        raise CredentialsUnreadable(f"Configuration file {path} not found")
    path = path.expanduser()
    text = path.read_text()
    try:
        # A kubeconfig in JSON (JSON is YAML) needs no YAML parser.
        conf = json.loads(text)
    except ValueError:
        import yaml

        try:
            conf = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise CredentialsUnreadable(f"{path} is not YAML: {_first_line(exc)}") from None
    if not isinstance(conf, dict):
        raise CredentialsUnreadable(f"{path} is not a kubeconfig (a YAML mapping)")
    context = _named(conf, "contexts", conf.get("current-context"), "context")
    cluster = _named(conf, "clusters", context.get("cluster"), "cluster")
    user = _named(conf, "users", context.get("user"), "user")
    server = str(cluster.get("server") or "")
    if not server:
        raise CredentialsUnreadable(f"{path}: the current context's cluster names no server")

    def file(name: str) -> str:
        return str((path.parent / os.path.expanduser(name)).resolve())

    if cluster.get("insecure-skip-tls-verify"):
        context_ = ssl.create_default_context()
        context_.check_hostname = False
        context_.verify_mode = ssl.CERT_NONE
    elif server.startswith("http://"):
        # No TLS to set up: a context that is never used, without the system's CA bundle.
        context_ = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    elif cluster.get("certificate-authority-data"):
        data = base64.b64decode(cluster["certificate-authority-data"]).decode()
        context_ = ssl.create_default_context(cadata=data)
    elif cluster.get("certificate-authority"):
        context_ = ssl.create_default_context(cafile=file(cluster["certificate-authority"]))
    else:
        context_ = ssl.create_default_context()
    _client_certificate(context_, user, file)

    auth: httpx.Auth | None = None
    if isinstance(user.get("exec"), dict):
        auth = BearerAuth(exec_plugin(user["exec"], cluster))
    elif user.get("token"):
        auth = BearerAuth(StaticToken(str(user["token"])))
    elif user.get("tokenFile"):
        auth = BearerAuth(TokenFile(Path(file(user["tokenFile"]))))
    elif user.get("username") and user.get("password"):
        auth = httpx.BasicAuth(str(user["username"]), str(user["password"]))
    elif user.get("auth-provider"):
        raise CredentialsUnreadable(
            f"{path}: its user's auth-provider is not supported; use exec or a token"
        )
    return ApiServer(server, context_, auth)


def _named(conf: Obj, section: str, name: Any, key: str) -> Obj:
    for entry in conf.get(section) or []:
        if isinstance(entry, dict) and entry.get("name") == name:
            found = entry.get(key) or {}
            if isinstance(found, dict):
                return found
    raise CredentialsUnreadable(f"its {section} have no {name!r} (current-context)")


def _client_certificate(context: ssl.SSLContext, user: Obj, file: Callable[[str], str]) -> None:
    """The user's client certificate and key, from files or inline data, into `context`."""
    if user.get("client-certificate") and user.get("client-key"):
        context.load_cert_chain(file(user["client-certificate"]), file(user["client-key"]))
        return
    if not (user.get("client-certificate-data") and user.get("client-key-data")):
        return
    # ssl loads a certificate chain from files only: written where nobody else can read.
    with tempfile.TemporaryDirectory(prefix="pcc-kubeconfig-") as directory:
        paths = []
        for key in ("client-certificate-data", "client-key-data"):
            where = Path(directory) / key
            where.touch(mode=0o600)
            where.write_bytes(base64.b64decode(user[key]))
            paths.append(str(where))
        context.load_cert_chain(*paths)


def exec_plugin(plugin: Obj, cluster: Obj) -> ExecPlugin:
    """A kubeconfig user's `exec` section, run as client-go runs it, or ExecPluginRefused.

    The plugin gets KUBERNETES_EXEC_INFO as client-go sets it (some plugins choose their
    output by it): not interactive (a daemon has no terminal), with the cluster when
    provideClusterInfo asks.
    """
    version = plugin.get("apiVersion")
    if version not in (EXEC_V1, EXEC_V1BETA1):
        raise ExecPluginRefused(
            f"its exec credential plugin has apiVersion {version}; use {EXEC_V1} or {EXEC_V1BETA1}"
        )
    if plugin.get("interactiveMode") == "Always":
        raise ExecPluginRefused(
            "its exec credential plugin needs a terminal (interactiveMode: Always), which a "
            "daemon has not; use a plugin with interactiveMode Never or IfAvailable"
        )
    if not plugin.get("command"):
        raise ExecPluginRefused("its exec credential plugin names no command")
    spec: Obj = {"interactive": False}
    if plugin.get("provideClusterInfo"):
        spec["cluster"] = {
            key: cluster[key]
            for key in ("server", "certificate-authority-data", "insecure-skip-tls-verify")
            if key in cluster
        }
    info = {"apiVersion": version, "kind": "ExecCredential", "spec": spec}
    env = {
        str(var.get("name")): str(var.get("value", ""))
        for var in plugin.get("env") or []
        if isinstance(var, dict)
    }
    env["KUBERNETES_EXEC_INFO"] = json.dumps(info)
    return ExecPlugin(str(plugin["command"]), [str(arg) for arg in plugin.get("args") or []], env)


# What callers make of failures


def status_code(error: BaseException) -> int | None:
    """The HTTP status the API server answered with (in a watch's ERROR event too), None if it
    did not answer."""
    return error.code if isinstance(error, RequestFailed) else None


def retrying(log: logging.Logger, rng: random.Random | None = None) -> tuple[Backoff, Outage]:
    """The waits of a loop that asks the API server until it answers (jittered by `rng`), and
    its error lines."""
    outage = Outage(
        log,
        quiet="{problem}; retrying",
        loud="{problem}; retrying",
        back="The API server answers again after {seconds:.0f} s",
        repeat=REPORT_EVERY,
    )
    backoff = Backoff(
        first=API_RETRY_FIRST, cap=API_RETRY_CAP, least=0.0, rng=rng or random.Random()
    )
    return backoff, outage


def why_failed(error: RequestFailed) -> str:
    """`describe_error`, saying so when the API server did not answer at all."""
    why = describe_error(error)
    return why if status_code(error) is not None else f"the API server cannot be reached: {why}"


def describe_error(error: BaseException) -> str:
    """One line: the API server's own message, or what went wrong on the way to it."""
    return _first_line(error)
