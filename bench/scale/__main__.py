"""What N DRA drivers cost a real kube-apiserver: this tree's and the Go reference's, side by side.

    nox -s scale                          # 100 nodes of each, about 40 minutes on 2 cores
    nox -s scale -- --quick               # 3 nodes, short windows: checks the script (CI)
    nox -s scale -- --nodes 200 --idle 1200 --only pcc --json out.json

For each kind of driver, one after the other, each on a control plane of its own (etcd and
kube-apiserver as the cluster session builds them, on 127.0.0.1, no root): N Nodes, N driver
processes (each its node's, its own user and token, its own fake host tree and kubelet
directories; no kubelet), then, from the API server's audit log, its /metrics, the kernel's
connection table and /proc: the start, an idle window long enough to hold watch renewals (the
drivers renew every 5 to 10 minutes), a 30 s outage of the API server and the herd after it,
one device change and one node's slices deleted, and memory. The Go reference is
kubernetes-sigs/dra-example-driver's kubelet plugin (k8s.io/dynamic-resource-allocation's
helper), built from its module by bench/scale/builds.py. Nothing is judged: the figures are
printed (docs/dra.md keeps a run's).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from bench.harness import bytecode_env
from bench.report import report_footer, report_header
from bench.scale import builds, report
from bench.scale.apiserver import Failed
from bench.scale.drivers import KINDS, PCC, REFERENCE
from bench.scale.run import Figures, Settings, measure

QUICK = {"nodes": 3, "idle": 5.0, "settle": 1.0, "outage": 5.0, "after_outage": 5.0,
         "change_within": 45.0}  # fmt: skip


# inotify instances a driver of this tree takes (3), and room for the rest of the machine's.
INOTIFY_PER_DRIVER = 4
INOTIFY_SPARE = 256


def _log(line: str) -> None:
    print(f"scale: {line}", file=sys.stderr, flush=True)


def _terminated(signum: int, frame: FrameType | None) -> None:
    # Unwinds like Ctrl-C does: every driver and daemon is stopped on the way out.
    raise SystemExit(f"scale: stopped by signal {signum}")


def inotify_room(nodes: int) -> None:
    """Enough inotify instances for `nodes` drivers of one user (this tree's takes 3 each):
    the kernel's limit is per user, 128 by default, where on a real pool each driver is alone
    on its node. Raised when this runs as root (never lowered again: other work may count on
    it); else one line that says how."""
    limit = Path("/proc/sys/fs/inotify/max_user_instances")
    have, need = int(limit.read_text()), INOTIFY_PER_DRIVER * nodes + INOTIFY_SPARE
    if have >= need:
        return
    if os.geteuid() != 0:
        raise SystemExit(
            f"scale: {nodes} drivers of one user need {need} inotify instances, and "
            f"fs.inotify.max_user_instances is {have}: raise it (as root: sysctl "
            f"fs.inotify.max_user_instances={need}), or run fewer (--nodes)"
        )
    limit.write_text(f"{need}\n")
    _log(f"raised fs.inotify.max_user_instances from {have} to {need} for {nodes} drivers")


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.scale", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: " + ", ".join(f"{k} {v:g}" for k, v in QUICK.items())
                        + ", no node deleted alone (any flag given still wins)")  # fmt: skip
    parser.add_argument("--nodes", type=int, help="drivers (and nodes) of each kind (100)")
    parser.add_argument("--idle", type=float, help="the idle window, seconds (660)")
    parser.add_argument(
        "--settle", type=float, help="seconds after the last start before the idle window (30)"
    )
    parser.add_argument("--outage", type=float, help="how long kube-apiserver is down (30)")
    parser.add_argument(
        "--after-outage", type=float, help="seconds watched after it is ready again (360)"
    )
    parser.add_argument(
        "--change-within", type=float, help="seconds a driver has to write its slice (90)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=4, help="drivers starting at once, unpublished (4)"
    )
    parser.add_argument("--only", choices=sorted(KINDS), help="one kind of driver only")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--keep", type=Path, help="keep every log, the audit log and the nodes' trees here"
    )
    args = parser.parse_args(argv)
    defaults = {"nodes": 100, "idle": 660.0, "settle": 30.0, "outage": 30.0,
                "after_outage": 360.0, "change_within": 90.0}  # fmt: skip
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, QUICK[key] if args.quick else value)
    if args.nodes < 2:
        parser.error("--nodes: at least 2 (one node's device changes, another's slices go)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, _terminated)
    inotify_room(args.nodes)
    started = time.monotonic()
    kinds = [KINDS[args.only]] if args.only else [PCC, REFERENCE]
    apiserver, etcd = builds.control_plane(_log)
    program = builds.reference(_log) if REFERENCE in kinds else None
    settings = Settings(
        nodes=args.nodes, concurrency=args.concurrency, settle=args.settle, idle=args.idle,
        outage=args.outage, after_outage=args.after_outage, change_within=args.change_within,
        delete_one=not args.quick, keep=args.keep,
    )  # fmt: skip
    titles = {PCC.key: PCC.title,
              REFERENCE.key: f"{REFERENCE.title} {builds.REFERENCE.version()}"}  # fmt: skip
    # The load average in it is the start's: the machine is shared.
    header = report_header(
        "pcc-device-plugin scale benchmark: N DRA drivers against a real kube-apiserver",
        f"kube-apiserver and etcd, the cluster session's builds ({apiserver.parent.name}, "
        f"{etcd.parent.name}), on 127.0.0.1; counts from its audit log",
        f"{args.nodes} nodes of each kind, each its own user, process, host tree; "
        f"idle {args.idle:g} s, outage {args.outage:g} s, watched {args.after_outage:g} s after",
    )
    results: dict[str, Figures] = {}
    with tempfile.TemporaryDirectory(prefix="pcc-scale-pycache-") as cache:
        env = bytecode_env(Path(cache))
        env["PYTHONPATH"] = ""
        for kind in kinds:
            try:
                results[kind.key] = measure(kind, settings, (apiserver, etcd), program, env, _log)
            except Failed as error:
                _log(f"{kind.title}: {error}")
                return 1
    header.append(report_footer(started))
    header.append(f"command: {' '.join(['python -m bench.scale', *(argv or sys.argv[1:])])}")
    windows = {"concurrency": float(args.concurrency), "settle": args.settle,
               "idle": args.idle, "outage": args.outage}  # fmt: skip
    print(report.render(header, titles, results, args.nodes, windows))
    if args.json:
        args.json.write_text(json.dumps(
            {"machine": header, **{key: f.values for key, f in results.items()}},
            indent=1, default=str,
        ))  # fmt: skip
    return 0


if __name__ == "__main__":
    os.environ.pop("KUBECONFIG", None)
    sys.exit(main())
