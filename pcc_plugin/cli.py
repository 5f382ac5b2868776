"""Command line: flags as the Go plugins spell them, one-line errors, exit codes.

Exit codes: 0 after SIGTERM/SIGINT; 1 when the device or PCC directory is not
there or the daemon cannot go on; 2 for usage errors; 128+N when a second
signal N forces the exit.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from pcc_plugin import klog
from pcc_plugin.config import (
    DEFAULT_RESOURCE_COUNT,
    DEFAULT_RESOURCE_NAME,
    MAX_RESOURCE_COUNT,
    Config,
    ConfigError,
)
from pcc_plugin.resources import ResourceSpec, health_problem, pcc_resource

log = logging.getLogger("pcc_plugin")

PROG = "pcc-device-plugin"
_FLAGS = (
    "pcc-device",
    "pcc-socket-path",
    "resource-name",
    "resource-count",
    "device-plugin-path",
    "host-root",
    "v",
    "metrics-bind-address",
    "pre-start-check",
    "config",
    "cdi",
    "cdi-spec-dir",
    "help",
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        usage_error(message)


def usage_error(message: str) -> NoReturn:
    print(f"{PROG}: {message} (see --help)", file=sys.stderr)
    sys.exit(2)


def _whole_number(minimum: int) -> type[int]:
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse  # type: ignore[return-value]


def go_style(argv: Sequence[str]) -> list[str]:
    """Accept Go's single-dash spelling of our flags (`-v=1`, `-resource-count 8`)."""
    normalised: list[str] = []
    for index, arg in enumerate(argv):
        if arg == "--":
            return normalised + list(argv[index:])
        if arg.startswith("-") and not arg.startswith("--") and arg[1:].split("=", 1)[0] in _FLAGS:
            arg = "-" + arg
        normalised.append(arg)
    return normalised


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        allow_abbrev=False,
        description=(
            "Kubernetes device plugin for AMD SEV-SNP nodes: advertises shares of the "
            "guest device and gives each container the device and the PCC socket directory."
        ),
        epilog=(
            "`pcc-device-plugin doctor [flags]` checks a node with the same flags. "
            "Flags also take Go's single-dash spelling (-v=1, -resource-count 8). "
            "Exit codes: 0 stopped by SIGTERM/SIGINT; 1 device or PCC directory missing, "
            "or a fatal error; 2 usage error; 130/143 forced by a second signal."
        ),
    )
    add = parser.add_argument
    add(
        "--pcc-device",
        default="/dev/sev-guest",
        metavar="PATH",
        help="host device node, given to containers as /dev/sev-guest (default: %(default)s)",
    )
    add(
        "--pcc-socket-path",
        default="/var/run/pcc",
        metavar="DIR",
        help="host PCC socket directory, mounted read-write at /var/run/pcc (default: %(default)s)",
    )
    add(
        "--resource-name",
        default=DEFAULT_RESOURCE_NAME,
        metavar="NAME",
        help="extended resource registered with kubelet (default: %(default)s)",
    )
    add(
        "--resource-count",
        default=DEFAULT_RESOURCE_COUNT,
        type=_whole_number(1),
        metavar="N",
        help="shares advertised, i.e. how many containers may use the device at once, "
        f"1 to {MAX_RESOURCE_COUNT} (default: %(default)s)",
    )
    add(
        "--device-plugin-path",
        default="/var/lib/kubelet/device-plugins",
        metavar="DIR",
        help="kubelet's device-plugin socket directory; waited for if missing "
        "(default: %(default)s)",
    )
    add(
        "--host-root",
        default="",
        metavar="DIR",
        help="where the host's filesystem is mounted in this container; the device and "
        "PCC directory are checked under it, kubelet is given the host paths "
        "(default: none)",
    )
    add(
        "--metrics-bind-address",
        default=":8080",
        metavar="ADDRESS",
        help="where to serve /metrics, /livez and /readyz: host:port, :port for every "
        "address, or empty to serve nothing (default: %(default)s)",
    )
    add(
        "--pre-start-check",
        action="store_true",
        help="ask kubelet to call PreStartContainer and check the device and PCC directory "
        "again before each container starts (default: off)",
    )
    add(
        "--config",
        default="",
        metavar="FILE",
        help="YAML file of resources to serve instead of the PCC profile above "
        "(see docs/profiles.md)",
    )
    add(
        "--cdi",
        action="store_true",
        help="also write a CDI spec per resource and name CDI devices in Allocate answers "
        "(default: off)",
    )
    add(
        "--cdi-spec-dir",
        default="/var/run/cdi",
        metavar="DIR",
        help="where CDI specs are written (default: %(default)s)",
    )
    add("--v", default=0, type=_whole_number(0), metavar="LEVEL", dest="verbosity",
        help="log verbosity: 0 registrations and errors, 1 each Allocate and registration "
             "step, 2 debug and gRPC internals (default: %(default)s)")  # fmt: skip
    return parser


def parse_config(argv: Sequence[str]) -> Config:
    args = build_parser().parse_args(go_style(argv))
    try:
        return Config(**vars(args))
    except ConfigError as exc:
        usage_error(str(exc))


def load_specs(config: Config) -> list[ResourceSpec]:
    """The resources to serve: the file's with --config, else the PCC profile from the flags."""
    if not config.config:
        return [pcc_resource(config)]
    # Imported only now: the YAML parser is not needed without --config.
    from pcc_plugin import profiles

    try:
        return profiles.load(config.config)
    except ConfigError as exc:
        usage_error(str(exc))


def main(argv: Sequence[str] | None = None) -> NoReturn:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "doctor":
        from pcc_plugin import doctor

        doctor.main(argv[1:])
    config = parse_config(argv)
    klog.configure(config.verbosity)
    specs = load_specs(config)
    if not config.config:
        problem = health_problem(specs[0], config.host_root)
        if problem:
            log.error("%s", problem)
            sys.exit(1)
    # Imported only now: `--help` and usage errors stay fast.
    import trio

    from pcc_plugin import supervisor
    from pcc_plugin.watch import FatalError

    try:
        trio.run(supervisor.run, config, specs)
    except* FatalError as group:
        for error in _leaves(group):
            log.error("%s", error)
        sys.exit(1)
    sys.exit(0)


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    leaves: list[BaseException] = []
    for exc in group.exceptions:
        leaves.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return leaves
