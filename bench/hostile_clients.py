"""Careless and hostile clients, each run in a process of its own so that it does not share the
benchmark's GIL with the well-behaved client being timed.

    python -m bench.hostile_clients metrics PORT SECONDS RATE   # GET /metrics RATE times a second
    python -m bench.hostile_clients large SOCKET SECONDS        # 4 MiB Allocate requests in a loop

Each prints `ready` when it starts, then how many requests it made and how many were
answered as expected.
"""

from __future__ import annotations

import socket
import sys
import time

import grpc

from bench.harness import ALLOCATE
from pcc_plugin.sim._pb import deviceplugin_v1beta1_pb2 as pb

FOUR_MIB = 4 * 1024 * 1024
_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"


def flood_metrics(port: int, seconds: float, rate: float) -> tuple[int, int]:
    """GET /metrics at `rate` a second, one connection each, paced, for `seconds`."""
    sent = answered = 0
    print("ready", flush=True)
    started = time.monotonic()
    while (now := time.monotonic()) - started < seconds:
        due = started + sent / rate
        if due > now:
            time.sleep(due - now)
        sent += 1
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(_REQUEST)
            received = b""
            while chunk := conn.recv(65536):
                received += chunk
        answered += received.startswith(b"HTTP/1.1 200")
    return sent, answered


def large_messages(socket_path: str, seconds: float) -> tuple[int, int]:
    """AllocateRequests of 4 MiB (one container naming one 4 MiB ID), one after another.

    The daemon accepts messages of up to 4 MiB, reads this one and refuses the ID: the
    expected answer is INVALID_ARGUMENT.
    """
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=["x" * (FOUR_MIB - 16)])]
    ).SerializeToString()
    assert len(request) <= FOUR_MIB
    sent = answered = 0
    with grpc.insecure_channel(
        f"unix:{socket_path}", options=[("grpc.default_authority", "localhost")]
    ) as channel:
        call = channel.unary_unary(
            ALLOCATE, request_serializer=lambda data: data, response_deserializer=lambda data: data
        )
        print("ready", flush=True)
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            sent += 1
            try:
                call(request, timeout=10)
            except grpc.RpcError as error:
                answered += error.code() == grpc.StatusCode.INVALID_ARGUMENT
    return sent, answered


def main(argv: list[str]) -> None:
    kind, target, seconds = argv[0], argv[1], float(argv[2])
    if kind == "metrics":
        sent, answered = flood_metrics(int(target), seconds, float(argv[3]))
    else:
        sent, answered = large_messages(target, seconds)
    print(sent, answered, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
