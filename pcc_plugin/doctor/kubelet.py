"""Checks of kubelet's socket directory, kubelet.sock, and the daemon's own socket."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

from pcc_plugin import grpc_clients
from pcc_plugin.doctor.report import AS_ROOT, DAEMON_LOG, Result, expect_kind, failed, passed
from pcc_plugin.fs import connect_error
from pcc_plugin.plugin_dir import KUBELET_SOCKET, is_own_socket
from pcc_plugin.resource import ResourceSpec

# Each network check gives up after this long.
CHECK_TIMEOUT = 5.0
# Kubelet serves Register only on this service, so this answers UNIMPLEMENTED.
KUBELET_PROBE = "/v1beta1.Registration/PccDoctorProbe"
KUBELET_CREATES_IT = (
    "kubelet creates it at start: check that kubelet runs (systemctl status kubelet) "
    "and that --device-plugin-path is <kubelet's --root-dir>/device-plugins"
)


def check_kubelets_dir(check: str, directory: Path, missing_fix: str) -> Result:
    """A directory kubelet creates at start, seen from where the doctor runs."""
    problem = expect_kind(
        check,
        directory,
        "a directory",
        f"{missing_fix}, mounted from the host when the doctor runs in the pod",
        f"remove it and restart kubelet, which creates the directory (rm {directory}; "
        "systemctl restart kubelet)",
    )
    return problem or passed(check, f"{directory} is a directory")


async def check_kubelet(plugin_dir: Path) -> Result:
    check = "kubelet"
    path = plugin_dir / KUBELET_SOCKET
    problem = expect_kind(
        check,
        path,
        "a socket",
        KUBELET_CREATES_IT,
        f"remove it and restart kubelet, which creates the socket at start "
        f"(rm {path}; systemctl restart kubelet)",
    )
    if problem:
        return problem
    error = connect_error(path)
    if isinstance(error, ConnectionRefusedError):
        return failed(
            check,
            f"nothing listens on {path}",
            "kubelet is down and left its socket behind: start it (systemctl restart kubelet)",
        )
    if isinstance(error, PermissionError):
        return failed(
            check,
            f"cannot connect to {path}: permission denied",
            f"{AS_ROOT}; on SELinux nodes, in a domain allowed to connect to kubelet.sock "
            "(container_device_plugin_t)",
        )
    if error is not None:
        return failed(
            check, f"cannot connect to {path}: {error.strerror}", "systemctl restart kubelet"
        )
    answer = await grpc_clients.probe_unimplemented(path, KUBELET_PROBE, CHECK_TIMEOUT)
    if answer:
        return failed(
            check,
            f"{path} takes connections but {answer}",
            "restart kubelet (systemctl restart kubelet); if that does not help, "
            "something other than kubelet serves this socket",
        )
    return passed(
        check, f"{path} answers like kubelet (UNIMPLEMENTED for a method it does not serve)"
    )


def _devices(count: int) -> str:
    return f"{count} device" if count == 1 else f"{count} devices"


def sockets_newest_first(directory: Path, named: Callable[[str], bool]) -> list[Path]:
    """The sockets in `directory` whose names are `named`, newest first."""
    sockets = []
    for entry in os.scandir(directory):
        if not named(entry.name):
            continue
        try:
            status = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            # A restarting daemon removes its old socket.
            continue
        if stat.S_ISSOCK(status.st_mode):
            sockets.append((status.st_mtime_ns, directory / entry.name))
    return [path for _, path in sorted(sockets, reverse=True)]


def _daemon_socket(plugin_dir: Path, spec: ResourceSpec) -> tuple[Path | None, int]:
    """The newest of the resource's sockets that takes connections, and how many are stale."""
    stale = 0
    for path in sockets_newest_first(
        plugin_dir, lambda name: is_own_socket(spec.socket_prefix, name)
    ):
        if connect_error(path) is None:
            return path, stale
        stale += 1
    return None, stale


async def check_plugin(
    plugin_dir: Path, spec: ResourceSpec, expected: int, pre_start_check: bool
) -> Result:
    check = f"plugin {spec.name}"
    path, stale = _daemon_socket(plugin_dir, spec)
    if path is None:
        left = f" ({stale} stale, left by a daemon that was killed)" if stale else ""
        return failed(
            check,
            f"no {spec.socket_prefix}-<pid>-<token>-<n>.sock in {plugin_dir} "
            f"takes connections{left}",
            f"start the daemon, or see why it stopped ({DAEMON_LOG} --previous); "
            "it must run with the same --device-plugin-path",
        )
    try:
        options, listing = await grpc_clients.read_device_plugin(path, CHECK_TIMEOUT)
    except grpc_clients.CallFailed as exc:
        return failed(
            check,
            f"{path.name} takes connections but {exc}",
            f"see the daemon's log ({DAEMON_LOG}) and restart its pod",
        )
    devices = len(listing.devices)
    healthy = sum(device.health == "Healthy" for device in listing.devices)
    summary = f"{path.name} lists {_devices(devices)}, {healthy} Healthy"
    problems, fixes = [], []
    if devices != expected:
        problems.append(f"expected {_devices(expected)}")
        fixes.append(
            "give the doctor the daemon's flags; if they are right, restart the daemon so it "
            "takes them"
        )
    if healthy != devices:
        problems.append("expected every one Healthy")
        fixes.append(
            "the device and directory checks above and the daemon's log "
            f"({DAEMON_LOG}, lines with 'Unhealthy') say what is missing"
        )
    if options.pre_start_required != pre_start_check:
        have = "with" if options.pre_start_required else "without"
        problems.append(f"its options show the daemon runs {have} --pre-start-check")
        fixes.append("give the doctor the daemon's flags")
    if problems:
        return failed(check, f"{summary}; {'; '.join(problems)}", "; ".join(fixes))
    return passed(check, summary)
