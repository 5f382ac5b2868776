"""The DRA mode on a laptop: `python -m pcc_plugin.sim dra|prepare|unprepare|stop`
(docs/dra.md, "Try it on a laptop").

`dra --dir DIR` runs the simulator of dra_cluster.py, which serves the fake API server, the
simulated kubelet's DRA side and a control socket, DIR/sim.sock; without --foreground it starts
it in the background and returns once it serves. The other three commands are its clients: they
ask it, one JSON line each way, for what the scheduler and kubelet do with a claim, so that
kubelet's calls are the simulated kubelet's own. `python -m pcc_plugin.sim` imports this
module for every command, so it leaves the simulator's imports to dra_cluster.py (h2's alone
took 0.4 s of each `kubelet` and `allocate` here).
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from pcc_plugin.flags import MAX_KUBELET_DIR_BYTES
from pcc_plugin.fs import connect_error
from pcc_plugin.sim.rules import CALL_TIMEOUT

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


def unserved_dir(directory: Path) -> Path:
    """`directory`, created, absolute, and served by no simulator (a dead one's socket
    removed); CommandError if the simulator cannot serve there."""
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
    path = directory / CONTROL_SOCKET
    if isinstance(connect_error(path), (FileNotFoundError, ConnectionRefusedError)):
        path.unlink(missing_ok=True)
        return directory
    pid = ask(directory, {"call": "pid"}, 5.0)["pid"]
    raise CommandError(
        f"a simulator (pid {pid}) serves in {directory} already: stop it with "
        f"python -m pcc_plugin.sim stop --dir {directory}, or give another --dir"
    )


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


def start_dra(args: Any) -> int:
    """`dra` without --foreground: the simulator in a background process; returns once it
    serves, or says why it could not."""
    directory, node = unserved_dir(args.dir), args.node
    log_path = directory / LOG
    read_fd, write_fd = os.pipe()
    argv = [sys.executable, "-m", "pcc_plugin.sim", "dra", "--foreground", f"--dir={directory}"]
    argv += [f"--node={node}", f"--ready-fd={write_fd}"]
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
    # The answer may take kubelet's whole call deadline.
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


def stop_dra(args: Any) -> int:
    answer = ask(args.dir, {"call": "stop"}, 30.0)
    print(f"The simulator in {args.dir} (pid {answer['pid']}) stopped.")
    return 0
