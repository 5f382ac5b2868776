"""--config: every kind of mistake is one line naming the file and key path; good files load."""

from __future__ import annotations

import hashlib
import os
import re
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
import yaml
from daemon_support import log_line
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pcc_plugin.profiles import ProfileError, load
from pcc_plugin.resource import DeviceNode, HostMount, ResourceSpec
from pcc_plugin.sim import FakeNode, SimKubelet, StartDaemon, run_blocking
from pcc_plugin.yaml_input import MAX_ALIASES, MAX_BYTES, MAX_DEPTH, MAX_VALUES

ROOT = Path(__file__).resolve().parent.parent


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "profiles.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_the_shipped_examples_load() -> None:
    pcc, power = (
        load(str(ROOT / "docs" / "examples" / "pcc.yaml")).specs,
        load(str(ROOT / "docs" / "examples" / "power-block.yaml")).specs,
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
    # Its devices are handed out only where the kernel does not say they are the host's.
    assert not disks.device_nodes[0].allow_sensitive
    (tdx,) = load(str(ROOT / "docs" / "examples" / "tdx.yaml")).specs
    assert (tdx.name, tdx.count, tdx.only_on) == ("tke.cloud.tencent.com/tdx-guest", 16, "tdx")
    assert tdx.device_nodes == (DeviceNode("/dev/tdx[-_]guest", "", "rw", "char"),)
    (vtpm,) = load(str(ROOT / "docs" / "examples" / "vtpm.yaml")).specs
    assert (vtpm.name, vtpm.count, vtpm.only_on) == ("tke.cloud.tencent.com/vtpm", 16, "tpm")
    assert vtpm.device_nodes == (DeviceNode("/dev/tpmrm0", "/dev/tpmrm0", "rw", "char"),)
    assert vtpm.mounts == (
        HostMount("/sys/kernel/security/tpm0", "/run/cc-device-plugin", read_only=True),
    )
    # No example opts in to anything.
    for spec in (*pcc, *power, tdx, vtpm):
        assert not any(node.allow_sensitive for node in spec.device_nodes)
        assert not any(mount.allow_sensitive for mount in spec.mounts)


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
    ).specs
    assert spec.count == 1
    assert spec.socket_prefix == "my-device.v2"
    assert spec.device_nodes == (DeviceNode("/dev/x", "/dev/x", "rw", "char"),)
    assert spec.envs == (("A_B", "1"),)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("resources: [", "not valid YAML at line 1"),
        ("[]", "(top level): must be a mapping, got list"),
        ("{}", ": resources: is required"),
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


def test_the_digest_names_the_bytes_the_resources_were_read_from(tmp_path: Path) -> None:
    """/metrics and the doctor name what runs by it: a file replaced once it was read (a
    ConfigMap update while the daemon starts or reloads) must not lend it its hash."""
    path = Path(write(tmp_path, "resources: [{name: a.example.com/x, mounts: [{hostPath: /a}]}]"))
    read = path.read_bytes()
    profile = load(str(path))
    path.write_text("resources: [{name: b.example.com/y, mounts: [{hostPath: /b}]}]\n")
    assert profile.digest == hashlib.sha256(read).hexdigest()[:16]
    assert [spec.name for spec in profile.specs] == ["a.example.com/x"]
    assert load(str(path)).digest == hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    assert load(str(path)).digest != profile.digest


# Input that cost a traceback or seconds before it was bounded: each is refused in one line
# that says where.
MOUNT = "resources: [{name: a.b/c, mounts: [{hostPath: /m}]"
BAD_INPUT = [
    pytest.param("resources: []\n".encode("utf-16"), "is UTF-16 or UTF-32", id="UTF-16 with BOM"),
    pytest.param(
        "resources: []\n".encode("utf-16-le"),
        "has a NUL byte at line 1, column 2; save it as UTF-8",
        id="UTF-16 without BOM",
    ),
    pytest.param(
        "resources:\n  - name: caf\xe9\n".encode("latin-1"),
        "is not UTF-8: byte 0xe9 at line 2, column 14",
        id="Latin-1",
    ),
    pytest.param(b"resources: []\0\n", "has a NUL byte at line 1, column 14", id="NUL byte"),
    pytest.param(
        b'resources: [{name: a.b/c, devices: [{hostPath: "/dev/x\\0"}]}]',
        "resources[0].devices[0].hostPath: contains a NUL character",
        id="escaped NUL in a path",
    ),
    pytest.param(
        MOUNT.encode() + b', env: {A: "\\0"}}]',
        "resources[0].env.A: contains a NUL character",
        id="escaped NUL in an environment value",
    ),
    pytest.param(
        b"resources:\n  - name: a.com/x\n    name: b.com/y\n    mounts: [{hostPath: /m}]\n",
        "resources[0].name: duplicate key at line 3 (first at line 2)",
        id="duplicate key",
    ),
    pytest.param(
        b"resources: []\nresources: []\n",
        "resources: duplicate key at line 2 (first at line 1)",
        id="duplicate top-level key",
    ),
    pytest.param(
        b"x: &x 1\ny: [" + b", ".join([b"*x"] * (MAX_ALIASES + 1)) + b"]\n",
        f"at line 2, column {5 + 4 * MAX_ALIASES}: more than {MAX_ALIASES} aliases",
        id="too many aliases",
    ),
    pytest.param(
        b"a: &a [x, x, x, x, x, x, x, x, x, x]\n"
        b"b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
        b"c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\n"
        b"d: [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n",
        f"at line 4, column 33: more than {MAX_VALUES} values",
        id="billion laughs",
    ),
    pytest.param(b"a: &a [*a]\n", "alias *a stands for a value that contains it", id="alias loop"),
    pytest.param(
        b"[" * 100_000, f"at line 1, column {MAX_DEPTH + 1}: nested more than", id="deep nesting"
    ),
    pytest.param(
        b"# " + b"x" * MAX_BYTES, f"is larger than {MAX_BYTES // 1024} KiB", id="too large"
    ),
    pytest.param(
        MOUNT.encode() + b", count: 2001-13-45}]",
        "not valid YAML at line 1, column 60: cannot read '2001-13-45': month must be in 1..12",
        id="impossible date",
    ),
    pytest.param(
        MOUNT.encode() + b", count: " + b"9" * 5000 + b"}]",
        "Exceeds the limit (4300 digits)",
        id="huge number",
    ),
    pytest.param(
        MOUNT.encode() + b", env: {ON: x}}]",
        "resources[0].env.ON: this key is read as bool, not a string: quote it",
        id="key that is not a string",
    ),
    pytest.param(b"? [a]\n: b\n", "(top level): the key at line 1 is not a string", id="list key"),
    pytest.param(
        MOUNT.encode() + b', env: {"A\\nB": x}}]',
        "resources[0].env.'A\\nB': is not a valid environment variable name",
        id="key with a newline",
    ),
    pytest.param(
        b"resources: [\x07]",
        "not valid YAML at line 1, column 13: character U+0007 is not allowed",
        id="control character",
    ),
    pytest.param(
        b"resources: []\n---\nresources: []\n",
        "expected a single document in the stream, but found another document",
        id="two documents",
    ),
]


@pytest.mark.parametrize(("data", "message"), BAD_INPUT)
def test_bad_input_is_one_line_saying_where(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "profiles.yaml"
    path.write_bytes(data)
    with pytest.raises(ProfileError) as error:
        load(str(path))
    assert str(error.value).startswith(f"{path}: ")
    assert message in str(error.value)
    assert "\n" not in str(error.value)
    assert len(str(error.value)) < 300


def test_aliases_and_merge_keys_within_the_bounds_load(tmp_path: Path) -> None:
    first, second = load(
        write(
            tmp_path,
            """
            resources:
              - &first {name: a.example.com/x, count: 2, mounts: [&pcc {hostPath: /var/run/pcc}]}
              - {<<: *first, name: b.example.com/y, socketPrefix: y, mounts: [*pcc]}
            """,
        )
    ).specs
    assert (first.name, first.count, second.name, second.count) == (
        "a.example.com/x",
        2,
        "b.example.com/y",
        2,
    )
    assert first.mounts == second.mounts == (HostMount("/var/run/pcc", "/var/run/pcc", False),)


async def test_a_file_that_is_not_regular_is_refused_without_waiting(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    for path in (fifo, tmp_path):
        with trio.fail_after(5), pytest.raises(ProfileError) as error:
            # In a thread of its own: opening a FIFO for reading waits for a writer.
            await trio.to_thread.run_sync(load, str(path), abandon_on_cancel=True)
        assert str(error.value) == f"--config {path}: not a regular file"


# Files just under 1 MiB in the shapes PyYAML's pure-Python parser is slowest at. Unbounded,
# the flow list took over 20 s, the 100,000 aliases of 390 KiB 11 s. Each is refused by its size,
# unread.
MIB = 1024 * 1024
COSTLY = {
    "a flow list of one-character values": "x: [" + "1," * (MIB // 2 - 4) + "1]\n",
    "a block list": "x:\n" + "- 1\n" * (MIB // 4 - 1),
    "a mapping of many keys": "".join(f"k{i:06}: 1\n" for i in range(MIB // 12)),
    "100,000 aliases": "a: &a x\nb: [" + ", ".join(["*a"] * 100_000) + "]\n",
}


@pytest.mark.parametrize("text", COSTLY.values(), ids=COSTLY.keys())
def test_costly_files_are_refused_by_their_size_unread(tmp_path: Path, text: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ProfileError, match=f"is larger than {MAX_BYTES // 1024} KiB"):
        load(path)


def test_a_dense_list_within_the_size_bound_is_refused_where_the_values_run_over(
    tmp_path: Path,
) -> None:
    """Not after parsing the whole file (PyYAML alone takes about 6 times as long): at the
    value past the bound, whatever the machine's speed."""
    path = write(tmp_path, "x: [" + "1," * (MAX_BYTES // 2 - 8) + "1]\n")
    with pytest.raises(ProfileError) as error:
        load(path)
    found = re.search(r"at line 1, column (\d+): more than (\d+) values", str(error.value))
    assert found, error.value
    # Two characters a value: refused about the 10,000th of them, not at the line's end.
    assert int(found[1]) <= len("x: [") + 2 * MAX_VALUES + 1 < os.path.getsize(path) // 6
    assert int(found[2]) == MAX_VALUES


# The costliest files within the bounds: the longest list of values, with the rest of the
# bytes as blank lines, before or after it.
VALUES_AT_THE_BOUND = "resources: [" + "1," * (MAX_VALUES - 4) + "1]\n"
BLANK_LINES = "\n" * (MAX_BYTES - len(VALUES_AT_THE_BOUND))


@pytest.mark.parametrize(
    "text",
    [VALUES_AT_THE_BOUND + BLANK_LINES, BLANK_LINES + VALUES_AT_THE_BOUND],
    ids=["list first", "blank lines first"],
)
def test_the_costliest_files_within_the_bounds_cost_about_what_the_parser_does(
    tmp_path: Path, text: str
) -> None:
    """The bounds make the parser's cost the most a file can cost (0.3 s of CPU on a busy
    two-core machine); the loader's own keeping count must not add much to it. Both in CPU
    time, one after the other, so that the machine's speed and load cancel out."""
    path = write(tmp_path, text)
    assert os.path.getsize(path) == MAX_BYTES

    def cost(work: Callable[[], object]) -> float:
        """This thread's CPU time for `work`, the lesser of two (other threads' and a
        moment's slowness of the machine are not the work's)."""
        times = []
        for _ in range(2):
            started = time.thread_time()
            work()
            times.append(time.thread_time() - started)
        return min(times)

    def loader() -> None:
        with pytest.raises(ProfileError, match=r"resources\[0\]: must be a mapping, got int"):
            load(path)

    assert cost(loader) < 2 * cost(lambda: yaml.compose(text, Loader=yaml.SafeLoader))


VALID = textwrap.dedent(
    """
    resources:
      - name: example.com/disk
        count: 2
        socketPrefix: disk
        devices: [{hostPath: "/dev/vd*", type: block}]
        mounts:
          - {hostPath: /var/run/pcc, containerPath: /pcc, readOnly: true}
        env: {MODE: "fast"}
    """
).encode()


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    database=None,
    # too_slow: how fast examples are made is the machine's (a busy one is slow), not ours.
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    edits=st.lists(
        st.tuples(st.integers(0, len(VALID)), st.integers(0, 8), st.binary(max_size=8)),
        min_size=1,
        max_size=4,
    )
)
def test_any_damage_to_a_file_is_one_line_or_still_a_file(
    tmp_path: Path, edits: list[tuple[int, int, bytes]]
) -> None:
    data = VALID
    for at, cut, inserted in edits:
        data = data[:at] + inserted + data[at + cut :]
    path = tmp_path / "damaged.yaml"
    path.write_bytes(data)
    message = ""
    try:
        load(str(path))
    except ProfileError as error:
        message = str(error)
    assert not message or message.startswith((f"{path}: ", f"--config {path}: "))
    assert "\n" not in message


def one_entry(kind: str, entry: str) -> str:
    return f"resources: [{{name: a.example.com/x, {kind}: [{{{entry}}}]}}]"


REFUSED_UNLESS_OPTED_IN = "refused unless this entry sets allowSensitiveHostPath: true"


@pytest.mark.parametrize(
    ("kind", "host_path", "hazard"),
    [
        ("mounts", "/", "/ is the host's whole filesystem"),
        ("mounts", "//etc/", "/etc is the host's configuration and credentials"),
        ("mounts", "/usr/../etc/kubernetes", "/etc/kubernetes is inside /etc (the host's"),
        ("mounts", "/proc", "/proc is the host's processes and kernel settings"),
        ("mounts", "/sys/fs/cgroup", "/sys/fs/cgroup is inside /sys"),
        ("mounts", "/dev", "/dev is every device node of the host"),
        ("mounts", "/boot", "/boot is the host's kernel and boot loader"),
        ("mounts", "/root/.ssh", "/root/.ssh is inside /root"),
        ("mounts", "/var/lib/kubelet/", "/var/lib/kubelet is kubelet's state"),
        ("mounts", "/var/lib/kubelet/pods", "/var/lib/kubelet/pods is inside /var/lib/kubelet"),
        ("mounts", "/var", "/var holds /var/lib/kubelet"),
        ("mounts", "/run", "/run holds /run/containerd (containerd's socket directory"),
        ("mounts", "/var/run/pcc/..", "/var/run holds /var/run/containerd"),
        ("mounts", "/run/containerd", "/run/containerd is containerd's socket directory"),
        ("mounts", "/var/run/containerd", "/var/run/containerd is containerd's socket"),
        ("mounts", "/run/crio", "/run/crio is CRI-O's socket directory"),
        ("mounts", "/var/run/crio/", "/var/run/crio is CRI-O's socket directory"),
        ("mounts", "/run/docker.sock", "/run/docker.sock is Docker's socket"),
        ("mounts", "/var/run/docker.sock", "/var/run/docker.sock is Docker's socket"),
        ("mounts", "/var/run/dockershim.sock", "/var/run/dockershim.sock is dockershim's"),
        ("mounts", "/var/lib/containerd", "/var/lib/containerd is containerd's storage"),
        ("mounts", "/run/k3s/containerd", "/run/k3s/containerd is inside /run/k3s (k3s's and"),
        ("mounts", "/var/run/k3s", "/var/run/k3s is k3s's and RKE2's containerd socket"),
        ("mounts", "/var/lib/rancher/rke2", "/var/lib/rancher/rke2 is inside /var/lib/rancher"),
        ("mounts", "/run/podman", "/run/podman is Podman's socket directory"),
        ("mounts", "/run/containers/storage", "/run/containers/storage is inside /run/containers"),
        ("mounts", "/run/user/1000/podman", "/run/user/1000/podman is inside /run/user (every"),
        ("mounts", "/home/core/.local", "/home/core/.local is inside /home (the users' home"),
        ("mounts", "/var/run/crio/crio.sock", "/var/run/crio/crio.sock is inside /var/run/crio"),
        ("mounts", "/run/runc", "/run/runc is runc's state of every container"),
        (
            "mounts",
            "/run/systemd/journal",
            "/run/systemd/journal is inside /run/systemd (systemd's",
        ),
        ("mounts", "/var/run/dbus", "/var/run/dbus is D-Bus's system bus socket"),
        ("mounts", "/var/lib/etcd", "/var/lib/etcd is etcd's data"),
        ("mounts", "/var/log/pods", "/var/log/pods is inside /var/log (the host's and every pod's"),
        ("mounts", "/usr/local/bin", "/usr/local/bin is inside /usr (the host's programs"),
        ("mounts", "/opt", "/opt holds /opt/cni (the CNI plugins the container runtime runs"),
        ("mounts", "/sys/kernel/config", "/sys/kernel/config is inside /sys"),
        ("mounts", "/sys/kernel/security", "/sys/kernel/security is inside /sys"),
        ("devices", "/dev/mem", "/dev/mem is the host's physical memory"),
        ("devices", "/dev/./kmem", "/dev/kmem is the kernel's memory"),
        ("devices", "//dev/port", "/dev/port is the host's I/O ports"),
        ("devices", "/dev/*", "/dev/* matches /dev/mem (the host's physical memory)"),
        ("devices", "/dev/[kx]mem", "/dev/[kx]mem matches /dev/kmem (the kernel's memory)"),
    ],
)
def test_sensitive_host_paths_are_refused_without_an_opt_in(
    tmp_path: Path, kind: str, host_path: str, hazard: str
) -> None:
    path = write(tmp_path, one_entry(kind, f"hostPath: {host_path!r}"))
    with pytest.raises(ProfileError) as error:
        load(path)
    assert str(error.value).startswith(f"{path}: resources[0].{kind}[0].hostPath: {hazard}")
    assert str(error.value).endswith(REFUSED_UNLESS_OPTED_IN)


def test_an_entry_may_opt_in_to_a_sensitive_host_path(tmp_path: Path) -> None:
    (spec,) = load(
        write(
            tmp_path,
            """
            resources:
              - name: a.example.com/x
                devices:
                  - {hostPath: /dev/mem, permissions: r, allowSensitiveHostPath: true}
                  - {hostPath: /dev/vda, allowSensitiveHostPath: false}
                mounts:
                  - hostPath: /var/lib/kubelet/pod-resources/
                    allowSensitiveHostPath: true
            """,
        )
    ).specs
    assert spec.device_nodes == (
        DeviceNode("/dev/mem", "/dev/mem", "r", "char", allow_sensitive=True),
        DeviceNode("/dev/vda", "/dev/vda", "rw", "char"),
    )
    assert spec.mounts == (
        HostMount(
            "/var/lib/kubelet/pod-resources",
            "/var/lib/kubelet/pod-resources",
            allow_sensitive=True,
        ),
    )


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            "hostPath: /var/run/pcc, allowSensitiveHostPath: true",
            "resources[0].mounts[0].allowSensitiveHostPath: hostPath is not a sensitive host "
            "path: remove the opt-in",
        ),
        (
            "hostPath: /etc, allowSensitiveHostPath: 'yes'",
            "resources[0].mounts[0].allowSensitiveHostPath: must be true or false, got 'yes'",
        ),
        # No runtime can make a mount point in a container's /sys (read-only sysfs).
        (
            "hostPath: /sys/kernel/config/tsm/report",
            "resources[0].mounts[0].containerPath: /sys/kernel/config/tsm/report is inside /sys, "
            "where container runtimes cannot make a mount point (a container's /sys is "
            "read-only sysfs), so the container would not start: give another path, e.g. "
            "/run/report",
        ),
        (
            "hostPath: /var/run/pcc, containerPath: /sys/pcc",
            "resources[0].mounts[0].containerPath: /sys/pcc is inside /sys, where",
        ),
    ],
)
def test_an_opt_in_must_be_needed_and_boolean_and_no_mount_lands_in_sys(
    tmp_path: Path, entry: str, message: str
) -> None:
    path = write(tmp_path, one_entry("mounts", entry))
    with pytest.raises(ProfileError, match=re.escape(f"{path}: {message}")):
        load(path)


@pytest.mark.parametrize(
    "host_path", ["/sys/kernel/config/tsm/report", "/sys/kernel/security/tpm0"]
)
def test_the_tsm_report_directory_and_a_tpms_event_log_need_no_opt_in(
    tmp_path: Path, host_path: str
) -> None:
    """Neither gives a container more than the TEE's guest device does (docs/profiles.md)."""
    entry = f"hostPath: {host_path}, containerPath: /run/x, readOnly: true"
    (spec,) = load(write(tmp_path, one_entry("mounts", entry))).specs
    assert spec.mounts == (HostMount(host_path, "/run/x", read_only=True),)


def test_a_block_device_may_opt_in_as_the_kernel_decides_when_it_is_there(
    tmp_path: Path,
) -> None:
    """The kernel says which block devices are the host's (tests/test_kernel.py); a character
    device that no path rule names cannot opt in."""
    (spec,) = load(
        write(
            tmp_path,
            one_entry("devices", "hostPath: /dev/sd*, type: block, allowSensitiveHostPath: true"),
        )
    ).specs
    assert spec.device_nodes == (DeviceNode("/dev/sd*", "", "rw", "block", allow_sensitive=True),)
    path = write(
        tmp_path, one_entry("devices", "hostPath: /dev/vfio/1, allowSensitiveHostPath: true")
    )
    with pytest.raises(
        ProfileError, match="hostPath is not a sensitive host path: remove the opt-in"
    ):
        load(path)


def test_only_on_names_hardware_the_kernel_tells(tmp_path: Path) -> None:
    for kind in ("sev-snp", "tdx", "tpm"):
        text = f"resources: [{{name: a.example.com/x, onlyOn: {kind}, mounts: [{{hostPath: /x}}]}}]"
        (spec,) = load(write(tmp_path, text)).specs
        assert spec.only_on == kind
    path = write(
        tmp_path, "resources: [{name: a.example.com/x, onlyOn: sgx, mounts: [{hostPath: /x}]}]"
    )
    with pytest.raises(
        ProfileError,
        match=re.escape(
            f"{path}: resources[0].onlyOn: must be one of sev-snp, tdx, tpm, got 'sgx'"
        ),
    ):
        load(path)


def test_paths_are_handed_out_normalised(tmp_path: Path) -> None:
    (spec,) = load(
        write(
            tmp_path,
            one_entry("mounts", "hostPath: //var/run/./pcc/, containerPath: /pcc/../run/pcc/"),
        )
    ).specs
    assert spec.mounts == (HostMount("/var/run/pcc", "/run/pcc"),)


async def test_each_opt_in_is_a_warning_at_start(
    fake_node: FakeNode, start_daemon: StartDaemon
) -> None:
    config = fake_node.root / "profiles.yaml"
    config.write_text(
        textwrap.dedent(
            """
            resources:
              - name: a.example.com/x
                devices:
                  - {hostPath: /dev/sev-guest}
                  - {hostPath: /dev/mem, allowSensitiveHostPath: true}
                mounts: [{hostPath: /var/lib/kubelet/pod-resources, allowSensitiveHostPath: true}]
              - name: b.example.com/y
                mounts: [{hostPath: /var/run/pcc}]
            """
        )
    )
    with trio.fail_after(20):
        daemon = start_daemon(*fake_node.daemon_args(verbosity=0), f"--config={config}")
        # Logged as each resource starts; the second resource's start comes after.
        await run_blocking(daemon.wait_for_log, "Starting pcc-device-plugin: b.example.com/y", 10.0)
    warnings = [line for line in daemon.log_text().splitlines() if "allowSensitiveHostPath" in line]
    assert [line[0] for line in warnings] == ["W", "W"]
    assert [line.split("] ", 1)[1] for line in warnings] == [
        "a.example.com/x: /dev/mem is the host's physical memory; containers get it: "
        "its entry sets allowSensitiveHostPath",
        "a.example.com/x: /var/lib/kubelet/pod-resources is inside /var/lib/kubelet "
        "(kubelet's state, with every pod's volumes and secrets); containers get it: "
        "its entry sets allowSensitiveHostPath",
    ]


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

        served = ("tke.cloud.tencent.com/pcc-device", "example.com/disk")

        def both_registered() -> bool:
            names = {r.resource_name for r in kubelet.registrations if r.accepted}
            return names == set(served) and all(kubelet.stream_open(name) for name in served)

        # The one whose device is missing waits for it; the others are served meanwhile.
        await log_line(daemon, "example.com/absent: waiting for ")
        await run_blocking(kubelet.wait_for, both_registered, 10.0)
        assert kubelet.devices("tke.cloud.tencent.com/pcc-device") == {
            f"pcc-{i}": "Healthy" for i in range(4)
        }
        assert kubelet.devices("example.com/disk") == {"vda-0": "Healthy"}
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
        assert specs == ["example.com-disk.json", "tke.cloud.tencent.com-pcc-device.json"]
        (fake_node.host_root / "dev" / "not-here").symlink_to("/dev/null")
        await run_blocking(
            kubelet.wait_for,
            lambda: kubelet.devices("example.com/absent") == {"absent-0": "Healthy",
                                                               "absent-1": "Healthy"},
            10.0,
        )  # fmt: skip
        specs = sorted(p.name for p in cdi_dir.iterdir())
        assert "example.com-absent.json" in specs
        assert await run_blocking(daemon.terminate) == 0
        # Containers restarting while the plugin is away still need the specs.
        assert sorted(p.name for p in cdi_dir.iterdir()) == specs


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        pytest.param(
            b"resources: [{name: x}]\n",
            "resources[0].name: 'x' would be rejected by kubelet: needs the form domain/name, "
            "e.g. example.com/device",
            id="bad name",
        ),
        pytest.param(
            "resources: []\n".encode("utf-16"),
            "is UTF-16 or UTF-32 (it starts with a byte-order mark); save it as UTF-8",
            id="UTF-16",
        ),
        pytest.param(
            b"resources:\n  - name: \xff\n",
            "is not UTF-8: byte 0xff at line 2, column 11; save it as UTF-8",
            id="not UTF-8",
        ),
        pytest.param(
            b'resources: [{name: a.b/c, devices: [{hostPath: "/dev/x\\0"}]}]\n',
            "resources[0].devices[0].hostPath: contains a NUL character",
            id="NUL",
        ),
        pytest.param(
            b"resources:\n  - name: a.com/x\n    name: b.com/y\n    mounts: [{hostPath: /m}]\n",
            "resources[0].name: duplicate key at line 3 (first at line 2)",
            id="duplicate key",
        ),
        pytest.param(
            b"a: &a x\nb: [" + b", ".join([b"*a"] * 30_000) + b"]\n",
            f"at line 2, column {5 + 4 * MAX_ALIASES}: more than {MAX_ALIASES} aliases",
            id="aliases",
        ),
        pytest.param(
            b"resources: [{name: a.b/c, mounts: [{hostPath: /var/run}]}]\n",
            "resources[0].mounts[0].hostPath: /var/run holds /var/run/containerd (containerd's "
            "socket directory, root on the node): refused unless this entry sets "
            "allowSensitiveHostPath: true",
            id="sensitive mount",
        ),
        pytest.param(
            b"#" * (MAX_BYTES + 1),
            f"is larger than {MAX_BYTES // 1024} KiB, the most it may be",
            id="too large",
        ),
    ],
)
async def test_a_bad_config_is_a_usage_error_of_one_line(
    fake_node: FakeNode, start_daemon: StartDaemon, data: bytes, problem: str
) -> None:
    config = fake_node.root / "profiles.yaml"
    config.write_bytes(data)
    with trio.fail_after(20):
        daemon = start_daemon(*fake_node.daemon_args(), f"--config={config}")
        assert await run_blocking(daemon.exited, 15) == 2
    # One pointer to the keys' rules, at the end: a message of its own would say it twice.
    assert daemon.log_text() == f"pcc-device-plugin: {config}: {problem} (see docs/profiles.md)\n"
    assert daemon.log_text().count("docs/profiles.md") == 1
