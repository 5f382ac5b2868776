"""The command line, for the daemon and the doctor alike: flags as the Go plugins spell them.

Each flag is written once, as a field of `Flags`: its default, its help and its
check. Usage errors are one line, `<prog>: --flag: problem (see --help)`, and
exit 2.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import attrs

from pcc_plugin import __version__
from pcc_plugin.kernel import TSM_REPORT
from pcc_plugin.resource import (
    CONTAINER_TSM_REPORT,
    DNS1123_SUBDOMAIN,
    MAX_RESOURCE_COUNT,
    ResourceSpec,
    pcc_resource,
    resource_name_problem,
)
from pcc_plugin.sensitive import device_hazard, mount_hazard, normalised

PROG = "pcc-device-plugin"
# The DaemonSet's name in manifests/, which passes it from the pod label app.kubernetes.io/instance.
DEFAULT_INSTANCE_NAME = PROG
# Printed by `--version --v=1`: what a bug report needs besides our own version.
STACK = ("trio", "grpclib", "betterproto2", "asyncinotify", "attrs")
# A unix socket path holds at most 107 bytes; our socket names take up to 51
# (`<prefix of up to 20>-<pid>-<token>-<n>.sock`).
MAX_PLUGIN_DIR_BYTES = 56
MODES = ("device-plugin", "dra")
DEFAULT_MODE = "device-plugin"
DEFAULT_DRIVER_NAME = "pcc.tke.cloud.tencent.com"
# Room for `<driver>-<token>-reg.sock` in a unix socket path (107 bytes; dra.sockets
# shortens the token when a path would be longer).
MAX_KUBELET_DIR_BYTES = 48
# A DRA device taint's effects that keep new claims off a device (the first) and evict the pods
# using it too (the second); `None` would leave it allocatable.
TAINT_EFFECTS = ("NoSchedule", "NoExecute")


# A Kubernetes label value that is not empty: the manifests pass one.
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")


class UsageError(ValueError):
    """A flag value that cannot work; the message starts with the flag's name."""


Check = Callable[[Any], str | None]


def _flag(
    name: str,
    default: Any,
    help: str,
    *,
    metavar: str | None = None,
    check: Check = lambda _: None,
    shown: str | None = None,
) -> Any:
    def validate(_: object, __: attrs.Attribute[Any], value: Any) -> None:
        problem = check(value)
        if problem:
            raise UsageError(f"{name}: {problem}")

    return attrs.field(
        default=default,
        validator=validate,
        metadata={"flag": name, "help": help, "metavar": metavar, "shown": shown},
    )


def _unless(problem: str, test: Callable[[Any], object]) -> Check:
    """The problem (its `{value!r}` filled in) for a value that fails `test`."""
    return lambda value: None if test(value) else problem.format(value=value)


_absolute = _unless("must be an absolute path, got {value!r}", lambda value: value[:1] == "/")


def _host_path(hazard: Callable[[str], str | None]) -> Check:
    """An absolute path that is not a sensitive host path (flags have no opt-in)."""

    def check(value: str) -> str | None:
        danger = hazard(normalised(value))
        refused = f"{danger}: refusing to hand it to containers" if danger else None
        return _absolute(value) or refused

    return check


def _socket_dir(limit: int) -> Check:
    """An absolute directory short enough for the socket paths made in it."""

    def check(value: str) -> str | None:
        size = len(value.encode())
        too_long = f"is too long for unix sockets: {size} bytes, at most {limit}"
        return too_long if size > limit else _absolute(value)

    return check


def _instance_name(value: str) -> str | None:
    if not value:
        return (
            "must not be empty: the manifests pass the pod label app.kubernetes.io/instance, "
            "set it in the pod template"
        )
    if len(value) <= 63 and _LABEL_VALUE.fullmatch(value):
        return None
    return (
        f"must be 1-63 letters, digits, '-', '_' or '.', starting and ending with a letter or "
        f"digit, as a Kubernetes label value is, got {value!r}"
    )


def _is_bind_address(value: str) -> bool:
    _, colon, port = value.rpartition(":")
    return not value or (bool(colon) and port.isdigit() and int(port) <= 65535)


_resource_count = _unless(
    f"must be from 1 to {MAX_RESOURCE_COUNT}, got {{value}}", lambda v: 1 <= v <= MAX_RESOURCE_COUNT
)
_host_root = _unless("must be empty or an absolute path, got {value!r}", lambda v: v[:1] in "/")
_bind_address = _unless("must be host:port, :port or empty, got {value!r}", _is_bind_address)
_mode = _unless(f"must be {' or '.join(MODES)}, got {{value!r}}", lambda v: v in ("", *MODES))
_taint_effect = _unless(
    f"must be {' or '.join(TAINT_EFFECTS)}, got {{value!r}}", lambda v: v in TAINT_EFFECTS
)
_pod_uid = _unless(
    "must be a pod UID (lowercase hex and '-'), got {value!r}",
    lambda v: not v or re.fullmatch(r"[0-9a-f][0-9a-f-]{0,62}", v),
)
# Kubernetes checks a DRA driver name as a DNS subdomain of at most 63 characters.
_driver_name = _unless(
    "must be a lowercase DNS subdomain with a dot, at most 63 characters, "
    f"e.g. {DEFAULT_DRIVER_NAME}, got {{value!r}}",
    lambda v: len(v) <= 63 and "." in v and DNS1123_SUBDOMAIN.fullmatch(v),
)


def _resource_name(value: str) -> str | None:
    problem = resource_name_problem(value)
    return f"{value!r} would be rejected by kubelet: {problem}" if problem else None


@attrs.frozen
class Flags:
    """Every flag, validated; constructing one with a bad value raises UsageError."""

    pcc_device: str = _flag(
        "--pcc-device", "/dev/sev-guest",
        "host device node, given to containers as /dev/sev-guest",
        metavar="PATH", check=_host_path(device_hazard),
    )  # fmt: skip
    pcc_socket_path: str = _flag(
        "--pcc-socket-path", "/var/run/pcc",
        "host PCC socket directory, mounted read-write at /var/run/pcc",
        metavar="DIR", check=_host_path(mount_hazard),
    )  # fmt: skip
    tsm_report: bool = _flag(
        "--tsm-report", False,
        f"also give containers the kernel's TSM attestation-report interface (configfs-tsm, "
        f"Linux 6.7+): the host's {TSM_REPORT}, read-write at {CONTAINER_TSM_REPORT}",
    )  # fmt: skip
    resource_name: str = _flag(
        "--resource-name", "tke.cloud.tencent.com/pcc-device",
        "extended resource registered with kubelet",
        metavar="NAME", check=_resource_name,
    )  # fmt: skip
    resource_count: int = _flag(
        "--resource-count", 16,
        "shares advertised, i.e. how many containers may use the device at once, "
        f"1 to {MAX_RESOURCE_COUNT}",
        metavar="N", check=_resource_count,
    )  # fmt: skip
    device_plugin_path: str = _flag(
        "--device-plugin-path", "/var/lib/kubelet/device-plugins",
        "kubelet's device-plugin socket directory; waited for if missing",
        metavar="DIR", check=_socket_dir(MAX_PLUGIN_DIR_BYTES),
    )  # fmt: skip
    host_root: str = _flag(
        "--host-root", "",
        "where the host's filesystem is mounted in this container; the device and PCC "
        "directory are checked under it, kubelet is given the host paths",
        metavar="DIR", check=_host_root,
    )  # fmt: skip
    metrics_bind_address: str = _flag(
        "--metrics-bind-address", ":8080",
        "where to serve /metrics, /livez and /readyz: host:port, :port for every address, "
        "or empty to serve nothing",
        metavar="ADDRESS", check=_bind_address,
    )  # fmt: skip
    pre_start_check: bool = _flag(
        "--pre-start-check", False,
        "ask kubelet to call PreStartContainer and check the device and PCC directory "
        "again before each container starts",
    )  # fmt: skip
    exit_if_missing: bool = _flag(
        "--exit-if-missing", False,
        "exit 1 at start if the device or the PCC directory (with --config: any resource's "
        "device node or mount source) is missing, so that kubelet restarts the daemon with its "
        "back-off; without it the daemon waits for them and serves once they are in place",
    )  # fmt: skip
    config: str = _flag(
        "--config", "",
        "YAML file of resources to serve instead of the PCC profile above "
        "(see docs/profiles.md)",
        metavar="FILE",
    )  # fmt: skip
    cdi: bool = _flag(
        "--cdi", False,
        "also write a CDI spec per resource and name CDI devices in Allocate answers",
    )  # fmt: skip
    cdi_spec_dir: str = _flag(
        "--cdi-spec-dir", "/var/run/cdi", "where CDI specs are written",
        metavar="DIR", check=_absolute,
    )  # fmt: skip
    instance_name: str = _flag(
        "--instance-name", DEFAULT_INSTANCE_NAME,
        "this instance's name, written into its CDI specs: it rewrites and removes only "
        "specs of its own name, so instances sharing --cdi-spec-dir need different names "
        "(the manifests pass the pod label app.kubernetes.io/instance)",
        metavar="NAME", check=_instance_name,
    )  # fmt: skip
    mode: str = _flag(
        "--mode", "",
        "device-plugin: serve kubelet's device plugin API (extended resource --resource-name); "
        "dra: be the DRA driver --driver-name instead (docs/dra.md). One mode per node",
        metavar="MODE", check=_mode, shown=f"{DEFAULT_MODE}, or the --config file's mode",
    )  # fmt: skip
    driver_name: str = _flag(
        "--driver-name", DEFAULT_DRIVER_NAME,
        "with --mode=dra: the DRA driver name, in ResourceSlices, claims and DeviceClasses",
        metavar="NAME", check=_driver_name,
    )  # fmt: skip
    node_name: str = _flag(
        "--node-name", "",
        "with --mode=dra: this node's name, the pool of its ResourceSlices (the manifests pass "
        "spec.nodeName); required there",
        metavar="NAME",
    )  # fmt: skip
    kubelet_registry_path: str = _flag(
        "--kubelet-registry-path", "/var/lib/kubelet/plugins_registry",
        "with --mode=dra: kubelet's plugin registration directory; waited for if missing",
        metavar="DIR", check=_socket_dir(MAX_KUBELET_DIR_BYTES),
    )  # fmt: skip
    kubelet_plugins_path: str = _flag(
        "--kubelet-plugins-path", "/var/lib/kubelet/plugins",
        "with --mode=dra: kubelet's plugin directory; the DRA socket and the checkpoint of "
        "prepared claims go in <DIR>/<driver-name>",
        metavar="DIR", check=_socket_dir(MAX_KUBELET_DIR_BYTES),
    )  # fmt: skip
    kubeconfig: str = _flag(
        "--kubeconfig", "",
        "with --mode=dra: a kubeconfig file for the API server; without it, the pod's "
        "service account (in-cluster)",
        metavar="FILE",
    )  # fmt: skip
    pod_uid: str = _flag(
        "--pod-uid", "",
        "with --mode=dra: this pod's UID (the manifests pass metadata.uid), which makes this "
        "instance's socket names its own during a rolling update; without it, a random token",
        metavar="UID", check=_pod_uid,
    )  # fmt: skip
    unhealthy_taint_effect: str = _flag(
        "--unhealthy-taint-effect", TAINT_EFFECTS[0],
        "with --mode=dra, where the API server serves device taints: the effect of the taint "
        "an unhealthy device gets, NoSchedule (no new claim gets it) or NoExecute (the pods "
        "using it are evicted too); without taints it is withdrawn from the ResourceSlices",
        metavar="EFFECT", check=_taint_effect,
    )  # fmt: skip
    verbosity: int = _flag(
        "--v", 0,
        "log verbosity: 0 registrations and errors, 1 each Allocate and registration step, "
        "2 debug and gRPC internals",
        metavar="LEVEL", check=_unless("must be at least 0, got {value}", lambda v: v >= 0),
    )  # fmt: skip

    def pcc_resource(self) -> ResourceSpec:
        """The resource these flags describe (served unless --config names a file)."""
        return pcc_resource(
            self.resource_name,
            self.resource_count,
            normalised(self.pcc_device),
            normalised(self.pcc_socket_path),
            self.tsm_report,
        )


FLAG_NAMES = tuple(field.metadata["flag"] for field in attrs.fields(Flags))
_KNOWN = (*FLAG_NAMES, "--help", "--version")


def usage_error(prog: str, message: str, see: str = "--help") -> NoReturn:
    print(f"{prog}: {message} (see {see})", file=sys.stderr)
    sys.exit(2)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse says "argument --x: problem"; every other usage error says "--x: problem".
        usage_error(self.prog, message.removeprefix("argument "))


def go_style(argv: Sequence[str]) -> list[str]:
    """Accept Go's single-dash spelling of our flags (`-v=1`, `-resource-count 8`)."""
    known = {name.removeprefix("--") for name in _KNOWN}
    normalised: list[str] = []
    for index, arg in enumerate(argv):
        if arg == "--":
            return normalised + list(argv[index:])
        if arg.startswith("-") and not arg.startswith("--") and arg[1:].split("=", 1)[0] in known:
            arg = "-" + arg
        normalised.append(arg)
    return normalised


def _whole_number(text: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None


def build_parser(prog: str, description: str, epilog: str) -> argparse.ArgumentParser:
    parser = _Parser(prog=prog, allow_abbrev=False, description=description, epilog=epilog)
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    for field in attrs.fields(Flags):
        name, help_text = field.metadata["flag"], field.metadata["help"]
        if field.default is False:
            parser.add_argument(name, action="store_true", help=f"{help_text} (default: off)")
            continue
        shown = field.metadata["shown"] or (field.default if field.default != "" else "none")
        parser.add_argument(
            name,
            dest=field.name,
            default=field.default,
            type=_whole_number if isinstance(field.default, int) else str,
            metavar=field.metadata["metavar"],
            help=f"{help_text} (default: {shown})",
        )
    return parser


def unexpected(arg: str) -> str:
    """The usage error for an argument that no flag takes, in the form every other one has."""
    name = arg.split("=", 1)[0]
    # A known flag is left over only when it came after "--", as an argument.
    if not arg.startswith("-") or arg == "-" or name in _KNOWN:
        return f"{arg}: unexpected argument: everything is given by a flag"
    import difflib

    close = difflib.get_close_matches("--" + name.lstrip("-"), _KNOWN, n=1)
    return f"{name}: unknown flag" + (f"; did you mean {close[0]}?" if close else "")


def parse(argv: Sequence[str], prog: str, description: str, epilog: str) -> tuple[Flags, bool]:
    """The flags, and whether --version was asked for; usage errors exit 2."""
    known, rest = build_parser(prog, description, epilog).parse_known_args(go_style(argv))
    rest = [arg for arg in rest if arg != "--"]
    if rest:
        usage_error(prog, unexpected(rest[0]))
    args = vars(known)
    wants_version = args.pop("version")
    try:
        return Flags(**args), wants_version
    except UsageError as exc:
        usage_error(prog, str(exc))


def version_text(verbosity: int) -> str:
    """`pcc-device-plugin <version>`; at --v=1 and above, the versions of the stack too."""
    text = f"{PROG} {__version__}"
    if verbosity >= 1:
        from importlib.metadata import version

        stack = ", ".join(f"{name} {version(name)}" for name in STACK)
        text += f" (Python {sys.version.split()[0]}; {stack})"
    return text
