"""Kubelet from source, at the version pinned in ``kubelet/go.mod``, cached per version.

    PYTHONPATH=tools python3 -m e2e.kubelet_build     # build unless cached; print the path

The module in ``kubelet/`` requires ``k8s.io/kubernetes`` at one version and replaces every
``k8s.io/*`` staging module with its ``v0.<minor>.<patch>`` release; ``go build`` fetches them
through the Go module proxy (``GOPROXY``, proxy.golang.org by default) and checks them against
``kubelet/go.sum``. The binary goes to ``<cache>/kubelet-<version>/kubelet`` by rename, with
``build.json`` beside it saying how it was built; a later call with the same version, Go and
flags reuses it. A lock file serialises builds: a second caller (``nox -s e2e`` while CI's
background build runs) waits for the first and then finds the binary.

The flags make the cold build cheaper, not the kubelet better: ``-N -l`` turn off the compiler's
optimisations and inlining and ``-dwarf=false`` its debug information, for every package;
``-s -w`` keep the linker from writing symbol and DWARF tables. The e2e needs a kubelet that
behaves like kubelet, not one that is fast. The Go build cache lives in the work directory and is
deleted after a successful build, so nothing outside the cache directory grows. Standard library
only: CI runs this before any virtual environment exists.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODULE = HERE / "kubelet"
CACHE = Path(os.environ.get("PCC_E2E_CACHE", "/var/cache/pcc-device-plugin"))
PACKAGE = "k8s.io/kubernetes/cmd/kubelet"
GCFLAGS = "all=-N -l -dwarf=false"
VERSION_PACKAGE = "k8s.io/component-base/version"


def version() -> str:
    """The k8s.io/kubernetes version that kubelet/go.mod requires, e.g. ``v1.37.2``."""
    found = re.search(r"^require k8s\.io/kubernetes (v\S+)$", (MODULE / "go.mod").read_text(), re.M)
    if not found:
        raise SystemExit(f"{MODULE / 'go.mod'} does not require k8s.io/kubernetes on one line")
    return found[1]


def ldflags(kube_version: str) -> str:
    major, minor = kube_version.removeprefix("v").split(".")[:2]
    stamp = {"gitVersion": kube_version, "gitMajor": major, "gitMinor": minor}
    return " ".join(["-s", "-w", *(f"-X {VERSION_PACKAGE}.{k}={v}" for k, v in stamp.items())])


def cache_dir(kube_version: str) -> Path:
    return CACHE / f"kubelet-{kube_version}"


def _go_version(go: str) -> str:
    return subprocess.run(
        [go, "env", "GOVERSION"], capture_output=True, text=True, check=True
    ).stdout.strip()


def _recipe(go: str, kube_version: str) -> dict[str, str]:
    return {
        "version": kube_version,
        "go": _go_version(go),
        "gcflags": GCFLAGS,
        "ldflags": ldflags(kube_version),
        "go.sum": (MODULE / "go.sum").read_text(),
    }


def cached(kube_version: str | None = None) -> Path | None:
    """The cached kubelet when one was built by this recipe, else None."""
    kube_version = kube_version or version()
    directory = cache_dir(kube_version)
    go = shutil.which("go")
    try:
        stamp = json.loads((directory / "build.json").read_text())
    except (OSError, ValueError):
        return None
    if go is None or stamp.get("recipe") != _recipe(go, kube_version):
        return None
    binary = directory / "kubelet"
    return binary if binary.is_file() else None


@contextlib.contextmanager
def _locked(path: Path, log: Callable[[str], None]) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"kubelet: another build holds {path}; waiting for it")
            started = time.monotonic()
            fcntl.flock(lock, fcntl.LOCK_EX)
            log(f"kubelet: waited {time.monotonic() - started:.0f} s for the other build")
        yield


def ensure(log: Callable[[str], None] = print) -> Path:
    """The kubelet binary for the pinned version: cached, or built now (minutes when cold).

    PCC_E2E_KUBELET names a kubelet binary to use instead (any version; nothing is built).
    """
    given = os.environ.get("PCC_E2E_KUBELET")
    if given:
        log(f"kubelet: {given} (PCC_E2E_KUBELET)")
        return Path(given).resolve()
    kube_version = version()
    directory = cache_dir(kube_version)
    with _locked(CACHE / f"kubelet-{kube_version}.lock", log):
        found = cached(kube_version)
        if found:
            log(f"kubelet {kube_version}: cached at {found}")
            return found
        go = shutil.which("go")
        if go is None:
            raise SystemExit("kubelet: `go` is not on PATH; install Go (see docs/e2e.md)")
        recipe = _recipe(go, kube_version)
        work = directory / "work"
        work.mkdir(parents=True, exist_ok=True)
        build_log = directory / "build.log"
        partial = directory / "kubelet.partial"
        env = dict(os.environ, CGO_ENABLED="0", GOFLAGS="-mod=readonly", GOCACHE=str(work))
        argv = [
            go, "build", "-trimpath", f"-gcflags={GCFLAGS}", f"-ldflags={recipe['ldflags']}",
            "-o", str(partial), PACKAGE,
        ]  # fmt: skip
        log(f"kubelet {kube_version}: building with {recipe['go']} (log: {build_log})")
        started = time.monotonic()
        with build_log.open("w") as out:
            result = subprocess.run(
                argv, cwd=MODULE, env=env, stdout=out, stderr=subprocess.STDOUT, check=False
            )
        seconds = time.monotonic() - started
        if result.returncode != 0:
            tail = build_log.read_text().splitlines()[-20:]
            raise SystemExit(
                f"kubelet: go build failed after {seconds:.0f} s (exit {result.returncode}); "
                f"{build_log}:\n" + "\n".join(tail)
            )
        os.replace(partial, directory / "kubelet")
        stamp = {
            "recipe": recipe,
            "seconds": round(seconds),
            "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "loadavg": Path("/proc/loadavg").read_text().split()[:3],
            "cpus": os.cpu_count(),
        }
        (directory / "build.json").write_text(json.dumps(stamp, indent=1) + "\n")
        shutil.rmtree(work, ignore_errors=True)
        log(f"kubelet {kube_version}: built in {seconds:.0f} s")
        return directory / "kubelet"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.kubelet_build", description=__doc__)
    parser.parse_args(argv)
    path = ensure(lambda line: print(line, file=sys.stderr, flush=True))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
