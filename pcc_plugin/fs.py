"""Small filesystem and unix-socket facts, shared by the daemon and the doctor."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

# (device, inode, ctime): tells one file at a path from the next, even if the
# kernel reuses the inode number.
Identity = tuple[int, int, int]


def is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


def identity(path: Path) -> Identity | None:
    try:
        status = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return status.st_dev, status.st_ino, status.st_ctime_ns


def connect_error(path: Path) -> OSError | None:
    """Why the unix socket at `path` takes no connections, or None when something listens."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(str(path))
        except BlockingIOError:
            # A full backlog: something listens, just busily.
            return None
        except OSError as exc:
            return exc
    return None


def nearest_existing_dir(path: Path) -> Path:
    while not path.is_dir():
        path = path.parent
    return path
