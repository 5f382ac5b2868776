"""One filesystem fault under kubelet's directory, played in a private mount namespace.

    unshare -m --propagation private python tests/fs_fault_scenario.py FAULT

The directory is a small tmpfs mounted here, so the fault (read-only, full, no permission)
touches nothing outside. The simulated kubelet serves in it first; then the fault; then the
daemon starts, meets the fault, retries; then the fault is repaired and the daemon must
register. Prints one JSON object with what it saw; exits non-zero if a step timed out.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from pcc_plugin.sim import Daemon, FakeNode, SimKubelet

RESOURCE = "tke.cloud.tencent.com/pcc-device"
RETRIES_SEEN = 9
WAIT = 20.0


def run(fault: str) -> dict[str, object]:
    node = FakeNode.create()
    plugin_dir = node.plugin_dir
    plugin_dir.mkdir()
    # Room for kubelet.sock, a few files and nothing more, when the fault is "full".
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,nr_inodes=16,mode=0750", "tmpfs", plugin_dir],
        check=True,
    )
    kubelet = SimKubelet(plugin_dir)
    kubelet.start()
    fillers: list[Path] = []
    wrapper: list[str] = []
    if fault == "read-only":
        subprocess.run(["mount", "-o", "remount,ro", plugin_dir], check=True)
    elif fault == "full":
        try:
            while True:
                filler = plugin_dir / f"filler-{len(fillers)}"
                filler.write_bytes(b"")
                fillers.append(filler)
        except OSError:
            pass
    elif fault == "permission denied":
        plugin_dir.chmod(0o550)
        # Root without the capability that lets it ignore file modes.
        wrapper = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    else:
        raise SystemExit(f"unknown fault {fault!r}")
    args = node.daemon_args(verbosity=1)
    daemon = Daemon([*wrapper, sys.executable, "-m", "pcc_plugin", *args], node.root / "d.log")
    try:
        daemon.wait_for_log("Restarting the device plugin server: cannot serve", WAIT)
        fds_at_first_retry = daemon.open_fds()
        daemon.wait_for_log("Restarting the device plugin server: cannot serve", WAIT,
                            count=RETRIES_SEEN)  # fmt: skip
        fds_after_retries = daemon.open_fds()
        if fault == "read-only":
            subprocess.run(["mount", "-o", "remount,rw", plugin_dir], check=True)
        elif fault == "full":
            for filler in fillers:
                filler.unlink()
        else:
            plugin_dir.chmod(0o750)
        daemon.wait_for_log("Serving in ", WAIT)
        daemon.wait_for_log("Registered device plugin with Kubelet", WAIT)
        kubelet.wait_for(lambda: kubelet.stream_open(RESOURCE), WAIT)
        text = daemon.log_text()
        return {
            "error_lines": [line for line in text.splitlines() if line.startswith("E")],
            "traceback": "Traceback" in text,
            "retries": len(re.findall("Restarting the device plugin server: cannot serve", text)),
            "fds_at_first_retry": fds_at_first_retry,
            "fds_after_retries": fds_after_retries,
            "registered": kubelet.stream_open(RESOURCE),
            "log": text,
        }
    finally:
        daemon.close()
        kubelet.stop()
        subprocess.run(["umount", "--lazy", plugin_dir], check=False)
        shutil.rmtree(node.root, ignore_errors=True)


if __name__ == "__main__":
    start = time.monotonic()
    result = run(sys.argv[1])
    result["seconds"] = round(time.monotonic() - start, 2)
    print(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)
