"""The scale benchmark's binaries: etcd and kube-apiserver as the cluster session builds them,
and the Go reference driver, built here the same way.

    PYTHONPATH=tools python3 -m bench.scale.builds      # all three unless cached

etcd and the control plane come from ``tools/e2e/builds.py`` (``ensure``: cached in its cache
directory, or built now, waiting on its lock while another caller builds them). The reference is
the kubelet plugin of kubernetes-sigs/dra-example-driver, at the version our Go module
``bench/scale/dra-example-driver/`` requires: ``go build`` fetches it through the Go module proxy
(``GOPROXY``) and checks it against that module's go.sum, built by the e2e's own build
functions: the same flags, lock, cache directory and shared Go build cache as its components.
Standard library only, as the e2e's builds are.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
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


def reference(log: Log = print) -> Path:
    """The reference driver's binary: cached, or built now (a few minutes when cold).

    What `builds.ensure` does for the e2e's components, for one that is not among them: its
    lock, its build (the shared Go build cache, removed once every e2e component is built and
    no build runs) and its cache, through the functions `ensure` uses.
    """
    version = REFERENCE.version()
    with builds._locked(builds.CACHE / f"{REFERENCE.name}-{version}.lock", log, REFERENCE.name):
        found = builds.cached(REFERENCE)
        if found:
            log(f"the reference driver {version}: cached at {found}")
        directory = found or builds._build(REFERENCE, version, log)
    builds._remove_shared_go_cache_when_done(log)
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
