"""The fleet of ``nox -s cluster``: three more nodes beside the harness's own, on one control plane.

Node A is the harness's node (node.py): its kubelet and containerd run in the harness's
namespaces, with the control plane, as on a control-plane node that also runs pods. Nodes B, C
and D each have namespaces of their own (:class:`Member` says what each is):

- a mount namespace, made by ``unshare`` from the harness's, in which ``python -m e2e
  fleet-node`` (:func:`hold`) lays its own overlays on /dev, /run and /var/lib and binds its own
  kubelet, containerd and log directories (node.own_directories), then holds the namespaces
  open until the harness ends; its containerd and kubelet are started in them with ``nsenter``,
  and its files are seen from the harness under ``/proc/<holder>/root`` (node.Node.see);
- a network namespace with one end of a veth pair, ``eth0``, at ``192.0.2.<n>``; the other end
  is a port of the bridge ``pcc-fleet0`` in the harness's namespace, whose address
  ``192.0.2.254`` is every member's default route. The harness routes each member's pod subnet
  ``10.244.<n>.0/24`` to it, so pods of every node reach each other and the API server (the
  ``kubernetes`` Service's address is on the harness's loopback) through one pod network;
- a cgroup root of its own for its pods, ``/<node name>`` in every hierarchy;
- its own client certificate (``system:node:<name>``) and kubelet build.

Each member's fake SEV-SNP device and PCC directory are its own: what it inherits from the
harness's overlays (node A's) is removed in its own, then made again as :class:`Member` says.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import attrs
import trio

from .control_plane import ControlPlane
from .node import NODE_NAME, Node, own_directories
from .scenario import DEVICE, DEVICE_NUMBER, PCC_DIR

CGROUPS = Path("/sys/fs/cgroup")
BRIDGE = "pcc-fleet0"
GATEWAY = "192.0.2.254"
HOLD_READY = "ready"
# What a member inherits from node A's overlays and must not share: A's PCC directory and CDI
# specs, and its CNI plugins' address records.
NOT_SHARED = (PCC_DIR, Path("/var/run/cdi"), Path("/var/lib/cni"))


@attrs.frozen
class Member:
    """A node of the fleet beside node A: its letter, its number (in its addresses), the kubelet
    build it runs (tools/e2e/builds.py), and whether its device and PCC directory are there when
    it starts."""

    letter: str
    number: int
    kubelet: str
    device: bool
    pcc_dir: bool

    @property
    def name(self) -> str:
        return f"{NODE_NAME}-{self.letter}"

    @property
    def ip(self) -> str:
        return f"192.0.2.{self.number}"

    @property
    def pod_subnet(self) -> str:
        return f"10.244.{self.number}.0/24"


# B: a PCC node on the oldest kubelet minor still supported upstream; C: not a PCC node, labelled
# nowhere; D: a PCC node whose PCC service comes up after the plugin (the boot race).
MEMBERS = (
    Member("b", 2, "kubelet-1.35", device=True, pcc_dir=True),
    Member("c", 3, "kubelet", device=False, pcc_dir=False),
    Member("d", 4, "kubelet", device=True, pcc_dir=False),
)


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def hold(state: Path) -> int:
    """``python -m e2e fleet-node``, run by ``unshare`` in a member's new mount and network
    namespaces: make them the node's, say so, and hold them until the harness ends."""
    own_directories(state)
    for setting, value in (("ip_forward", "1"), ("conf/all/rp_filter", "0")):
        Path("/proc/sys/net/ipv4", setting).write_text(value)
    _run("ip", "link", "set", "lo", "up")
    print(HOLD_READY, flush=True)
    sys.stdin.read()
    return 0


def make_bridge() -> None:
    """The fleet's bridge in the harness's namespace, which routes between the members."""
    _run("ip", "link", "add", BRIDGE, "type", "bridge")
    _run("ip", "address", "add", f"{GATEWAY}/24", "dev", BRIDGE)
    _run("ip", "link", "set", BRIDGE, "up")
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1")


def cgroup_directories(name: str) -> list[Path]:
    return [hierarchy / name for hierarchy in CGROUPS.iterdir() if hierarchy.is_dir()]


@attrs.define
class Holder:
    """The process that holds a member's namespaces open (:func:`hold`)."""

    process: trio.Process

    @property
    def enter(self) -> tuple[str, ...]:
        return ("nsenter", f"--target={self.process.pid}", "--mount", "--net", "--")

    @property
    def root(self) -> Path:
        return Path(f"/proc/{self.process.pid}/root")

    async def release(self) -> None:
        if self.process.stdin is not None:
            await self.process.stdin.aclose()
        with trio.move_on_after(10):
            await self.process.wait()


async def open_namespaces(member: Member, state: Path) -> Holder:
    argv = [
        "unshare", "--mount", "--propagation", "private", "--net", "--",
        sys.executable, "-m", "e2e", "fleet-node", "--state", str(state),
    ]  # fmt: skip
    process = await trio.lowlevel.open_process(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(os.environ)
    )
    assert process.stdout is not None
    said = b""
    with trio.fail_after(30):
        while not said.endswith(b"\n"):
            chunk = await process.stdout.receive_some(64)
            if not chunk:
                raise RuntimeError(f"{member.name}: its namespaces could not be made ({said!r})")
            said += chunk
    if said.strip() != HOLD_READY.encode():
        raise RuntimeError(f"{member.name}: {said!r}")
    holder = Holder(process)
    pid = str(process.pid)
    veth = f"veth-{member.letter}"
    _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", pid)
    _run("ip", "link", "set", veth, "master", BRIDGE, "up")
    inside = ("nsenter", f"--target={pid}", "--net", "--")
    _run(*inside, "ip", "address", "add", f"{member.ip}/24", "dev", "eth0")
    _run(*inside, "ip", "link", "set", "eth0", "up")
    _run(*inside, "ip", "route", "add", "default", "via", GATEWAY)
    _run("ip", "route", "add", member.pod_subnet, "via", member.ip)
    for directory in cgroup_directories(member.name):
        directory.mkdir(exist_ok=True)
    return holder


def make_device(path: Path) -> None:
    os.mknod(path, 0o666 | stat.S_IFCHR, DEVICE_NUMBER)
    os.chmod(path, 0o666)


def own_node_files(node: Node, member: Member) -> None:
    """The member's own device and directories in its overlays, not node A's."""
    for path in NOT_SHARED:
        shutil.rmtree(node.see(path), ignore_errors=True)
    node.see(DEVICE).unlink(missing_ok=True)
    if member.device:
        make_device(node.see(DEVICE))
    if member.pcc_dir:
        node.see(PCC_DIR).mkdir(mode=0o755)


@attrs.define
class Fleet:
    """Node A and the members, their nodes by name."""

    a: Node
    members: dict[str, tuple[Member, Node, Holder]] = attrs.field(factory=dict)

    @property
    def nodes(self) -> dict[str, Node]:
        return {self.a.name: self.a} | {name: node for name, (_, node, _) in self.members.items()}

    def member(self, letter: str) -> tuple[Member, Node]:
        member, node, _ = self.members[f"{NODE_NAME}-{letter}"]
        return member, node

    async def release(self) -> None:
        """Let the holders go; the members' cgroups go once the session's namespace has ended
        (``python -m e2e`` removes them with runc's)."""
        for _, _, holder in self.members.values():
            await holder.release()


async def open_fleet(
    a: Node,
    control_plane: ControlPlane,
    state: Path,
    logs: Path,
    kubelets: dict[str, Path],
    nursery: trio.Nursery,
) -> Fleet:
    """The members' namespaces and Nodes (nothing started in them yet)."""
    make_bridge()
    fleet = Fleet(a)
    for member in MEMBERS:
        own_state = state / "fleet" / member.letter
        own_state.mkdir(parents=True)
        holder = await open_namespaces(member, own_state)
        own_logs = logs / member.name
        own_logs.mkdir()
        node = Node(
            own_state, own_logs, kubelets[member.kubelet], a.containerd_binaries, a.runc,
            nursery, control_plane.node_kubeconfig(member.name), control_plane.pki.ca.certificate,
            name=member.name, ip=member.ip, enter=holder.enter, root=holder.root,
            pod_subnet=member.pod_subnet, cgroup_root=f"/{member.name}",
        )  # fmt: skip
        own_node_files(node, member)
        node.write_cni_config()
        fleet.members[member.name] = (member, node, holder)
    return fleet
