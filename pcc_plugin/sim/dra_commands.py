"""The DRA mode on a laptop: `python -m pcc_plugin.sim dra|prepare|unprepare|stop`
(docs/dra.md, "Try it on a laptop").

`dra --dir DIR` serves, in one process: the fake API server on 127.0.0.1 with one Node, and a
kubeconfig for it (DIR/kubeconfig); the simulated kubelet's DRA side, watching
DIR/plugins_registry; and a control socket, DIR/sim.sock. The other three commands are its
clients: they ask it, one JSON line each way, for what the scheduler and kubelet do with a claim
(`prepare`: allocate it a free device of the node's slices, then NodePrepareResources;
`unprepare`: NodeUnprepareResources, then delete it), so kubelet's calls are the simulated
kubelet's own, to the instance that registered last, as on a node. Without --foreground, `dra`
returns once all three serve and the simulator runs on in the background, logging to
DIR/sim.log.
"""

from __future__ import annotations

import io
import json
import logging
import os
import select
import signal
import socket
import socketserver
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from pcc_plugin.flags import MAX_KUBELET_DIR_BYTES
from pcc_plugin.sim.apiserver import FakeApiServer
from pcc_plugin.sim.dra import CALL_TIMEOUT, SimDraKubelet
from pcc_plugin.sim.rules import is_dns_label, is_dns_subdomain

log = logging.getLogger(__name__)

DRIVER = "pcc.tke.cloud.tencent.com"
NODE = "node-a"
CONTROL_SOCKET = "sim.sock"
KUBECONFIG = "kubeconfig"
REGISTRY = "plugins_registry"
LOG = "sim.log"
# The driver's directories that `dra` suggests and `prepare` assumes (its flags say where).
PLUGINS = "plugins"
CDI = "cdi"
# The claim's one request, as in manifests/examples/dra-app.
REQUEST = "pcc"
# A request is a claim's names and a few options; a longer line is not one of ours.
MAX_LINE = 4096
# How long `dra` waits for its background process to serve.
START_TIMEOUT = 30.0
# What `prepare` and `unprepare` wait for the driver by default.
DRIVER_TIMEOUT = 30.0


class CommandError(Exception):
    """What went wrong, in one line with the fix; the command exits 1."""


def dns_subdomain(value: str) -> str:
    """A ResourceClaim's or a Node's name, as Kubernetes checks it."""
    if not is_dns_subdomain(value):
        raise ValueError(
            f"{value!r} is not a DNS subdomain: lowercase letters, digits, '-' and '.', at most 253"
        )
    return value


def dns_label(value: str) -> str:
    """A namespace's name, as Kubernetes checks it."""
    if not is_dns_label(value):
        raise ValueError(
            f"{value!r} is not a DNS label: lowercase letters, digits and '-', at most 63"
        )
    return value


def usable_dir(directory: Path) -> Path:
    """`directory`, created, absolute; CommandError if the simulator cannot serve there."""
    directory = directory.absolute()
    # The driver's sockets go in DIR/plugins_registry and DIR/plugins, the longer of the two.
    size = len(os.fsencode(directory / REGISTRY))
    if size > MAX_KUBELET_DIR_BYTES:
        raise CommandError(
            f"--dir {directory}: the driver's --kubelet-registry-path, {directory / REGISTRY}, "
            f"would be {size} bytes, more than the {MAX_KUBELET_DIR_BYTES} its unix sockets "
            "leave; give a shorter directory (mktemp -d makes one in /tmp)"
        )
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as failure:
        raise CommandError(
            f"--dir {directory}: {failure.strerror or failure}; give a directory you can write"
        ) from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise CommandError(f"--dir {directory}: not writable; give a directory you can write")
    return directory


def unserved_dir(directory: Path) -> Path:
    """`directory`, usable, and served by no simulator (a dead one's socket removed)."""
    directory = usable_dir(directory)
    path = directory / CONTROL_SOCKET
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError):
            path.unlink(missing_ok=True)
            return directory
    pid = ask(directory, {"call": "pid"}, 5.0)["pid"]
    raise CommandError(
        f"a simulator (pid {pid}) serves in {directory} already: stop it with "
        f"python -m pcc_plugin.sim stop --dir {directory}, or give another --dir"
    )


# The server: the simulator's process.


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


def serving(directory: Path, node: str, said: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"The simulator serves in {directory} (pid {said['pid']}): the fake API server at "
            f"{said['url']}, with the Node {node}, and the simulated kubelet's DRA side.",
            f"The driver's flags for them: --mode=dra --node-name={node} "
            f"--kubeconfig={directory / KUBECONFIG} --kubelet-registry-path={directory / REGISTRY} "
            f"--kubelet-plugins-path={directory / PLUGINS} --cdi-spec-dir={directory / CDI}",
            f"Stop it with: python -m pcc_plugin.sim stop --dir {directory}",
        ]
    )


def start_dra(directory: Path, node: str) -> int:
    """`dra` without --foreground: the simulator in a background process; returns once it
    serves, or says why it could not."""
    directory = unserved_dir(directory)
    log_path = directory / LOG
    read_fd, write_fd = os.pipe()
    argv = [
        sys.executable,
        "-m",
        "pcc_plugin.sim",
        "dra",
        "--dir",
        str(directory),
        "--node",
        node,
        "--foreground",
        "--ready-fd",
        str(write_fd),
    ]
    with log_path.open("w") as log_file:
        child = subprocess.Popen(
            argv,
            pass_fds=(write_fd,),
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as ready:
        readable, _, _ = select.select([ready], [], [], START_TIMEOUT)
        line = ready.readline(MAX_LINE) if readable else b""
    if not line.endswith(b"\n"):
        if child.poll() is None:
            child.kill()
        child.wait()
        said = [one for one in log_path.read_text(errors="replace").splitlines() if one.strip()]
        why = said[-1] if said else f"nothing said within {START_TIMEOUT:g} s"
        raise CommandError(f"the simulator did not start (its log: {log_path}): {why}")
    print(serving(directory, node, json.loads(line)))
    print(f"It runs in the background; its log: {log_path}")
    return 0


# The clients.


def ask(directory: Path, request: dict[str, Any], timeout: float) -> dict[str, Any]:
    """The simulator's answer to `request`; CommandError if none serves in `directory`."""
    path = directory.absolute() / CONTROL_SOCKET
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(timeout)
        try:
            connection.connect(str(path))
            connection.sendall(json.dumps(request).encode() + b"\n")
            with connection.makefile("rb") as answers:
                line = answers.readline(MAX_LINE)
                if request.get("call") == "stop":
                    answers.read()  # until the process has exited
        except (FileNotFoundError, ConnectionRefusedError):
            raise CommandError(
                f"no simulator serves in {directory}: start one with "
                f"python -m pcc_plugin.sim dra --dir {directory}"
            ) from None
        except TimeoutError:
            raise CommandError(
                f"the simulator in {directory} did not answer within {timeout:g} s "
                f"(its log: {directory / LOG})"
            ) from None
        except OSError as failure:
            raise CommandError(f"cannot reach the simulator at {path}: {failure}") from None
    try:
        answer: dict[str, Any] = json.loads(line)
    except ValueError:
        raise CommandError(
            f"the simulator in {directory} ended the call without an answer "
            f"(its log: {directory / LOG})"
        ) from None
    # An answer about a claim (with its UID) says how the driver answered, error or not.
    if "error" in answer and "uid" not in answer:
        raise CommandError(str(answer["error"]))
    return answer


def claim_call(directory: Path, call: str, args: Any) -> dict[str, Any]:
    request = {
        "call": call,
        "namespace": args.namespace,
        "name": args.claim,
        "driver": args.driver,
        "timeout": args.timeout,
    }
    if call == "prepare":
        request["device"] = args.device
    return ask(directory, request, args.timeout + CALL_TIMEOUT + 5)


def cdi_spec_naming(cdi_dir: Path, device_id: str) -> Path | None:
    """The spec in `cdi_dir` that defines the CDI device `device_id` (vendor/class=name), as
    a container runtime looks it up: its kind and one of its devices' names."""
    kind, _, name = device_id.partition("=")
    for path in sorted(cdi_dir.glob("*.json")):
        try:
            spec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # not ours to judge; a runtime skips it too
        if isinstance(spec, dict) and spec.get("kind") == kind:
            devices = spec.get("devices") or []
            if any(isinstance(one, dict) and one.get("name") == name for one in devices):
                return path
    return None


def prepare_claim(args: Any) -> int:
    claim = f"{args.namespace}/{args.claim}"
    answer = claim_call(args.dir, "prepare", args)
    uid = answer["uid"]
    print(
        f"{claim} (UID {uid}): allocated {answer['device']} of pool {answer['pool']}, as "
        "the scheduler would"
    )
    if answer["error"]:
        raise CommandError(f"the driver refused {claim}: {answer['error']}")
    print("NodePrepareResources, as kubelet calls it before the pod starts, answered:")
    ids = []
    for device in answer["devices"]:
        ids += device["cdi"]
        print(
            f"  {device['device']} of pool {device['pool']} for request "
            f"{', '.join(device['requests'])}: CDI device {', '.join(device['cdi'])}"
        )
    cdi_dir = args.cdi_spec_dir or args.dir.absolute() / CDI
    for device_id in dict.fromkeys(ids):
        path = cdi_spec_naming(cdi_dir, device_id)
        if path is None:
            raise CommandError(
                f"no CDI spec in {cdi_dir} defines {device_id}: give the driver's "
                "--cdi-spec-dir with --cdi-spec-dir"
            )
        print(f"The CDI spec the container runtime reads for {device_id}, {path}:")
        print(path.read_text().rstrip())
    return 0


def unprepare_claim(args: Any) -> int:
    claim = f"{args.namespace}/{args.claim}"
    answer = claim_call(args.dir, "unprepare", args)
    if answer["error"]:
        raise CommandError(f"the driver could not unprepare {claim}: {answer['error']}")
    print(
        f"NodeUnprepareResources of {claim} (UID {answer['uid']}), as kubelet calls it once "
        "the pod is gone, answered: done; the ResourceClaim is deleted"
    )
    cdi_dir = args.cdi_spec_dir or args.dir.absolute() / CDI
    device_id = f"{args.driver}/claim={answer['uid']}"
    left = cdi_spec_naming(cdi_dir, device_id)
    if left is not None:
        raise CommandError(f"{left} still defines {device_id}: the driver left it behind")
    print(f"No CDI spec in {cdi_dir} defines {device_id} any more.")
    return 0


def stop_dra(directory: Path) -> int:
    answer = ask(directory, {"call": "stop"}, 30.0)
    print(f"The simulator in {directory} (pid {answer['pid']}) stopped.")
    return 0
