"""A node for the DRA mode's tests: the fake API server, the simulated kubelet's DRA side, and
the daemon's flags for them; waits on what the API server and kubelet see."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from pcc_plugin.sim import FakeNode, run_blocking
from pcc_plugin.sim.apiserver import FakeApiServer
from pcc_plugin.sim.dra import SimDraKubelet

DRIVER = "pcc.tke.cloud.tencent.com"
NODE = "node-a"
WAIT = 10.0


@attrs.frozen
class DraNode:
    node: FakeNode
    api: FakeApiServer
    kubelet: SimDraKubelet
    registry: Path
    plugins: Path
    cdi: Path
    kubeconfig: Path

    @property
    def state(self) -> Path:
        return self.plugins / DRIVER

    def daemon_args(self, verbosity: int = 1) -> list[str]:
        return [
            "--mode=dra",
            f"--node-name={NODE}",
            f"--kubeconfig={self.kubeconfig}",
            f"--kubelet-registry-path={self.registry}",
            f"--kubelet-plugins-path={self.plugins}",
            f"--cdi-spec-dir={self.cdi}",
            "--host-root",
            str(self.node.host_root),
            "--metrics-bind-address=127.0.0.1:0",
            f"--v={verbosity}",
        ]

    def slices(self) -> list[dict[str, Any]]:
        return sorted(self.api.slices(NODE), key=lambda obj: obj["metadata"]["name"])

    def devices(self) -> list[str]:
        return [device["name"] for obj in self.slices() for device in obj["spec"]["devices"]]

    def checkpoint(self) -> dict[str, Any]:
        claims: dict[str, Any] = json.loads((self.state / "checkpoint.json").read_text())["claims"]
        return claims

    def claim(self, name: str, uid: str, device: str = "pcc-3", pool: str = NODE) -> None:
        result = {"request": "pcc", "driver": DRIVER, "pool": pool, "device": device}
        self.api.put_claim("default", name, [result], uid=uid)


async def published(
    dra: DraNode, devices: list[str], generation: int | None = None, within: float = WAIT
) -> None:
    """Until the node's slices list exactly `devices` (at that pool generation, if given)."""

    def done() -> bool:
        slices = dra.slices()
        return (
            bool(slices)
            and dra.devices() == devices
            and (generation is None or slices[0]["spec"]["pool"]["generation"] == generation)
        )

    await run_blocking(dra.api.wait_for, done, within)


async def registered(dra: DraNode, count: int = 1) -> None:
    """Until kubelet has accepted `count` registrations of the driver, and holds one."""

    def done() -> bool:
        accepted = [one for one in dra.kubelet.registrations if one.error is None]
        return len(accepted) >= count and bool(dra.kubelet.instances(DRIVER))

    await run_blocking(dra.kubelet.wait_for, done, WAIT)


SHARES = [f"pcc-{index}" for index in range(16)]


# A watch's events as kube.Api.watch_slices passes them on: (type, object).
Event = Callable[[str, dict[str, Any]], None]


class SliceWatcher:
    """kube.Api.watch_slices for the tests' in-memory API servers: each says in `watch` what
    a watch from `version`, ending after `seconds`, does."""

    async def watch_slices(
        self, fields: dict[str, str], version: str, seconds: int, event: Event,
        opened: Callable[[], None],
    ) -> None:  # fmt: skip
        await self.watch(version, seconds, event, opened)

    async def watch(
        self, version: str, seconds: int, event: Event, opened: Callable[[], None]
    ) -> None:
        raise NotImplementedError
