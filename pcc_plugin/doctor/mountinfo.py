"""Which mount holds a path, from /proc/self/mountinfo: enough to say why it is read-only."""

from __future__ import annotations

import os

import attrs

from pcc_plugin.kernel import unescape
from pcc_plugin.sensitive import is_within


@attrs.frozen
class Mount:
    """One line of /proc/self/mountinfo, as much as the writable check needs."""

    point: str
    read_only: bool
    fs_read_only: bool
    fs_type: str


def mount_of(path: str) -> Mount | None:
    """The mount that holds `path`: the deepest mount point above it, the last one on top."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as mountinfo:
            lines = mountinfo.read().splitlines()
    except OSError:
        return None
    target = os.path.realpath(path)
    found: Mount | None = None
    for line in lines:
        fields = line.split(" ")
        # Optional fields end with "-", then come the type, the source, the fs options.
        separator = fields.index("-")
        point = unescape(fields[4])
        if is_within(target, point) and (found is None or len(point) >= len(found.point)):
            found = Mount(
                point=point,
                read_only="ro" in fields[5].split(","),
                fs_read_only="ro" in fields[separator + 3].split(","),
                fs_type=fields[separator + 1],
            )
    return found
