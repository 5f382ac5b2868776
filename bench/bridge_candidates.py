"""The two ways to run grpclib (asyncio) under trio without trio-asyncio, measured side by side.

Each candidate serves the daemon's shape, reduced to its crossings: trio accepts a connection
on a unix socket and hands it to asyncio (`call_asyncio`), grpclib answers a unary call there,
and the connection's close wakes the trio task that owns it. In the ``+notify`` rows each call
also wakes a trio task as it ends (what the daemon's connection watcher needed of every call
until it learned to wait for the last one only). A grpcio client in this process drives it.

- ``guest``: trio as a guest of an asyncio host loop, one thread (`trio.lowlevel.start_guest_run`);
  asyncio code calls trio's sync API directly, trio code asyncio's.
- ``thread``: trio on the main thread, an asyncio loop on a thread of its own; every crossing
  goes through `loop.call_soon_threadsafe` / `TrioToken.run_sync_soon`.

    python -m bench.bridge_candidates            # both, one after the other, three times
    python -m bench.bridge_candidates serve guest SOCKET   # one server (the driver runs these)

Printed per candidate: unary call p50/p99 and the server's CPU per call (schedstat, every
thread), CPU per dial-back (connect, one call, close), and CPU over 5 s of idle.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import trio

from bench.procfs import cpu_ns
from pcc_plugin import _grpclib

METHOD = "/bench.Bench/Call"
ANSWER = b"\x0a\x0e" + b"x" * 14
CALLS = 3000
WARMUP = 300
DIALS = 500
IDLE = 5.0


class Candidate:
    """What the daemon needs of a bridge: both ways of calling, and a notification."""

    async def call_asyncio(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Any:
        raise NotImplementedError

    def notify(self, fn: Callable[[], None]) -> None:
        """Run trio-side `fn` (an Event's set) from asyncio code."""
        raise NotImplementedError

    def run(self, main: Callable[[Candidate], Awaitable[None]]) -> None:
        raise NotImplementedError


class Guest(Candidate):
    async def call_asyncio(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Any:
        task = asyncio.get_running_loop().create_task(fn(*args))
        done = trio.Event()
        task.add_done_callback(lambda _: done.set())
        try:
            await done.wait()
        finally:
            if not task.done():
                task.cancel()
                with trio.CancelScope(shield=True):
                    await done.wait()
        return task.result()

    def notify(self, fn: Callable[[], None]) -> None:
        fn()

    def run(self, main: Callable[[Candidate], Awaitable[None]]) -> None:
        loop = asyncio.new_event_loop()
        outcomes: list[Any] = []

        def done(outcome: Any) -> None:
            outcomes.append(outcome)
            loop.stop()

        start = functools.partial(
            trio.lowlevel.start_guest_run, main, self,
            run_sync_soon_threadsafe=loop.call_soon_threadsafe,
            run_sync_soon_not_threadsafe=loop.call_soon, done_callback=done,
        )  # fmt: skip
        loop.call_soon(start)
        loop.run_forever()
        loop.close()
        outcomes[0].unwrap()


class Thread(Candidate):
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.token: trio.lowlevel.TrioToken | None = None

    async def call_asyncio(self, fn: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> Any:
        assert self.token is not None
        future = asyncio.run_coroutine_threadsafe(fn(*args), self.loop)
        done = trio.Event()
        token = self.token
        future.add_done_callback(lambda _: token.run_sync_soon(done.set))
        try:
            await done.wait()
        finally:
            if not future.done():
                future.cancel()
                with trio.CancelScope(shield=True):
                    await done.wait()
        return future.result()

    def notify(self, fn: Callable[[], None]) -> None:
        assert self.token is not None
        self.token.run_sync_soon(fn)

    def run(self, main: Callable[[Candidate], Awaitable[None]]) -> None:
        thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        thread.start()

        async def owned() -> None:
            self.token = trio.lowlevel.current_trio_token()
            try:
                await main(self)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)

        trio.run(owned)
        thread.join()


CANDIDATES: dict[str, Callable[[], Candidate]] = {
    "guest": Guest,
    "thread": Thread,
}


class _Protocol(asyncio.Protocol):
    def __init__(self, grpc: asyncio.Protocol, lost: Callable[[], None]) -> None:
        self._grpc = grpc
        self._lost = lost

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._grpc.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._grpc.data_received(data)

    def eof_received(self) -> bool | None:
        return self._grpc.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._grpc.connection_lost(exc)
        self._lost()


async def serve(candidate: Candidate, path: str, notify: bool) -> None:
    # Set at each call's end, for a trio task that waits for it (the connection watcher).
    call_ended = [trio.Event()]

    def ended() -> None:
        call_ended[0].set()
        call_ended[0] = trio.Event()

    async def watch_calls() -> None:
        while True:
            await call_ended[0].wait()

    async def call(stream: _grpclib.ServerStream) -> None:
        await stream.recv_message()
        await stream.send_message(ANSWER)
        if notify:
            candidate.notify(ended)

    grpc = _grpclib.server({METHOD: (call, False)}, lambda path, stream: None, 65535)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path)
    sock.listen(64)
    listener = trio.SocketListener(trio.socket.from_stdlib_socket(sock))

    async def connection(stream: trio.SocketStream) -> None:
        conn = socket.socket(fileno=stream.socket.detach())
        closed = trio.Event()

        async def set_up() -> None:
            await asyncio.get_running_loop().connect_accepted_socket(
                lambda: _Protocol(_grpclib.protocol(grpc), lambda: candidate.notify(closed.set)),
                conn,
            )

        await candidate.call_asyncio(set_up)
        await closed.wait()

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, connection, [listener])
        nursery.start_soon(watch_calls)
        print("serving", flush=True)
        await trio.sleep_forever()


def measure(name: str, notify: bool) -> dict[str, float] | None:
    import grpc

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.sock"
        server = subprocess.Popen(
            [sys.executable, "-m", "bench.bridge_candidates", "serve", name, str(path),
             "notify" if notify else "quiet"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert server.stdout is not None
            if server.stdout.readline().strip() != "serving":
                assert server.stderr is not None
                print(f"{name}: did not start: {server.stderr.read().strip().splitlines()[-1]}")
                return None
            target = f"unix://{path}"
            with grpc.insecure_channel(target) as channel:
                method = channel.unary_unary(METHOD)
                for _ in range(WARMUP):
                    method(b"")
                latencies = []
                before = cpu_ns(server.pid)
                for _ in range(CALLS):
                    start = time.perf_counter()
                    method(b"")
                    latencies.append(time.perf_counter() - start)
                per_call = (cpu_ns(server.pid) - before) / CALLS / 1e3
            before = cpu_ns(server.pid)
            for _ in range(DIALS):
                with grpc.insecure_channel(target) as channel:
                    channel.unary_unary(METHOD)(b"")
            per_dial = (cpu_ns(server.pid) - before) / DIALS / 1e3
            time.sleep(1.0)  # the last connection's close reaches the server
            before = cpu_ns(server.pid)
            time.sleep(IDLE)
            idle = (cpu_ns(server.pid) - before) / 1e6
            latencies.sort()
            return {
                "p50_us": statistics.median(latencies) * 1e6,
                "p99_us": latencies[int(len(latencies) * 0.99)] * 1e6,
                "cpu_per_call_us": per_call,
                "cpu_per_dial_us": per_dial,
                "idle_cpu_ms": idle,
            }
        finally:
            server.kill()
            server.wait()


def main() -> None:
    if sys.argv[1:2] == ["serve"]:
        name, path, mode = sys.argv[2:5]
        candidate = CANDIDATES[name]()
        candidate.run(functools.partial(serve, path=path, notify=mode == "notify"))
        return
    print(f"Python {sys.version.split()[0]}, trio {trio.__version__}; {CALLS} calls, "
          f"{DIALS} dials, {IDLE:g} s idle per candidate")  # fmt: skip
    print(f"{'candidate':<14}{'p50 µs':>9}{'p99 µs':>9}{'CPU/call µs':>13}{'CPU/dial µs':>13}"
          f"{'idle CPU ms':>13}")  # fmt: skip
    for _ in range(3):
        for name, notify in itertools.product(CANDIDATES, (False, True)):
            figures = measure(name, notify)
            if figures is not None:
                label = f"{name}{' +notify' if notify else ''}"
                print(f"{label:<14}{figures['p50_us']:>9.0f}{figures['p99_us']:>9.0f}"
                      f"{figures['cpu_per_call_us']:>13.0f}{figures['cpu_per_dial_us']:>13.0f}"
                      f"{figures['idle_cpu_ms']:>13.2f}")  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("PYTHONOPTIMIZE", "2")
    main()
