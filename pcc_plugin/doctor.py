"""`pcc-device-plugin doctor`: the troubleshooting table, run as checks against this node.

Given the daemon's flags, it checks what the daemon needs and what kubelet sees: the
device nodes and directories (under --host-root), kubelet's socket directory,
kubelet.sock, the daemon's own socket and /readyz. It prints one line per check,
PASS, FAIL (with the fix) or SKIP (not applicable, or waiting on a failed check),
and exits 0 only when nothing failed.

It changes nothing: kubelet gets no Register (that would replace the daemon's
registration), only a call to a method it does not serve; the daemon gets the
calls kubelet makes, and a ListAndWatch stream that ends after its first message.
"""

from __future__ import annotations

import collections
import glob
import os
import re
import stat
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal, NoReturn

import attrs
import trio

from pcc_plugin import bridge, cli, klog
from pcc_plugin.config import KUBELET_SOCKET, Config, ConfigError
from pcc_plugin.resources import (
    DeviceNode,
    DeviceType,
    HostMount,
    ResourceSpec,
    seen_from_here,
)
from pcc_plugin.watch import connect_error

# Each network check gives up after this long.
CHECK_TIMEOUT = 5.0
# Kubelet serves Register only on this service, so this answers UNIMPLEMENTED.
KUBELET_PROBE = "/v1beta1.Registration/PccDoctorProbe"
MAX_HTTP_RESPONSE = 65536

_DEVICE_WORDS: dict[DeviceType, str] = {"char": "a character device", "block": "a block device"}
_AS_ROOT = "run the doctor as root, as the daemon runs"
_KUBELET_CREATES_IT = (
    "kubelet creates it at start: check that kubelet runs (systemctl status kubelet) "
    "and that --device-plugin-path is <kubelet's --root-dir>/device-plugins"
)
_DAEMON_LOG = "kubectl -n kube-system logs <the plugin's pod on this node>"


@attrs.frozen
class Result:
    status: Literal["PASS", "FAIL", "SKIP"]
    check: str
    detail: str
    fix: str = ""

    def line(self) -> str:
        text = f"{self.status}  {self.check}: {self.detail}"
        return f"{text}; fix: {self.fix}" if self.fix else text


def passed(check: str, detail: str) -> Result:
    return Result("PASS", check, detail)


def failed(check: str, detail: str, fix: str) -> Result:
    return Result("FAIL", check, detail, fix)


def skipped(check: str, detail: str) -> Result:
    return Result("SKIP", check, detail)


def _kind(mode: int) -> str:
    for test, word in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISFIFO, "a FIFO"),
    ):
        if test(mode):
            return word
    return "an unknown kind of file"


def _expect_kind(
    check: str, path: str | Path, wanted: str, missing_fix: str, wrong_fix: str
) -> Result | None:
    """A FAIL when `path` is missing, cannot be looked at, or is not `wanted`; else None."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return failed(check, f"{path} does not exist", missing_fix)
    except OSError as exc:
        return failed(check, f"cannot look at {path}: {exc.strerror}", _AS_ROOT)
    if _kind(mode) != wanted:
        return failed(check, f"{path} is {_kind(mode)}, not {wanted}", wrong_fix)
    return None


def _mounted_hint(host_root: str, host_path: str) -> str:
    if not host_root:
        return ""
    parent = os.path.dirname(host_path)
    return f"; with --host-root, the host's {parent} must be mounted at {host_root}{parent}"


def _is_within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


# Device nodes


def _glob_matches(node: DeviceNode, host_root: str) -> list[str]:
    matches = []
    for match in sorted(glob.glob(seen_from_here(host_root, node.host_path))):
        try:
            mode = os.stat(match).st_mode
        except OSError:
            continue
        if _kind(mode) == _DEVICE_WORDS[node.device_type]:
            matches.append(match)
    return matches


def check_device(node: DeviceNode, host_root: str) -> Result:
    check = f"device {node.host_path}"
    wanted = _DEVICE_WORDS[node.device_type]
    load_driver = (
        "load its driver on the host (for /dev/sev-guest: modprobe sev-guest, on an SEV-SNP "
        "guest kernel), or give the daemon and the doctor the right path"
    )
    if node.is_glob:
        matches = _glob_matches(node, host_root)
        if not matches:
            pattern = seen_from_here(host_root, node.host_path)
            return failed(
                check,
                f"nothing matching {pattern} is {wanted}",
                load_driver + _mounted_hint(host_root, node.host_path),
            )
        return passed(check, f"{len(matches)} match, each {wanted}: {', '.join(matches)}")
    path = seen_from_here(host_root, node.host_path)
    problem = _expect_kind(
        check,
        path,
        wanted,
        load_driver + _mounted_hint(host_root, node.host_path),
        f"something replaced the device node: remove {node.host_path} on the host and "
        "load its driver again (for /dev/sev-guest: modprobe -r sev-guest; modprobe sev-guest)",
    )
    return problem or passed(check, f"{path} is {wanted}")


# Directories mounted into containers


@attrs.frozen
class _Mount:
    """One line of /proc/self/mountinfo, as much as the writable check needs."""

    point: str
    read_only: bool
    fs_read_only: bool
    fs_type: str


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda octal: chr(int(octal.group(1), 8)), field)


def _mount_of(path: str) -> _Mount | None:
    """The mount that holds `path`: the deepest mount point above it, the last one on top."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as mountinfo:
            lines = mountinfo.read().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    found: _Mount | None = None
    for line in lines:
        fields = line.split(" ")
        # Optional fields end with "-", then come the type, the source, the fs options.
        separator = fields.index("-")
        point = _unescape(fields[4])
        if _is_within(target, point) and (found is None or len(point) >= len(found.point)):
            found = _Mount(
                point=point,
                read_only="ro" in fields[5].split(","),
                fs_read_only="ro" in fields[separator + 3].split(","),
                fs_type=fields[separator + 1],
            )
    return found


def _writable(check: str, mount: HostMount, path: str, host_root: str) -> Result:
    if os.access(path, os.W_OK | os.X_OK):
        return passed(check, f"{path} is a writable directory")
    where = _mount_of(path)
    if where is not None and where.fs_read_only:
        return failed(
            check,
            f"{path} is on a read-only filesystem ({where.fs_type} at {where.point})",
            f"remount that filesystem read-write on the host, or move {mount.host_path} "
            "to one that is",
        )
    if where is not None and where.read_only:
        if host_root and _is_within(where.point, host_root):
            # The pod sees the host through read-only mounts on purpose; kubelet
            # mounts the host's directory into containers read-write.
            return passed(
                check,
                f"{path} is a directory on a read-write filesystem "
                f"(read-only here only through this container's mount at {where.point})",
            )
        return failed(
            check,
            f"{path} is on a read-only mount at {where.point}",
            f"remount it read-write (mount -o remount,bind,rw {where.point})",
        )
    mode = stat.S_IMODE(os.stat(path).st_mode)
    return failed(
        check,
        f"{path} (mode {mode:04o}) is not writable for uid {os.geteuid()}",
        f"give its owner write permission on the host (chmod u+w {mount.host_path}); " + _AS_ROOT,
    )


def check_mount(mount: HostMount, host_root: str) -> Result:
    check = f"{mount.label} {mount.host_path}"
    path = seen_from_here(host_root, mount.host_path)
    problem = _expect_kind(
        check,
        path,
        "a directory",
        f"create it on the host (mkdir -p {mount.host_path}; the service that owns it "
        "usually does at start), or give the daemon and the doctor the right path"
        + _mounted_hint(host_root, mount.host_path),
        f"make {mount.host_path} a directory on the host",
    )
    if problem:
        return problem
    if mount.read_only:
        return passed(check, f"{path} is a directory")
    return _writable(check, mount, path, host_root)


# Kubelet's socket directory, kubelet, the daemon


def check_plugin_dir(plugin_dir: Path) -> Result:
    check = "device-plugin dir"
    problem = _expect_kind(
        check,
        plugin_dir,
        "a directory",
        f"{_KUBELET_CREATES_IT}, mounted from the host when the doctor runs in the pod",
        f"remove it and restart kubelet, which creates the directory (rm {plugin_dir}; "
        "systemctl restart kubelet)",
    )
    return problem or passed(check, f"{plugin_dir} is a directory")


async def check_kubelet(plugin_dir: Path) -> Result:
    check = "kubelet"
    path = plugin_dir / KUBELET_SOCKET
    problem = _expect_kind(
        check,
        path,
        "a socket",
        _KUBELET_CREATES_IT,
        f"remove it and restart kubelet, which creates the socket at start "
        f"(rm {path}; systemctl restart kubelet)",
    )
    if problem:
        return problem
    error = connect_error(path)
    if isinstance(error, ConnectionRefusedError):
        return failed(
            check,
            f"nothing listens on {path}",
            "kubelet is down and left its socket behind: start it (systemctl restart kubelet)",
        )
    if isinstance(error, PermissionError):
        return failed(
            check,
            f"cannot connect to {path}: permission denied",
            f"{_AS_ROOT}; on SELinux nodes, in a domain allowed to connect to kubelet.sock "
            "(container_device_plugin_t)",
        )
    if error is not None:
        return failed(
            check, f"cannot connect to {path}: {error.strerror}", "systemctl restart kubelet"
        )
    answer = await bridge.probe_unimplemented(path, KUBELET_PROBE, CHECK_TIMEOUT)
    if answer:
        return failed(
            check,
            f"{path} takes connections but {answer}",
            "restart kubelet (systemctl restart kubelet); if that does not help, "
            "something other than kubelet serves this socket",
        )
    return passed(
        check, f"{path} answers like kubelet (UNIMPLEMENTED for a method it does not serve)"
    )


def expected_devices(spec: ResourceSpec, host_root: str) -> int:
    """How many devices the daemon should list: `count` shares of each device found."""
    if not any(node.is_glob for node in spec.device_nodes):
        return spec.count
    found = {
        match
        for node in spec.device_nodes
        if node.is_glob
        for match in _glob_matches(node, host_root)
    }
    return spec.count * len(found)


def _devices(count: int) -> str:
    return f"{count} device" if count == 1 else f"{count} devices"


def _daemon_socket(plugin_dir: Path, spec: ResourceSpec) -> tuple[Path | None, int]:
    """The newest of the resource's sockets that takes connections, and how many are stale."""
    sockets = []
    for entry in os.scandir(plugin_dir):
        if not spec.is_own_socket(entry.name):
            continue
        try:
            status = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            # A restarting daemon removes its old socket.
            continue
        if stat.S_ISSOCK(status.st_mode):
            sockets.append((status.st_mtime_ns, plugin_dir / entry.name))
    stale = 0
    for _, path in sorted(sockets, reverse=True):
        if connect_error(path) is None:
            return path, stale
        stale += 1
    return None, stale


async def check_plugin(
    plugin_dir: Path, spec: ResourceSpec, expected: int, pre_start_check: bool
) -> Result:
    check = f"plugin {spec.name}"
    path, stale = _daemon_socket(plugin_dir, spec)
    if path is None:
        left = f" ({stale} stale, left by a daemon that was killed)" if stale else ""
        return failed(
            check,
            f"no {spec.socket_prefix}-<pid>-<token>-<n>.sock in {plugin_dir} "
            f"takes connections{left}",
            f"start the daemon, or see why it stopped ({_DAEMON_LOG} --previous); "
            "it must run with the same --device-plugin-path",
        )
    try:
        options, listing = await bridge.read_device_plugin(path, CHECK_TIMEOUT)
    except bridge.CallFailed as exc:
        return failed(
            check,
            f"{path.name} takes connections but {exc}",
            f"see the daemon's log ({_DAEMON_LOG}) and restart its pod",
        )
    devices = len(listing.devices)
    healthy = sum(device.health == "Healthy" for device in listing.devices)
    summary = f"{path.name} lists {_devices(devices)}, {healthy} Healthy"
    problems, fixes = [], []
    if devices != expected:
        problems.append(f"expected {_devices(expected)}")
        fixes.append(
            "give the doctor the daemon's flags; if they are right, restart the daemon so it "
            "takes them"
        )
    if healthy != devices:
        problems.append("expected every one Healthy")
        fixes.append(
            "the device and directory checks above and the daemon's log "
            f"({_DAEMON_LOG}, lines with 'Unhealthy') say what is missing"
        )
    if options.pre_start_required != pre_start_check:
        have = "with" if options.pre_start_required else "without"
        problems.append(f"its options show the daemon runs {have} --pre-start-check")
        fixes.append("give the doctor the daemon's flags")
    if problems:
        return failed(check, f"{summary}; {'; '.join(problems)}", "; ".join(fixes))
    return passed(check, summary)


# /readyz


def _loopback(bind_address: str) -> tuple[str, int]:
    """Where to reach a server bound to `bind_address` from this host."""
    host, _, port = bind_address.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return host, int(port)


async def _http_get(host: str, port: int, path: str) -> tuple[int, str]:
    """The status code and body of GET `path`; raises OSError, trio.TooSlowError, ValueError."""
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    request = f"GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n"
    response = b""
    with trio.fail_after(CHECK_TIMEOUT):
        async with await trio.open_tcp_stream(host, port) as stream:
            await stream.send_all(request.encode())
            while len(response) < MAX_HTTP_RESPONSE:
                chunk = await stream.receive_some(MAX_HTTP_RESPONSE)
                if not chunk:
                    break
                response += chunk
    head, _, body = response.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].split()
    if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/"):
        raise ValueError(f"not an HTTP response: {head[:80]!r}")
    return int(status_line[1]), body.decode("utf-8", errors="replace")


def _connect_failure(exc: OSError) -> str:
    # trio raises one OSError for all attempts, with each attempt's error as its cause.
    cause = exc.__cause__
    attempts = cause.exceptions if isinstance(cause, BaseExceptionGroup) else (exc,)
    reasons = {
        os.strerror(attempt.errno)
        for attempt in attempts
        if isinstance(attempt, OSError) and attempt.errno
    }
    return ", ".join(sorted(reasons)) or str(exc)


async def check_readyz(bind_address: str) -> Result:
    check = "readyz"
    if not bind_address:
        return skipped(check, "metrics and probes are off (--metrics-bind-address is empty)")
    host, port = _loopback(bind_address)
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/readyz"
    try:
        status, body = await _http_get(host, port, "/readyz")
    except OSError as exc:
        return failed(
            check,
            f"cannot connect to {url}: {_connect_failure(exc)}",
            "the daemon is not running, runs with another --metrics-bind-address (give the "
            "doctor its flags), or could not listen (its log says 'Metrics and probes are off')",
        )
    except trio.TooSlowError:
        return failed(
            check,
            f"{url} did not answer within {CHECK_TIMEOUT:g} s",
            f"the daemon is stuck: restart its pod and report its log ({_DAEMON_LOG})",
        )
    except ValueError as exc:
        return failed(
            check,
            f"{url} answered garbage: {exc}",
            "something else listens there: give the daemon another --metrics-bind-address",
        )
    reason = "; ".join(line.strip() for line in body.splitlines() if line.strip())
    if status == 200:
        return passed(check, f"{url} answers 200 {reason}")
    return failed(
        check,
        f"{url} answers {status}: {reason}",
        f"the reason says what the daemon waits for; the checks above and its log "
        f"({_DAEMON_LOG}) say why",
    )


# Running the checks


async def examine(
    config: Config, specs: Sequence[ResourceSpec], report: Callable[[Result], None]
) -> None:
    """Run every check in order and `report` each result as it comes."""
    host_root = config.host_root
    node_checks: dict[str, Result] = {}
    for spec in specs:
        for node in spec.device_nodes:
            node_checks.setdefault(f"device {node.host_path}", check_device(node, host_root))
        for mount in spec.mounts:
            node_checks.setdefault(
                f"{mount.label} {mount.host_path}", check_mount(mount, host_root)
            )
    for result in node_checks.values():
        report(result)
    plugin_dir = Path(config.device_plugin_path)
    directory = check_plugin_dir(plugin_dir)
    report(directory)
    async with bridge.asyncio_loop():
        if directory.status == "PASS":
            kubelet = await check_kubelet(plugin_dir)
        else:
            kubelet = skipped("kubelet", f"not checked until {plugin_dir} exists")
        report(kubelet)
        for spec in specs:
            if kubelet.status == "PASS":
                expected = expected_devices(spec, host_root)
                report(await check_plugin(plugin_dir, spec, expected, config.pre_start_check))
            else:
                # Until kubelet has opened its own stream, the daemon would take
                # the doctor's ListAndWatch for kubelet's.
                report(skipped(f"plugin {spec.name}", "not checked until kubelet answers"))
    report(await check_readyz(config.metrics_bind_address))


def parse_config(argv: Sequence[str]) -> Config:
    parser = cli.build_parser()
    parser.prog = f"{cli.PROG} doctor"
    parser.description = (
        "Check this node for the plugin: device and directories, kubelet's socket directory "
        "and kubelet.sock, the daemon's socket and /readyz. Give it the daemon's flags. "
        "It changes nothing and sends kubelet no Register."
    )
    parser.epilog = "Exit codes: 0 no check failed; 1 a check failed; 2 usage error."
    args = parser.parse_args(cli.go_style(argv))
    try:
        return Config(**vars(args))
    except ConfigError as exc:
        cli.usage_error(str(exc))


def main(argv: Sequence[str]) -> NoReturn:
    config = parse_config(argv)
    klog.configure(config.verbosity)
    specs = cli.load_specs(config)
    results: list[Result] = []

    def report(result: Result) -> None:
        results.append(result)
        print(result.line(), flush=True)

    trio.run(examine, config, specs, report)
    counts = collections.Counter(result.status for result in results)
    print(
        f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped.", flush=True
    )
    sys.exit(1 if counts["FAIL"] else 0)
