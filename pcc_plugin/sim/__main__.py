"""The simulated kubelet as a command, to try the daemon by hand (the `sim` extra).

python -m pcc_plugin.sim kubelet --dir /tmp/pcc-try/device-plugins
    serve kubelet.sock there until SIGTERM or SIGINT, printing one line per event
python -m pcc_plugin.sim allocate --dir /tmp/pcc-try/device-plugins pcc-0 [pcc-1 ...]
    what kubelet's Allocate of those devices gets from the plugin serving in that
    directory, as a container would be given it
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

import grpc

from pcc_plugin.sim._pb import deviceplugin_v1beta1_pb2 as pb
from pcc_plugin.sim.demo import what_the_container_gets
from pcc_plugin.sim.kubelet import SimKubelet
from pcc_plugin.sim.rules import ALLOCATE, KUBELET_SOCKET


def serve_kubelet(args: argparse.Namespace) -> int:
    # The simulator logs each event as one plain line; grpcio only its warnings.
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")
    logging.getLogger("pcc_plugin.sim").setLevel(logging.INFO)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda _signum, _frame: stop.set())
    kubelet = SimKubelet(args.dir, legacy=args.legacy, key_by=args.key_by)
    with kubelet:
        stop.wait()
    return 0


def allocate(args: argparse.Namespace) -> int:
    """Dial the newest plugin socket in the directory, as kubelet dials a registered one."""
    sockets = sorted(
        (path for path in args.dir.glob("*.sock") if path.name != KUBELET_SOCKET),
        key=lambda path: path.stat().st_mtime_ns,
    )
    if not sockets:
        print(f"no plugin socket in {args.dir}: start the daemon first", file=sys.stderr)
        return 1
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=args.device_ids)]
    )
    with grpc.insecure_channel(f"unix:{sockets[-1]}") as channel:
        call = channel.unary_unary(
            ALLOCATE,
            request_serializer=pb.AllocateRequest.SerializeToString,
            response_deserializer=pb.AllocateResponse.FromString,
        )
        try:
            response = call(request, timeout=10)
        except grpc.RpcError as failure:
            print(f"{sockets[-1].name} answered {failure.code().name}: {failure.details()}")
            return 1
    print(f"{sockets[-1].name} answered; the container gets:")
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
    one.add_argument("device_ids", nargs="+", metavar="DEVICE_ID")
    args = parser.parse_args()
    try:
        sys.exit(serve_kubelet(args) if args.command == "kubelet" else allocate(args))
    except ValueError as too_long:
        parser.error(str(too_long))


if __name__ == "__main__":
    main()
