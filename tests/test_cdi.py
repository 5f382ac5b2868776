"""CDI specs: contents, shape (CDI 0.6.0), atomic writes, removal, and Allocate answers."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from pcc_plugin import cdi
from pcc_plugin.flags import Flags
from pcc_plugin.plugin import DevicePlugin
from pcc_plugin.resource import DeviceNode, ResourceSpec
from pcc_plugin.stats import ResourceStats

# The parts of CDI spec 0.6.0 this plugin writes, from the specification's text:
# names, kinds and edits that runtimes reject otherwise.
_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$"
_KIND = r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?/[A-Za-z0-9]([A-Za-z0-9_.-]*[A-Za-z0-9])?$"
CDI_0_6_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["cdiVersion", "kind", "devices"],
    "additionalProperties": False,
    "properties": {
        "cdiVersion": {"const": "0.6.0"},
        "kind": {"type": "string", "pattern": _KIND},
        "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
        "devices": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "containerEdits"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string", "pattern": _NAME},
                    "annotations": {"type": "object"},
                    "containerEdits": {"$ref": "#/$defs/edits"},
                },
            },
        },
        "containerEdits": {"$ref": "#/$defs/edits"},
    },
    "$defs": {
        "edits": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "env": {"type": "array", "items": {"type": "string", "pattern": "^[^=]+="}},
                "deviceNodes": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["path"],
                        "additionalProperties": False,
                        "properties": {
                            "path": {"type": "string", "pattern": "^/"},
                            "hostPath": {"type": "string", "pattern": "^/"},
                            "permissions": {"type": "string", "pattern": "^[rwm]+$"},
                        },
                    },
                },
                "mounts": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["hostPath", "containerPath"],
                        "additionalProperties": False,
                        "properties": {
                            "hostPath": {"type": "string", "pattern": "^/"},
                            "containerPath": {"type": "string", "pattern": "^/"},
                            "options": {"type": "array", "items": {"type": "string"}},
                        },
                    },
                },
            },
        }
    },
}


def test_pcc_spec_contents_and_shape(host: Path, tmp_path: Path) -> None:
    cdi_dir = tmp_path / "cdi"
    plugin = DevicePlugin(Flags().pcc_resource(), str(host), ResourceStats(), cdi_spec_dir=cdi_dir)
    path = cdi_dir / "tke.cloud.tencent.com-pcc-device.json"
    spec = json.loads(path.read_text())
    jsonschema.validate(spec, CDI_0_6_SCHEMA)
    assert spec == {
        "cdiVersion": "0.6.0",
        "kind": "tke.cloud.tencent.com/pcc-device",
        "annotations": {cdi.MANAGED_BY: "true"},
        "devices": [
            {
                "name": "pcc",
                "containerEdits": {
                    "deviceNodes": [
                        {
                            "path": "/dev/sev-guest",
                            "hostPath": "/dev/sev-guest",
                            "permissions": "rw",
                        }
                    ],
                    "mounts": [
                        {
                            "hostPath": "/var/run/pcc",
                            "containerPath": "/var/run/pcc",
                            "options": ["rbind", "rw"],
                        }
                    ],
                },
            }
        ],
    }
    assert path.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in cdi_dir.iterdir()] == [path.name]  # no temporary file left
    (container,) = plugin.allocate([["pcc-0", "pcc-1"]])
    assert container.cdi_devices == ("tke.cloud.tencent.com/pcc-device=pcc",)
    # Runtimes without CDI still get the device and the mount.
    assert [d.host_path for d in container.device_nodes] == ["/dev/sev-guest"]
    assert [m.host_path for m in container.mounts] == ["/var/run/pcc"]


def test_globbed_devices_get_a_cdi_device_each_and_gone_ones_leave_the_spec(
    host: Path, tmp_path: Path
) -> None:
    for name in ("dm-0", "dm-1"):
        (host / "dev" / name).symlink_to("/dev/null")
    spec = ResourceSpec(
        name="power.example.com/block",
        count=1,
        socket_prefix="block",
        device_nodes=(DeviceNode("/dev/dm-*", "", "rw", "char"),),
        envs=(("MODE", "x"),),
    )
    plugin = DevicePlugin(spec, str(host), ResourceStats(), cdi_spec_dir=tmp_path / "cdi")
    path = tmp_path / "cdi" / "power.example.com-block.json"
    written = json.loads(path.read_text())
    jsonschema.validate(written, CDI_0_6_SCHEMA)
    assert [d["name"] for d in written["devices"]] == ["dm-0", "dm-1"]
    assert written["devices"][0]["containerEdits"]["env"] == ["MODE=x"]
    (host / "dev" / "dm-0").unlink()
    plugin.refresh()
    assert [d["name"] for d in json.loads(path.read_text())["devices"]] == ["dm-1"]
    assert plugin.allocate([["dm-1-0"]])[0].cdi_devices == ("power.example.com/block=dm-1",)


def test_only_own_specs_of_departed_resources_are_removed(tmp_path: Path) -> None:
    managed = {"cdiVersion": "0.6.0", "annotations": {cdi.MANAGED_BY: "true"}}
    (tmp_path / "example.com-gone.json").write_text(json.dumps(managed))
    (tmp_path / "example.com-kept.json").write_text(json.dumps(managed))
    (tmp_path / "nvidia.com-gpu.json").write_text(json.dumps({"cdiVersion": "0.5.0"}))
    (tmp_path / "broken.json").write_text("{")
    cdi.remove_departed_specs(tmp_path, {"example.com/kept"})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "broken.json",
        "example.com-kept.json",
        "nvidia.com-gpu.json",
    ]


def test_an_unwritable_dir_is_one_error_and_allocate_still_works(
    host: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    plugin = DevicePlugin(Flags().pcc_resource(), str(host), ResourceStats(), cdi_spec_dir=blocked)
    assert any("Cannot write CDI spec" in message for message in caplog.messages)
    assert plugin.allocate([["pcc-0"]])[0].device_nodes


def test_kind_and_names_follow_cdi_rules() -> None:
    assert re.fullmatch(_KIND[1:-1], "tke.cloud.tencent.com/pcc-device")
    assert os.path.basename(cdi.spec_path(Path("/x"), "a.b/c")) == "a.b-c.json"
