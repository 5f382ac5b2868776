"""Host paths that give a container the node: refused unless a profile entry opts in.

A mount of one of these directories, of a directory inside one, or of a
directory that holds one (`/var` holds `/var/lib/kubelet`), and the memory
and port devices, hand a container control of the node or of other pods.
Paths are checked as written, once `..`, `.` and repeated or trailing slashes
are taken out (`normalised`), and handed out in that form; symlinks on the
host are not followed (the host is the operator's). Block devices are looked
at as the kernel lists them, once they are there (`kernel.BlockUse`): no path
tells a whole disk or the root filesystem's volume from a protected LUN.
"""

from __future__ import annotations

import fnmatch
import glob
import posixpath

from pcc_plugin.kernel import TPM_EVENT_LOG, TSM_REPORT

OPT_IN = "allowSensitiveHostPath"

# What each gives a container, in the words of the error.
_RUN = {
    "/run/containerd": "containerd's socket directory, root on the node",
    "/run/crio": "CRI-O's socket directory, root on the node",
    "/run/docker": "Docker's state directory, root on the node",
    "/run/docker.sock": "Docker's socket, root on the node",
    "/run/dockershim.sock": "dockershim's socket, root on the node",
    "/run/cri-dockerd.sock": "cri-dockerd's socket, root on the node",
    # k3s and RKE2 run their own containerd, its socket in /run/k3s/containerd.
    "/run/k3s": "k3s's and RKE2's containerd socket directory, root on the node",
    "/run/podman": "Podman's socket directory, root on the node",
    "/run/containers": "Podman's and CRI-O's runtime state, with registry credentials",
    "/run/runc": "runc's state of every container",
    "/run/crun": "crun's state of every container",
    "/run/systemd": "systemd's sockets, root on the node",
    "/run/dbus": "D-Bus's system bus socket, root on the node through its services",
    "/run/user": "every user's runtime directory, with their systemd, D-Bus and rootless "
    "Podman sockets",
}
_DIRECTORIES = {
    "/": "the host's whole filesystem",
    "/boot": "the host's kernel and boot loader",
    "/dev": "every device node of the host",
    "/etc": "the host's configuration and credentials",
    "/proc": "the host's processes and kernel settings",
    "/root": "root's home directory",
    "/home": "the users' home directories, with their keys and rootless Podman's storage",
    "/sys": "the host's kernel and device settings",
    "/usr": "the host's programs and libraries",
    "/bin": "the host's programs",
    "/sbin": "the host's programs",
    "/lib": "the host's libraries and kernel modules",
    "/lib64": "the host's libraries",
    "/opt/cni": "the CNI plugins the container runtime runs as root",
    "/var/lib/kubelet": "kubelet's state, with every pod's volumes and secrets",
    "/var/lib/etcd": "etcd's data, every Secret of the cluster",
    "/var/lib/containerd": "containerd's storage, every container's files",
    "/var/lib/containers": "CRI-O's and Podman's storage, every container's files",
    "/var/lib/docker": "Docker's storage, every container's files",
    "/var/lib/rancher": "k3s's and RKE2's state: their containerd's storage and the cluster's "
    "tokens",
    "/var/log": "the host's and every pod's logs",
    **_RUN,
    # /var/run is a symlink to /run on current hosts; kubelet is given either spelling.
    **{"/var" + path: what for path, what in _RUN.items()},
}
# Inside one of the directories above, but no more than the TEE's guest device gives: handed out
# without an opt-in. configfs-tsm makes the attestation reports the guest device makes; the TPM's
# boot event log is what attestation sends to verifiers anyway, in read-only files.
_HARMLESS = {TSM_REPORT, TPM_EVENT_LOG}
_DEVICES = {
    "/dev/mem": "the host's physical memory",
    "/dev/kmem": "the kernel's memory",
    "/dev/port": "the host's I/O ports",
}


def normalised(path: str) -> str:
    """An absolute path without `..`, `.`, or repeated or trailing slashes."""
    # normpath keeps a leading '//' (POSIX leaves its meaning open); no host gives it one.
    return "/" + posixpath.normpath(path).lstrip("/")


def is_within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def mount_hazard(host_path: str) -> str | None:
    """What mounting the normalised `host_path` would give a container, if that is too much."""
    if any(is_within(host_path, harmless) for harmless in _HARMLESS):
        return None
    for protected, what in _DIRECTORIES.items():
        if host_path == protected:
            return f"{host_path} is {what}"
        if protected != "/" and is_within(host_path, protected):
            return f"{host_path} is inside {protected} ({what})"
        if is_within(protected, host_path):
            return f"{host_path} holds {protected} ({what})"
    return None


def device_hazard(host_path: str) -> str | None:
    """What handing out the normalised `host_path` (or what its glob matches) would give."""
    directory, name = posixpath.split(host_path)
    for device, what in _DEVICES.items():
        if host_path == device:
            return f"{host_path} is {what}"
        device_directory, device_name = posixpath.split(device)
        if (
            glob.has_magic(name)
            and directory == device_directory
            and fnmatch.fnmatchcase(device_name, name)
        ):
            return f"{host_path} matches {device} ({what})"
    return None
