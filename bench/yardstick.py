"""A minimal grpcio server answering the daemon's Allocate, to compare CPU per call with.

grpcio is gRPC's C core with protobuf's C decoder: about as cheap as a Python process can
answer a call. Run as ``python -m bench.yardstick SOCKET``; it answers what the daemon answers
for one share of the PCC profile and serves until killed.
"""

from __future__ import annotations

import sys
import threading
from concurrent import futures
from typing import Any

import grpc

from pcc_plugin.sim._pb import deviceplugin_v1beta1_pb2 as pb


def allocate(request: Any, context: Any) -> Any:
    return pb.AllocateResponse(
        container_responses=[
            pb.ContainerAllocateResponse(
                devices=[
                    pb.DeviceSpec(
                        container_path="/dev/sev-guest",
                        host_path="/dev/sev-guest",
                        permissions="rw",
                    )
                ],
                mounts=[pb.Mount(container_path="/var/run/pcc", host_path="/var/run/pcc")],
            )
            for _ in request.container_requests
        ]
    )


def main(socket_path: str) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    handler = grpc.unary_unary_rpc_method_handler(
        allocate,
        request_deserializer=pb.AllocateRequest.FromString,
        response_serializer=pb.AllocateResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("v1beta1.DevicePlugin", {"Allocate": handler})]
    )
    server.add_insecure_port(f"unix:{socket_path}")
    server.start()
    print("serving", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv[1])
