"""grpclib alone on asyncio serving the generated DevicePlugin service: the stack's floor.

No trio, no bridge, no bounds: betterproto2's generated server base with the two methods a
kubelet calls when it dials back (GetDevicePluginOptions, ListAndWatch's first list), so that
the daemon's CPU per dial-back can be read beside what grpclib itself needs for it. Run as
``python -m bench.stack_floor SOCKET``; prints ``serving`` and serves until killed.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator

from grpclib.server import Server

from pcc_plugin._proto import v1beta1 as api

DEVICES = [api.Device(id=f"pcc-{number}", health="Healthy") for number in range(16)]


class DevicePlugin(api.DevicePluginBase):
    async def get_device_plugin_options(self, message: api.Empty) -> api.DevicePluginOptions:
        return api.DevicePluginOptions()

    async def list_and_watch(self, message: api.Empty) -> AsyncIterator[api.ListAndWatchResponse]:
        yield api.ListAndWatchResponse(devices=DEVICES)
        await asyncio.Event().wait()


async def serve(socket_path: str) -> None:
    server = Server([DevicePlugin()])
    await server.start(path=socket_path)
    print("serving", flush=True)
    await server.wait_closed()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1]))
