"""The scale benchmark's binaries: etcd and kube-apiserver as the cluster session builds them,
and the Go reference driver, built here the same way.

    PYTHONPATH=tools python3 -m bench.scale.builds      # all three unless cached

etcd and the control plane come from ``tools/e2e/builds.py`` (``ensure``: cached in its cache
directory, or built now, waiting on its lock while another caller builds them). The reference is
the kubelet plugin of kubernetes-sigs/dra-example-driver, at the version our Go module
``bench/scale/dra-example-driver/`` requires: ``go build`` fetches it through the Go module proxy
(``GOPROXY``) and checks it against that module's go.sum, with the same flags and into the same
cache directory as the e2e's components (a lock of its own, ``build.json`` saying the recipe).
It does not use the e2e's shared Go build cache, which that module deletes when its own builds
are done: a temporary one, deleted after the build, so that only the binary stays.
Standard library only, as the e2e's builds are.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from e2e import builds

HERE = Path(__file__).resolve().parent
Log = Callable[[str], None]


@dataclass(frozen=True)
class Reference(builds.Component):
    """A Go module of ours under bench/scale/ (not tools/e2e/), built as the e2e's are."""

    @property
    def module(self) -> Path:
        return HERE / self.name


REFERENCE = Reference(
    "dra-example-driver",
    "sigs.k8s.io/dra-example-driver",
    ("sigs.k8s.io/dra-example-driver/cmd/dra-example-kubeletplugin",),
)


@contextlib.contextmanager
def _locked(path: Path, log: Log) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"the reference driver: another build holds {path}; waiting for it")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _build(version: str, log: Log) -> Path:
    go = shutil.which("go")
    if go is None:
        raise SystemExit("the reference driver: `go` is not on PATH; install Go 1.26 or newer")
    recipe = REFERENCE.recipe(go, version)
    directory = REFERENCE.directory(version)
    partial = directory / "partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    build_log = directory / "build.log"
    argv = [
        go, "build", "-trimpath", f"-gcflags={recipe['gcflags']}",
        f"-ldflags={recipe['ldflags']}", "-o", f"{partial}/", *REFERENCE.packages,
    ]  # fmt: skip
    log(f"the reference driver {version}: building with {recipe['go']} (log: {build_log})")
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="go-build-", dir=directory) as go_cache,
        build_log.open("w") as out,
    ):
        env = dict(os.environ, CGO_ENABLED="0", GOFLAGS="-mod=readonly", GOCACHE=go_cache)
        result = subprocess.run(
            argv, cwd=REFERENCE.module, env=env, stdout=out, stderr=subprocess.STDOUT, check=False
        )
    seconds = time.monotonic() - started
    if result.returncode != 0:
        tail = build_log.read_text().splitlines()[-20:]
        raise SystemExit(
            f"the reference driver: go build failed after {seconds:.0f} s "
            f"(exit {result.returncode}); {build_log}:\n" + "\n".join(tail)
        )
    for name in REFERENCE.binaries:
        os.replace(partial / name, directory / name)
    partial.rmdir()
    stamp = {"recipe": recipe, "seconds": round(seconds), "cpus": os.cpu_count()}
    (directory / "build.json").write_text(json.dumps(stamp, indent=1) + "\n")
    log(f"the reference driver {version}: built in {seconds:.0f} s")
    return directory


def reference(log: Log = print) -> Path:
    """The reference driver's binary: cached, or built now (a few minutes when cold)."""
    version = REFERENCE.version()
    with _locked(builds.CACHE / f"{REFERENCE.name}-{version}.lock", log):
        found = builds.cached(REFERENCE)
        directory = found or _build(version, log)
    if found:
        log(f"the reference driver {version}: cached at {found}")
    return directory / REFERENCE.binaries[0]


def control_plane(log: Log = print) -> tuple[Path, Path]:
    """kube-apiserver and etcd, the cluster session's builds."""
    apiserver = builds.ensure("control-plane", log) / "kube-apiserver"
    return apiserver, builds.ensure("etcd", log) / "etcd"


def main() -> int:
    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    print(reference(log), flush=True)
    for binary in control_plane(log):
        print(binary, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
