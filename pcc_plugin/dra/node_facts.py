"""What the node can truthfully say of its confidential computing: device attributes that claims
and DeviceClasses select on with CEL, as `device.attributes["<driver>"].teeType`.

Read from the host's sysfs under --host-root (manifests/overlays/dra mounts the host's /sys at
/host/sys, read-only; a container's own /sys shows the same kernel but not its configfs):

- `teeType`: `sev-snp` while the kernel has registered the SEV-SNP guest's platform device
  (`/sys/bus/platform/devices/sev-guest`, which Linux registers only when it runs as an SEV-SNP
  guest, whether or not the sev-guest driver is loaded); `tdx` where the kernel's CPU flags
  have `tdx_guest` (set at boot in a TDX guest; /proc/cpuinfo, not namespaced, read in this
  container unless the host's /proc is under --host-root). Not published otherwise: the driver
  says nothing it did not read.
- `tsmReport`: whether the kernel's TSM attestation-report interface is there, the configfs
  directory `/sys/kernel/config/tsm/report` (Linux 6.7 and later, configfs mounted).

Neither is published when `<host-root>/sys` is not there. Both are read at start and at every
change of the devices (loading sev-guest brings the device node and the TSM provider at once),
never on a timer.
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from pcc_plugin.kernel import SEV_SNP, SEV_SNP_GUEST, TDX, TSM_REPORT, missing_hardware
from pcc_plugin.resource import seen_from_here

SYSFS = "/sys"


@attrs.frozen
class NodeFacts:
    """What was read; None: not known, and not published."""

    tee_type: str | None = None
    tsm_report: bool | None = None

    def attributes(self) -> dict[str, dict[str, Any]]:
        found: dict[str, dict[str, Any]] = {}
        if self.tee_type is not None:
            found["teeType"] = {"string": self.tee_type}
        if self.tsm_report is not None:
            found["tsmReport"] = {"bool": self.tsm_report}
        return found

    def describe(self) -> str:
        said = [] if self.tee_type is None else [f"teeType {self.tee_type}"]
        if self.tsm_report is not None:
            said.append(f"tsmReport {str(self.tsm_report).lower()}")
        return ", ".join(said) or "nothing"


def sysfs_missing(host_root: str) -> str | None:
    """Where the host's sysfs should be and is not, or None."""
    sysfs = seen_from_here(host_root, SYSFS)
    return None if os.path.isdir(sysfs) else sysfs


def read_facts(host_root: str) -> NodeFacts:
    if sysfs_missing(host_root):
        return NodeFacts()
    tsm = os.path.isdir(seen_from_here(host_root, TSM_REPORT))
    if os.path.lexists(seen_from_here(host_root, SEV_SNP_GUEST)):
        return NodeFacts(SEV_SNP, tsm)
    return NodeFacts(None if missing_hardware(TDX, host_root) else TDX, tsm)
