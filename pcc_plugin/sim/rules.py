"""What kubelet checks and does, as the simulator needs it: API constants, names, its directory."""

from __future__ import annotations

import re
import stat
from pathlib import Path
from typing import Literal

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
MAX_SOCKET_PATH_BYTES = 107
DIAL_TIMEOUT = 10.0
PRE_START_TIMEOUT = 30.0
# Kubelet's deadline for a DRA driver's NodePrepareResources and NodeUnprepareResources.
CALL_TIMEOUT = 45.0

# Written out here, not taken from generated code, so a wrong package or service name in the
# daemon's proto fails against the simulator as it would against a real kubelet.
REGISTER = "/v1beta1.Registration/Register"
GET_DEVICE_PLUGIN_OPTIONS = "/v1beta1.DevicePlugin/GetDevicePluginOptions"
LIST_AND_WATCH = "/v1beta1.DevicePlugin/ListAndWatch"
GET_PREFERRED_ALLOCATION = "/v1beta1.DevicePlugin/GetPreferredAllocation"
ALLOCATE = "/v1beta1.DevicePlugin/Allocate"
PRE_START_CONTAINER = "/v1beta1.DevicePlugin/PreStartContainer"

KeyBy = Literal["endpoint", "resource"]

_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*")
_QUALIFIED_NAME_PART = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


def is_dns_subdomain(value: str) -> bool:
    """Kubernetes' IsDNS1123Subdomain: the names of most objects (Nodes, ResourceClaims)."""
    return len(value) <= 253 and _DNS1123_SUBDOMAIN.fullmatch(value) is not None


def is_dns_label(value: str) -> bool:
    """Kubernetes' IsDNS1123Label: a namespace's name."""
    return len(value) <= 63 and re.fullmatch(_DNS1123_LABEL, value) is not None


def is_qualified_name(value: str) -> bool:
    """Kubernetes' IsQualifiedName: an optional DNS-1123 subdomain prefix and a short name."""
    prefix, slash, name = value.rpartition("/")
    if slash and not is_dns_subdomain(prefix):
        return False
    return len(name) <= 63 and _QUALIFIED_NAME_PART.fullmatch(name) is not None


def is_extended_resource_name(name: str) -> bool:
    """Kubernetes' IsExtendedResourceName, the check kubelet applies to RegisterRequest."""
    if "/" not in name or "kubernetes.io/" in name or name.startswith("requests."):
        return False
    return is_qualified_name(f"requests.{name}")


def remove_sockets(directory: Path) -> None:
    """What kubelet does at start: delete socket files, keep regular files and subdirectories.

    Like kubelet, it follows symlinks to decide (and then removes the link).
    """
    for entry in directory.iterdir():
        try:
            if stat.S_ISSOCK(entry.stat().st_mode):
                entry.unlink()
        except FileNotFoundError:
            continue
