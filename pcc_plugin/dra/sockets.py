"""The DRA mode's two sockets: their names, and those earlier instances left behind.

The DRA socket (`<plugins>/<driver>/dra-<token>.sock`) serves before the registration
socket (`<plugins_registry>/<driver>-<token>-reg.sock`) exists: kubelet dials the DRA socket
as soon as it has registered the driver. The token is the pod's UID (--pod-uid) or this
process's own, so the two instances of a rolling update never share a name; each removes its
own sockets when it stops. Light on purpose: the doctor and the flags' checks use it, and
the doctor loads no API client.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from pcc_plugin.flags import Flags
from pcc_plugin.plugin_dir import process_token

MAX_SOCKET_PATH_BYTES = 107
REGISTRATION_SUFFIX = "-reg.sock"
# What kubelet's plugin watcher and the DRA socket's clients see of the driver: its type, and
# the services it serves by version.
PLUGIN_TYPE = "DRAPlugin"
DRA_V1 = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/"
DRA_V1BETA1 = "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/"


def state_dir(config: Flags) -> Path:
    """Where the DRA socket, the checkpoint and its lock go: kubelet's, per driver."""
    return Path(config.kubelet_plugins_path) / config.driver_name


def instance_token(config: Flags) -> str:
    """What tells this instance's sockets from another's: the pod's UID, or the process's."""
    return config.pod_uid or process_token()


def socket_paths(config: Flags, token: str = "") -> tuple[Path, Path]:
    """The registration socket and the DRA socket of this instance (or of the instance whose
    token is `token`).

    With a name too long for a unix socket, the token and driver give way to a hash of them.
    """
    token = token or instance_token(config)
    registry = Path(config.kubelet_registry_path)
    registration = registry / f"{config.driver_name}-{token}{REGISTRATION_SUFFIX}"
    dra = state_dir(config) / f"dra-{token}.sock"
    digest = hashlib.sha256(f"{config.driver_name}/{token}".encode()).hexdigest()[:16]
    if len(os.fsencode(registration)) > MAX_SOCKET_PATH_BYTES:
        registration = registry / f"{digest}{REGISTRATION_SUFFIX}"
    if len(os.fsencode(dra)) > MAX_SOCKET_PATH_BYTES:
        dra = state_dir(config) / f"dra-{digest}.sock"
    return registration, dra


def is_registration_socket(name: str, driver: str) -> bool:
    """Whether `name` is a registration socket `socket_paths` names for `driver`, or a hashed
    one (whose driver only its GetInfo tells)."""
    if name.startswith(f"{driver}-") and name.endswith(REGISTRATION_SUFFIX):
        return True
    return re.fullmatch(rf"[0-9a-f]{{16}}{re.escape(REGISTRATION_SUFFIX)}", name) is not None


def socket_path_problem(config: Flags) -> str | None:
    """Why this instance's sockets cannot be made, even hashed (a usage error)."""
    _, dra = socket_paths(config)
    if len(os.fsencode(dra)) > MAX_SOCKET_PATH_BYTES:
        return (
            f"--driver-name: {dra} is longer than the {MAX_SOCKET_PATH_BYTES} bytes of a unix "
            "socket path; use a shorter driver name or --kubelet-plugins-path"
        )
    return None


def earlier_sockets(config: Flags) -> list[Path]:
    """Sockets this driver's instances name, this one's included: what nothing serves of them
    is stale. A hashed registration name does not say whose it is; one nothing serves is dead
    whoever left it, and kubelet's plugin watcher would dial it at every kubelet start."""
    registry = Path(config.kubelet_registry_path)
    found = [
        path
        for path in registry.glob(f"*{REGISTRATION_SUFFIX}")
        if is_registration_socket(path.name, config.driver_name)
    ]
    return found + sorted(state_dir(config).glob("dra-*.sock"))
