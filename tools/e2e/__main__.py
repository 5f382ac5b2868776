"""``python -m e2e``: run the e2e or the cluster (``nox -s e2e`` and ``nox -s cluster`` do).

    PYTHONPATH=tools python -m e2e --plugin-image build/images/pcc-device-plugin-linux-amd64.tar
    PYTHONPATH=tools python -m e2e cluster --plugin-image build/images/...-amd64.tar
    PYTHONPATH=tools python -m e2e preflight [--cluster]   # root and the tools, nothing else

Outside the namespaces: checks, the binaries (cached or built, e2e.builds), the pause image, a
state directory, then ``unshare ... python -m e2e inside`` and the clean-up after it. Logs go to
``build/<session>/logs-<UTC time>/`` (every daemon's log, and on failure pods/ with every
container's log as kubelet kept it); they are removed after a run that passed, unless
``--keep-logs``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from . import CLUSTER_STAGES

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("runc", "unshare", "mount", "ip", "nsenter", "go")
# The cluster's certificates, and the CNI plugins its pods' network is made with.
CLUSTER_TOOLS = ("openssl",)
CNI_PLUGINS = ("bridge", "host-local", "loopback")
CNI_PACKAGE = "containernetworking-plugins"
CGROUPS = Path("/sys/fs/cgroup")


def cni_problem(plugin: Path) -> str:
    """Why the cluster cannot use CNI plugin `plugin` ("" if it can): missing, or of a version
    that does not speak the CNI version of the cluster's network configuration."""
    from .node import CNI_VERSION

    if not plugin.exists():
        return f"no CNI plugin {plugin.name} in {plugin.parent} (Debian: {CNI_PACKAGE})"
    asked = subprocess.run(
        [plugin], env={"CNI_COMMAND": "VERSION"}, stdin=subprocess.DEVNULL, capture_output=True,
        text=True, timeout=30, check=False,
    )  # fmt: skip
    try:
        supported = json.loads(asked.stdout)["supportedVersions"]
    except (ValueError, KeyError, TypeError):
        supported = None
    fix = f"{CNI_PACKAGE} 1.0 or newer in {plugin.parent}"
    if supported is None:
        answer = (asked.stdout or asked.stderr).strip()[:80]
        return f"CNI plugin {plugin} does not say its CNI versions ({answer!r}): {fix}"
    if CNI_VERSION not in supported:
        return f"CNI plugin {plugin} speaks CNI {', '.join(supported)}, not {CNI_VERSION}: {fix}"
    return ""


def preflight(cluster: bool) -> list[str]:
    from . import images
    from .node import CNI_PLUGINS as CNI_DIRECTORY

    tools = TOOLS + CLUSTER_TOOLS * cluster
    problems = [f"{tool} is not on PATH" for tool in tools if shutil.which(tool) is None]
    problems += filter(None, [images.busybox_problem()])
    if cluster:
        problems += [cni_problem(Path(CNI_DIRECTORY) / plugin) for plugin in CNI_PLUGINS]
    if os.geteuid() != 0:
        problems.append("needs root")
    return [problem for problem in problems if problem]


def _image_references(archive: Path) -> list[str]:
    with tarfile.open(archive) as tar:
        member = tar.extractfile("manifest.json")
        assert member is not None, f"{archive}: no manifest.json (not a docker-archive)"
        manifest = json.load(member)
    tags: list[str] = [tag for image in manifest for tag in image.get("RepoTags") or []]
    if not tags:
        raise SystemExit(f"{archive}: the image has no name (RepoTags); save it with a tag")
    return tags


def _cgroups() -> set[Path]:
    """runc's cgroups for containerd's k8s.io namespace and the fleet's nodes (fleet.py), in
    every hierarchy (v1 and v2)."""
    patterns = ("k8s.io", "k8s.io/*", "*/k8s.io", "*/k8s.io/*", "*/pcc-e2e-node-*",
                "*/pcc-e2e-node-*/**")  # fmt: skip
    return {path for pattern in patterns for path in CGROUPS.glob(pattern) if path.is_dir()}


def _remove_new_cgroups(before: set[Path], within: float = 10) -> None:
    """The cgroups made during the session, deepest first. A cgroup stays busy for a moment
    after the namespace's end killed its processes: those are tried again, for `within`
    seconds at most."""
    deadline = time.monotonic() + within
    while True:
        left = []
        for path in sorted(_cgroups() - before, key=lambda p: len(p.parts), reverse=True):
            try:
                path.rmdir()
            except OSError as failed:
                left.append((path, failed))
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for path, problem in left:
        print(f"e2e: left {path}: {problem}", file=sys.stderr)


def _wait_interruptibly(process: subprocess.Popen[bytes], grace: float = 120) -> int:
    """Wait for the namespace's harness; on Ctrl-C it cleans up itself, given `grace` seconds."""
    try:
        return process.wait()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"e2e: interrupted; waiting up to {grace:.0f} s for the clean-up", file=sys.stderr)
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        raise


def _binaries(cluster: bool) -> list[str]:
    """The binaries' arguments for `inside`: built or cached (e2e.builds), versions printed."""
    from . import builds

    def log(line: str) -> None:
        print(f"e2e: {line}", flush=True)

    kubelet = builds.kubelet(log)
    found = {"kubelet": kubelet, "containerd": builds.ensure("containerd", log) / "containerd"}
    # The control plane's minor, whatever kubectl the machine has (the skew kubectl allows).
    found["kubectl"] = builds.ensure("kubectl", log) / "kubectl"
    if cluster:
        control_plane = builds.ensure("control-plane", log)
        found["kube-apiserver"] = control_plane / "kube-apiserver"
        found["etcd"] = builds.ensure("etcd", log) / "etcd"
        found["kubelet-1.35"] = builds.ensure("kubelet-1.35", log) / "kubelet"
    # Not built here: the first runc on PATH, named to containerd by its path (node.py).
    found["runc"] = Path(shutil.which("runc") or "runc").resolve()
    for name, binary in found.items():
        asked = [str(binary), *(["version", "--client"] if name == "kubectl" else ["--version"])]
        version = subprocess.run(asked, capture_output=True, text=True, check=False)
        if version.returncode != 0 or not version.stdout.strip():
            raise SystemExit(
                f"e2e: {name} {binary} does not run (`--version`: exit {version.returncode}, "
                f"{(version.stderr or version.stdout).strip()[:200]!r}); see docs/e2e.md"
            )
        log(f"{binary}: {version.stdout.strip().splitlines()[0]}")
    argv = ["--kubelet", str(kubelet), "--containerd", str(found["containerd"].parent),
            "--runc", str(found["runc"]), "--kubectl", str(found["kubectl"])]  # fmt: skip
    if cluster:
        argv += ["--control-plane", str(control_plane), "--etcd", str(found["etcd"]),
                 "--kubelet-1.35", str(found["kubelet-1.35"])]  # fmt: skip
    return argv


def run(args: argparse.Namespace) -> int:
    from . import images, scenario

    cluster = args.command == "cluster"
    session = "cluster" if cluster else "e2e"
    problems = preflight(cluster)
    if problems:
        raise SystemExit(f"{session}: " + "; ".join(problems) + " (see docs/e2e.md)")
    started = time.monotonic()
    binaries = _binaries(cluster)
    pause, pause_reference = images.pause_archive()
    consumer, consumer_reference = images.consumer_archive()
    plugin_archive = Path(args.plugin_image).resolve()
    plugin_references = _image_references(plugin_archive)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    logs = ROOT / "build" / session / f"logs-{stamp}"
    logs.mkdir(parents=True)
    state = Path(tempfile.mkdtemp(prefix=f"pcc-{session}-", dir="/tmp"))
    cgroups_before = _cgroups()
    print(f"{session}: setup took {time.monotonic() - started:.0f} s; logs in {logs}", flush=True)
    argv = [
        "unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc",
        "--net", "--kill-child",
        sys.executable, "-m", "e2e", "inside", "--session", session, "--state", str(state),
        "--logs", str(logs), *binaries, "--pause-image", str(pause), "--pause-reference",
        pause_reference, "--consumer-image", str(consumer), "--consumer-reference",
        consumer_reference, "--plugin-image", str(plugin_archive), "--plugin-reference",
        plugin_references[0],
    ]  # fmt: skip
    if cluster:
        argv += [f"--only={stage}" for stage in args.only or ()]
    else:
        variants = args.variant or scenario.RUN_BY_DEFAULT
        argv += [*(f"--variant={v}" for v in variants), f"--race={args.race}",
                 f"--race-pods={args.race_pods}"]  # fmt: skip
        if scenario.YARDSTICK in variants:
            argv += ["--yardstick", str(images.yardstick_binary())]
    code = 1
    try:
        code = _wait_interruptibly(subprocess.Popen(argv, env=dict(os.environ)))
    finally:
        _remove_new_cgroups(cgroups_before)
        try:
            state.rmdir()
        except OSError as error:
            print(f"{session}: left {state}: {error}", file=sys.stderr)
        if code == 0 and not args.keep_logs:
            shutil.rmtree(logs)
        else:
            print(f"{session}: logs kept in {logs}", file=sys.stderr)
    print(f"{session}: {'passed' if code == 0 else 'FAILED'} in {time.monotonic() - started:.0f} s")
    return code


def inside(args: argparse.Namespace) -> int:
    import trio

    from . import harness

    # The kubectl built at the control plane's version, for the checks and what they run.
    os.environ["PATH"] = os.pathsep.join([str(Path(args.kubectl).parent), os.environ["PATH"]])
    return trio.run(harness.main, args)


# Kubelet restarts per variant in the race check (scenario.Variant.race); issue 26's protocol.
RACE_ROUNDS = 10
# Kept race pods each hold one of the 16 shares, and consumer-1 holds another.
RACE_ROUNDS_KEPT_AT_MOST = 15


def main(argv: Sequence[str] | None = None) -> int:
    from . import scenario

    parser = argparse.ArgumentParser(
        prog="python -m e2e",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command")
    preflight_command = commands.add_parser("preflight", help="check root and the tools only")
    preflight_command.add_argument("--cluster", action="store_true", help="for nox -s cluster")
    for name in ("run", "cluster", "inside"):
        command = commands.add_parser(name)
        command.add_argument("--plugin-image", required=True, help="docker-archive tarball")
    for name in ("run", "inside"):
        commands.choices[name].add_argument(
            "--variant", action="append", choices=scenario.RUN_BY_DEFAULT,
            help="run only this pod template (repeatable; default: all three); "
            f"{scenario.YARDSTICK}: the Go yardstick, for the race's figures (docs/e2e.md)",
        )  # fmt: skip
        commands.choices[name].add_argument(
            "--race", type=int, default=RACE_ROUNDS, metavar="N",
            help=f"kubelet restarts per variant in the race check (default {RACE_ROUNDS})",
        )  # fmt: skip
        commands.choices[name].add_argument(
            "--race-pods", choices=("kept", "removed"), default="kept",
            help="keep each race pod until the check ends (default; at most "
            f"{RACE_ROUNDS_KEPT_AT_MOST} rounds), or remove it before the next round",
        )  # fmt: skip
    for name in ("run", "cluster"):
        commands.choices[name].add_argument("--keep-logs", action="store_true")
    for name in ("cluster", "inside"):
        commands.choices[name].add_argument(
            "--only", action="append", choices=CLUSTER_STAGES, metavar="STAGE",
            help=f"run only this stage of the cluster's checks (repeatable; default: all of "
            f"{', '.join(CLUSTER_STAGES)}, in that order; docs/e2e.md)",
        )  # fmt: skip
    inner = commands.choices["inside"]
    inner.add_argument("--session", choices=("e2e", "cluster"), required=True)
    for option in ("--state", "--logs", "--kubelet", "--containerd", "--runc", "--kubectl",
                   "--pause-image", "--pause-reference", "--consumer-image",
                   "--consumer-reference", "--plugin-reference"):  # fmt: skip
        inner.add_argument(option, required=True)
    inner.add_argument("--yardstick", help="the yardstick's binary")
    inner.add_argument("--control-plane")
    inner.add_argument("--etcd")
    inner.add_argument("--kubelet-1.35", dest="kubelet_1_35")
    # A member of the cluster's fleet holding its namespaces (fleet.hold).
    commands.add_parser("fleet-node").add_argument("--state", required=True)
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments and arguments[0].startswith("--"):
        arguments.insert(0, "run")
    args = parser.parse_args(arguments)
    if args.command == "run" and args.race_pods == "kept" and args.race > RACE_ROUNDS_KEPT_AT_MOST:
        parser.error(
            f"--race: at most {RACE_ROUNDS_KEPT_AT_MOST} with the race pods kept (each holds a "
            "share); use --race-pods=removed for more"
        )
    if args.command == "preflight":
        problems = preflight(args.cluster)
        for problem in problems:
            print(f"e2e preflight: {problem}", file=sys.stderr)
        return 1 if problems else 0
    if args.command == "inside":
        return inside(args)
    if args.command == "fleet-node":
        from . import fleet

        return fleet.hold(Path(args.state))
    if args.command in ("run", "cluster"):
        return run(args)
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
