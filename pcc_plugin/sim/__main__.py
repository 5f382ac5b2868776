"""The simulated kubelet as a command, to try the daemon by hand (the `sim` extra).

python -m pcc_plugin.sim kubelet --dir /tmp/pcc-try/device-plugins
    serve kubelet.sock there until SIGTERM or SIGINT, printing one line per event
python -m pcc_plugin.sim allocate --dir /tmp/pcc-try/device-plugins [--resource NAME] pcc-0 ...
    what kubelet's Allocate of those devices gets from the plugin, as a container would be
    given it: from the endpoint that resource registered last with that kubelet, or without
    --resource from the newest plugin socket in the directory
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path

import grpc

from pcc_plugin.sim._pb import deviceplugin_v1beta1_pb2 as pb
from pcc_plugin.sim.demo import what_the_container_gets
from pcc_plugin.sim.kubelet import SimKubelet
from pcc_plugin.sim.rules import ALLOCATE, KUBELET_SOCKET
from pcc_plugin.sim.state import Registration

# Written by `kubelet` in its directory: the endpoint each resource registered last, which
# `allocate --resource` dials, as kubelet dials the endpoint a resource registered.
REGISTERED_ENDPOINTS = "sim-kubelet-endpoints.json"


class EndpointRecord:
    """The endpoint each resource registered last, kept in a file for `allocate`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.endpoints: dict[str, str] = {}

    def add(self, registration: Registration) -> None:
        """Called under the simulator's lock, one registration at a time."""
        self.endpoints[registration.resource_name] = registration.endpoint
        # Replaced whole: `allocate` never reads half a file.
        descriptor, staged = tempfile.mkstemp(dir=self.path.parent, prefix=".sim-kubelet-")
        with os.fdopen(descriptor, "w") as file:
            json.dump(self.endpoints, file, indent=1, sort_keys=True)
        os.replace(staged, self.path)


def serve_kubelet(args: argparse.Namespace) -> int:
    # The simulator logs each event as one plain line; grpcio only its warnings.
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")
    logging.getLogger("pcc_plugin.sim").setLevel(logging.INFO)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda _signum, _frame: stop.set())
    record = EndpointRecord(args.dir / REGISTERED_ENDPOINTS)
    # An earlier kubelet's endpoints are gone: kubelet deletes every socket as it starts.
    record.path.unlink(missing_ok=True)
    kubelet = SimKubelet(args.dir, legacy=args.legacy, key_by=args.key_by)
    kubelet.on_registered = record.add
    with kubelet:
        stop.wait()
    return 0


def plugin_socket(directory: Path, resource: str | None) -> Path:
    """The socket kubelet would dial for `resource`; else the newest plugin socket there.
    Raises LookupError saying why there is none."""
    if resource is None:
        sockets = sorted(
            (path for path in directory.glob("*.sock") if path.name != KUBELET_SOCKET),
            key=lambda path: path.stat().st_mtime_ns,
        )
        if not sockets:
            raise LookupError(f"no plugin socket in {directory}: start the daemon first")
        return sockets[-1]
    endpoints: dict[str, str]
    try:
        endpoints = json.loads((directory / REGISTERED_ENDPOINTS).read_text())
    except FileNotFoundError:
        endpoints = {}  # nothing has registered (yet) with a simulated kubelet there
    if resource not in endpoints:
        registered = ", ".join(sorted(endpoints)) or "nothing"
        raise LookupError(
            f"{resource} has not registered with the simulated kubelet in {directory} "
            f"(registered: {registered})"
        )
    return directory / endpoints[resource]


def allocate(args: argparse.Namespace) -> int:
    try:
        path = plugin_socket(args.dir, args.resource)
    except LookupError as missing:
        print(missing, file=sys.stderr)
        return 1
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=args.device_ids)]
    )
    with grpc.insecure_channel(f"unix:{path}") as channel:
        call = channel.unary_unary(
            ALLOCATE,
            request_serializer=pb.AllocateRequest.SerializeToString,
            response_deserializer=pb.AllocateResponse.FromString,
        )
        try:
            response = call(request, timeout=10)
        except grpc.RpcError as failure:
            print(f"{path.name} answered {failure.code().name}: {failure.details()}")
            return 1
    print(f"{path.name} answered; the container gets:")
    for line in what_the_container_gets(response):
        print(f"  {line}")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pcc_plugin.sim",
        description="The simulated kubelet, to try the daemon by hand. See the README.",
        allow_abbrev=False,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    kubelet = commands.add_parser("kubelet", help="serve kubelet.sock until SIGTERM or SIGINT")
    kubelet.add_argument("--dir", required=True, type=Path, help="device-plugin directory")
    kubelet.add_argument(
        "--legacy", action="store_true", help="answer Register before dialling the plugin"
    )
    kubelet.add_argument(
        "--key-by",
        choices=["endpoint", "resource"],
        default="endpoint",
        help="keep plugin clients per endpoint (kubelet 1.35+) or per resource (older ones)",
    )
    one = commands.add_parser("allocate", help="Allocate devices from the plugin, as kubelet")
    one.add_argument("--dir", required=True, type=Path, help="device-plugin directory")
    one.add_argument(
        "--resource",
        metavar="NAME",
        help="the resource to call: the endpoint it registered last with the simulated kubelet "
        "serving in --dir (default: the newest plugin socket there)",
    )
    one.add_argument("device_ids", nargs="+", metavar="DEVICE_ID")
    args = parser.parse_args()
    try:
        sys.exit(serve_kubelet(args) if args.command == "kubelet" else allocate(args))
    except ValueError as too_long:
        parser.error(str(too_long))


if __name__ == "__main__":
    main()
