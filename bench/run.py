"""Start the real daemon against the simulated kubelet and print one table of figures.

    nox -s bench                         # the full run: about three minutes on 2 cores
    python -m bench.run --quick          # fewer repetitions: checks the script, not the daemon
    python -m bench.run --json out.json  # also write the raw figures
    nox -s bench -- --compare [REV]      # instead: before (REV), after and the Go peer

Each figure with a target (written for a 2-core machine) is marked PASS or MISS; the exit
code is 0 either way unless ``--strict`` is given. BENCHMARKS.md shows a run of today. The parts:
`harness` (the daemon on a fake node, a grpcio client), `procfs` (readings), `scenarios` (the
targets and what is judged against them), `hostile` (hostile clients, peak memory),
`rollout` (two instances), `image` (the daemon from the built image), `report` (the table);
`compare` runs issue 36's comparison (its own table, its own docstring).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench import compare, hostile, rollout, scenarios
from bench.harness import IMAGE_ENV, Bench, bytecode_env
from bench.report import Report, report_footer, report_header
from pcc_plugin.sim import FakeNode, SimKubelet


def machine() -> list[str]:
    return report_header(
        "pcc-device-plugin benchmark: the real daemon against the simulated kubelet",
        "daemon: python -m pcc_plugin --v=0 --metrics-bind-address=127.0.0.1:0 on a fake node; "
        "kubelet: pcc_plugin.sim.SimKubelet (grpcio) in the benchmark's process",
        "bytecode: compiled once into a temporary PYTHONPYCACHEPREFIX, as in the image; "
        f"environment as in the image: {' '.join(f'{k}={v}' for k, v in IMAGE_ENV.items())}",
    )


def run(args: argparse.Namespace) -> Report:
    report = Report()
    quick = args.quick
    node = FakeNode.create()
    try:
        env = bytecode_env(node.root / "pycache")
        with contextlib.ExitStack() as cleanup, SimKubelet(node.plugin_dir) as kubelet:
            bench = Bench(node, kubelet, cleanup, report, env)
            scenarios.start_to_registered(bench, 3 if quick else 10)
            # One daemon from here to the restarts, as one node's runs for weeks.
            daemon = scenarios.idle(bench, 3 if quick else args.idle_seconds)
            scenarios.dra_idle(bench)
            endpoint = kubelet.registrations[-1].endpoint
            scenarios.allocate(bench, daemon.pid, endpoint, 500 if quick else 5000,
                               2 if quick else 5)  # fmt: skip
            scenarios.under_hostile_loads(bench, daemon, endpoint, 100 if quick else 1000,
                                          2 if quick else 5)  # fmt: skip
            dials = 100 if quick else 1000
            scenarios.restarts(bench, daemon, endpoint, 20 if quick else args.restarts, dials)
            bench.stop(daemon)
            scenarios.floor(bench, 20 if quick else args.restarts, dials)
            scenarios.health_change(bench, (16, 10_000), 2 if quick else 5)
            hostile.peak_memory(bench, 2 if quick else 8)
            rollout.rollouts(bench, 1 if quick else 5)
            scenarios.from_image(bench, 3 if quick else 10, skipped=args.no_image)
    finally:
        node.remove()
    return report


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(arg == "--compare" or arg.startswith("--compare=") for arg in argv):
        return compare.main(argv)
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--compare", nargs="?", metavar="REV",
        help=f"instead: the daemon at REV ({compare.BEFORE}), this tree's and the Go peer side "
        "by side (bench/compare.py; --quick, --passes N, --json PATH)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    parser.add_argument("--restarts", type=int, default=200, help="kubelet restarts (200)")
    parser.add_argument("--idle-seconds", type=float, default=30.0, help="idle CPU window (30)")
    parser.add_argument("--no-image", action="store_true", help="skip the daemon from the image")
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    started = time.monotonic()
    header = machine()
    report = run(args)
    header.append(report_footer(started))
    header.append(f"command: {' '.join(sys.argv)}")
    print(report.render(header))
    if args.json:
        args.json.write_text(json.dumps({"machine": header, **report.figures}, indent=1))
    return 1 if args.strict and report.misses else 0


if __name__ == "__main__":
    sys.exit(main())
