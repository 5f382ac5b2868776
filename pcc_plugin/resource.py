"""The model of one extended resource: what it advertises, and what a container gets.

A resource comes from the flags (the PCC profile, `pcc_resource`) or from a
profiles file (`profiles.load`); either way it is a `ResourceSpec`. Its
devices are what the node has of it right now (`take_inventory`), and a
container allocated some of them gets a `Grant`.
"""

from __future__ import annotations

import errno
import functools
import glob
import os
import re
import stat
from collections.abc import Callable
from typing import Literal

import attrs

from pcc_plugin.kernel import LOAD, NODE_HAS, TSM_REPORT, BlockUse, missing_hardware
from pcc_plugin.sensitive import OPT_IN

CONTAINER_DEVICE_PATH = "/dev/sev-guest"
CONTAINER_PCC_PATH = "/var/run/pcc"
# Where containers get configfs-tsm's report directory with --tsm-report: not at its own path,
# where no runtime can mount it (a container's /sys is read-only sysfs, in which no mount point
# can be made, and its /sys/kernel/config is empty).
CONTAINER_TSM_REPORT = "/run/tsm/report"
# kubelet keeps every device ID in memory and in its checkpoint, and each
# ListAndWatch message carries them all; 10,000 shares stay far below gRPC's
# 4 MiB message limit.
MAX_RESOURCE_COUNT = 10_000

_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_SUBDOMAIN = re.compile(rf"{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*")
_QUALIFIED_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


def resource_name_problem(name: str) -> str | None:
    """Why kubelet would reject `name` as an extended resource name, or None.

    Kubelet accepts `domain/name` outside `kubernetes.io/` whose
    `requests.<name>` form is a valid qualified name.
    """
    if "/" not in name:
        return "needs the form domain/name, e.g. example.com/device"
    if name.startswith("requests."):
        return "must not start with 'requests.'"
    prefix, _, short = name.partition("/")
    if prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io"):
        return "the kubernetes.io domain is reserved for Kubernetes"
    if "/" in short:
        return "has more than one '/'"
    if len(prefix) > 253 or not DNS1123_SUBDOMAIN.fullmatch(prefix):
        return f"domain {prefix!r} is not a lowercase DNS subdomain"
    if len(short) > 63 or not _QUALIFIED_NAME.fullmatch(short):
        return (
            f"name {short!r} must be 1-63 characters of letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit"
        )
    return None


DeviceType = Literal["char", "block"]
_DEVICE_TEST = {"char": stat.S_ISCHR, "block": stat.S_ISBLK}
DEVICE_WORDS: dict[DeviceType, str] = {"char": "a character device", "block": "a block device"}


@attrs.frozen
class DeviceNode:
    """A device node; a glob in its last component makes one device per match."""

    host_path: str
    # Empty for a glob: each match appears at its host path.
    container_path: str
    permissions: str = "rw"
    device_type: DeviceType = "char"
    # Its profile entry opted in to handing out a sensitive host path (see `sensitive`).
    allow_sensitive: bool = False

    @property
    def is_glob(self) -> bool:
        return glob.has_magic(self.host_path)


@attrs.frozen
class HostMount:
    host_path: str
    container_path: str
    read_only: bool = False
    # Named in the detect error, e.g. "socket path" for the PCC directory.
    label: str = "mount"
    # Its profile entry opted in to mounting a sensitive host path (see `sensitive`).
    allow_sensitive: bool = False


@attrs.frozen
class ResourceSpec:
    name: str
    count: int
    # Starts socket names and, without globs, device IDs.
    socket_prefix: str = attrs.field(
        validator=attrs.validators.matches_re(r"[a-z0-9][a-z0-9.-]{0,19}")
    )
    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[HostMount, ...] = ()
    envs: tuple[tuple[str, str], ...] = ()
    # The hardware (kernel.HARDWARE) without which the node has none of this resource.
    only_on: str | None = None

    @property
    def fixed_nodes(self) -> tuple[DeviceNode, ...]:
        return tuple(node for node in self.device_nodes if not node.is_glob)

    @property
    def glob_nodes(self) -> tuple[DeviceNode, ...]:
        return tuple(node for node in self.device_nodes if node.is_glob)

    def host_paths(self) -> list[str]:
        """Every path to watch: device nodes (globs as patterns) and mount sources."""
        return [node.host_path for node in self.device_nodes] + [
            mount.host_path for mount in self.mounts
        ]


def pcc_resource(
    name: str, count: int, device: str, pcc_dir: str, tsm_report: bool = False
) -> ResourceSpec:
    """The PCC profile: one SEV-SNP guest device and the PCC socket directory, shared; with
    `tsm_report`, configfs-tsm's report directory too."""
    mounts = [HostMount(pcc_dir, CONTAINER_PCC_PATH, False, "socket path")]
    if tsm_report:
        mounts.append(HostMount(TSM_REPORT, CONTAINER_TSM_REPORT, False, "TSM report"))
    return ResourceSpec(
        name=name,
        count=count,
        socket_prefix="pcc",
        device_nodes=(DeviceNode(device, CONTAINER_DEVICE_PATH, "rw", "char"),),
        mounts=tuple(mounts),
    )


# What to do when the PCC profile's device or directory is missing: the daemon's line while it
# waits (or its fatal line with --exit-if-missing) and the doctor's fixes say the same, as do
# the README and docs/deploy.md.
NODE_LABEL = "tke.cloud.tencent.com/pcc-device-plugin"
LOAD_SEV_GUEST = "on an SEV-SNP guest, load its sev-guest driver (modprobe sev-guest)"
NOT_AN_SEV_SNP_NODE = f"a node that is not one has no PCC device: remove its label {NODE_LABEL}"
START_PCC_SERVICE = (
    "start the PCC service on the node, which creates the directory; never create it by hand: "
    "an empty one hides a node whose PCC service does not run"
)
LOAD_TSM_REPORT = (
    "configfs-tsm needs Linux 6.7 or later with configfs mounted at /sys/kernel/config "
    "(mount -t configfs none /sys/kernel/config) and the TEE's guest driver loaded; "
    "or run without --tsm-report"
)
# Trying the daemon elsewhere (a laptop, a test): the flags that name the paths.
ELSEWHERE_DEVICE = (
    "not on a node: point --pcc-device (below --host-root, if given) at a character device, "
    "e.g. a symlink to /dev/null"
)
ELSEWHERE_DIR = (
    "not on a node: point --pcc-socket-path (below --host-root, if given) at a directory"
)


def seen_from_here(host_root: str, host_path: str) -> str:
    """Where a host path is visible to this process (under --host-root)."""
    return host_root + host_path


@attrs.frozen
class Problem:
    """Why a device cannot be used: in the words operators search for (`text`), and as a
    Kubernetes label value (`cause`, e.g. `dev-sev-guest-missing`), which a DRA device taint
    carries."""

    text: str
    cause: str


_MAX_LABEL_VALUE = 63


def _cause(host_path: str, condition: str) -> str:
    """`<host path>-<condition>` as a label value; a long path keeps its end."""
    what = re.sub(r"[^A-Za-z0-9_.]+", "-", host_path).strip("-_.")
    what = what[len(what) - (_MAX_LABEL_VALUE - len(condition) - 1) :].lstrip("-_.")
    return f"{what}-{condition}" if what else condition


def _problem(host_root: str, host_path: str, what: str, kind: DeviceType | None) -> Problem | None:
    """Why `host_path` is not a device of `kind` (None: a directory) now, or None."""
    path = seen_from_here(host_root, host_path)
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            condition = "missing"
        elif exc.errno in (errno.EACCES, errno.EPERM):
            condition = "not-permitted"
        else:
            condition = "unreadable"
        return Problem(f"detect {what} {path} failed: {exc.strerror}", _cause(host_path, condition))
    if kind is None:
        right, wrong, condition = stat.S_ISDIR, "a directory", "not-a-directory"
    else:
        right, wrong, condition = _DEVICE_TEST[kind], DEVICE_WORDS[kind], f"not-a-{kind}-device"
    if right(mode):
        return None
    return Problem(f"detect {what} {path} failed: not {wrong}", _cause(host_path, condition))


BlockUses = Callable[[], BlockUse]


def host_owned(
    node: DeviceNode, host_path: str, host_root: str, block_use: BlockUses
) -> str | None:
    """What the kernel says makes the block device at `host_path` the host's, unless its entry
    opted in: a whole disk, or what holds a mounted filesystem or swap (kernel.BlockUse)."""
    if node.device_type != "block" or node.allow_sensitive:
        return None
    try:
        number = os.stat(seen_from_here(host_root, host_path)).st_rdev
    except OSError:
        return None
    return block_use().hazard(host_path, number)


def _node_problem(node: DeviceNode, host_root: str, block_use: BlockUses) -> Problem | None:
    problem = _problem(host_root, node.host_path, "device", node.device_type)
    hazard = problem is None and host_owned(node, node.host_path, host_root, block_use)
    if hazard:
        return Problem(
            f"{hazard}: refused unless its entry sets {OPT_IN} (docs/profiles.md)",
            _cause(node.host_path, "host-owned"),
        )
    return problem


def _mount_problem(mount: HostMount, host_root: str) -> Problem | None:
    return _problem(host_root, mount.host_path, mount.label, None)


def shared_problem(
    spec: ResourceSpec, host_root: str, block_use: BlockUses | None = None
) -> Problem | None:
    """Why the node cannot serve any of `spec` now.

    Covers what every device of the resource needs: its fixed device nodes and
    its mount sources. Devices found by a glob are checked one by one.
    """
    block_use = block_use or functools.cache(lambda: BlockUse(host_root))
    for node in spec.fixed_nodes:
        problem = _node_problem(node, host_root, block_use)
        if problem:
            return problem
    for mount in spec.mounts:
        problem = _mount_problem(mount, host_root)
        if problem:
            return problem
    return None


@attrs.frozen
class Missing:
    """What a resource waits for before it is served: a device node or mount source as this
    process sees it (`path`), why it is not in place (`problem`, the words operators search
    for), and the line that says both with what to check on the node and elsewhere."""

    path: str
    problem: str
    message: str


def start_problem(spec: ResourceSpec, host_root: str) -> Missing | None:
    """The first of `spec`'s fixed device nodes and mount sources that is not in place, or None.

    The PCC profile's two get the fixes the doctor gives too; a profile's own entries are named
    by their host path. A resource the node does not have (`onlyOn`) waits for nothing; one it
    has waits for a device its globs match too, as the kernel says there is one.
    """
    if not_on_node(spec, host_root):
        return None
    for node in spec.fixed_nodes:
        problem = _problem(host_root, node.host_path, "device", node.device_type)
        if problem:
            if node.container_path == CONTAINER_DEVICE_PATH:
                fix = f"{LOAD_SEV_GUEST}; {NOT_AN_SEV_SNP_NODE}; {ELSEWHERE_DEVICE}"
            else:
                fix = f"not on a node: point the profile's {node.host_path} at a device"
            return _missing(host_root, node.host_path, problem, fix)
    if spec.only_on and spec.glob_nodes and not _glob_matches(spec, host_root):
        patterns = " or ".join(node.host_path for node in spec.glob_nodes)
        seen = seen_from_here(host_root, patterns)
        problem = Problem(
            f"detect device {seen} failed: nothing matches, though the kernel says the node "
            f"{NODE_HAS[spec.only_on]}",
            _cause(spec.glob_nodes[0].host_path, "missing"),
        )
        return _missing(host_root, patterns, problem, f"load its driver ({LOAD[spec.only_on]})")
    for mount in spec.mounts:
        problem = _mount_problem(mount, host_root)
        if problem:
            if mount.container_path == CONTAINER_PCC_PATH:
                fix = f"{START_PCC_SERVICE}; {ELSEWHERE_DIR}"
            elif mount.host_path == TSM_REPORT:
                fix = LOAD_TSM_REPORT
            else:
                fix = f"not on a node: point the profile's {mount.host_path} at a directory"
            return _missing(host_root, mount.host_path, problem, fix)
    return None


def _missing(host_root: str, host_path: str, problem: Problem, fix: str) -> Missing:
    message = f"{problem.text}; check {host_path} on the node: {fix}"
    return Missing(seen_from_here(host_root, host_path), problem.text, message)


@attrs.frozen
class Device:
    """One device as kubelet sees it: an ID, the nodes it brings, and its health."""

    id: str
    # Shares of the same nodes have the same group (also their CDI device name).
    group: str
    nodes: tuple[DeviceNode, ...]
    problem: str | None
    # The problem as a label value (Problem.cause), when there is one.
    cause: str | None = None

    @property
    def healthy(self) -> bool:
        return self.problem is None


def _glob_id(host_path: str) -> str:
    # /dev/vfio/12 -> vfio_12: unique within the resource and short, as kubelet wants.
    relative = host_path.removeprefix("/dev/").lstrip("/")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", relative)[-50:]


def _glob_matches(spec: ResourceSpec, host_root: str) -> bool:
    """Whether a glob of `spec` matches a device of its type now."""
    return any(
        _problem(host_root, match.removeprefix(host_root), "device", node.device_type) is None
        for node in spec.glob_nodes
        for match in glob.glob(seen_from_here(host_root, node.host_path))
    )


def not_on_node(spec: ResourceSpec, host_root: str) -> str | None:
    """Why the kernel says this node has none of `spec` (it lacks the `onlyOn` hardware)."""
    return missing_hardware(spec.only_on, host_root) if spec.only_on else None


def take_inventory(
    spec: ResourceSpec,
    host_root: str,
    seen: dict[str, DeviceNode],
    refused: dict[str, str] | None = None,
) -> tuple[Device, ...]:
    """The resource's devices now. `seen` remembers glob matches, so a gone one stays listed;
    `refused` gets the matches the kernel says are the host's (`host_owned`), and why.

    Without globs: `count` shares of the fixed nodes. With globs: `count`
    shares of each matched node, plus the fixed nodes. None on a node without the
    resource's `onlyOn` hardware.
    """
    if not_on_node(spec, host_root):
        return ()
    # Read only if a block device is looked at, and once.
    block_use = functools.cache(lambda: BlockUse(host_root))
    shared = shared_problem(spec, host_root, block_use)
    if not spec.glob_nodes:
        return tuple(
            _share(f"{spec.socket_prefix}-{index}", spec.socket_prefix, spec.fixed_nodes, shared)
            for index in range(spec.count)
        )
    for pattern in spec.glob_nodes:
        for match in sorted(glob.glob(seen_from_here(host_root, pattern.host_path))):
            host_path = match.removeprefix(host_root) if host_root else match
            if host_path in seen or _problem(host_root, host_path, "device", pattern.device_type):
                continue
            hazard = host_owned(pattern, host_path, host_root, block_use)
            if hazard:
                if refused is not None:
                    refused[host_path] = hazard
                continue
            seen[host_path] = attrs.evolve(pattern, host_path=host_path, container_path=host_path)
    devices = []
    for host_path, node in sorted(seen.items()):
        problem = shared or _node_problem(node, host_root, block_use)
        group = _glob_id(host_path)
        for index in range(spec.count):
            devices.append(_share(f"{group}-{index}", group, (*spec.fixed_nodes, node), problem))
    return tuple(devices)


def _share(
    device_id: str, group: str, nodes: tuple[DeviceNode, ...], problem: Problem | None
) -> Device:
    if problem is None:
        return Device(device_id, group, nodes, None)
    return Device(device_id, group, nodes, problem.text, problem.cause)


@attrs.frozen
class Grant:
    """What one container gets for the devices allocated to it."""

    device_nodes: tuple[DeviceNode, ...]
    mounts: tuple[HostMount, ...]
    envs: tuple[tuple[str, str], ...]
    # Fully qualified CDI device names, with --cdi.
    cdi_devices: tuple[str, ...] = ()


def grant(spec: ResourceSpec, devices: list[Device]) -> Grant:
    # Several shares of one node still give that node, and each mount, once.
    nodes = {node.host_path: node for device in devices for node in device.nodes}
    return Grant(tuple(nodes.values()), spec.mounts, spec.envs)
