"""Run the simulated kubelet until SIGTERM or SIGINT, printing one line per event.

python -m pcc_plugin.sim --dir /tmp/pcc-x/device-plugins [--legacy] [--key-by resource]
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from pathlib import Path

from pcc_plugin.sim.kubelet import SimKubelet


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m pcc_plugin.sim", allow_abbrev=False)
    parser.add_argument("--dir", required=True, type=Path, help="device-plugin socket directory")
    parser.add_argument(
        "--legacy", action="store_true", help="answer Register before dialling the plugin"
    )
    parser.add_argument(
        "--key-by",
        choices=["endpoint", "resource"],
        default="endpoint",
        help="keep plugin clients per endpoint (recent kubelets) or per resource (older ones)",
    )
    args = parser.parse_args()
    # The simulator logs each event as one plain line; grpcio only its warnings.
    logging.basicConfig(stream=sys.stdout, level=logging.WARNING, format="%(message)s")
    logging.getLogger("pcc_plugin.sim").setLevel(logging.INFO)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda _signum, _frame: stop.set())
    try:
        kubelet = SimKubelet(args.dir, legacy=args.legacy, key_by=args.key_by)
    except ValueError as too_long:
        parser.error(str(too_long))
    with kubelet:
        stop.wait()


if __name__ == "__main__":
    main()
