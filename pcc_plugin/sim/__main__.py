"""The simulated kubelet as a command, to try the daemon by hand (the `sim` extra):
`python -m pcc_plugin.sim kubelet|allocate` for the device plugin (the README), and
`dra|prepare|unprepare|stop` for the DRA mode (dra_commands.py; docs/dra.md, "Try it on a
laptop"). Each command's --help says what it does.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, NoReturn

import grpc

from pcc_plugin.flags import usage_error
from pcc_plugin.sim import dra_commands
from pcc_plugin.sim._pb import deviceplugin_v1beta1_pb2 as pb
from pcc_plugin.sim.demo import what_the_container_gets
from pcc_plugin.sim.kubelet import SimKubelet
from pcc_plugin.sim.rules import ALLOCATE, KUBELET_SOCKET, is_dns_label, is_dns_subdomain
from pcc_plugin.sim.state import Registration

# Written by `kubelet` in its directory while it serves (removed when it stops): the endpoint
# each resource registered last, which `allocate --resource` dials, as kubelet dials the
# endpoint a resource registered.
REGISTERED_ENDPOINTS = "sim-kubelet-endpoints.json"
# How often `allocate` looks again while it waits for the plugin to register.
LOOK_AGAIN = 0.05


def serve_kubelet(args: argparse.Namespace) -> int:
    # The simulator logs each event as one plain line; grpcio only its warnings.
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")
    logging.getLogger("pcc_plugin.sim").setLevel(logging.INFO)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda _signum, _frame: stop.set())
    record = args.dir / REGISTERED_ENDPOINTS
    endpoints: dict[str, str] = {}

    def registered(registration: Registration) -> None:
        """Called under the simulator's lock, one registration at a time."""
        endpoints[registration.resource_name] = registration.endpoint
        # Replaced whole: `allocate` never reads half a file.
        descriptor, staged = tempfile.mkstemp(dir=args.dir, prefix=".sim-kubelet-")
        with os.fdopen(descriptor, "w") as file:
            json.dump(endpoints, file, indent=1, sort_keys=True)
        os.replace(staged, record)

    # An earlier kubelet's endpoints are gone: kubelet deletes every socket as it starts.
    record.unlink(missing_ok=True)
    kubelet = SimKubelet(args.dir, key_by=args.key_by)
    kubelet.on_registered = registered
    try:
        with kubelet:
            stop.wait()
    finally:
        # What it recorded is no kubelet's any more: `allocate` waits for the next one's.
        record.unlink(missing_ok=True)
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


def registered_socket(directory: Path, resource: str | None, timeout: float) -> Path:
    """`plugin_socket`, once there is one: the daemon may still be starting (about a second).
    LookupError, saying what is missing and where to look, after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return plugin_socket(directory, resource)
        except LookupError as missing:
            if time.monotonic() >= deadline:
                raise LookupError(
                    f"{missing}, after {timeout:g} s; is the daemon running, with "
                    f"--device-plugin-path={directory}, and the simulated kubelet there?"
                ) from None
        time.sleep(LOOK_AGAIN)


def allocate(args: argparse.Namespace) -> int:
    try:
        path = registered_socket(args.dir, args.resource, args.timeout)
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
            if args.resource is None and failure.code() == grpc.StatusCode.INVALID_ARGUMENT:
                print(
                    f"{path.name} is the newest plugin socket in {args.dir}; with several "
                    "resources (--config), name the one those devices are of with --resource"
                )
            return 1
    print(f"{path.name} answered; the container gets:")
    for line in what_the_container_gets(response):
        print(f"  {line}")
    return 0


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # One line, as every usage error of the project's commands.
        usage_error(self.prog, message.removeprefix("argument "))


# argparse types: an ArgumentTypeError's reason is what the usage error says.


def positive_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds < math.inf:
        raise argparse.ArgumentTypeError(f"{value} is not a number of seconds above 0")
    return seconds


def dns_subdomain(value: str) -> str:
    """A ResourceClaim's or a Node's name, as Kubernetes checks it."""
    if not is_dns_subdomain(value):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a DNS subdomain: lowercase letters, digits, '-' and '.', at most 253"
        )
    return value


def dns_label(value: str) -> str:
    """A namespace's name, as Kubernetes checks it."""
    if not is_dns_label(value):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a DNS label: lowercase letters, digits and '-', at most 63"
        )
    return value


def add_dra_commands(commands: Any) -> None:
    dra = commands.add_parser(
        "dra", help="serve the fake API server and the simulated kubelet's DRA side"
    )
    dra.add_argument(
        "--dir",
        required=True,
        type=Path,
        help="where to serve: a short path, for unix sockets (mktemp -d makes one)",
    )
    dra.add_argument(
        "--node",
        type=dns_subdomain,
        default=dra_commands.NODE,
        help="the Node's name (default: %(default)s)",
    )
    dra.add_argument(
        "--foreground",
        action="store_true",
        help="stay in the foreground, printing one line per event",
    )
    # The background process says on this descriptor that it serves.
    dra.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    for name, does in (
        ("prepare", "allocate a ResourceClaim a device and have kubelet prepare it"),
        ("unprepare", "have kubelet unprepare a ResourceClaim, then delete it"),
    ):
        one = commands.add_parser(name, help=does)
        one.add_argument("--dir", required=True, type=Path, help="where `dra` serves")
        one.add_argument(
            "--namespace",
            type=dns_label,
            default="default",
            help="the claim's namespace (default: %(default)s)",
        )
        one.add_argument(
            "--driver",
            default=dra_commands.DRIVER,
            help="the DRA driver's name (default: %(default)s)",
        )
        one.add_argument(
            "--timeout",
            type=positive_seconds,
            default=dra_commands.DRIVER_TIMEOUT,
            metavar="SECONDS",
            help="how long to wait for the driver (default: %(default)g)",
        )
        one.add_argument(
            "--cdi-spec-dir",
            type=Path,
            metavar="DIR",
            help="the driver's --cdi-spec-dir (default: DIR/cdi of --dir)",
        )
        if name == "prepare":
            one.add_argument(
                "--device",
                metavar="NAME",
                help="the device to allocate (default: the first free one)",
            )
        one.add_argument("claim", type=dns_subdomain, metavar="CLAIM")
    stop = commands.add_parser("stop", help="stop the simulator that `dra` started")
    stop.add_argument("--dir", required=True, type=Path, help="where `dra` serves")


def main() -> None:
    parser = _OneLineParser(
        prog="python -m pcc_plugin.sim",
        description="The simulated kubelet, to try the daemon by hand. See the README, and "
        "docs/dra.md for the DRA mode.",
        allow_abbrev=False,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    kubelet = commands.add_parser("kubelet", help="serve kubelet.sock until SIGTERM or SIGINT")
    kubelet.add_argument("--dir", required=True, type=Path, help="device-plugin directory")
    kubelet.add_argument(
        "--key-by",
        choices=["endpoint", "resource"],
        default="endpoint",
        help="keep plugin clients per endpoint (kubelet 1.37+) or per resource (older ones)",
    )
    one = commands.add_parser("allocate", help="Allocate devices from the plugin, as kubelet")
    one.add_argument("--dir", required=True, type=Path, help="device-plugin directory")
    one.add_argument(
        "--resource",
        metavar="NAME",
        help="the resource to call: the endpoint it registered last with the simulated kubelet "
        "serving in --dir (default: the newest plugin socket there)",
    )
    one.add_argument(
        "--timeout",
        type=positive_seconds,
        default=30.0,
        metavar="SECONDS",
        help="how long to wait for the plugin to register (default 30)",
    )
    one.add_argument("device_ids", nargs="+", metavar="DEVICE_ID")
    add_dra_commands(commands)
    args = parser.parse_args()
    try:
        if args.command == "dra" and args.foreground:
            # Only here: the fake API server and kubelet's DRA side, and their imports.
            from pcc_plugin.sim.dra_cluster import serve_dra

            sys.exit(serve_dra(args.dir, args.node, args.ready_fd))
        run = {
            "kubelet": serve_kubelet,
            "allocate": allocate,
            "dra": dra_commands.start_dra,
            "prepare": dra_commands.prepare_claim,
            "unprepare": dra_commands.unprepare_claim,
            "stop": dra_commands.stop_dra,
        }[args.command]
        sys.exit(run(args))
    except dra_commands.CommandError as error:
        print(f"{parser.prog} {args.command}: {error}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)  # Ctrl-C while waiting: the shell's own status for it, no traceback
    except ValueError as too_long:
        parser.error(str(too_long))


if __name__ == "__main__":
    main()
