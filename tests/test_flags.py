"""Flags, usage errors, detection: what an operator types and reads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pcc_plugin import main
from pcc_plugin.flags import Flags, build_parser, go_style, parse
from pcc_plugin.resource import MAX_RESOURCE_COUNT, resource_name_problem, shared_problem


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pcc_plugin", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def parse_config(argv: list[str]) -> Flags:
    flags, wants_version = parse(argv, "pcc-device-plugin", main.DESCRIPTION, main.EPILOG)
    assert not wants_version
    return flags


def test_defaults() -> None:
    assert parse_config([]) == Flags(
        pcc_device="/dev/sev-guest",
        pcc_socket_path="/var/run/pcc",
        resource_name="tke.cloud.tencent.com/pcc-device",
        resource_count=16,
        device_plugin_path="/var/lib/kubelet/device-plugins",
        host_root="",
        verbosity=0,
        metrics_bind_address=":8080",
        pre_start_check=False,
        config="",
        cdi=False,
        cdi_spec_dir="/var/run/cdi",
        instance_name="pcc-device-plugin",
        mode="",
        driver_name="pcc.tke.cloud.tencent.com",
        node_name="",
        kubelet_registry_path="/var/lib/kubelet/plugins_registry",
        kubelet_plugins_path="/var/lib/kubelet/plugins",
        kubeconfig="",
        pod_uid="",
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--resource-count=8", "--v=1"],
        ["--resource-count", "8", "--v", "1"],
        ["-resource-count", "8", "-v=1"],
        ["-resource-count=8", "-v", "1"],
    ],
)
def test_go_and_gnu_spellings_agree(argv: list[str]) -> None:
    config = parse_config(argv)
    assert (config.resource_count, config.verbosity) == (8, 1)


def test_go_style_leaves_values_and_unknown_flags_alone() -> None:
    assert go_style(["-resource-name", "-x", "-bogus", "--", "-v"]) == [
        "--resource-name",
        "-x",
        "-bogus",
        "--",
        "-v",
    ]


def test_every_flag_is_documented() -> None:
    help_text = build_parser("pcc-device-plugin", "", "").format_help()
    for flag in (
        "--pcc-device",
        "--pcc-socket-path",
        "--resource-name",
        "--resource-count",
        "--device-plugin-path",
        "--host-root",
        "--v",
        "--metrics-bind-address",
        "--pre-start-check",
    ):
        assert flag in help_text


def test_largest_resource_count_is_accepted() -> None:
    assert parse_config([f"--resource-count={MAX_RESOURCE_COUNT}"]).resource_count == 10_000


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--resource-count=0"], "--resource-count: must be from 1 to 10000, got 0"),
        (["--resource-count=-3"], "--resource-count: must be from 1 to 10000, got -3"),
        (["--resource-count=ten"], "--resource-count: must be a whole number, got 'ten'"),
        (["--resource-count=1.5"], "--resource-count: must be a whole number, got '1.5'"),
        (["--resource-count=10001"], "--resource-count: must be from 1 to 10000, got 10001"),
        (["--resource-name=pcc-device"], "needs the form domain/name"),
        (["--resource-name=kubernetes.io/pcc"], "kubernetes.io domain is reserved"),
        (["--resource-name=requests.example.com/pcc"], "must not start with 'requests.'"),
        (["--resource-name=Example.com/pcc"], "is not a lowercase DNS subdomain"),
        (["--resource-name=example.com/-pcc"], "must be 1-63 characters"),
        (["--pcc-device=dev/sev-guest"], "--pcc-device: must be an absolute path"),
        (
            ["--pcc-device=//dev/./mem"],
            "--pcc-device: /dev/mem is the host's physical memory: refusing to hand it to "
            "containers",
        ),
        (["--pcc-device=/dev/port"], "--pcc-device: /dev/port is the host's I/O ports"),
        (["--pcc-socket-path=/"], "--pcc-socket-path: / is the host's whole filesystem"),
        (
            ["--pcc-socket-path=/var/run/pcc/../"],
            "--pcc-socket-path: /var/run holds /var/run/containerd (containerd's socket",
        ),
        (
            ["--pcc-socket-path=/etc/pcc/"],
            "--pcc-socket-path: /etc/pcc is inside /etc (the host's configuration",
        ),
        (["--host-root=host"], "--host-root: must be empty or an absolute path"),
        (
            ["--instance-name="],
            "--instance-name: must not be empty: the manifests pass the pod label "
            "app.kubernetes.io/instance, set it in the pod template",
        ),
        (
            ["--instance-name=a b"],
            "--instance-name: must be 1-63 letters, digits, '-', '_' or '.', starting and "
            "ending with a letter or digit, as a Kubernetes label value is, got 'a b'",
        ),
        (["--instance-name=" + "a" * 64], "--instance-name: must be 1-63 letters"),
        (["--device-plugin-path=/" + "d" * 80], "--device-plugin-path: is too long"),
        (["--v=-1"], "--v: must be at least 0, got -1"),
        (["--metrics-bind-address=8080"], "--metrics-bind-address: must be host:port"),
        (["--metrics-bind-address=:http"], "--metrics-bind-address: must be host:port"),
        (["--bogus"], "pcc-device-plugin: --bogus: unknown flag (see --help)"),
        (["-bogus=1", "--v=1"], "pcc-device-plugin: -bogus: unknown flag (see --help)"),
        (["--pcc-dev=/dev/x"], "--pcc-dev: unknown flag; did you mean --pcc-device? (see --help)"),
        (["--v=1", "extra"], "extra: unexpected argument: everything is given by a flag"),
        (["--", "--v=1"], "--v=1: unexpected argument: everything is given by a flag"),
        (["--resource-count"], "--resource-count: expected one argument"),
    ],
)
def test_usage_errors_are_one_line_exit_2(argv: list[str], expected: str) -> None:
    result = run_cli(*argv)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("pcc-device-plugin: ")
    assert expected in lines[0]
    assert "Traceback" not in result.stderr


def test_help_exits_0() -> None:
    result = run_cli("-help")
    assert result.returncode == 0
    assert "--resource-count" in result.stdout


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("tke.cloud.tencent.com/pcc-device", None),
        ("example.com/a_b.c", None),
        ("example.com/" + "x" * 63, None),
        ("example.com/" + "x" * 64, "must be 1-63 characters"),
        ("sub.kubernetes.io/x", "reserved"),
        ("example.com/a/b", "more than one '/'"),
        ("/x", "is not a lowercase DNS subdomain"),
    ],
)
def test_resource_names_as_kubelet_checks_them(name: str, problem: str | None) -> None:
    found = resource_name_problem(name)
    if problem is None:
        assert found is None
    else:
        assert found is not None
        assert problem in found


def detect(host: Path) -> str | None:
    problem = shared_problem(Flags().pcc_resource(), str(host))
    return problem.text if problem else None


def test_detect_accepts_a_character_device_and_a_directory(host: Path) -> None:
    assert detect(host) is None


def test_detect_missing_device(host: Path) -> None:
    (host / "dev" / "sev-guest").unlink()
    assert detect(host) == (f"detect device {host}/dev/sev-guest failed: No such file or directory")


def test_detect_device_that_is_not_a_character_device(host: Path) -> None:
    (host / "dev" / "sev-guest").unlink()
    (host / "dev" / "sev-guest").write_text("")
    assert detect(host) == (f"detect device {host}/dev/sev-guest failed: not a character device")


def test_detect_missing_socket_dir(host: Path) -> None:
    os.rmdir(host / "var" / "run" / "pcc")
    assert detect(host) == (
        f"detect socket path {host}/var/run/pcc failed: No such file or directory"
    )


def test_detect_socket_path_that_is_a_file(host: Path) -> None:
    os.rmdir(host / "var" / "run" / "pcc")
    (host / "var" / "run" / "pcc").write_text("")
    assert detect(host) == (f"detect socket path {host}/var/run/pcc failed: not a directory")
