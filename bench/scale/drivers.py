"""The drivers under test, one process per node: this tree's daemon in `--mode=dra`, and the Go
reference (kubernetes-sigs/dra-example-driver's kubelet plugin).

Each node is a directory of its own: the kubeconfig with the node's own token, kubelet's
registration and plugin directories (no kubelet: nobody registers the drivers, which publish
all the same), a CDI directory, and for this tree's daemon a fake host tree (--host-root) with
the device (a symlink to /dev/null, a character device), the PCC directory and the sysfs
entries of an SEV-SNP guest. Paths stay short: the drivers' unix socket paths live in them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import attrs

from bench.harness import ROOT
from bench.scale.apiserver import STOP_WITHIN, ControlPlane, stop

PCC_DRIVER = "pcc.tke.cloud.tencent.com"
REFERENCE_DRIVER = "gpu.example.com"
# Our daemon's default: the reference gets as many devices, so that slices weigh alike.
DEVICES = 16


@attrs.define
class Node:
    index: int
    name: str
    directory: Path
    process: subprocess.Popen[bytes] | None = None
    # time.time() at Popen, and when its first slice write was answered.
    started: float = 0.0
    published: float = 0.0
    # CPU seconds of the process when its first slice write was seen.
    start_cpu: float = 0.0

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def log(self) -> Path:
        return self.directory / "driver.log"

    @property
    def host(self) -> Path:
        return self.directory / "host"

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            stop(process, STOP_WITHIN)


@attrs.define
class Kind:
    """One kind of driver: how to lay out its node and start it."""

    key: str
    title: str
    driver: str
    # The device of one node can be taken away (this tree's daemon watches its host tree; the
    # reference's devices are made up at start and never change).
    changes_devices: bool

    def layout(self, node: Node, plane: ControlPlane) -> None:
        for part in ("reg", "plug", "cdi"):
            (node.directory / part).mkdir(parents=True, exist_ok=True)
        plane.kubeconfig(node.name, node.directory / "kubeconfig")
        if self.changes_devices:
            for part in ("dev", "var/run/pcc", "sys/bus/platform/devices/sev-guest",
                         "sys/kernel/config/tsm/report"):  # fmt: skip
                (node.host / part).mkdir(parents=True, exist_ok=True)
            self.device_back(node)

    def argv(self, node: Node, program: Path | None) -> list[str]:
        common = {"node-name": node.name, "kubeconfig": node.directory / "kubeconfig",
                  "pod-uid": uuid.uuid4()}  # fmt: skip
        if self.key == "pcc":
            flags = {
                **common, "mode": "dra", "kubelet-registry-path": node.directory / "reg",
                "kubelet-plugins-path": node.directory / "plug",
                "cdi-spec-dir": node.directory / "cdi", "host-root": node.host,
                "metrics-bind-address": "127.0.0.1:0", "v": 0,
            }  # fmt: skip
            command = [sys.executable, "-m", "pcc_plugin"]
        else:
            assert program is not None
            flags = {
                **common, "kubelet-registrar-directory-path": node.directory / "reg",
                "kubelet-plugins-directory-path": node.directory / "plug",
                "cdi-root": node.directory / "cdi", "num-devices": DEVICES,
            }  # fmt: skip
            command = [str(program)]
        return command + [f"--{flag}={value}" for flag, value in flags.items()]

    def start(self, node: Node, program: Path | None, env: dict[str, str]) -> None:
        with node.log.open("ab") as out:
            node.process = subprocess.Popen(
                self.argv(node, program), cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True,
            )  # fmt: skip

    def device_gone(self, node: Node) -> None:
        (node.host / "dev" / "sev-guest").unlink()

    def device_back(self, node: Node) -> None:
        (node.host / "dev" / "sev-guest").symlink_to("/dev/null")


PCC = Kind("pcc", "pcc-device-plugin (this tree)", PCC_DRIVER, changes_devices=True)
REFERENCE = Kind("go", "dra-example-driver (Go)", REFERENCE_DRIVER, changes_devices=False)
KINDS = {kind.key: kind for kind in (PCC, REFERENCE)}
