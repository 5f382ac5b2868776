"""`pcc-device-plugin doctor [flags]`: run every check in order, print a line each, exit 0/1/2."""

from __future__ import annotations

import collections
import glob
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from pcc_plugin import bridge, configuration, flags, klog
from pcc_plugin.doctor.attestation import check_event_log, check_hardware, check_tsm_report
from pcc_plugin.doctor.config import check_config
from pcc_plugin.doctor.dra import KUBELET_CREATES_REGISTRY, check_driver
from pcc_plugin.doctor.kubelet import (
    KUBELET_CREATES_IT,
    check_kubelet,
    check_kubelets_dir,
    check_plugin,
)
from pcc_plugin.doctor.node import (
    check_device,
    check_kernel_device,
    check_mount,
    check_pcc_node,
    kernel_device,
)
from pcc_plugin.doctor.readyz import check_readyz
from pcc_plugin.doctor.report import Result, skipped
from pcc_plugin.flags import DEFAULT_MODE, Flags
from pcc_plugin.kernel import TPM_EVENT_LOG, TSM_REPORT
from pcc_plugin.resource import (
    DeviceNode,
    ResourceSpec,
    not_on_node,
    seen_from_here,
    take_inventory,
)

PROG = f"{flags.PROG} doctor"
DESCRIPTION = (
    "Check this node for the plugin: device and directories, kubelet's socket directory "
    "and kubelet.sock, the daemon's socket and /readyz (with --mode=dra: kubelet's plugin "
    "registry and the driver's sockets instead of the device-plugin ones). Give it the "
    "daemon's flags. It changes nothing and sends kubelet no Register."
)
EPILOG = "Exit codes: 0 no check failed; 1 a check failed; 2 usage error."


async def examine(
    config: Flags,
    served: configuration.Served,
    config_problem: str | None,
    report: Callable[[Result], None],
) -> None:
    """Run every check in order and `report` each result as it comes.

    With an invalid --config file (`config_problem`), there are no resources to check, but
    kubelet and the daemon still can be: it keeps running the configuration it had.
    """
    host_root, specs = config.host_root, served.specs
    if config.config:
        for result in _examine_profiles(specs, host_root):
            report(result)
    else:
        for result in check_pcc_node(specs[0], host_root):
            report(result)
    if any(mount.host_path == TSM_REPORT for spec in specs for mount in spec.mounts):
        report(check_tsm_report(host_root))
    if served.mode == "dra":
        await _examine_dra(config, report)
    else:
        await _examine_device_plugin(config, specs, report)
    report(await check_readyz(config.metrics_bind_address))
    if config.config:
        report(
            await check_config(
                config.config, config.metrics_bind_address, served.digest, config_problem
            )
        )


def _examine_profiles(specs: Sequence[ResourceSpec], host_root: str) -> list[Result]:
    """Each resource's devices and mounts, once each; the hardware a resource is only on, and
    what a TEE's device, its event log and configfs-tsm need (doctor/attestation.py)."""
    checks: dict[str, Result] = {}
    only_on: dict[str, list[str]] = {}
    for spec in specs:
        if spec.only_on:
            only_on.setdefault(spec.only_on, []).append(spec.name)
    for kind, names in only_on.items():
        checks[f"hardware {kind}"] = check_hardware(kind, host_root, names)
    for spec in specs:
        absent = f"not checked: the node has no {spec.only_on}" if spec.only_on else ""
        absent = absent if not_on_node(spec, host_root) else ""
        for node in spec.device_nodes:
            check = f"device {node.host_path}"
            if absent:
                checks.setdefault(check, skipped(check, absent))
                continue
            checks.setdefault(check, check_device(node, host_root))
            # A profile's symlinks (/dev/disk/by-id/...) are often meant, and are not warned
            # about; a TEE's device is checked to be its driver's, as the PCC profile's is.
            for match in _matches(node, host_root):
                if device := kernel_device(match):
                    checks.setdefault(device.check, check_kernel_device(match, host_root, device))
        for mount in spec.mounts:
            check = f"{mount.label} {mount.host_path}"
            if absent:
                checks.setdefault(check, skipped(check, absent))
            elif mount.host_path == TSM_REPORT:
                continue  # its own check, after these
            else:
                checks.setdefault(check, check_mount(mount, host_root))
                if mount.host_path == TPM_EVENT_LOG:
                    checks.setdefault("event log", check_event_log(mount, host_root))
    return list(checks.values())


def _matches(node: DeviceNode, host_root: str) -> list[str]:
    """The host paths of what the node's path (or glob) names now."""
    if not node.is_glob:
        return [node.host_path]
    found = glob.glob(seen_from_here(host_root, node.host_path))
    return sorted(match.removeprefix(host_root) for match in found)


async def _examine_dra(config: Flags, report: Callable[[Result], None]) -> None:
    registry = Path(config.kubelet_registry_path)
    directory = check_kubelets_dir("plugin registry dir", registry, KUBELET_CREATES_REGISTRY)
    report(directory)
    if directory.status == "PASS":
        report(await check_driver(registry, config.driver_name))
    else:
        report(skipped(f"DRA driver {config.driver_name}", f"not checked until {registry} exists"))


async def _examine_device_plugin(
    config: Flags, specs: Sequence[ResourceSpec], report: Callable[[Result], None]
) -> None:
    plugin_dir = Path(config.device_plugin_path)
    directory = check_kubelets_dir("device-plugin dir", plugin_dir, KUBELET_CREATES_IT)
    report(directory)
    if directory.status == "PASS":
        kubelet = await check_kubelet(plugin_dir)
    else:
        kubelet = skipped("kubelet", f"not checked until {plugin_dir} exists")
    report(kubelet)
    for spec in specs:
        if kubelet.status == "PASS":
            # The daemon should list what it would find itself.
            expected = len(take_inventory(spec, config.host_root, {}))
            report(await check_plugin(plugin_dir, spec, expected, config.pre_start_check))
        else:
            # What the daemon lists matters only to a kubelet that answers.
            report(skipped(f"plugin {spec.name}", "not checked until kubelet answers"))


def main(argv: Sequence[str]) -> NoReturn:
    config, wants_version = flags.parse(argv, PROG, DESCRIPTION, EPILOG)
    if wants_version:
        print(flags.version_text(config.verbosity))
        sys.exit(0)
    klog.configure(config.verbosity)
    served = configuration.Served([], "", config.mode or DEFAULT_MODE)
    config_problem = None
    try:
        served = configuration.read(config)
    except configuration.ConfigError as exc:
        if not config.config:
            flags.usage_error(PROG, str(exc))
        # The daemon keeps what it runs: kubelet and the daemon can still be checked.
        config_problem = f"{exc} (see {exc.see})"
    results: list[Result] = []

    def report(result: Result) -> None:
        results.append(result)
        print(result.line(), flush=True)

    bridge.run(examine, config, served, config_problem, report)
    counts = collections.Counter(result.status for result in results)
    print(
        f"{counts['PASS']} passed, {counts['WARN']} warned, {counts['FAIL']} failed, "
        f"{counts['SKIP']} skipped.",
        flush=True,
    )
    sys.exit(1 if counts["FAIL"] else 0)
