"""The daemon's configuration: validated once at start into a frozen object."""

from __future__ import annotations

import re
from collections.abc import Callable

import attrs

DEFAULT_RESOURCE_NAME = "tke.cloud.tencent.com/pcc-device"
DEFAULT_RESOURCE_COUNT = 16
# kubelet keeps every device ID in memory and in its checkpoint, and each
# ListAndWatch message carries them all; 10,000 shares stay far below gRPC's
# 4 MiB message limit.
MAX_RESOURCE_COUNT = 10_000
CONTAINER_DEVICE_PATH = "/dev/sev-guest"
CONTAINER_PCC_PATH = "/var/run/pcc"
KUBELET_SOCKET = "kubelet.sock"
# A unix socket path holds at most 107 bytes; our socket names take up to 51
# (`<prefix of up to 20>-<pid>-<token>-<n>.sock`).
MAX_PLUGIN_DIR_BYTES = 56

_DNS1123_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS1123_SUBDOMAIN = re.compile(rf"{_DNS1123_LABEL}(\.{_DNS1123_LABEL})*")
_QUALIFIED_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


class ConfigError(ValueError):
    """A value an operator passed that cannot work; the message names the flag."""


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
    if len(prefix) > 253 or not _DNS1123_SUBDOMAIN.fullmatch(prefix):
        return f"domain {prefix!r} is not a lowercase DNS subdomain"
    if len(short) > 63 or not _QUALIFIED_NAME.fullmatch(short):
        return (
            f"name {short!r} must be 1-63 characters of letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit"
        )
    return None


def _check_resource_name(_: object, __: attrs.Attribute[str], value: str) -> None:
    problem = resource_name_problem(value)
    if problem:
        raise ConfigError(f"--resource-name {value!r} would be rejected by kubelet: {problem}")


def _check_resource_count(_: object, __: attrs.Attribute[int], value: int) -> None:
    if not 1 <= value <= MAX_RESOURCE_COUNT:
        raise ConfigError(f"--resource-count must be from 1 to {MAX_RESOURCE_COUNT}, got {value}")


def _absolute(flag: str) -> Callable[[object, attrs.Attribute[str], str], None]:
    def check(_: object, __: attrs.Attribute[str], value: str) -> None:
        if not value.startswith("/"):
            raise ConfigError(f"{flag} must be an absolute path, got {value!r}")

    return check


def _plugin_dir(_: object, __: attrs.Attribute[str], value: str) -> None:
    if len(value.encode()) > MAX_PLUGIN_DIR_BYTES:
        raise ConfigError(
            f"--device-plugin-path is too long for unix sockets: {len(value.encode())} bytes, "
            f"at most {MAX_PLUGIN_DIR_BYTES}"
        )


def _bind_address(_: object, __: attrs.Attribute[str], value: str) -> None:
    if not value:
        return
    _, colon, port = value.rpartition(":")
    if not colon or not port.isdigit() or int(port) > 65535:
        raise ConfigError(
            f"--metrics-bind-address must be host:port, :port or empty, got {value!r}"
        )


def _host_root(_: object, __: attrs.Attribute[str], value: str) -> None:
    if value and not value.startswith("/"):
        raise ConfigError(f"--host-root must be empty or an absolute path, got {value!r}")


@attrs.frozen
class Config:
    pcc_device: str = attrs.field(default="/dev/sev-guest", validator=_absolute("--pcc-device"))
    pcc_socket_path: str = attrs.field(
        default="/var/run/pcc", validator=_absolute("--pcc-socket-path")
    )
    resource_name: str = attrs.field(default=DEFAULT_RESOURCE_NAME, validator=_check_resource_name)
    resource_count: int = attrs.field(
        default=DEFAULT_RESOURCE_COUNT, validator=_check_resource_count
    )
    device_plugin_path: str = attrs.field(
        default="/var/lib/kubelet/device-plugins",
        validator=[_absolute("--device-plugin-path"), _plugin_dir],
    )
    host_root: str = attrs.field(default="", validator=_host_root)
    verbosity: int = 0
    # `host:port`, `:port` (every address) or "" (no metrics and probes).
    metrics_bind_address: str = attrs.field(default=":8080", validator=_bind_address)
    pre_start_check: bool = False
    # A YAML file of resources; empty means the PCC profile from the flags above.
    config: str = ""
    cdi: bool = False
    cdi_spec_dir: str = attrs.field(default="/var/run/cdi", validator=_absolute("--cdi-spec-dir"))
