"""The device-plugin mode on the shared skeleton (generations.py): one resource's generation.

Each generation serves a fresh socket name in kubelet's device-plugin directory,
`pcc-<pid>-<random>-<n>.sock` (bound under a temporary name and renamed into place once
listening), watches the directory, follows the newer instances of its resource (rollout.py),
and registers once it serves. Its answers are service.DevicePlugin's.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import trio

from pcc_plugin import grpc_server
from pcc_plugin._proto import v1beta1 as api
from pcc_plugin.flags import Flags
from pcc_plugin.generations import Generation, ServeGeneration
from pcc_plugin.inventory import watch_health
from pcc_plugin.plugin_dir import SocketNames, own_sockets, remove_stale_sockets, watch_plugin_dir
from pcc_plugin.registration import API_VERSION, Kubelet, KubeletLink, reregister_when_stream_ends
from pcc_plugin.resource import ResourceSpec
from pcc_plugin.rollout import Followers
from pcc_plugin.service import SERVICE, DevicePlugin
from pcc_plugin.state import ResourceState


class DevicePluginMode:
    """One resource served to kubelet's device manager."""

    server = "the device plugin server"
    directory_flags = "--device-plugin-path"

    def __init__(self, config: Flags, spec: ResourceSpec, state: ResourceState) -> None:
        self.plugin = DevicePlugin(
            spec,
            config.host_root,
            state,
            pre_start_check=config.pre_start_check,
            cdi_spec_dir=Path(config.cdi_spec_dir) if config.cdi else None,
            instance_name=config.instance_name,
        )
        self.state = state
        self.directory = Path(config.device_plugin_path)
        self._names = SocketNames(spec.socket_prefix)
        self._kubelet = Kubelet(state)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[ServeGeneration]:
        """The inventory's watch; generations once the resource's paths are in place."""
        async with trio.open_nursery() as nursery:
            await nursery.start(watch_health, self.plugin.inventory)
            await self.plugin.inventory.in_place.wait()
            yield self.serve_generation
            nursery.cancel_scope.cancel()

    async def serve_generation(self, generation: Generation) -> None:
        """Serve on a fresh socket, watch the directory, and register."""
        spec, plugin_dir, nursery = self.plugin.spec, self.directory, generation.nursery
        endpoint = next(self._names)
        link = KubeletLink(self.state)
        server = grpc_server.Server(
            link.tell_apart(self.plugin.methods(), SERVICE),
            self.state.handler_failed,
            link.connection_closed,
        )
        remove_stale_sockets(
            own_sockets(plugin_dir, spec.socket_prefix, endpoint), self._names.stem
        )
        own = await nursery.start(server.serve, plugin_dir / endpoint)
        followers = Followers(
            nursery, plugin_dir, spec.socket_prefix, self._names.stem, link, generation.restart
        )
        await nursery.start(
            watch_plugin_dir, generation.inotify, plugin_dir, endpoint, own, generation.restart,
            followers.appeared,
        )  # fmt: skip
        request = api.RegisterRequest(
            version=API_VERSION,
            endpoint=endpoint,
            resource_name=spec.name,
            options=self.plugin.options,
        )
        nursery.start_soon(self._kubelet.register, plugin_dir, request, link, generation.cause)
        nursery.start_soon(reregister_when_stream_ends, plugin_dir, link, generation.restart)
