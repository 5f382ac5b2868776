"""The API server, through lightkube's async client (httpx under trio, by anyio).

In-cluster credentials by default (the pod's service account: its token is read again when
the API server refuses it, as kubelet rotates it), a kubeconfig with --kubeconfig. Every
request has a deadline (`REQUEST_TIMEOUT`); a watch has none of its own, so its callers
bound it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import lightkube
from lightkube.core.exceptions import ApiError, ConfigError
from lightkube.resources.core_v1 import Node
from lightkube.resources.resource_v1 import ResourceClaim, ResourceSlice

from pcc_plugin.errors import FatalError

REQUEST_TIMEOUT = 10.0

# What a request to the API server can fail with: an answer (ApiError, with the status),
# or no answer (a connection refused, reset or timed out).
RequestFailed = httpx.HTTPError


Obj = dict[str, Any]


class Api:
    """The few requests the driver makes, objects as JSON dicts: lightkube's models stay here."""

    def __init__(self, client: lightkube.AsyncClient) -> None:
        self._client = client

    async def node_uid(self, name: str) -> str:
        node = await self._client.get(Node, name)
        return str(_as_dict(node)["metadata"]["uid"])

    async def get_claim(self, namespace: str, name: str) -> Obj:
        return _as_dict(await self._client.get(ResourceClaim, name, namespace=namespace))

    async def list_slices(self, fields: dict[str, Any]) -> tuple[list[Obj], str]:
        """The slices the field selector picks, and the list's resource version."""
        listing = self._client.list(ResourceSlice, fields=fields)
        items = [_as_dict(item) async for item in listing]
        return items, str(listing.resourceVersion)

    async def watch_slices(
        self, fields: dict[str, Any], version: str
    ) -> AsyncIterator[tuple[str, Obj]]:
        """Events from `version` on, until the caller stops; RequestFailed if it breaks."""
        watch = self._client.watch(ResourceSlice, fields=fields, resource_version=version)
        async for event, obj in watch:
            yield event, _as_dict(obj)

    async def create_slice(self, obj: Obj) -> Obj:
        return _as_dict(await self._client.create(_slice(obj)))

    async def replace_slice(self, obj: Obj) -> Obj:
        return _as_dict(await self._client.replace(_slice(obj)))

    async def delete_slice(self, name: str) -> None:
        await self._client.delete(ResourceSlice, name)

    async def close(self) -> None:
        await self._client.close()


def _as_dict(model: Any) -> Obj:
    found: Obj = model.to_dict()
    return found


def _slice(obj: Obj) -> Any:
    return ResourceSlice.from_dict(obj)  # type: ignore[no-untyped-call]


def open_client(kubeconfig: str) -> Api:
    """A client for the API server; FatalError (one line) without credentials."""
    try:
        config = (
            lightkube.KubeConfig.from_file(kubeconfig)
            if kubeconfig
            else lightkube.KubeConfig.from_service_account()
        )
        return Api(
            lightkube.AsyncClient(
                config, field_manager="pcc-device-plugin", timeout=httpx.Timeout(REQUEST_TIMEOUT)
            )
        )
    except (ConfigError, KeyError, OSError, ValueError) as exc:
        if kubeconfig:
            where, fix = f"--kubeconfig {kubeconfig}", "give a readable kubeconfig file"
        else:
            where = "the pod's service account"
            fix = "mount its token (automountServiceAccountToken: true, as manifests/overlays/dra)"
        raise FatalError(
            f"cannot read API server credentials from {where}: {describe_error(exc)}; {fix}"
        ) from None


def status_code(error: BaseException) -> int | None:
    """The HTTP status the API server answered with, None if it did not answer."""
    return error.status.code if isinstance(error, ApiError) else None


def describe_error(error: BaseException) -> str:
    """One line: the API server's own message, or what went wrong on the way to it."""
    if isinstance(error, ApiError):
        return f"{error.status.code} {error.status.reason}: {error.status.message}"
    if isinstance(error, KeyError):
        return f"{error.args[0]} is not set"
    text = str(error) or type(error).__name__
    return text.splitlines()[0]
