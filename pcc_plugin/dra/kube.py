"""The API server, through lightkube's async client, on the asyncio side of the bridge.

lightkube runs on asyncio (httpx through anyio), not on trio: its exec credential plugins
(kubeconfigs whose user runs a command, as cloud providers' do) start the command with
asyncio's subprocess API. Callers are trio code; `Api` carries each request across.

In-cluster credentials by default (the pod's service account: its token is read again when
the API server refuses it, as kubelet rotates it), a kubeconfig with --kubeconfig. Every
request has a deadline (`REQUEST_TIMEOUT`); a watch has none of its own, so its callers
bound it.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any, TypeVar, cast

import httpx
import lightkube
import trio
import yaml
from lightkube.core.exceptions import ApiError, ConfigError
from lightkube.resources.core_v1 import Node
from lightkube.resources.resource_v1 import ResourceClaim, ResourceSlice

from pcc_plugin.bridge import call_asyncio
from pcc_plugin.errors import FatalError
from pcc_plugin.generations import Backoff, Outage

REQUEST_TIMEOUT = 10.0
# After a failed request the next waits this long, doubling to the cap, jittered.
API_RETRY_FIRST = 0.5
API_RETRY_CAP = 15.0
# An error line while the API server cannot be reached, at most this often.
REPORT_EVERY = 60.0
# A watch being closed: its connection's close is all that is left to do.
CLOSE_TIMEOUT = 1.0

# What a request to the API server can fail with: an answer (ApiError, with the status),
# or no answer (a connection refused, reset or timed out).
RequestFailed = httpx.HTTPError

# The exec credential API versions client-go speaks; lightkube 0.x reads the same
# ExecCredential (its status.token) but knows the second by name only.
EXEC_V1 = "client.authentication.k8s.io/v1"
EXEC_V1BETA1 = "client.authentication.k8s.io/v1beta1"

Obj = dict[str, Any]
_T = TypeVar("_T")


class Api:
    """The few requests the driver makes, objects as JSON dicts: lightkube's models stay here.

    Called from trio; each request runs as an asyncio task (`bridge.call_asyncio`)."""

    def __init__(self, client: lightkube.AsyncClient) -> None:
        self._client = client

    async def node_uid(self, name: str) -> str:
        node = await call_asyncio(self._client.get, Node, name)
        return str(_as_dict(node)["metadata"]["uid"])

    async def get_claim(self, namespace: str, name: str) -> Obj:
        return _as_dict(
            await call_asyncio(self._client.get, ResourceClaim, name, namespace=namespace)
        )

    async def list_slices(self, fields: dict[str, Any]) -> tuple[list[Obj], str]:
        """The slices the field selector picks, and the list's resource version."""

        async def listing() -> tuple[list[Obj], str]:
            pages = self._client.list(ResourceSlice, fields=fields)
            items = [_as_dict(item) async for item in pages]
            return items, str(pages.resourceVersion)

        return await call_asyncio(listing)

    async def watch_slices(
        self, fields: dict[str, Any], version: str
    ) -> AsyncGenerator[tuple[str, Obj], None]:
        """Events from `version` on, until the caller stops; RequestFailed if it breaks (410
        Gone once `version` is too old). The caller closes it (contextlib.aclosing)."""
        events = cast(
            "AsyncGenerator[tuple[str, Any], None]",
            self._client.watch(ResourceSlice, fields=fields, resource_version=version),
        )
        try:
            while True:
                try:
                    event, obj = await call_asyncio(_next, events)
                except StopAsyncIteration:
                    return
                yield event, _as_dict(obj)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT):
                await call_asyncio(events.aclose)

    async def create_slice(self, obj: Obj, *, dry_run: bool = False) -> Obj:
        return _as_dict(await call_asyncio(self._client.create, _slice(obj), dry_run=dry_run))

    async def replace_slice(self, obj: Obj) -> Obj:
        return _as_dict(await call_asyncio(self._client.replace, _slice(obj)))

    async def delete_slice(self, name: str) -> None:
        await call_asyncio(self._client.delete, ResourceSlice, name)

    async def close(self) -> None:
        await call_asyncio(self._client.close)


async def _next(events: AsyncGenerator[_T, None]) -> _T:
    # Iterated first on asyncio's side, the generator is asyncio's to finalize, not trio's.
    return await anext(events)


def _as_dict(model: Any) -> Obj:
    return cast(Obj, model.to_dict())


def _slice(obj: Obj) -> Any:
    return ResourceSlice.from_dict(obj)  # type: ignore[no-untyped-call]


def open_client(kubeconfig: str) -> Api:
    """A client for the API server; FatalError (one line) without credentials."""
    try:
        config = (
            _read_kubeconfig(kubeconfig)
            if kubeconfig
            else lightkube.KubeConfig.from_service_account()
        )
        return Api(
            lightkube.AsyncClient(
                config, field_manager="pcc-device-plugin", timeout=httpx.Timeout(REQUEST_TIMEOUT)
            )
        )
    except ExecPluginRefused as exc:
        raise FatalError(
            f"cannot use the credentials of --kubeconfig {kubeconfig}: {exc}"
        ) from None
    except (ConfigError, KeyError, OSError, ValueError, yaml.YAMLError) as exc:
        if kubeconfig:
            where, fix = f"--kubeconfig {kubeconfig}", "give a readable kubeconfig file"
        else:
            where = "the pod's service account"
            fix = "mount its token (automountServiceAccountToken: true, as manifests/overlays/dra)"
        raise FatalError(
            f"cannot read API server credentials from {where}: {describe_error(exc)}; {fix}"
        ) from None


def _read_kubeconfig(path: str) -> lightkube.KubeConfig:
    """lightkube's KubeConfig of the file, its current context's exec credential plugin (if
    any) given what client-go gives one."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"Configuration file {path} not found")
    conf = yaml.safe_load(file.read_text())
    if not isinstance(conf, dict):
        raise ConfigError(f"{path} is not a kubeconfig (a YAML mapping)")
    conf = copy.deepcopy(conf)
    contexts = {
        entry.get("name"): entry.get("context") or {} for entry in conf.get("contexts") or []
    }
    context = contexts.get(conf.get("current-context"), {})
    clusters = {
        entry.get("name"): entry.get("cluster") or {} for entry in conf.get("clusters") or []
    }
    for entry in conf.get("users") or []:
        user = entry.get("user") or {}
        if entry.get("name") == context.get("user") and isinstance(user.get("exec"), dict):
            user["exec"] = exec_plugin(user["exec"], clusters.get(context.get("cluster"), {}))
    return lightkube.KubeConfig.from_dict(conf, fname=file)


class ExecPluginRefused(ConfigError):
    """An exec credential plugin the driver cannot run; the message says why and what to use."""


def exec_plugin(plugin: Obj, cluster: Obj) -> Obj:
    """A kubeconfig user's `exec` section as lightkube 0.x runs it, or ExecPluginRefused.

    v1 and v1beta1 plugins both print an ExecCredential whose status.token lightkube reads;
    lightkube knows v1 by name only, so a v1 plugin is run as v1beta1 is. Either gets
    KUBERNETES_EXEC_INFO as client-go sets it (some plugins choose their output by it): not
    interactive (a daemon has no terminal), with the cluster when provideClusterInfo asks.
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
    spec: Obj = {"interactive": False}
    if plugin.get("provideClusterInfo"):
        spec["cluster"] = {
            key: cluster[key]
            for key in ("server", "certificate-authority-data", "insecure-skip-tls-verify")
            if key in cluster
        }
    info = {"apiVersion": version, "kind": "ExecCredential", "spec": spec}
    env = [var for var in plugin.get("env") or [] if var.get("name") != "KUBERNETES_EXEC_INFO"]
    env.append({"name": "KUBERNETES_EXEC_INFO", "value": json.dumps(info)})
    return {
        "apiVersion": EXEC_V1BETA1,
        "command": plugin.get("command"),
        "args": plugin.get("args") or [],
        "env": env,
    }


def status_code(error: BaseException) -> int | None:
    """The HTTP status the API server answered with (in a watch's ERROR event too), None if it
    did not answer."""
    if isinstance(error, ApiError):
        return error.status.code
    if isinstance(error, httpx.HTTPStatusError):
        return error.response.status_code
    return None


def retrying(log: logging.Logger) -> tuple[Backoff, Outage]:
    """The waits of a loop that asks the API server until it answers, and its error lines."""
    outage = Outage(
        log,
        quiet="{problem}; retrying",
        loud="{problem}; retrying",
        back="The API server answers again after {seconds:.0f} s",
        repeat=REPORT_EVERY,
    )
    return Backoff(first=API_RETRY_FIRST, cap=API_RETRY_CAP), outage


def why_failed(error: RequestFailed) -> str:
    """`describe_error`, saying so when the API server did not answer at all."""
    why = describe_error(error)
    return why if status_code(error) is not None else f"the API server cannot be reached: {why}"


def describe_error(error: BaseException) -> str:
    """One line: the API server's own message, or what went wrong on the way to it."""
    if isinstance(error, ApiError):
        return f"{error.status.code} {error.status.reason}: {error.status.message}"
    if isinstance(error, KeyError):
        return f"{error.args[0]} is not set"
    text = str(error) or type(error).__name__
    return text.splitlines()[0]
