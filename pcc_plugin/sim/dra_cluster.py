"""The simulator behind `python -m pcc_plugin.sim dra` (dra_commands.py; docs/dra.md, "Try
it on a laptop"): in one process, the fake API server on 127.0.0.1 with one Node and a kubeconfig
for it (DIR/kubeconfig), the simulated kubelet's DRA side watching DIR/plugins_registry, and a
control socket, DIR/sim.sock, on which `prepare` and `unprepare` ask for what the scheduler and
kubelet do with a claim (allocate it a free device of the node's slices, then
NodePrepareResources; NodeUnprepareResources, then delete it): kubelet's calls go to the
instance that registered last, as on a node.
"""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import socketserver
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from pcc_plugin.sim.apiserver import FakeApiServer
from pcc_plugin.sim.dra import SimDraKubelet
from pcc_plugin.sim.dra_commands import (
    CONTROL_SOCKET,
    KUBECONFIG,
    MAX_LINE,
    REGISTRY,
    REQUEST,
    CommandError,
    serving,
    unserved_dir,
)

log = logging.getLogger(__name__)


class SimCluster:
    """The fake API server and the simulated kubelet of one node, and what the control
    socket's clients ask of them."""

    def __init__(self, directory: Path, node: str) -> None:
        self.directory = directory
        self.node = node
        self.api = FakeApiServer()
        self.kubelet = SimDraKubelet(directory / REGISTRY, node, self.api)
        self.stopping = threading.Event()
        # One claim allocated at a time, as one scheduler would.
        self._allocating = threading.Lock()

    def start(self) -> None:
        self.api.start()
        self.api.add_node(self.node)
        self.api.write_kubeconfig(self.directory / KUBECONFIG)
        self.kubelet.start()

    def stop(self) -> None:
        self.kubelet.stop()
        self.api.stop()

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        call = request.get("call")
        try:
            if call == "pid":
                return {"pid": os.getpid()}
            if call == "stop":
                self.stopping.set()
                return {"pid": os.getpid()}
            if call == "prepare":
                return self.prepare(request)
            if call == "unprepare":
                return self.unprepare(request)
        except CommandError as error:
            return {"error": str(error)}
        return {"error": f"unknown call {call!r}"}

    def wait_for_driver(self, driver: str, timeout: float, devices: bool) -> None:
        """Until kubelet has registered `driver` (and, with `devices`, its slices list
        devices of this node)."""
        started = time.monotonic()
        try:
            self.kubelet.wait_for(lambda: bool(self.kubelet.instances(driver)), timeout)
        except TimeoutError:
            raise CommandError(
                f"the DRA driver {driver} has not registered with the simulated kubelet within "
                f"{timeout:g} s: start it with --kubelet-registry-path="
                f"{self.directory / REGISTRY} (its log says what it waits for)"
            ) from None
        if not devices:
            return
        left = max(0.0, timeout - (time.monotonic() - started))
        try:
            self.api.wait_for(lambda: bool(self.published(driver)), left)
        except TimeoutError:
            raise CommandError(
                f"the DRA driver {driver} has published no device for the Node {self.node} "
                f"within {timeout:g} s: its log says why (its --node-name must be {self.node}, "
                "and its device and PCC directory must be there)"
            ) from None

    def published(self, driver: str) -> list[str]:
        """The devices the node's slices of `driver` list, but for tainted ones, which the
        scheduler gives no claim that does not tolerate the taint (these tolerate none)."""
        return [
            device["name"]
            for obj in self.api.slices(self.node)
            if obj["spec"]["driver"] == driver
            for device in obj["spec"].get("devices") or []
            if not device.get("taints")
        ]

    def allocated(self, driver: str) -> dict[str, str]:
        """Device -> the claim (namespace/name) it is allocated to, of this node's pool."""
        taken = {}
        for (namespace, name), claim in self.api.claims.items():
            results = claim.get("status", {}).get("allocation", {}).get("devices", {})
            for result in results.get("results", []):
                if result["driver"] == driver and result["pool"] == self.node:
                    taken[result["device"]] = f"{namespace}/{name}"
        return taken

    def allocate(self, namespace: str, name: str, driver: str, wanted: str | None) -> Any:
        """The claim, allocated a device as the scheduler would: the one wanted, else the
        first free one. A claim allocated before keeps its device."""
        with self._allocating:
            claim = self.api.claims.get((namespace, name))
            if claim is not None:
                (result,) = claim["status"]["allocation"]["devices"]["results"]
                if wanted is not None and result["device"] != wanted:
                    raise CommandError(
                        f"{namespace}/{name} is allocated {result['device']} already: unprepare "
                        "it first, or name another claim"
                    )
                return claim
            published = self.published(driver)
            taken = self.allocated(driver)
            if wanted is not None:
                if wanted not in published:
                    raise CommandError(
                        f"{wanted} is not a device of the Node {self.node}'s ResourceSlices "
                        f"({published[0]} to {published[-1]}): name one of them"
                    )
                if wanted in taken:
                    raise CommandError(
                        f"{wanted} is allocated to {taken[wanted]}: unprepare that claim "
                        "first, or name another device"
                    )
                device = wanted
            else:
                free = [device for device in published if device not in taken]
                if not free:
                    raise CommandError(
                        f"every device of the Node {self.node} is allocated: unprepare a "
                        "claim first"
                    )
                device = free[0]
            result = {"request": REQUEST, "driver": driver, "pool": self.node, "device": device}
            log.info("allocated %s to the ResourceClaim %s/%s", device, namespace, name)
            return self.api.put_claim(namespace, name, [result])

    def prepare(self, request: dict[str, Any]) -> dict[str, Any]:
        namespace, name, driver = request["namespace"], request["name"], request["driver"]
        self.wait_for_driver(driver, float(request["timeout"]), devices=True)
        claim = self.allocate(namespace, name, driver, request.get("device"))
        uid = claim["metadata"]["uid"]
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        answer = self.call(self.kubelet.prepare, driver, (namespace, name, uid)).claims[uid]
        log.info("NodePrepareResources %s/%s: %s", namespace, name, answer.error or "prepared")
        return {
            "uid": uid,
            "device": result["device"],
            "pool": result["pool"],
            "error": answer.error,
            "devices": [
                {
                    "requests": list(device.request_names),
                    "pool": device.pool_name,
                    "device": device.device_name,
                    "cdi": list(device.cdi_device_ids),
                }
                for device in answer.devices
            ],
        }

    def unprepare(self, request: dict[str, Any]) -> dict[str, Any]:
        namespace, name, driver = request["namespace"], request["name"], request["driver"]
        claim = self.api.claims.get((namespace, name))
        if claim is None:
            known = ", ".join(sorted("/".join(key) for key in self.api.claims)) or "none"
            raise CommandError(
                f"there is no ResourceClaim {namespace}/{name}: prepare it first (claims: {known})"
            )
        self.wait_for_driver(driver, float(request["timeout"]), devices=False)
        uid = claim["metadata"]["uid"]
        answer = self.call(self.kubelet.unprepare, driver, (namespace, name, uid)).claims[uid]
        log.info("NodeUnprepareResources %s/%s: %s", namespace, name, answer.error or "done")
        if not answer.error:
            # The pod gone, its claim is deleted: the device is free for the next.
            with self._allocating:
                self.api.claims.pop((namespace, name), None)
        return {"uid": uid, "error": answer.error}

    def call(self, method: Any, driver: str, claim: tuple[str, str, str]) -> Any:
        try:
            return method(driver, [claim])
        except LookupError as gone:
            raise CommandError(f"{gone}: it went while the call was being made") from None
        except grpc.RpcError as failure:
            raise CommandError(
                f"the DRA driver {driver} answered {failure.code().name}: {failure.details()}"
            ) from None


class _ControlHandler(socketserver.StreamRequestHandler):
    server: ControlServer

    def handle(self) -> None:
        line = self.rfile.readline(MAX_LINE)
        try:
            request = json.loads(line)
        except ValueError:
            request = None
        if isinstance(request, dict):
            answer = self.server.cluster.answer(request)
        else:
            answer = {"error": f"not a request: {line[:80]!r}"}
        self.wfile.write(json.dumps(answer).encode() + b"\n")
        self.wfile.flush()
        if request == {"call": "stop"}:
            # Held open until this process exits (the client reads until then, so this read
            # ends only with the process): `stop` returns once the simulator is gone.
            self.rfile.read()


class ControlServer(socketserver.ThreadingUnixStreamServer):
    # A `stop` connection stays open until the process exits: not waited for.
    daemon_threads = True
    block_on_close = False

    def __init__(self, path: Path, cluster: SimCluster) -> None:
        self.cluster = cluster
        super().__init__(str(path), _ControlHandler)


def serve_dra(directory: Path, node: str, ready_fd: int | None) -> int:
    """Serve until SIGTERM, SIGINT or `stop`; with `ready_fd`, say there once serving."""
    directory = unserved_dir(directory)
    # The simulator logs each event as one plain line; grpcio only its warnings.
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)  # its log file, in the background
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")
    logging.getLogger("pcc_plugin.sim").setLevel(logging.INFO)
    cluster = SimCluster(directory, node)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda _signum, _frame: cluster.stopping.set())
    cluster.start()
    server = ControlServer(directory / CONTROL_SOCKET, cluster)
    threading.Thread(target=server.serve_forever, name="sim-control", daemon=True).start()
    try:
        said = {"pid": os.getpid(), "url": cluster.api.url}
        if ready_fd is None:
            print(serving(directory, node, said))
        else:
            os.write(ready_fd, json.dumps(said).encode() + b"\n")
            os.close(ready_fd)
        cluster.stopping.wait()
        log.info("stopping")
    finally:
        cluster.stop()
        server.shutdown()
        server.server_close()
        (directory / CONTROL_SOCKET).unlink(missing_ok=True)
    return 0
