"""Kubernetes, etcd and containerd from source, each at the version its Go module pins, cached.

    PYTHONPATH=tools python3 -m e2e.builds                      # every component unless cached
    PYTHONPATH=tools python3 -m e2e.builds kubelet containerd   # only these

Each component is a Go module of ours under ``tools/e2e/`` that requires one upstream module at
one version (``kubelet/``, ``kubelet-1.35/``, ``control-plane/`` and ``kubectl/`` require
``k8s.io/kubernetes`` and replace every ``k8s.io/*`` staging module with its
``v0.<minor>.<patch>`` release). ``go build`` fetches the
sources through the Go module proxy (``GOPROXY``) and checks them against the module's
``go.sum``. The binaries go to ``<cache>/<component>-<version>/`` by rename, with ``build.json``
beside them saying how they were built; a later call with the same version, Go and flags reuses
them. A lock file per component serialises builds: a second caller (``nox -s e2e`` while CI's
background build runs) waits for the first and then finds the binaries.

Every component is built with ``-gcflags=all=-N -l -dwarf=false``: no optimisation, no
inlining, no debug information, which makes a cold build much cheaper (kubelet: 619 s against
825 s); the sessions need components that behave as released ones do, not fast ones. One set of
flags for all also lets them share the standard library and the modules they have in common
(gRPC, protobuf, golang.org/x) in the build cache below. ``-s -w`` keep the linker from writing
symbol and DWARF tables.

The components share one Go build cache, ``<cache>/go-build``: the control plane compiles most
of what kubelet compiles (client-go, the API types, apimachinery), the same sources with the same
flags. It is deleted once every component is built and no build is running, so that nothing
outside the binaries stays. Standard library only: CI runs this before any virtual environment
exists.
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
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("PCC_E2E_CACHE", "/var/cache/pcc-device-plugin"))
SHARED_GO_CACHE = CACHE / "go-build"
UNOPTIMISED = "all=-N -l -dwarf=false"
KUBERNETES_VERSION_PACKAGE = "k8s.io/component-base/version"
CONTAINERD_VERSION_VARIABLE = "github.com/containerd/containerd/v2/version.Version"

Log = Callable[[str], None]


@dataclass(frozen=True)
class Component:
    """One Go module of ours under tools/e2e/ and the commands built from it."""

    name: str
    pins: str
    packages: tuple[str, ...]
    tags: str = ""

    @property
    def module(self) -> Path:
        return HERE / self.name

    @property
    def binaries(self) -> list[str]:
        """`go build -o <dir>/` names each command after the last element of its path."""
        return [package.rsplit("/", 1)[1] for package in self.packages]

    def version(self) -> str:
        """The version of `pins` that go.mod requires, e.g. ``v1.37.2``."""
        pattern = rf"^require {re.escape(self.pins)} (v\S+)$"
        found = re.search(pattern, (self.module / "go.mod").read_text(), re.M)
        if not found:
            raise SystemExit(f"{self.module / 'go.mod'} does not require {self.pins} on one line")
        return found[1]

    def ldflags(self, version: str) -> str:
        if self.pins == "k8s.io/kubernetes":
            major, minor = version.removeprefix("v").split(".")[:2]
            stamp = {"gitVersion": version, "gitMajor": major, "gitMinor": minor}
            variables = [f"{KUBERNETES_VERSION_PACKAGE}.{k}={v}" for k, v in stamp.items()]
        elif self.name == "containerd":
            variables = [f"{CONTAINERD_VERSION_VARIABLE}={version}"]
        else:
            variables = []  # etcd's version is a constant of its source
        return " ".join(["-s", "-w", *(f"-X {variable}" for variable in variables)])

    def directory(self, version: str | None = None) -> Path:
        return CACHE / f"{self.name}-{version or self.version()}"

    def recipe(self, go: str, version: str) -> dict[str, str]:
        recipe = {
            "version": version,
            "go": _go_version(go),
            "gcflags": UNOPTIMISED,
            "ldflags": self.ldflags(version),
            "go.sum": (self.module / "go.sum").read_text(),
        }
        # Only where there are tags: kubelet's recipe keeps the keys it had before the other
        # components came, so that kubelets cached by then stay valid.
        if self.tags:
            recipe["tags"] = self.tags
        return recipe


KUBERNETES = "k8s.io/kubernetes/cmd"
CONTAINERD = "github.com/containerd/containerd/v2/cmd"
COMPONENTS = {
    component.name: component
    for component in (
        # In the order CI needs them: the e2e's first, then the cluster's.
        Component(
            "containerd",
            "github.com/containerd/containerd/v2",
            tuple(
                f"{CONTAINERD}/{command}"
                for command in ("containerd", "containerd-shim-runc-v2", "ctr")
            ),
            # Snapshotters the sessions do not use, which need cgo or kernel headers.
            tags="no_btrfs,no_devmapper,no_zfs",
        ),
        Component("kubelet", "k8s.io/kubernetes", (f"{KUBERNETES}/kubelet",)),
        Component(
            "control-plane",
            "k8s.io/kubernetes",
            tuple(
                f"{KUBERNETES}/{command}"
                for command in ("kube-apiserver", "kube-controller-manager", "kube-scheduler")
            ),
        ),
        # Our own main package (etcd/main.go), which runs etcd's.
        Component("etcd", "go.etcd.io/etcd/server/v3", ("pcc.local/e2e/etcd",)),
        # The cluster's own kubectl (the control plane's minor), and the fleet's older kubelet.
        Component("kubectl", "k8s.io/kubernetes", (f"{KUBERNETES}/kubectl",)),
        Component("kubelet-1.35", "k8s.io/kubernetes", (f"{KUBERNETES}/kubelet",)),
    )
}


def _go_version(go: str) -> str:
    return subprocess.run(
        [go, "env", "GOVERSION"], capture_output=True, text=True, check=True
    ).stdout.strip()


def cached(component: Component) -> Path | None:
    """The component's directory when every binary there was built by this recipe, else None."""
    version = component.version()
    directory = component.directory(version)
    go = shutil.which("go")
    try:
        stamp = json.loads((directory / "build.json").read_text())
    except (OSError, ValueError):
        return None
    if go is None or stamp.get("recipe") != component.recipe(go, version):
        return None
    if not all((directory / name).is_file() for name in component.binaries):
        return None
    return directory


@contextlib.contextmanager
def _locked(path: Path, log: Log, what: str) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"{what}: another build holds {path}; waiting for it")
            started = time.monotonic()
            fcntl.flock(lock, fcntl.LOCK_EX)
            log(f"{what}: waited {time.monotonic() - started:.0f} s for the other build")
        yield


@contextlib.contextmanager
def _using_shared_go_cache() -> Iterator[Path]:
    """The shared Go build cache, held (shared lock) so that no clean-up removes it meanwhile."""
    SHARED_GO_CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / "go-build.lock").open("a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        yield SHARED_GO_CACHE


def _remove_shared_go_cache_when_done(log: Log) -> None:
    """Delete the shared Go build cache once every component is cached and no build runs."""
    if not SHARED_GO_CACHE.exists() or not all(cached(c) for c in COMPONENTS.values()):
        return
    with (CACHE / "go-build.lock").open("a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # a build uses it; the last one to finish removes it
        shutil.rmtree(SHARED_GO_CACHE, ignore_errors=True)
        log(f"every component is built: removed the shared Go build cache {SHARED_GO_CACHE}")


def _build(component: Component, version: str, log: Log) -> Path:
    go = shutil.which("go")
    if go is None:
        raise SystemExit(f"{component.name}: `go` is not on PATH; install Go (see docs/e2e.md)")
    recipe = component.recipe(go, version)
    directory = component.directory(version)
    partial = directory / "partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    build_log = directory / "build.log"
    argv = [
        go, "build", "-trimpath", f"-gcflags={recipe['gcflags']}",
        f"-ldflags={recipe['ldflags']}", *([f"-tags={component.tags}"] * bool(component.tags)),
        "-o", f"{partial}/", *component.packages,
    ]  # fmt: skip
    log(f"{component.name} {version}: building with {recipe['go']} (log: {build_log})")
    started = time.monotonic()
    with _using_shared_go_cache() as go_cache, build_log.open("w") as out:
        env = dict(os.environ, CGO_ENABLED="0", GOFLAGS="-mod=readonly", GOCACHE=str(go_cache))
        result = subprocess.run(
            argv, cwd=component.module, env=env, stdout=out, stderr=subprocess.STDOUT, check=False
        )
    seconds = time.monotonic() - started
    if result.returncode != 0:
        tail = build_log.read_text().splitlines()[-20:]
        raise SystemExit(
            f"{component.name}: go build failed after {seconds:.0f} s (exit {result.returncode}); "
            f"{build_log}:\n" + "\n".join(tail)
        )
    for name in component.binaries:
        os.replace(partial / name, directory / name)
    partial.rmdir()
    stamp = {
        "recipe": recipe,
        "seconds": round(seconds),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3],
        "cpus": os.cpu_count(),
    }
    (directory / "build.json").write_text(json.dumps(stamp, indent=1) + "\n")
    log(f"{component.name} {version}: built in {seconds:.0f} s")
    return directory


def ensure(name: str, log: Log = print) -> Path:
    """The directory of component `name`'s binaries: cached, or built now (minutes when cold)."""
    component = COMPONENTS[name]
    version = component.version()
    with _locked(CACHE / f"{name}-{version}.lock", log, name):
        found = cached(component)
        if found:
            log(f"{name} {version}: cached at {found}")
            return found
        directory = _build(component, version, log)
    _remove_shared_go_cache_when_done(log)
    return directory


def kubelet(log: Log = print) -> Path:
    """The kubelet binary: PCC_E2E_KUBELET (any version; nothing is built), or the pinned one."""
    given = os.environ.get("PCC_E2E_KUBELET")
    if given:
        log(f"kubelet: {given} (PCC_E2E_KUBELET)")
        return Path(given).resolve()
    return ensure("kubelet", log) / "kubelet"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.builds",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "components", nargs="*", metavar="component",
        help=f"any of {', '.join(COMPONENTS)} (default: all, in that order)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    unknown = [name for name in args.components if name not in COMPONENTS]
    if unknown:
        parser.error(f"no component {', '.join(unknown)}; there are {', '.join(COMPONENTS)}")
    for name in args.components or COMPONENTS:
        print(ensure(name, lambda line: print(line, file=sys.stderr, flush=True)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
