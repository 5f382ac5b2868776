"""--config: every kind of mistake is one line naming the file and key path; good files load."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import trio

from pcc_plugin.profiles import ProfileError, load
from pcc_plugin.resource import DeviceNode, HostMount, ResourceSpec
from pcc_plugin.sim import FakeNode, SimKubelet, StartDaemon, run_blocking

ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "profiles.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_the_shipped_examples_load() -> None:
    pcc, power = (
        load(str(ROOT / "docs" / "examples" / "pcc.yaml")),
        load(str(ROOT / "docs" / "examples" / "power-block.yaml")),
    )
    assert pcc == [
        ResourceSpec(
            name="tke.cloud.tencent.com/pcc-device",
            count=16,
            socket_prefix="pcc",
            device_nodes=(DeviceNode("/dev/sev-guest", "/dev/sev-guest", "rw", "char"),),
            mounts=(HostMount("/var/run/pcc", "/var/run/pcc", False),),
        )
    ]
    (disks,) = power
    assert disks.name == "power.example.com/block"
    assert disks.device_nodes[0].is_glob
    assert disks.device_nodes[0].device_type == "block"


def test_defaults_and_derived_prefix(tmp_path: Path) -> None:
    (spec,) = load(
        write(
            tmp_path,
            """
            resources:
              - name: example.com/My_Device.v2
                devices: [{hostPath: /dev/x}]
                env: {A_B: "1"}
            """,
        )
    )
    assert spec.count == 1
    assert spec.socket_prefix == "my-device.v2"
    assert spec.device_nodes == (DeviceNode("/dev/x", "/dev/x", "rw", "char"),)
    assert spec.envs == (("A_B", "1"),)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("resources: [", "not valid YAML at line 1"),
        ("[]", "(top level): must be a mapping, got list"),
        ("{}", "(top level).resources: is required"),
        ("resources: []", "resources: must list at least one resource"),
        ("{resources: [{name: x/y, devices: [{hostPath: /d}]}], extra: 1}", "extra: unknown key"),
        ("resources: [{devices: [{hostPath: /d}]}]", "resources[0].name: is required"),
        (
            "resources: [{name: 7, devices: [{hostPath: /d}]}]",
            "resources[0].name: must be a string",
        ),
        (
            "resources: [{name: kubernetes.io/x, devices: [{hostPath: /d}]}]",
            "resources[0].name: 'kubernetes.io/x' would be rejected by kubelet",
        ),
        (
            "resources: [{name: a.b/c, count: 0, devices: [{hostPath: /d}]}]",
            "resources[0].count: must be a whole number from 1 to 10000",
        ),
        (
            "resources: [{name: a.b/c, count: 'many', devices: [{hostPath: /d}]}]",
            "resources[0].count: must be a whole number",
        ),
        ("resources: [{name: a.b/c}]", "resources[0]: gives containers nothing"),
        (
            "resources: [{name: a.b/c, devices: {hostPath: /d}}]",
            "resources[0].devices: must be a list, got dict",
        ),
        (
            "resources: [{name: a.b/c, devices: [{hostPath: dev/x}]}]",
            "resources[0].devices[0].hostPath: must be an absolute path, got 'dev/x'",
        ),
        (
            "resources: [{name: a.b/c, devices: [{hostPath: /d, permissions: rwx}]}]",
            "resources[0].devices[0].permissions: must be made of r, w and m",
        ),
        (
            "resources: [{name: a.b/c, devices: [{hostPath: /d, type: pipe}]}]",
            "resources[0].devices[0].type: must be char or block",
        ),
        (
            "resources: [{name: a.b/c, devices: [{hostPath: /d*/x}]}]",
            "resources[0].devices[0].hostPath: a glob may only be in the last path component",
        ),
        (
            "resources: [{name: a.b/c, devices: [{hostPath: /dev/sd*, containerPath: /x}]}]",
            "resources[0].devices[0].containerPath: not allowed with a glob",
        ),
        (
            "resources: [{name: a.b/c, devices: [{hostPath: /d, size: 1}]}]",
            "resources[0].devices[0].size: unknown key",
        ),
        (
            "resources: [{name: a.b/c, mounts: [{hostPath: /m, readOnly: 'yes'}]}]",
            "resources[0].mounts[0].readOnly: must be true or false",
        ),
        (
            "resources: [{name: a.b/c, mounts: [{hostPath: /m}], env: {1X: a}}]",
            "resources[0].env.1X: is not a valid environment variable name",
        ),
        (
            "resources: [{name: a.b/c, mounts: [{hostPath: /m}], env: {X: 1}}]",
            "resources[0].env.X: must be a string, got 1 (quote it)",
        ),
        (
            "resources: [{name: a.b/c, socketPrefix: Bad_Prefix, mounts: [{hostPath: /m}]}]",
            "resources[0].socketPrefix: must be 1-20 of a-z",
        ),
        (
            "resources: [{name: a.b/c, mounts: [{hostPath: /m}]},"
            " {name: a.b/c, socketPrefix: other, mounts: [{hostPath: /m}]}]",
            "resources[1].name: 'a.b/c' is used twice",
        ),
        (
            "resources: [{name: a.b/disk, mounts: [{hostPath: /m}]},"
            " {name: c.d/disk, mounts: [{hostPath: /m}]}]",
            "resources[1].socketPrefix: 'disk' is used twice",
        ),
    ],
)
def test_bad_files_are_one_line_with_the_key_path(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ProfileError) as error:
        load(path)
    assert str(error.value).startswith(f"{path}: ")
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match=r"--config .*/absent.yaml: No such file or directory"):
        load(str(tmp_path / "absent.yaml"))


async def test_two_resources_at_once_one_with_its_device_missing(
    kubelet: SimKubelet, fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    (fake_node.host_root / "dev" / "vda").symlink_to("/dev/null")
    config = fake_node.root / "profiles.yaml"
    config.write_text(
        textwrap.dedent(
            """
            resources:
              - name: tke.cloud.tencent.com/pcc-device
                count: 4
                socketPrefix: pcc
                devices: [{hostPath: /dev/sev-guest, containerPath: /dev/sev-guest}]
                mounts: [{hostPath: /var/run/pcc}]
              - name: example.com/disk
                devices: [{hostPath: /dev/vd*, type: char}]
              - name: example.com/absent
                count: 2
                devices: [{hostPath: /dev/not-here}]
            """
        )
    )
    cdi_dir = fake_node.root / "cdi"
    flags = [*fake_node.daemon_args(), f"--config={config}", "--cdi", f"--cdi-spec-dir={cdi_dir}"]
    with trio.fail_after(30):
        daemon = start_daemon(*flags)

        def all_registered() -> bool:
            names = {r.resource_name for r in kubelet.registrations if r.accepted}
            return len(names) == 3 and all(
                kubelet.stream_open(name)
                for name in ("tke.cloud.tencent.com/pcc-device", "example.com/disk")
            )

        await run_blocking(kubelet.wait_for, all_registered, 10.0)
        assert kubelet.devices("tke.cloud.tencent.com/pcc-device") == {
            f"pcc-{i}": "Healthy" for i in range(4)
        }
        assert kubelet.devices("example.com/disk") == {"vda-0": "Healthy"}
        await run_blocking(
            kubelet.wait_for,
            lambda: (
                kubelet.devices("example.com/absent")
                == {"absent-0": "Unhealthy", "absent-1": "Unhealthy"}
            ),
            10.0,
        )
        # A disk that appears is advertised.
        (fake_node.host_root / "dev" / "vdb").symlink_to("/dev/null")
        await run_blocking(
            kubelet.wait_for,
            lambda: kubelet.devices("example.com/disk") == {"vda-0": "Healthy", "vdb-0": "Healthy"},
            10.0,
        )
        response = await run_blocking(kubelet.allocate, "example.com/disk", [["vdb-0"]])
        (container,) = response.container_responses
        assert [(d.host_path, d.container_path) for d in container.devices] == [
            ("/dev/vdb", "/dev/vdb")
        ]
        assert [d.name for d in container.cdi_devices] == ["example.com/disk=vdb"]
        specs = sorted(p.name for p in cdi_dir.iterdir())
        assert specs == [
            "example.com-absent.json",
            "example.com-disk.json",
            "tke.cloud.tencent.com-pcc-device.json",
        ]
        assert await run_blocking(daemon.terminate) == 0
        # Containers restarting while the plugin is away still need the specs.
        assert sorted(p.name for p in cdi_dir.iterdir()) == specs


async def test_a_bad_config_is_a_usage_error(
    fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    config = fake_node.root / "profiles.yaml"
    config.write_text("resources: [{name: x}]\n")
    with trio.fail_after(20):
        daemon = start_daemon(*fake_node.daemon_args(), f"--config={config}")
        assert await run_blocking(daemon.proc.wait, 15) == 2
        assert daemon.log_text().strip() == (
            f"pcc-device-plugin: {config}: resources[0].name: 'x' would be rejected by kubelet: "
            "needs the form domain/name, e.g. example.com/device (see --help)"
        )
