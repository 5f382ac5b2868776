"""Allocate from several connections at once, each calling one after another: throughput.

    python -m bench.callers SOCKET DEVICE_ID CONNECTIONS SECONDS

The comparison (`bench.compare`) starts it as a process of its own, so that these calls do
not share the benchmark's GIL. Each connection is a grpcio channel of its own, driven by a
thread of its own. Prints `ready` once every connection has answered a call; then, SECONDS
later, the calls answered, the seconds they took and the CPU seconds this process used in
them (all its threads), which tells whether the clients rather than the server set the pace.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import grpc

from bench.harness import WAIT, allocate_method, allocate_request


def _connection(socket_path: str) -> Any:
    # A subchannel pool of its own: grpcio shares one connection among channels to one target.
    return grpc.insecure_channel(
        f"unix:{socket_path}",
        options=[("grpc.default_authority", "localhost"), ("grpc.use_local_subchannel_pool", 1)],
    )


def main(argv: list[str]) -> int:
    socket_path, device_id = argv[0], argv[1]
    connections, seconds = int(argv[2]), float(argv[3])
    request = allocate_request(device_id)
    channels = [_connection(socket_path) for _ in range(connections)]
    methods = [allocate_method(channel) for channel in channels]
    for method in methods:
        method(request, timeout=WAIT)
    go = threading.Barrier(connections + 1)
    until = [0.0]
    counts = [0] * connections
    failures: list[BaseException] = []

    def call(index: int) -> None:
        method = methods[index]
        go.wait()
        try:
            while time.monotonic() < until[0]:
                response = method(request, timeout=WAIT)
                if len(response.container_responses) != 1:
                    raise RuntimeError(f"unexpected Allocate answer: {response}")
                counts[index] += 1
        except BaseException as error:  # reported below, and the run fails
            failures.append(error)

    threads = [threading.Thread(target=call, args=(index,)) for index in range(connections)]
    for thread in threads:
        thread.start()
    print("ready", flush=True)
    cpu = time.process_time()
    started = time.monotonic()
    until[0] = started + seconds
    go.wait()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - started
    cpu = time.process_time() - cpu
    for channel in channels:
        channel.close()
    if failures:
        print(
            f"bench.callers: {len(failures)} connections failed: {failures[0]!r}", file=sys.stderr
        )
        return 1
    print(sum(counts), f"{elapsed:.6f}", f"{cpu:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
