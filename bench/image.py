"""The daemon started from the built image, as a node runs it: its interpreter, its bytecode.

`nox -s image` leaves the image as a docker-archive under build/images/. It is loaded into
podman, a container is created (never started) and its root filesystem mounted; the entry
point then runs under chroot with exactly the image's environment, in a private mount
namespace that has /proc, the host's /dev, and the host's /tmp (where the fake node is, so that
every path is the same inside and out). It needs root and podman; without them, or without the
archive, `bench.scenarios` says so and the rest of the benchmark runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from bench.harness import ROOT, Bench, accepted
from pcc_plugin.sim import Daemon

ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
ARCHIVE = ROOT / "build" / "images" / f"pcc-device-plugin-linux-{ARCH}.tar"


def _podman(*args: str) -> str:
    return subprocess.run(
        ["podman", *args], capture_output=True, text=True, check=True, timeout=300
    ).stdout.strip()


@contextlib.contextmanager
def rootfs() -> Iterator[tuple[dict[str, Any], Path]]:
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


def entry_point(config: dict[str, Any]) -> str:
    """The image's entry point with the interpreter's settings from its environment."""
    python_env = [e for e in config.get("Env", []) if e.startswith("PYTHON")]
    return " ".join([*python_env, *config["Entrypoint"]])


@contextlib.contextmanager
def running(bench: Bench, config: dict[str, Any], root: Path) -> Iterator[tuple[Daemon, float]]:
    """The image's daemon, registered: its process and the seconds from its start to that.

    The start includes the set-up (`unshare`, three mounts, `env`, `chroot`), as a container
    runtime's start of the container includes its own.
    """
    before = len(accepted(bench.kubelet))
    log_path = bench.log_path("image")
    started = time.monotonic()
    daemon = Daemon(
        _argv(config, root, [*config["Entrypoint"], *bench.node.daemon_args(verbosity=0)]),
        log_path,
    )
    try:
        registration = bench.registered(before)
        yield daemon, registration.answered_at - started
        bench.stop(daemon)
    finally:
        daemon.close()
