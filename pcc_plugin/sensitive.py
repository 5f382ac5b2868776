"""Host paths that give a container the node: refused unless a profile entry opts in.

A mount of one of these directories, of a directory inside one, or of a
directory that holds one (`/var` holds `/var/lib/kubelet`), and the memory
and port devices, hand a container control of the node or of other pods.
Paths are checked as written, once `..`, `.` and repeated or trailing slashes
are taken out (`normalised`), and handed out in that form; symlinks on the
host are not followed (the host is the operator's).
"""

from __future__ import annotations

import fnmatch
import glob
import posixpath

from pcc_plugin.resource import ResourceSpec

OPT_IN = "allowSensitiveHostPath"

# What each gives a container, in the words of the error.
_RUNTIME_SOCKETS = {
    "/run/containerd": "containerd's socket directory, root on the node",
    "/run/crio": "CRI-O's socket directory, root on the node",
    "/run/docker": "Docker's state directory, root on the node",
    "/run/docker.sock": "Docker's socket, root on the node",
    "/run/dockershim.sock": "dockershim's socket, root on the node",
    "/run/cri-dockerd.sock": "cri-dockerd's socket, root on the node",
}
_DIRECTORIES = {
    "/": "the host's whole filesystem",
    "/boot": "the host's kernel and boot loader",
    "/dev": "every device node of the host",
    "/etc": "the host's configuration and credentials",
    "/proc": "the host's processes and kernel settings",
    "/root": "root's home directory",
    "/sys": "the host's kernel and device settings",
    "/var/lib/kubelet": "kubelet's state, with every pod's volumes and secrets",
    "/var/lib/containerd": "containerd's storage, every container's files",
    "/var/lib/containers": "CRI-O's and Podman's storage, every container's files",
    "/var/lib/docker": "Docker's storage, every container's files",
    **_RUNTIME_SOCKETS,
    # /var/run is a symlink to /run on current hosts; kubelet is given either spelling.
    **{"/var" + path: what for path, what in _RUNTIME_SOCKETS.items()},
}
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


def opted_in(spec: ResourceSpec) -> list[str]:
    """What each entry of `spec` that opted in hands out: the log says so at start."""
    hazards = [device_hazard(node.host_path) for node in spec.device_nodes if node.allow_sensitive]
    hazards += [mount_hazard(mount.host_path) for mount in spec.mounts if mount.allow_sensitive]
    return [hazard for hazard in hazards if hazard]
