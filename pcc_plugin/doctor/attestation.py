"""Checks of what attestation needs beyond a device node: the hardware a resource is only on,
configfs-tsm's report directory, and a TPM's boot event log."""

from __future__ import annotations

import errno
import os
import secrets

from pcc_plugin.doctor.report import AS_ROOT, Result, expect_kind, failed, passed, skipped, warned
from pcc_plugin.kernel import (
    CPUINFO,
    NODE_HAS,
    SEV_SNP,
    SEV_SNP_GUEST,
    TDX,
    TDX_CPU_FLAG,
    TPM_CHIP,
    TSM_REPORT,
    missing_hardware,
    procfs,
    sysfs,
)
from pcc_plugin.resource import LOAD_TSM_REPORT, HostMount, seen_from_here

# The TPM event log's file in its securityfs directory (TPM 2.0 writes only this one).
EVENT_LOG = "binary_bios_measurements"
# The guest drivers that provide configfs-tsm's reports, as misc devices.
_TSM_PROVIDERS = ("sev-guest", "tdx_guest")
LOAD_TSM_PROVIDER = (
    "load the TEE's guest driver, which provides the reports: modprobe sev-guest on an SEV-SNP "
    "guest, modprobe tdx_guest on a TDX guest"
)


def check_hardware(kind: str, host_root: str, resources: list[str]) -> Result:
    """Whether the kernel says the node has `kind`, which `resources` are only on."""
    check = f"hardware {kind}"
    missing = missing_hardware(kind, host_root)
    if missing:
        return skipped(check, f"{missing}: {', '.join(resources)} list no devices here")
    if kind == SEV_SNP:
        evidence = f"{sysfs(host_root)}{SEV_SNP_GUEST.removeprefix('/sys')} exists"
    elif kind == TDX:
        evidence = f"the CPU flags in {procfs(host_root)}{CPUINFO.removeprefix('/proc')} have "
        evidence += TDX_CPU_FLAG
    else:
        evidence = f"{sysfs(host_root)}{TPM_CHIP.removeprefix('/sys')} exists"
    return passed(check, f"the kernel says the node {NODE_HAS[kind]} ({evidence})")


def check_tsm_report(host_root: str) -> Result:
    """configfs-tsm's report directory is there, and a report can be created in it: the doctor
    makes one and removes it at once. Where the directory is read-only (the plugin's pod sees
    the host's configfs through a read-only mount), the provider's driver is looked for instead."""
    check = f"TSM report {TSM_REPORT}"
    path = seen_from_here(host_root, TSM_REPORT)
    where = f"; with --host-root, the host's /sys/kernel/config must be mounted at {host_root}"
    problem = expect_kind(
        check,
        path,
        "a directory",
        LOAD_TSM_REPORT + (where + "/sys/kernel/config" if host_root else ""),
        f"{TSM_REPORT} must be configfs-tsm's own directory",
    )
    if problem:
        return problem
    probe = os.path.join(path, f"pcc-doctor-{secrets.token_hex(4)}")
    try:
        os.mkdir(probe)
    except OSError as exc:
        if exc.errno == errno.EROFS:
            return _tsm_provider_loaded(check, path, host_root)
        if exc.errno == errno.ENXIO:
            return failed(
                check,
                f"{path} is there, but no report can be created in it: no TEE guest driver "
                f"provides reports (mkdir: {exc.strerror})",
                LOAD_TSM_PROVIDER,
            )
        fix = AS_ROOT if exc.errno in (errno.EACCES, errno.EPERM) else LOAD_TSM_PROVIDER
        return failed(check, f"cannot create a report in {path}: {exc.strerror}", fix)
    try:
        with open(os.path.join(probe, "provider"), encoding="utf-8") as provider_file:
            provider: str | None = provider_file.read().strip()
    except OSError:
        provider = None
    try:
        os.rmdir(probe)
    except OSError as exc:
        return warned(
            check,
            f"a report could be created in {path}, but not removed: {exc.strerror}",
            f"remove it on the node: rmdir {probe.removeprefix(host_root)}",
        )
    if provider is None:
        # configfs-tsm gives each new report its files (inblob, outblob, provider, ...).
        return warned(
            check,
            f"{path} takes a new directory, but without a provider file: it is not configfs-tsm",
            f"mount configfs at /sys/kernel/config on the host; {LOAD_TSM_REPORT}",
        )
    return passed(
        check, f"{path} is there, and a report can be created in it (provider {provider})"
    )


def _tsm_provider_loaded(check: str, path: str, host_root: str) -> Result:
    """Where no report can be tried, whether a driver that provides them is loaded: each
    registers its misc device only once it provides configfs-tsm's reports (Linux 6.7+)."""
    loaded = [
        f"{sysfs(host_root)}/class/misc/{name}"
        for name in _TSM_PROVIDERS
        if os.path.exists(f"{sysfs(host_root)}/class/misc/{name}")
    ]
    not_tried = f"{path} is there; no report was tried, as it is read-only here"
    if loaded:
        return passed(check, f"{not_tried}, but its provider's driver is loaded ({loaded[0]})")
    return failed(
        check,
        f"{not_tried}, and no TEE guest driver that provides reports is loaded "
        f"({', '.join(f'{sysfs(host_root)}/class/misc/{name}' for name in _TSM_PROVIDERS)} "
        "are missing)",
        LOAD_TSM_PROVIDER,
    )


def check_event_log(mount: HostMount, host_root: str) -> Result:
    """The TPM's event log can be read in the directory mounted into containers."""
    check = f"TPM event log {mount.host_path}/{EVENT_LOG}"
    path = os.path.join(seen_from_here(host_root, mount.host_path), EVENT_LOG)
    try:
        with open(path, "rb") as log:
            log.read(1)
    except FileNotFoundError:
        return failed(
            check,
            f"{path} does not exist: the TPM's firmware left no event log (or the TPM is a 1.2)",
            "attestation with this TPM needs its event log: see the node's firmware settings",
        )
    except OSError as exc:
        return failed(check, f"cannot read {path}: {exc.strerror}", AS_ROOT)
    return passed(check, f"{path} can be read")
