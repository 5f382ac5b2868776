"""The daemon on a fake node with a simulated kubelet, told as a short story.

    python -m pcc_plugin.sim.demo [--keep]

Each step is followed by the daemon's own log lines (at --v=1) that it caused. With --keep,
the fake node, the daemon's log and the kubelet's events stay, and the end says where.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Iterator

import grpc

from pcc_plugin.sim._pb import deviceplugin_v1beta1_pb2 as pb
from pcc_plugin.sim.daemon import Daemon
from pcc_plugin.sim.kubelet import SimKubelet
from pcc_plugin.sim.node import FakeNode
from pcc_plugin.sim.rules import HEALTHY
from pcc_plugin.sim.state import NoPluginError

RESOURCE = "tke.cloud.tencent.com/pcc-device"
REGISTERED = "Registered device plugin with Kubelet"
TIMEOUT = 10.0
# The demo's last line: where to go next.
DRA_ON_A_LAPTOP = (
    "The same daemon as a DRA driver, on this machine in five steps: docs/dra.md, "
    '"Try it on a laptop".'
)


def what_the_container_gets(response: pb.AllocateResponse) -> Iterator[str]:
    container = response.container_responses[0]
    for device in container.devices:
        yield (
            f"device {device.container_path} (host {device.host_path}, "
            f"permissions {device.permissions})"
        )
    for mount in container.mounts:
        access = "read-only" if mount.read_only else "read-write"
        yield f"mount {mount.container_path} (host {mount.host_path}, {access})"
    for name, value in sorted(container.envs.items()):
        yield f"environment {name}={value}"
    for name, value in sorted(container.annotations.items()):
        yield f"annotation {name}={value}"
    for cdi_device in container.cdi_devices:
        yield f"CDI device {cdi_device.name}"


def registered(kubelet: SimKubelet, times: int) -> bool:
    accepted = sum(registration.accepted for registration in kubelet.registrations)
    return accepted >= times and kubelet.stream_open(RESOURCE)


class Demo:
    def __init__(self, keep: bool) -> None:
        self.node = FakeNode.create()
        self.kubelet = SimKubelet(self.node.plugin_dir)
        self.daemon: Daemon | None = None
        self.keep = keep
        self.step = 0
        self.started = time.monotonic()
        self._shown = 0

    def tell(self, text: str) -> None:
        self.step += 1
        print(f"{self.step}. {text}")

    def show_log(self) -> None:
        """The daemon's log lines since the last step, indented under it."""
        assert self.daemon is not None
        lines = self.daemon.log_text().splitlines()
        for line in lines[self._shown :]:
            print(f"     | {line}")
        self._shown = len(lines)

    def lap(self) -> int:
        """Milliseconds since the previous lap."""
        now = time.monotonic()
        elapsed, self.started = now - self.started, now
        return round(elapsed * 1000)

    def run(self) -> int:
        node, kubelet = self.node, self.kubelet
        self.tell(
            f"Fake node in {node.root}: /dev/sev-guest links to /dev/null (a character device), "
            "/var/run/pcc is a directory."
        )
        self.lap()
        kubelet.start()
        self.tell(f"The simulated kubelet serves {kubelet.socket_path} ({self.lap()} ms).")

        self.daemon = daemon = Daemon.spawn_plugin(
            node.daemon_args(verbosity=1), node.root / "daemon.log"
        )
        # The log first: waiting on it fails at once if the daemon exits.
        daemon.wait_for_log(REGISTERED, TIMEOUT)
        kubelet.wait_for(lambda: registered(kubelet, 1), TIMEOUT)
        registration = kubelet.registrations[-1]
        devices = kubelet.devices(RESOURCE)
        healthy = sum(health == HEALTHY for health in devices.values())
        self.tell(
            f"The daemon (pid {daemon.pid}) registered {registration.resource_name} "
            f"at endpoint {registration.endpoint} {self.lap()} ms after it was started, "
            f"and lists {len(devices)} devices, {healthy} healthy. Its log:"
        )
        self.show_log()
        self.allocate_one()

        kubelet.restart()
        self.tell(f"Kubelet restarted, wiping every socket in its directory ({self.lap()} ms).")
        daemon.wait_for_log(REGISTERED, TIMEOUT, count=2)
        kubelet.wait_for(lambda: registered(kubelet, 2), TIMEOUT)
        self.tell(f"The daemon noticed and registered again after {self.lap()} ms:")
        self.show_log()
        self.allocate_one()

        returncode = daemon.terminate(signal.SIGTERM, TIMEOUT)
        self.tell(f"SIGTERM sent: the daemon exited with code {returncode} after {self.lap()} ms.")
        self.show_log()
        return 0 if returncode == 0 else 1

    def allocate_one(self) -> None:
        device_id = next(iter(self.kubelet.devices(RESOURCE)))
        self.lap()
        response = self.kubelet.allocate(RESOURCE, [[device_id]])
        self.tell(
            f"Allocate of 1 device ({device_id}) answered in {self.lap()} ms. The container gets:"
        )
        for line in what_the_container_gets(response):
            print(f"     {line}")
        if self.step == 4:
            print(
                "   (Paths are the host's, as kubelet wants them: on a real node /dev/sev-guest "
                "is the node's own device. Here no container starts and nothing on this "
                "machine is touched; the daemon looked at the fake node under "
                f"{self.node.host_root} through --host-root.)"
            )
        self.show_log()

    def close(self) -> None:
        if self.daemon is not None:
            self.daemon.close()
        self.kubelet.stop()
        if self.keep:
            (self.node.root / "kubelet-events.log").write_text(
                "\n".join(self.kubelet.events) + "\n"
            )
            print(
                f"\nKept: the fake node in {self.node.root}, the daemon's log in "
                f"{self.node.root / 'daemon.log'}, the simulated kubelet's events in "
                f"{self.node.root / 'kubelet-events.log'}. Remove them with: rm -r {self.node.root}"
            )
        else:
            self.node.remove()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m pcc_plugin.sim.demo", allow_abbrev=False)
    parser.add_argument(
        "--keep", action="store_true", help="keep the fake node and the logs, and say where"
    )
    args = parser.parse_args()
    print("pcc-device-plugin demo: the real daemon, a simulated kubelet, a fake node\n")
    demo = Demo(keep=args.keep)
    try:
        status = demo.run()
    except (TimeoutError, RuntimeError, NoPluginError, grpc.RpcError) as error:
        print(f"\nStep {demo.step + 1} failed: {error}")
        if demo.daemon is not None:
            print(f"The daemon's log:\n{demo.daemon.log_text()}")
        status = 1
    finally:
        demo.close()
    if status == 0:
        print(f"\n{DRA_ON_A_LAPTOP}")
    sys.exit(status)


if __name__ == "__main__":
    main()
