"""The daemon on a fake node against the simulated kubelet, and a grpcio client for it.

Every daemon is ``python -m pcc_plugin`` on a fake node in a temporary directory under /tmp,
talking over unix sockets to :class:`pcc_plugin.sim.SimKubelet`, which runs on grpcio in the
benchmark's process. It runs as the image runs it: with compiled bytecode and the image's
interpreter settings (`IMAGE_ENV`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import grpc

from bench import procfs
from bench.report import Report
from pcc_plugin.sim import Daemon, FakeNode, Registration, SimKubelet
from pcc_plugin.sim._pb import deviceplugin_v1beta1_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
ALLOCATE = "/v1beta1.DevicePlugin/Allocate"
LIST_AND_WATCH = "/v1beta1.DevicePlugin/ListAndWatch"
OPTIONS = "/v1beta1.DevicePlugin/GetDevicePluginOptions"
RESOURCE = "tke.cloud.tencent.com/pcc-device"
# The ID the daemon gives its first share; another plugin (the Go peer) names its own.
DEVICE_ID = "pcc-0"
WAIT = 30.0
# What the Containerfile sets for the daemon: no docstrings, asserts or column offsets in memory.
IMAGE_ENV = {"PYTHONOPTIMIZE": "2", "PYTHONNODEBUGRANGES": "1"}
# Every module the daemon may import, compiled before any start (the image has them compiled).
DAEMON_MODULES = "pcc_plugin.main, pcc_plugin.supervisor, pcc_plugin.http_server, h11"


def bytecode_env(cache: Path, python: str = sys.executable, tree: Path = ROOT) -> dict[str, str]:
    """Compiled bytecode in `cache`, as the image has it (its build compiles what it installs):
    the daemon of `tree` (a checkout) as `python` imports it.

    Without it, a checkout with PYTHONDONTWRITEBYTECODE=1 (as here) compiles the daemon's own
    modules at every start, which the image never does.
    """
    env = {"PYTHONPYCACHEPREFIX": str(cache), "PYTHONDONTWRITEBYTECODE": ""}
    for optimize in ("", "2"):
        subprocess.run(
            [python, "-c", f"import {DAEMON_MODULES}"],
            check=True, cwd=tree,
            env={**os.environ, **env, **IMAGE_ENV, "PYTHONOPTIMIZE": optimize},
            timeout=WAIT,
        )  # fmt: skip
    return {**env, **IMAGE_ENV}


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """No cyclic GC pauses in this process (client and simulated kubelet) while timing."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def accepted(kubelet: SimKubelet) -> list[Registration]:
    return [registration for registration in kubelet.registrations if registration.accepted]


@contextlib.contextmanager
def plugin_channel(socket_path: Path) -> Iterator[Any]:
    channel = grpc.insecure_channel(
        f"unix:{socket_path}", options=[("grpc.default_authority", "localhost")]
    )
    try:
        yield channel
    finally:
        channel.close()


@contextlib.contextmanager
def python_module(
    module: str, *args: str, ready: str, env: Mapping[str, str] | None = None
) -> Iterator[subprocess.Popen[str]]:
    """``python -m module args``, once it has printed `ready`; killed at the end if still
    running. `env` is added to this process's environment."""
    process = subprocess.Popen(
        [sys.executable, "-m", module, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True,
        env=None if env is None else {**os.environ, **env},
    )  # fmt: skip
    try:
        assert process.stdout is not None
        if process.stdout.readline().strip() != ready:
            raise RuntimeError(f"python -m {module} {' '.join(args)} did not start")
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def dial_back(socket_path: Path) -> None:
    """What kubelet does when it dials a plugin back: connect, GetDevicePluginOptions, then
    ListAndWatch until its first list; then the connection is closed."""
    with plugin_channel(socket_path) as channel:
        options = channel.unary_unary(
            OPTIONS, request_serializer=pb.Empty.SerializeToString,
            response_deserializer=pb.DevicePluginOptions.FromString,
        )  # fmt: skip
        options(pb.Empty(), timeout=WAIT, wait_for_ready=True)
        list_and_watch = channel.unary_stream(
            LIST_AND_WATCH, request_serializer=pb.Empty.SerializeToString,
            response_deserializer=pb.ListAndWatchResponse.FromString,
        )  # fmt: skip
        stream = list_and_watch(pb.Empty(), timeout=WAIT)
        next(stream)
        stream.cancel()


def cpu_per_dial_back(pid: int, socket_path: Path, dials: int) -> float:
    """Process `pid`'s CPU (schedstat, every thread) per dial-back, in seconds."""
    for _ in range(20):
        dial_back(socket_path)
    with no_gc():
        busy = procfs.cpu_ns(pid)
        for _ in range(dials):
            dial_back(socket_path)
        busy = procfs.cpu_ns(pid) - busy
    return busy / 1e9 / dials


def allocate_method(channel: Any) -> Any:
    return channel.unary_unary(
        ALLOCATE,
        request_serializer=pb.AllocateRequest.SerializeToString,
        response_deserializer=pb.AllocateResponse.FromString,
    )


def allocate_request(device_id: str = DEVICE_ID) -> Any:
    """An AllocateRequest as kubelet sends it: one container request, one device."""
    return pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=[device_id])]
    )


def timed_allocates(method: Any, count: int, device_id: str = DEVICE_ID) -> list[float]:
    """Round trips of `count` Allocate calls as kubelet makes them: one container request."""
    request = allocate_request(device_id)
    latencies = []
    for _ in range(count):
        started = time.perf_counter()
        response = method(request, timeout=WAIT)
        latencies.append(time.perf_counter() - started)
        if len(response.container_responses) != 1:
            raise RuntimeError(f"unexpected Allocate answer: {response}")
    return latencies


@attrs.define
class Bench:
    """One fake node and simulated kubelet; daemons started on it are stopped at the end."""

    node: FakeNode
    kubelet: SimKubelet
    cleanup: contextlib.ExitStack
    report: Report
    env: dict[str, str]
    logs: int = 0

    def spawn(self, *extra: str, env: Mapping[str, str] | None = None) -> Daemon:
        args = [*self.node.daemon_args(verbosity=0), *extra]
        daemon = Daemon.spawn_plugin(args, self.log_path("daemon"), {**self.env, **(env or {})})
        self.cleanup.callback(daemon.close)
        return daemon

    def spawn_program(self, *argv: str, name: str, env: Mapping[str, str] | None = None) -> Daemon:
        """Another plugin than this tree's daemon (the Go yardstick, an older daemon), stopped
        at the end like it; `env` is added to this process's environment."""
        program = Daemon(list(argv), self.log_path(name), env)
        self.cleanup.callback(program.close)
        return program

    def log_path(self, name: str) -> Path:
        self.logs += 1
        return self.node.root / f"{name}-{self.logs}.log"

    def registered(self, after: int, devices: int = 16) -> Registration:
        """Wait for accepted registration number `after` + 1 and a full list on a live stream."""

        def ready() -> bool:
            return (
                len(accepted(self.kubelet)) > after
                and self.kubelet.stream_open(RESOURCE)
                and len(self.kubelet.devices(RESOURCE)) == devices
            )

        self.kubelet.wait_for(ready, WAIT)
        return accepted(self.kubelet)[after]

    def start(
        self, *extra: str, devices: int = 16, env: Mapping[str, str] | None = None
    ) -> tuple[Daemon, str]:
        """A daemon started and registered; its endpoint's socket name."""
        before = len(accepted(self.kubelet))
        daemon = self.spawn(*extra, env=env)
        return daemon, self.registered(before, devices).endpoint

    def socket(self, endpoint: str) -> Path:
        return self.node.plugin_dir / endpoint

    def stop(self, daemon: Daemon) -> float:
        """SIGTERM, and exit 0 expected: the seconds from the signal to the exit.

        Timed on a pidfd, which is readable the moment the process has exited: Popen.wait
        with a timeout polls, doubling its sleep up to 50 ms, and would round a stop of
        tens of milliseconds up to 31.5, 63.5 or 113.5.
        """
        pidfd = os.pidfd_open(daemon.pid)
        try:
            sent = time.monotonic()
            daemon.proc.send_signal(signal.SIGTERM)
            ended = select.select([pidfd], [], [], WAIT)[0]
            took = time.monotonic() - sent
        finally:
            os.close(pidfd)
        code = daemon.exited(WAIT) if ended else None
        if code != 0:
            raise RuntimeError(f"daemon {daemon.pid} exited {code}; log:\n{daemon.log_text()}")
        return took


def metrics_port(daemon: Daemon) -> int:
    line = daemon.wait_for_log("Serving /metrics, /livez and /readyz on 127.0.0.1 port ", WAIT)
    return int(line.rsplit(" ", 1)[1])


def scrape(port: int, path: str = "/metrics") -> bytes:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"http://127.0.0.1:{port}{path}", timeout=WAIT) as response:
        body: bytes = response.read()
        return body


# The daemon's scrape and probes.
PROBES = ("/metrics", "/livez", "/readyz")


def probed_and_scraped(port: int, paths: tuple[str, ...] = PROBES) -> None:
    """What a node does to a plugin within seconds of its start: a scrape and its probes, here
    on its metrics `port`."""
    for path in paths:
        scrape(port, path)
