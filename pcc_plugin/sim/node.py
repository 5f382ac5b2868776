"""A fake SEV-SNP node in a short temporary directory, for tests and the demo."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import attrs

NODE_DEVICE = "/dev/sev-guest"
NODE_PCC_DIR = "/var/run/pcc"
# The start of an AMD guest's /proc/cpuinfo, as the kernel writes it (flags shortened).
CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov hypervisor

processor\t: 1
"""


@attrs.frozen
class FakeNode:
    """``host_root`` stands for the host's ``/``; ``plugin_dir`` is left for kubelet to create."""

    root: Path
    host_root: Path
    device: Path
    pcc_dir: Path
    plugin_dir: Path

    @classmethod
    def create(cls) -> FakeNode:
        # Under /tmp, not pytest's long tmp_path: unix socket paths must fit in 107 bytes.
        root = Path(tempfile.mkdtemp(prefix="pcc-", dir="/tmp"))
        host_root = root / "host"
        node = cls(
            root=root,
            host_root=host_root,
            device=host_root / NODE_DEVICE.lstrip("/"),
            pcc_dir=host_root / NODE_PCC_DIR.lstrip("/"),
            plugin_dir=root / "device-plugins",
        )
        node.device.parent.mkdir(parents=True)
        # A symlink to /dev/null is a character device to stat(), like the real sev-guest.
        os.symlink("/dev/null", node.device)
        node.pcc_dir.mkdir(parents=True)
        # A sysfs that names no sev-guest device, as on a node without the driver; the SEV-SNP
        # guest's platform device and the TSM report directory, as on an SEV-SNP guest with
        # configfs mounted (what the DRA driver's node attributes read). Its devices/ makes it
        # the host's whole sysfs, read instead of this machine's (pcc_plugin.kernel.sysfs); its
        # procfs has CPU flags without tdx_guest.
        (host_root / "sys" / "devices").mkdir(parents=True)
        (host_root / "sys" / "class" / "misc").mkdir(parents=True)
        (host_root / "sys" / "bus" / "platform" / "devices" / "sev-guest").mkdir(parents=True)
        (host_root / "sys" / "kernel" / "config" / "tsm" / "report").mkdir(parents=True)
        (host_root / "proc").mkdir()
        (host_root / "proc" / "cpuinfo").write_text(CPUINFO)
        return node

    def daemon_args(self, verbosity: int = 2) -> list[str]:
        """The daemon's flags for this node; device paths are as seen from the host root."""
        return [
            "--host-root",
            str(self.host_root),
            "--pcc-device",
            NODE_DEVICE,
            "--pcc-socket-path",
            NODE_PCC_DIR,
            "--device-plugin-path",
            str(self.plugin_dir),
            # Loopback and a free port: tests run many daemons at once.
            "--metrics-bind-address=127.0.0.1:0",
            f"--v={verbosity}",
        ]

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
