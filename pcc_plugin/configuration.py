"""What the daemon serves, in which mode (`read`, at start and at each reload), and the
watch on the --config file.

With `--config`, the file is read again when it changes (a ConfigMap volume
swaps its `..data` symlink; an editor renames or rewrites the file) and on
SIGHUP. A new file is validated whole before anything changes; if it is
invalid, one error line says why and the running configuration keeps serving.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import attrs
import trio
from asyncinotify import Mask

from pcc_plugin.flags import DEFAULT_MODE, Flags
from pcc_plugin.inotify import DIR_GONE, next_events, open_inotify, wait_for_directory
from pcc_plugin.resource import ResourceSpec

log = logging.getLogger(__name__)

# kubelet's atomic writer: the file is a symlink into `..data`, itself a symlink
# replaced by a rename when the ConfigMap changes.
CONFIGMAP_DATA = "..data"
_CHANGED = Mask.CLOSE_WRITE | Mask.MOVED_TO | Mask.CREATE | Mask.DELETE | Mask.ATTRIB
# A ResourceSlice's string attributes hold at most this many characters.
MAX_ATTRIBUTE_CHARS = 64


class ConfigError(ValueError):
    """The flags and the --config file cannot be served: one line that starts with the flag,
    or names the file and key; `see` says where the fix is explained."""

    def __init__(self, message: str, see: str = "--help") -> None:
        super().__init__(message)
        self.see = see


@attrs.frozen
class Served:
    """What the daemon serves: its resources, the hash of the file they came from ("flags"
    without one), and the mode."""

    specs: list[ResourceSpec]
    digest: str
    mode: str


def read(config: Flags) -> Served:
    """The --config file's resources, else the PCC profile from the flags, in the mode --mode or
    the file's `mode` key gives (the two must agree); ConfigError if they cannot be served.

    It reads the file and nothing else, and changes nothing: a reload calls it too.
    """
    if not config.config:
        served = Served([config.pcc_resource()], "flags", config.mode or DEFAULT_MODE)
    elif config.tsm_report:
        raise ConfigError(
            f"--tsm-report: not used with --config: give the resources of {config.config} "
            "a mount of /sys/kernel/config/tsm/report instead",
            see="docs/profiles.md",
        )
    else:
        # Imported only now: the YAML parser is not needed without --config.
        from pcc_plugin import profiles

        try:
            specs, digest, file_mode = profiles.load(config.config)
        except profiles.ProfileError as exc:
            # --help names the flag only; the keys and their rules are in docs/profiles.md.
            raise ConfigError(str(exc), see="docs/profiles.md") from None
        if config.mode and file_mode and config.mode != file_mode:
            raise ConfigError(
                f"--mode: {config.mode} disagrees with mode {file_mode} in {config.config}; "
                "give one of them"
            )
        served = Served(specs, digest, config.mode or file_mode or DEFAULT_MODE)
    problem = dra_problem(config, served.specs) if served.mode == "dra" else None
    if problem:
        raise ConfigError(problem)
    return served


def dra_problem(config: Flags, specs: list[ResourceSpec]) -> str | None:
    """Why --mode=dra cannot serve these flags and resources, starting with the flag or key."""
    if not config.node_name:
        return (
            "--node-name: required with --mode=dra: the node's name is its ResourceSlices' pool "
            "(the manifests pass spec.nodeName)"
        )
    for name in ("cdi", "pre_start_check"):
        if getattr(config, name):
            flag = name.replace("_", "-")
            return f"--{flag}: not used with --mode=dra, which always hands devices over by CDI"
    if len(specs) != 1:
        return (
            f"--config: {config.config} lists {len(specs)} resources; --mode=dra serves one "
            "(one driver, one kind of device)"
        )
    (spec,) = specs
    if spec.glob_nodes:
        return f"--config: {spec.name}: --mode=dra serves no globbed devices"
    if "." in spec.socket_prefix:
        return (
            f"--config: {spec.name}: socketPrefix {spec.socket_prefix!r} names the DRA devices "
            "and must have no '.' (devices are DNS labels)"
        )
    long = [path for path in spec.host_paths() if len(path) > MAX_ATTRIBUTE_CHARS]
    if long:
        return (
            f"--config: {spec.name}: host path {long[0]!r} is longer than the "
            f"{MAX_ATTRIBUTE_CHARS} characters a ResourceSlice attribute holds"
        )
    from pcc_plugin.dra.sockets import socket_path_problem

    return socket_path_problem(config)


async def watch_config_file(
    path: Path,
    changed: trio.MemorySendChannel[str],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Send a reason on `changed` whenever the file at `path` may have changed.

    Watches its directory, not the file: ConfigMap updates and editors
    replace the file (or the symlink above it) rather than write into it.
    """
    names = {path.name, CONFIGMAP_DATA}
    started = False
    while True:
        await wait_for_directory(path.parent)
        async with open_inotify() as inotify:
            try:
                inotify.add_watch(path.parent, _CHANGED | DIR_GONE | Mask.ONLYDIR)
            except (FileNotFoundError, NotADirectoryError):
                continue
            if not started:
                task_status.started()
                started = True
            else:
                # The directory came back: what is in it now may be new.
                _request(changed, f"{path.parent} was created again")
            while True:
                events = await next_events(inotify)
                if any(event.name is not None and str(event.name) in names for event in events):
                    _request(changed, f"{path} changed")
                if any(event.mask & DIR_GONE for event in events):
                    break


def _request(changed: trio.MemorySendChannel[str], reason: str) -> None:
    # Already pending: that reload will read the file as it is then.
    with contextlib.suppress(trio.WouldBlock):
        changed.send_nowait(reason)
