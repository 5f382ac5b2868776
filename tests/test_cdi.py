"""CDI specs: contents, shape (CDI 0.6.0), atomic writes, removal, and Allocate answers."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import trio
from daemon_support import log_line, serving

from pcc_plugin import cdi
from pcc_plugin.flags import Flags
from pcc_plugin.resource import DeviceNode, ResourceSpec
from pcc_plugin.service import DevicePlugin
from pcc_plugin.sim import Daemon, FakeNode, SimKubelet, StartDaemon, run_blocking
from pcc_plugin.state import ResourceState

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
    plugin = DevicePlugin(
        Flags().pcc_resource(), str(host), ResourceState("x"), cdi_spec_dir=cdi_dir
    )
    path = cdi_dir / "tke.cloud.tencent.com-pcc-device.json"
    spec = json.loads(path.read_text())
    jsonschema.validate(spec, CDI_0_6_SCHEMA)
    assert spec == {
        "cdiVersion": "0.6.0",
        "kind": "tke.cloud.tencent.com/pcc-device",
        "annotations": {cdi.OWNER: "pcc-device-plugin"},
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
    (container,) = plugin.grants([["pcc-0", "pcc-1"]])
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
    plugin = DevicePlugin(spec, str(host), ResourceState("x"), cdi_spec_dir=tmp_path / "cdi")
    path = tmp_path / "cdi" / "power.example.com-block.json"
    written = json.loads(path.read_text())
    jsonschema.validate(written, CDI_0_6_SCHEMA)
    assert [d["name"] for d in written["devices"]] == ["dm-0", "dm-1"]
    assert written["devices"][0]["containerEdits"]["env"] == ["MODE=x"]
    (host / "dev" / "dm-0").unlink()
    plugin.inventory.refresh()
    assert [d["name"] for d in json.loads(path.read_text())["devices"]] == ["dm-1"]
    assert plugin.grants([["dm-1-0"]])[0].cdi_devices == ("power.example.com/block=dm-1",)


def owned_by(owner: str) -> dict[str, Any]:
    return {"cdiVersion": "0.6.0", "annotations": {cdi.OWNER: owner}}


# How versions without instance names marked every spec they wrote.
BEFORE_INSTANCE_NAMES = {"cdiVersion": "0.6.0", "annotations": {cdi.MANAGED_BY: "true"}}


def test_only_own_specs_of_departed_resources_are_removed(tmp_path: Path) -> None:
    for name, content in {
        "example.com-gone.json": owned_by("a"),
        "example.com-kept.json": owned_by("a"),
        "example.com-other.json": owned_by("b"),
        "example.com-old.json": BEFORE_INSTANCE_NAMES,
        "nvidia.com-gpu.json": {"cdiVersion": "0.5.0"},
    }.items():
        (tmp_path / name).write_text(json.dumps(content))
    (tmp_path / "broken.json").write_text("{")
    cdi.remove_departed_specs(tmp_path, {"example.com/kept"}, "a")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "broken.json",
        "example.com-kept.json",
        "example.com-old.json",
        "example.com-other.json",
        "nvidia.com-gpu.json",
    ]


def pcc_plugin_as(instance: str, host: Path, cdi_dir: Path) -> DevicePlugin:
    return DevicePlugin(
        Flags().pcc_resource(),
        str(host),
        ResourceState("x"),
        cdi_spec_dir=cdi_dir,
        instance_name=instance,
    )


PCC_SPEC = "tke.cloud.tencent.com-pcc-device.json"


@pytest.mark.parametrize(
    ("existing", "problem"),
    [
        pytest.param(
            owned_by("a"),
            "CDI spec {path} belongs to instance 'a', not to this instance 'b': "
            "tke.cloud.tencent.com/pcc-device is served without CDI; give each instance sharing "
            "--cdi-spec-dir its own resources, or remove the file if nothing needs it, then "
            "restart this instance",
            id="another instance's",
        ),
        pytest.param(
            {"cdiVersion": "0.6.0", "kind": "tke.cloud.tencent.com/pcc-device", "devices": []},
            "CDI spec {path} was not written by pcc-device-plugin: "
            "tke.cloud.tencent.com/pcc-device is served without CDI",
            id="written by hand",
        ),
    ],
)
def test_a_spec_that_is_not_this_instances_is_left_and_cdi_not_named(
    host: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    existing: dict[str, Any],
    problem: str,
) -> None:
    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir()
    path = cdi_dir / PCC_SPEC
    path.write_text(json.dumps(existing))
    plugin = pcc_plugin_as("b", host, cdi_dir)
    (host / "dev" / "sev-guest").unlink()
    plugin.inventory.refresh()
    assert json.loads(path.read_text()) == existing
    assert [p.name for p in cdi_dir.iterdir()] == [PCC_SPEC]  # no temporary file left
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1  # once, not at every refresh
    assert errors[0].startswith(problem.format(path=path))
    (host / "dev" / "sev-guest").symlink_to("/dev/null")
    plugin.inventory.refresh()
    (container,) = plugin.grants([["pcc-0"]])
    assert container.cdi_devices == ()
    assert [node.host_path for node in container.device_nodes] == ["/dev/sev-guest"]


@pytest.mark.parametrize(
    "existing",
    [owned_by("b"), BEFORE_INSTANCE_NAMES],
    ids=["its own", "written before instance names"],
)
def test_an_instance_rewrites_its_own_spec(
    host: Path, tmp_path: Path, existing: dict[str, Any]
) -> None:
    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir()
    (cdi_dir / PCC_SPEC).write_text(json.dumps(existing))
    plugin = pcc_plugin_as("b", host, cdi_dir)
    assert json.loads((cdi_dir / PCC_SPEC).read_text())["annotations"] == {cdi.OWNER: "b"}
    assert plugin.grants([["pcc-0"]])[0].cdi_devices == ("tke.cloud.tencent.com/pcc-device=pcc",)


def test_an_unwritable_dir_is_one_error_and_allocate_still_works(
    host: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    plugin = DevicePlugin(
        Flags().pcc_resource(), str(host), ResourceState("x"), cdi_spec_dir=blocked
    )
    assert any("Cannot write CDI spec" in message for message in caplog.messages)
    (container,) = plugin.grants([["pcc-0"]])
    assert container.device_nodes
    assert container.cdi_devices == ()


def test_kind_and_names_follow_cdi_rules() -> None:
    assert re.fullmatch(_KIND[1:-1], "tke.cloud.tencent.com/pcc-device")
    assert os.path.basename(cdi.spec_path(Path("/x"), "a.b/c")) == "a.b-c.json"


# Two instances against the real daemon: another DaemonSet (or a profile of another team)
# that shares --cdi-spec-dir.

X, Y = "a.example.com/x", "b.example.com/y"
X_SPEC, Y_SPEC = "a.example.com-x.json", "b.example.com-y.json"


def owners(cdi_dir: Path) -> dict[str, str]:
    return {
        path.name: json.loads(path.read_text())["annotations"][cdi.OWNER]
        for path in sorted(cdi_dir.glob("*.json"))
    }


async def test_two_instances_keep_each_others_specs_across_restarts(
    fake_node: FakeNode, kubelet: SimKubelet, start_daemon: StartDaemon
) -> None:
    cdi_dir = fake_node.root / "cdi"

    def start(instance: str, resource: str) -> Daemon:
        return start_daemon(
            *fake_node.daemon_args(),
            f"--resource-name={resource}",
            "--cdi",
            f"--cdi-spec-dir={cdi_dir}",
            f"--instance-name={instance}",
        )

    with trio.fail_after(60):
        a = start("a", X)
        await log_line(a, "Registered device plugin with Kubelet")
        b = start("b", Y)
        await log_line(b, "Registered device plugin with Kubelet")
        assert owners(cdi_dir) == {X_SPEC: "a", Y_SPEC: "b"}
        for instance, resource in (("a", X), ("b", Y), ("a", X)):
            stopped = a if instance == "a" else b
            assert await run_blocking(stopped.terminate) == 0
            # Containers restarting while an instance is away still need its spec.
            assert owners(cdi_dir) == {X_SPEC: "a", Y_SPEC: "b"}
            restarted = start(instance, resource)
            await log_line(restarted, "Registered device plugin with Kubelet")
            assert owners(cdi_dir) == {X_SPEC: "a", Y_SPEC: "b"}
            a, b = (restarted, b) if instance == "a" else (a, restarted)
        response = await run_blocking(kubelet.allocate, Y, [["pcc-0"]])
        assert [d.name for d in response.container_responses[0].cdi_devices] == [f"{Y}=pcc"]
        for daemon in (a, b):
            assert not re.search("Removed CDI spec|belongs to instance", daemon.log_text())


async def test_an_instance_serving_anothers_resource_leaves_its_spec_and_serves_without_cdi(
    fake_node: FakeNode, kubelet: SimKubelet, start_daemon: StartDaemon
) -> None:
    cdi_dir = fake_node.root / "cdi"
    common = [
        *fake_node.daemon_args(),
        f"--resource-name={X}",
        "--cdi",
        f"--cdi-spec-dir={cdi_dir}",
    ]
    with trio.fail_after(30):
        a = start_daemon(*common, "--instance-name=a")
        await log_line(a, "Registered device plugin with Kubelet")
        written = (cdi_dir / X_SPEC).read_text()
        c = start_daemon(*common, "--instance-name=c")
        error = await log_line(c, "belongs to instance")
        # Kubelet uses the newest registration of a resource: c's.
        await serving(kubelet, registrations=2, resource=X)
        response = await run_blocking(kubelet.allocate, X, [["pcc-0"]])
    assert error.startswith("E")
    assert error.split("] ", 1)[1] == (
        f"CDI spec {cdi_dir / X_SPEC} belongs to instance 'a', not to this instance 'c': "
        f"{X} is served without CDI; give each instance sharing --cdi-spec-dir its own "
        "resources, or remove the file if nothing needs it, then restart this instance"
    )
    (container,) = response.container_responses
    assert list(container.cdi_devices) == []
    assert [d.host_path for d in container.devices] == ["/dev/sev-guest"]
    assert (cdi_dir / X_SPEC).read_text() == written
