"""The e2e node: containerd and kubelet in private mount, PID and network namespaces.

``outside`` (run by ``python -m e2e``) prepares what needs the real machine (the binaries, the
images, a state directory) and starts ``python -m e2e inside --session e2e|cluster`` under
``unshare --mount --propagation private --pid --fork --mount-proc --net --kill-child``. There,
before anything starts, :func:`privatise` makes the machine's state private:

- a tmpfs over the state directory holds everything below;
- ``/dev``, ``/run`` and ``/var/lib`` become overlays on the machine's directories (their
  submounts bound again on top), so the fake ``/dev/sev-guest`` and ``/var/run/pcc`` and any
  mount point the node needs are created in the overlay, never on the machine;
- private directories are bound over ``/var/lib/kubelet``, ``/var/lib/containerd``,
  ``/run/containerd`` and ``/var/log`` (kubelet's pod logs and ``/var/log/containers``);
- the six ``/proc/sys`` files kubelet sets at start (``vm.overcommit_memory``, ``kernel.panic``,
  ...) are covered by private files, so kubelet writes those instead of the machine's sysctls;
- everything is made ``rshared`` again (inside the namespace only), as kubelet's
  ``mountPropagation: HostToContainer`` needs;
- the network namespace has only ``lo``, with the node's address ``192.0.2.1`` (TEST-NET-1) on
  it: kubelet's ports (10250, 10248) and the plugin's metrics port (8080, on the pods' host
  network) cannot clash with the machine's, and nothing listens on the machine's interfaces.

When the harness (PID 1 of the namespace) ends, the kernel kills every process left in it and
the mounts vanish with the namespace, even after ``kill -9``. ``outside`` then removes the state
directory and the cgroups runc left behind (only new, empty ones).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import trio

from .poll import wait_for

NODE_IP = "192.0.2.1"
NODE_NAME = "pcc-e2e-node"
NODE_LABELS = "tke.cloud.tencent.com/pcc-device-plugin=true"
KUBELET_PORT = 10250
KUBELET_HEALTHZ_PORT = 10248
CONTAINERD_SOCKET = "/run/containerd/containerd.sock"
# Debian's containernetworking-plugins (bridge, host-local, loopback) for the cluster's pods.
CNI_PLUGINS = "/usr/lib/cni"
CTR_TIMEOUT = 60
# kubelet's setupKernelTunables (pkg/kubelet/cm/container_manager_linux.go) sets these.
KUBELET_SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
OVERLAID = ("/dev", "/run", "/var/lib")
PRIVATE = {
    "kubelet": "/var/lib/kubelet",
    "containerd": "/var/lib/containerd",
    "containerd-state": "/run/containerd",
    "log": "/var/log",
}
PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
POD_RESOURCES_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True)


def _mountpoints() -> list[str]:
    with open("/proc/self/mountinfo") as info:
        return [line.split()[4] for line in info]


def _overlay(path: str, state: Path) -> None:
    """An overlay at `path` on what is there now, with its submounts bound again on top."""
    name = path.strip("/").replace("/", "-")
    original, lower, upper, work = (state / part / name for part in ("orig", "low", "up", "work"))
    for directory in (original, lower, upper, work):
        directory.mkdir(parents=True)
    submounts = sorted({m for m in _mountpoints() if Path(m).is_relative_to(path) and m != path})
    top = [m for m in submounts if not any(Path(m).is_relative_to(o) and m != o for o in submounts)]
    _run("mount", "--rbind", path, str(original))
    _run("mount", "--bind", path, str(lower))
    options = f"lowerdir={lower},upperdir={upper},workdir={work}"
    _run("mount", "-t", "overlay", "-o", options, f"pcc-e2e-{name}", path)
    for mountpoint in top:
        relative = Path(mountpoint).relative_to(path)
        again = ["mount", "--rbind", str(original / relative), mountpoint]
        if subprocess.run(again, capture_output=True, check=False).returncode != 0:
            # e.g. a user's FUSE mount under /run/user, which root may not open: the node
            # needs none of them.
            print(f"e2e: {mountpoint} is not bound again inside the namespace", flush=True)


def privatise(state: Path) -> None:
    """Make the machine's state private to this namespace (see the module's docstring)."""
    _run("mount", "-t", "tmpfs", "-o", "mode=0700,size=8g", "pcc-e2e-state", str(state))
    own_directories(state)
    for sysctl in KUBELET_SYSCTLS:
        if not (Path("/proc/sys") / sysctl).exists():
            continue
        private = state / "sysctl" / sysctl.replace("/", ".")
        private.parent.mkdir(parents=True, exist_ok=True)
        private.write_text((Path("/proc/sys") / sysctl).read_text())
        _run("mount", "--bind", str(private), f"/proc/sys/{sysctl}")
    _run("ip", "link", "set", "lo", "up")
    _run("ip", "address", "add", f"{NODE_IP}/32", "dev", "lo")


def own_directories(state: Path) -> None:
    """What a node keeps to itself, kept in `state`: overlays on /dev, /run and /var/lib, and
    its own kubelet, containerd and log directories; then everything rshared again, as kubelet's
    ``mountPropagation: HostToContainer`` needs. The harness's node makes them over the
    machine's, each node of the fleet over the harness's (fleet.py)."""
    for path in OVERLAID:
        _overlay(path, state)
    for name, target in PRIVATE.items():
        source = state / "private" / name
        source.mkdir(parents=True)
        Path(target).mkdir(parents=True, exist_ok=True)
        _run("mount", "--bind", str(source), target)
    _run("mount", "--make-rshared", "/")


@attrs.define
class Daemon:
    """A daemon the node runs (containerd, kubelet, ...), in a session of its own, logging to a
    file: directly, or, given a nursery, through a pipe that this process copies line by line,
    so that an action can follow a line the moment the daemon writes it (:meth:`on_line`)."""

    name: str
    argv: list[str]
    log: Path
    nursery: trio.Nursery | None = None
    env: dict[str, str] | None = None
    process: trio.Process | None = None
    started_at: float = 0.0
    starts: int = 0
    actions: list[tuple[tuple[str, ...], Callable[[], None]]] = attrs.field(factory=list)

    def on_line(self, action: Callable[[], None], *words: str) -> None:
        """Call `action` once, as soon as the daemon writes a line containing every one of
        `words`."""
        assert self.nursery is not None, f"{self.name}'s output is not watched"
        self.actions.append((words, action))

    def forget_actions(self) -> None:
        """Drop the actions whose lines never came."""
        self.actions.clear()

    async def start(self) -> None:
        assert self.process is None, f"{self.name} already runs"
        self.starts += 1
        with self.log.open("a") as out:
            out.write(f"\n===== pcc-e2e: start {self.starts}: {' '.join(self.argv)}\n")
            out.flush()
            self.started_at = time.clock_gettime(time.CLOCK_BOOTTIME)
            self.process = await trio.lowlevel.open_process(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out if self.nursery is None else subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=self.env,
            )
        if self.nursery is not None:
            assert self.process.stdout is not None
            self.nursery.start_soon(self._copy_output, self.process.stdout)

    async def _copy_output(self, output: trio.abc.ReceiveStream) -> None:
        pending = b""
        with self.log.open("ab", buffering=0) as out:
            async with output:
                async for chunk in output:
                    out.write(chunk)
                    *lines, pending = (pending + chunk).split(b"\n")
                    for line in lines:
                        self._act_on(line.decode(errors="replace"))

    def _act_on(self, line: str) -> None:
        for entry in list(self.actions):
            if all(word in line for word in entry[0]):
                self.actions.remove(entry)
                entry[1]()

    async def stop(self, grace: float = 20) -> int | None:
        """SIGTERM, then SIGKILL after `grace` seconds; the exit status (None if not running)."""
        process, self.process = self.process, None
        if process is None:
            return None
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
            with trio.move_on_after(grace):
                return await process.wait()
            process.kill()
        with trio.fail_after(10):
            return await process.wait()

    async def kill(self) -> None:
        """SIGKILL, as a crash or the OOM killer ends it."""
        process, self.process = self.process, None
        assert process is not None, f"{self.name} does not run"
        process.kill()
        with trio.fail_after(10):
            await process.wait()

    def check_running(self) -> None:
        if self.process is None or self.process.returncode is not None:
            code = None if self.process is None else self.process.returncode
            raise RuntimeError(f"{self.name} is not running (exit status {code}); see {self.log}")


def containerd_config(state: Path, sandbox_image: str, shim: Path, runc: Path) -> str:
    """containerd 2.x's configuration (version 3). CNI: the configurations in the state
    directory's cni/net.d (none for the e2e, whose pods use the host network), Debian's plugins.

    The shim and runc by absolute path: containerd looks for its shim on PATH before beside
    itself, and the shim for runc on PATH, so a machine's own containerd (Debian's 1.6, whose
    shim cannot serve 2.x) or another runc would be taken instead."""
    cni = state / "cni"
    return f"""\
version = 3
root = "/var/lib/containerd"
state = "/run/containerd"
# Nothing the sessions need; opt would create /opt/containerd on the machine.
disabled_plugins = [
  "io.containerd.internal.v1.opt",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
]

[grpc]
  address = "{CONTAINERD_SOCKET}"

[debug]
  # Debug: containerd says which CDI devices kubelet asked for (cluster check 4).
  level = "debug"

[plugins."io.containerd.cri.v1.images"]
  snapshotter = "overlayfs"
  [plugins."io.containerd.cri.v1.images".pinned_images]
    # Built locally and imported: nothing can be pulled here.
    sandbox = "{sandbox_image}"

[plugins."io.containerd.cri.v1.runtime"]
  # This machine lacks CAP_SYS_RESOURCE; without this runc fails with
  # "can't get final child's PID from pipe".
  restrict_oom_score_adj = true
  enable_selinux = false
  # CDI specs as the runtime reads them on a node (the default directories, said here).
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  [plugins."io.containerd.cri.v1.runtime".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      runtime_path = "{shim}"
      [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
        BinaryName = "{runc}"
  [plugins."io.containerd.cri.v1.runtime".cni]
    bin_dirs = ["{CNI_PLUGINS}"]
    conf_dir = "{cni / "net.d"}"
"""


# Addresses from host-local's own state under /var/lib/cni (private to the namespace); no masquerade
# and no port mapping, which would need iptables: nothing leaves the namespace. The pods' default
# route is the bridge, so they reach the `kubernetes` Service's address on the node
# (control_plane.py).
CNI_VERSION = "1.0.0"
POD_SUBNET = "10.244.0.0/24"


def cni_config(subnet: str) -> str:
    return f"""\
{{
  "cniVersion": "{CNI_VERSION}",
  "name": "pcc-e2e",
  "plugins": [
    {{
      "type": "bridge",
      "bridge": "pcc-e2e0",
      "isDefaultGateway": true,
      "ipMasq": false,
      "ipam": {{"type": "host-local", "ranges": [[{{"subnet": "{subnet}"}}]]}}
    }}
  ]
}}
"""


def kubelet_config(static_pods: Path, client_ca: Path | None, cgroup_root: str = "") -> str:
    """Standalone (no `client_ca`): pods come from files, and anyone on the namespace's loopback
    may use kubelet's API (/pods, /run, /metrics/probes), which the checks read. In a cluster:
    kubelet's API as a cluster has it, for clients with a certificate of the cluster's CA
    (the API server's), each request authorised by the API server."""
    if client_ca is None:
        access = """\
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow"""
    else:
        access = f"""\
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: true
  x509:
    clientCAFile: {client_ca}
authorization:
  mode: Webhook"""
    return f"""\
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
staticPodPath: {static_pods}
{access}
readOnlyPort: 0
containerRuntimeEndpoint: unix://{CONTAINERD_SOCKET}
# This machine: cgroup v1, no systemd, swap allowed.
failCgroupV1: false
cgroupDriver: cgroupfs
enforceNodeAllocatable: []
failSwapOn: false
""" + (
        # A node of the fleet keeps its pods under a cgroup root of its own, in QoS classes as
        # kubelet makes them; the harness's node leaves them where containerd puts them.
        f"cgroupsPerQOS: true\ncgroupRoot: {cgroup_root}\n" if cgroup_root
        else "cgroupsPerQOS: false\n"
    )  # fmt: skip


@attrs.define
class Node:
    """containerd and kubelet, started and stopped in order; call inside the namespace only.

    Standalone without `kubeconfig` (the e2e: static pods, labelled at start); with it, kubelet
    joins the cluster that the kubeconfig names, unlabelled, and accepts clients of `client_ca`.
    Kubelet's output goes through `nursery` (:meth:`Daemon.on_line`).

    The harness's own node runs in the harness's namespaces; a node of the fleet (fleet.py) in
    namespaces of its own, which `enter` (an ``nsenter`` argv) puts its daemons in, its files
    seen from here under `root`.
    """

    state: Path
    logs: Path
    kubelet_binary: Path
    containerd_binaries: Path
    runc: Path
    nursery: trio.Nursery
    kubeconfig: Path | None = None
    client_ca: Path | None = None
    name: str = NODE_NAME
    ip: str = NODE_IP
    enter: tuple[str, ...] = ()
    root: Path = Path("/")
    pod_subnet: str = POD_SUBNET
    cgroup_root: str = ""
    containerd: Daemon = attrs.field(init=False)
    kubelet: Daemon = attrs.field(init=False)
    static_pods: Path = attrs.field(init=False)
    staging: Path = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.static_pods = self.state / "static-pods"
        self.staging = self.state / "static-pods.staging"
        for directory in (self.static_pods, self.staging, self.state / "cni" / "net.d"):
            directory.mkdir(parents=True, exist_ok=True)
        config = self.state / "containerd.toml"
        # Anything else containerd finds by name, from its own build first.
        path = os.pathsep.join([str(self.containerd_binaries), os.environ.get("PATH", "")])
        self.containerd = Daemon(
            "containerd",
            [*self.enter, str(self.containerd_binaries / "containerd"), "--config", str(config)],
            self.logs / "containerd.log",
            env=dict(os.environ, PATH=path),
        )
        kubelet_config_file = self.state / "kubelet.yaml"
        kubelet_config_file.write_text(
            kubelet_config(self.static_pods, self.client_ca, self.cgroup_root)
        )
        joining = (
            [f"--kubeconfig={self.kubeconfig}"]
            if self.kubeconfig
            else [f"--node-labels={NODE_LABELS}"]
        )
        self.kubelet = Daemon(
            "kubelet",
            [
                *self.enter, str(self.kubelet_binary), f"--config={kubelet_config_file}",
                f"--hostname-override={self.name}", f"--node-ip={self.ip}", *joining, "--v=2",
            ],
            self.logs / "kubelet.log",
            nursery=self.nursery,
        )  # fmt: skip

    def write_containerd_config(self, sandbox_image: str) -> None:
        shim = self.containerd_binaries / "containerd-shim-runc-v2"
        config = containerd_config(self.state, sandbox_image, shim, self.runc)
        (self.state / "containerd.toml").write_text(config)

    def see(self, path: Path) -> Path:
        """A path of the node's, as this process sees it. Below /proc/<pid>/root an absolute
        symlink leads back to this process's root, so the machine's own ones (/var/run → /run),
        the same in every node, are followed here first."""
        if self.root == Path("/"):
            return path
        real = Path(os.path.realpath(path.parent)) / path.name
        return self.root / real.relative_to("/")

    def write_cni_config(self) -> None:
        """A bridge for pods off the host network (the cluster's), its gateway on the node."""
        config = cni_config(self.pod_subnet)
        (self.state / "cni" / "net.d" / "10-pcc-e2e.conflist").write_text(config)

    def put_static_pod(self, namespace: str, name: str, manifest: str) -> None:
        """Into staticPodPath by rename: kubelet never reads a half-written file."""
        staged = self.staging / f"{namespace}_{name}.yaml"
        staged.write_text(manifest)
        os.replace(staged, self.static_pods / staged.name)

    def remove_static_pod(self, namespace: str, name: str) -> None:
        (self.static_pods / f"{namespace}_{name}.yaml").unlink()

    def remove_all_static_pods(self) -> None:
        for manifest in self.static_pods.glob("*.yaml"):
            manifest.unlink()

    async def ctr(self, *args: str, within: float = CTR_TIMEOUT, gone_ok: bool = False) -> str:
        """`ctr` in containerd's k8s.io namespace (the CRI's); its output.

        With `gone_ok`, "not found" is no error: containerd's CRI deletes a task or container
        by itself when it stops, so one listed a moment ago may be gone; nor is "ttrpc:
        closed", a shim that exited while it was asked (the caller looks again).
        """
        with trio.fail_after(within):
            result = await trio.run_process(
                [
                    str(self.containerd_binaries / "ctr"),
                    "--address",
                    str(self.see(Path(CONTAINERD_SOCKET))),
                    "--namespace",
                    "k8s.io",
                    *args,
                ],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
        if result.returncode != 0:
            error = result.stderr.decode().strip()
            if gone_ok and ("not found" in error or "ttrpc: closed" in error):
                return ""
            raise RuntimeError(f"ctr {' '.join(args)}: {error}")
        return result.stdout.decode()

    async def tasks(self) -> dict[str, tuple[int, str]]:
        """containerd's tasks: container ID -> (PID, status)."""
        tasks = {}
        for line in (await self.ctr("tasks", "list")).splitlines()[1:]:
            container, pid, status = line.split()
            tasks[container] = (int(pid), status)
        return tasks

    async def stop_all_containers(self) -> None:
        """Every container's task killed and deleted, so that runc removes its cgroups."""
        for container, (_, status) in (await self.tasks()).items():
            if status != "STOPPED":
                await self.ctr("tasks", "kill", "--signal", "SIGKILL", container, gone_ok=True)

        async def all_stopped() -> bool | None:
            return all(s == "STOPPED" for _, s in (await self.tasks()).values()) or None

        await wait_for("every task stopped", all_stopped, within=30)

        async def all_deleted() -> bool | None:
            left = await self.tasks()
            for container in left:
                await self.ctr("tasks", "delete", "--force", container, gone_ok=True)
            return not left or None

        await wait_for("every task deleted", all_deleted, within=30)

    async def delete_all_containers(self) -> None:
        """Every container and sandbox gone from containerd (tasks first)."""
        await self.stop_all_containers()
        for container in (await self.ctr("containers", "list", "--quiet")).split():
            await self.ctr("containers", "delete", container, gone_ok=True)
