"""The e2e node: containerd and kubelet in private mount, PID and network namespaces.

``outside`` (run by ``python -m e2e``) prepares what needs the real machine (the kubelet binary,
the images, a state directory) and starts ``python -m e2e inside`` under
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
    for path in OVERLAID:
        _overlay(path, state)
    for name, target in PRIVATE.items():
        source = state / "private" / name
        source.mkdir(parents=True)
        Path(target).mkdir(parents=True, exist_ok=True)
        _run("mount", "--bind", str(source), target)
    for sysctl in KUBELET_SYSCTLS:
        if not (Path("/proc/sys") / sysctl).exists():
            continue
        private = state / "sysctl" / sysctl.replace("/", ".")
        private.parent.mkdir(parents=True, exist_ok=True)
        private.write_text((Path("/proc/sys") / sysctl).read_text())
        _run("mount", "--bind", str(private), f"/proc/sys/{sysctl}")
    _run("mount", "--make-rshared", "/")
    _run("ip", "link", "set", "lo", "up")
    _run("ip", "address", "add", f"{NODE_IP}/32", "dev", "lo")


@attrs.define
class Daemon:
    """A daemon the node runs (containerd, kubelet), in a session of its own, logging to a file."""

    name: str
    argv: list[str]
    log: Path
    process: trio.Process | None = None
    started_at: float = 0.0
    starts: int = 0

    async def start(self) -> None:
        assert self.process is None, f"{self.name} already runs"
        self.starts += 1
        with self.log.open("a") as out:
            out.write(f"\n===== pcc-e2e: start {self.starts}: {' '.join(self.argv)}\n")
            out.flush()
            self.started_at = time.clock_gettime(time.CLOCK_BOOTTIME)
            self.process = await trio.lowlevel.open_process(
                self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True
            )

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

    def check_running(self) -> None:
        if self.process is None or self.process.returncode is not None:
            code = None if self.process is None else self.process.returncode
            raise RuntimeError(f"{self.name} is not running (exit status {code}); see {self.log}")


def containerd_config(state: Path, sandbox_image: str) -> str:
    cni = state / "cni"
    return f"""\
version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
# Nothing the e2e needs; opt would create /opt/containerd.
disabled_plugins = [
  "io.containerd.internal.v1.opt",
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp",
  "io.containerd.internal.v1.tracing",
]

[grpc]
  address = "{CONTAINERD_SOCKET}"

[plugins."io.containerd.grpc.v1.cri"]
  # Built locally and imported: nothing can be pulled here.
  sandbox_image = "{sandbox_image}"
  # This machine lacks CAP_SYS_RESOURCE; without this runc fails with
  # "can't get final child's PID from pipe".
  restrict_oom_score_adj = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
  # No CNI: every pod of the e2e uses the host network (the namespace's).
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{cni / "bin"}"
    conf_dir = "{cni / "net.d"}"
"""


def kubelet_config(static_pods: Path) -> str:
    return f"""\
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# Standalone: no API server; pods come from files, and anyone on the namespace's loopback may use
# kubelet's API (/pods, /run, /metrics/probes), which the checks read.
staticPodPath: {static_pods}
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
readOnlyPort: 0
containerRuntimeEndpoint: unix://{CONTAINERD_SOCKET}
# This machine: cgroup v1, no systemd, swap allowed.
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupsPerQOS: false
enforceNodeAllocatable: []
failSwapOn: false
"""


@attrs.define
class Node:
    """containerd and kubelet, started and stopped in order; call inside the namespace only."""

    state: Path
    logs: Path
    kubelet_binary: Path
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
        self.containerd = Daemon(
            "containerd", ["containerd", "--config", str(config)], self.logs / "containerd.log"
        )
        kubelet_config_file = self.state / "kubelet.yaml"
        kubelet_config_file.write_text(kubelet_config(self.static_pods))
        self.kubelet = Daemon(
            "kubelet",
            [
                str(self.kubelet_binary), f"--config={kubelet_config_file}",
                f"--hostname-override={NODE_NAME}", f"--node-ip={NODE_IP}",
                f"--node-labels={NODE_LABELS}", "--v=2",
            ],
            self.logs / "kubelet.log",
        )  # fmt: skip

    def write_containerd_config(self, sandbox_image: str) -> None:
        (self.state / "containerd.toml").write_text(containerd_config(self.state, sandbox_image))

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
        by itself when it stops, so one listed a moment ago may be gone.
        """
        with trio.fail_after(within):
            result = await trio.run_process(
                ["ctr", "--address", CONTAINERD_SOCKET, "--namespace", "k8s.io", *args],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
        if result.returncode != 0:
            error = result.stderr.decode().strip()
            if gone_ok and "not found" in error:
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
        for container in await self.tasks():
            await self.ctr("tasks", "delete", "--force", container, gone_ok=True)

    async def delete_all_containers(self) -> None:
        """Every container and sandbox gone from containerd (tasks first)."""
        await self.stop_all_containers()
        for container in (await self.ctr("containers", "list", "--quiet")).split():
            await self.ctr("containers", "delete", container, gone_ok=True)
