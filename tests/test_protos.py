"""The generated code matches protos/, and carries exactly kubelet's gRPC paths."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from pcc_plugin._proto import v1beta1 as api
from pcc_plugin.flags import Flags
from pcc_plugin.service import DevicePlugin
from pcc_plugin.state import ResourceState

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import generate_protos  # noqa: E402


def _tree(path: Path) -> dict[str, bytes]:
    return {
        str(file.relative_to(path)): file.read_bytes()
        for file in sorted(path.rglob("*"))
        if file.is_file() and "__pycache__" not in file.parts
    }


@pytest.mark.skipif(
    importlib.util.find_spec("grpc_tools") is None, reason="needs the dev tools (grpcio-tools)"
)
def test_generated_code_matches_protos(tmp_path: Path) -> None:
    generate_protos.generate(tmp_path)
    for generated, committed in (
        (tmp_path / "_proto", ROOT / "pcc_plugin" / "_proto"),
        (tmp_path / "_pb", ROOT / "pcc_plugin" / "sim" / "_pb"),
    ):
        assert _tree(generated) == _tree(committed), (
            f"{committed} is out of date with protos/: run `nox -s protos`"
        )


def test_grpc_paths_are_kubelets() -> None:
    registration = {"/v1beta1.Registration/Register"}
    device_plugin = {
        "/v1beta1.DevicePlugin/GetDevicePluginOptions",
        "/v1beta1.DevicePlugin/ListAndWatch",
        "/v1beta1.DevicePlugin/GetPreferredAllocation",
        "/v1beta1.DevicePlugin/Allocate",
        "/v1beta1.DevicePlugin/PreStartContainer",
    }
    assert set(api.RegistrationBase().__mapping__()) == registration
    assert set(api.DevicePluginBase().__mapping__()) == device_plugin
    # The daemon's own handlers replace the generated ones on the same paths.
    plugin = DevicePlugin(Flags().pcc_resource(), "", ResourceState("x"))
    assert set(plugin.methods()) == device_plugin
