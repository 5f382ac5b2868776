"""The daemon started from the built image, as a node runs it: its interpreter, its bytecode.

`nox -s image` leaves the image as a docker-archive under build/images/. It is loaded into
podman, a container is created (never started) and its root filesystem mounted; the entry
point then runs under chroot with exactly the image's environment, in a private mount
namespace that has /proc, the host's /dev, and the host's /tmp (where the fake node is, so that
every path is the same inside and out). It needs root and podman; without them, or without the
archive, the section says so and the rest of the benchmark runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from bench.harness import (
    ROOT,
    Bench,
    accepted,
    allocate_method,
    metrics_port,
    plugin_channel,
    seconds_to_exit,
)
from bench.imports import STACK_AS_THE_DAEMON_IMPORTS_IT
from bench.report import ms
from bench.scenarios import (
    memory_rows,
    report_stack,
    report_start,
    scrape,
    sequential_allocates,
)
from pcc_plugin.sim import Daemon

ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
ARCHIVE = ROOT / "build" / "images" / f"pcc-device-plugin-linux-{ARCH}.tar"


def _podman(*args: str) -> str:
    return subprocess.run(
        ["podman", *args], capture_output=True, text=True, check=True, timeout=300
    ).stdout.strip()


@contextlib.contextmanager
def _image_rootfs() -> Iterator[tuple[dict[str, Any], Path]]:
    """The image's config and the root filesystem of a container created from it.

    The image is removed from podman's store again if loading it put it there.
    """
    before = set(_podman("images", "--all", "--quiet", "--no-trunc").split())
    loaded = _podman("load", "--quiet", "--input", str(ARCHIVE))
    image = loaded.rpartition(" ")[2]
    container = f"pcc-bench-{os.getpid()}"
    try:
        _podman("create", "--name", container, image)
        config = json.loads(_podman("image", "inspect", image))[0]["Config"]
        yield config, Path(_podman("mount", container))
    finally:
        subprocess.run(["podman", "umount", container], capture_output=True, check=False)
        subprocess.run(["podman", "rm", "--force", container], capture_output=True, check=False)
        after = set(_podman("images", "--all", "--quiet", "--no-trunc").split())
        if after - before:
            subprocess.run(["podman", "rmi", "--force", *sorted(after - before)],
                           capture_output=True, check=False)  # fmt: skip


def _argv(config: dict[str, Any], rootfs: Path, command: Sequence[str]) -> list[str]:
    """`command` run in the image's root filesystem with exactly the image's environment."""
    root = shlex.quote(str(rootfs))
    entry = ["env", "-i", *config.get("Env", []), "chroot", str(rootfs), *command]
    script = "\n".join(
        [
            "set -eu",
            f"mount -t proc proc {root}/proc",
            f"mount --rbind /dev {root}/dev",
            f"mkdir -p {root}/tmp && mount --bind /tmp {root}/tmp",
            f"exec {shlex.join(entry)}",
        ]
    )
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]


def unavailable() -> str | None:
    """Why the image's daemon cannot be measured here, or None."""
    if not ARCHIVE.exists():
        return "no image archive: run `nox -s image` first"
    if os.geteuid() != 0 or shutil.which("podman") is None:
        return "needs root and podman"
    return None


def from_image(bench: Bench) -> None:
    report = bench.report
    report.section(f"the daemon from the image ({ARCHIVE.relative_to(ROOT)}), as a node runs it")
    reason = unavailable()
    if reason:
        report.add("not measured", reason)
        return
    try:
        _measure(bench)
    except subprocess.CalledProcessError as exc:
        report.not_measured(
            "start -> registered (the image's)",
            f"podman failed: {' '.join(exc.cmd[:3])}: {exc.stderr.strip()[:80]}",
        )


# Starts after the first, which is the first from the freshly loaded image.
WARM_STARTS = 10
ALLOCATE_CALLS = 2000


@contextlib.contextmanager
def _running(
    bench: Bench, config: dict[str, Any], rootfs: Path
) -> Iterator[tuple[Daemon, float, str]]:
    """The image's daemon, registered: its process, the seconds that took, its endpoint."""
    before = len(accepted(bench.kubelet))
    bench.logs += 1
    started = time.monotonic()
    daemon = Daemon(
        _argv(config, rootfs, [*config["Entrypoint"], *bench.node.daemon_args(verbosity=0)]),
        bench.node.root / f"image-{bench.logs}.log",
    )
    try:
        registration = bench.registered(before)
        yield daemon, registration.answered_at - started, registration.endpoint
        bench.stop(daemon)
    finally:
        daemon.close()


def _measure(bench: Bench) -> None:
    report = bench.report
    with _image_rootfs() as (config, rootfs):
        with _running(bench, config, rootfs) as (daemon, first, _):
            report.add("start -> registered (one start)", f"{ms(first)} ms")
            python_env = [e for e in config.get("Env", []) if e.startswith("PYTHON")]
            report.add("entry point", " ".join([*python_env, *config["Entrypoint"]]))
            time.sleep(2)
            figures = {
                "not_scraped": memory_rows(
                    bench, daemon.pid, "metrics on, not scraped yet", check=False
                )
            }
            port = metrics_port(daemon)
            for path in ("/metrics", "/livez", "/readyz"):
                scrape(port, path)
            time.sleep(1)
            figures["scraped"] = memory_rows(
                bench, daemon.pid, "metrics on (default), scraped", check=True
            )
            report.figures["image_kib"] = figures
        _warm(bench, config, rootfs)


def _warm(bench: Bench, config: dict[str, Any], rootfs: Path) -> None:
    """Start and Allocate's CPU as a node pays them: the image's interpreter (Debian's, built
    otherwise than the development one) and bytecode. The start target is judged here, on what
    nodes run. Each start is followed by the stack imported alone by the image's interpreter
    and by the bench's own set-up alone (`_argv` running /bin/true), which every start here
    includes and a container's start does otherwise. The CPU target is judged on the
    development venv's, beside the grpcio yardstick."""
    python = str(PurePosixPath(config["Entrypoint"][0]).with_name("python"))
    stack_alone = _argv(config, rootfs, [python, "-c", STACK_AS_THE_DAEMON_IMPORTS_IT])
    set_up_alone = _argv(config, rootfs, ["/bin/true"])
    starts, stack, set_up = [], [], []
    for warm in range(WARM_STARTS):
        with _running(bench, config, rootfs) as (daemon, took, endpoint):
            starts.append(took)
            if warm == WARM_STARTS - 1:
                with plugin_channel(bench.socket(endpoint)) as channel:
                    method = allocate_method(channel)
                    _, cpu = sequential_allocates(daemon.pid, method, ALLOCATE_CALLS)
        stack.append(seconds_to_exit(stack_alone, {}))
        set_up.append(seconds_to_exit(set_up_alone, {}))
    report_start(bench.report, f"start -> registered, median of {WARM_STARTS} more", starts,
                 judged=True)  # fmt: skip
    report_stack(bench.report, stack, starts)
    bench.report.add(
        "  of each, the bench's set-up (unshare, mounts, env, chroot), median",
        f"{ms(statistics.median(set_up))} ms (min {ms(min(set_up))})",
    )
    bench.report.add(
        f"daemon CPU per Allocate, {ALLOCATE_CALLS} sequential calls", f"{cpu * 1e6:.0f} us"
    )
    bench.report.figures["image_start_s"] = starts
    bench.report.figures["image_stack_imports_s"] = stack
    bench.report.figures["image_set_up_s"] = set_up
    bench.report.figures["image_allocate_cpu_s"] = cpu
