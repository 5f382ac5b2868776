"""Checks of --mode=dra: kubelet's plugin registry, the driver's registration and DRA sockets."""

from __future__ import annotations

from pathlib import Path

from pcc_plugin import grpc_clients
from pcc_plugin.doctor.kubelet import CHECK_TIMEOUT, sockets_newest_first
from pcc_plugin.doctor.report import DAEMON_LOG, Result, failed, passed
from pcc_plugin.dra.sockets import DRA_V1, PLUGIN_TYPE, is_registration_socket
from pcc_plugin.fs import connect_error

# The driver serves no such method, so a live DRA socket answers UNIMPLEMENTED.
DRA_PROBE = DRA_V1 + "PccDoctorProbe"


KUBELET_CREATES_REGISTRY = (
    "kubelet creates it at start: check that kubelet runs (systemctl status kubelet) and "
    "that --kubelet-registry-path is <kubelet's --root-dir>/plugins_registry"
)


async def check_driver(registry: Path, driver: str) -> Result:
    """The driver answers GetInfo as kubelet's plugin watcher asks it, and its DRA socket serves."""
    check = f"DRA driver {driver}"
    refusals = []
    for path in sockets_newest_first(registry, lambda name: is_registration_socket(name, driver)):
        if connect_error(path) is not None:
            continue  # left by a driver that was killed
        try:
            info = await grpc_clients.read_plugin_info(path, CHECK_TIMEOUT)
        except grpc_clients.CallFailed as exc:
            refusals.append(f"{path.name}: {exc}")
            continue
        if info.name == driver:
            break
    else:
        why = f" ({'; '.join(refusals)})" if refusals else ""
        return failed(
            check,
            f"no registration socket in {registry} answers GetInfo for {driver}{why}",
            "start the daemon with --mode=dra, or see why it stopped "
            f"({DAEMON_LOG} --previous); give the doctor the daemon's flags",
        )
    if info.type != PLUGIN_TYPE:
        return failed(
            check,
            f"{path.name} says its type is {info.type!r}, not {PLUGIN_TYPE!r}",
            "something other than this daemon serves that socket: find it and stop it",
        )
    endpoint = Path(info.endpoint)
    problem = connect_error(endpoint)
    answer = (
        f"cannot connect: {problem.strerror}"
        if problem is not None
        else await grpc_clients.probe_unimplemented(endpoint, DRA_PROBE, CHECK_TIMEOUT)
    )
    if answer:
        return failed(
            check,
            f"{path.name} names the DRA socket {endpoint}, which {answer}",
            f"see the daemon's log ({DAEMON_LOG}) and restart its pod",
        )
    return passed(
        check,
        f"{path.name} answers for {driver} ({', '.join(info.supported_versions)}); its DRA "
        f"socket {endpoint} answers",
    )
