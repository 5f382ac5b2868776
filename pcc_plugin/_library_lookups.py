"""C library lookups made at import by trio and asyncinotify, answered without ldconfig.

trio (to name its threads through libpthread) and asyncinotify (to find
inotify_init in libc) each call `ctypes.util.find_library` at import. On Linux
that runs `/sbin/ldconfig -p` in a subprocess, a fork of the daemon, about
6 ms each, and imports shutil, tempfile, bz2 and lzma (0.65 MiB for good).
Both are glibc's own libraries, whose sonames glibc fixes on every
architecture: `glibc_sonames()` lets the imports inside it see a `ctypes.util`
that knows those two and asks the real module for any other name. Off glibc,
or once `ctypes.util` is imported anyway, it changes nothing.
tests/test_library_lookups.py pins what each library asks for.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Iterator

MODULE = "ctypes.util"
GLIBC_SONAMES = {"c": "libc.so.6", "pthread": "libpthread.so.0"}


def _is_glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError):
        return False


def _real_find_library(name: str) -> str | None:
    import ctypes

    # From its file: sys.modules may hold the stand-in.
    spec = importlib.machinery.PathFinder.find_spec(MODULE, ctypes.__path__)
    if spec is None or spec.loader is None:
        return None
    real = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(real)
    found: str | None = real.find_library(name)
    return found


def find_library(name: str) -> str | None:
    """`ctypes.util.find_library`, answered from GLIBC_SONAMES where it can be."""
    return GLIBC_SONAMES.get(name) or _real_find_library(name)


@contextlib.contextmanager
def glibc_sonames() -> Iterator[None]:
    """Within: `import ctypes.util` gives a stand-in whose find_library is the one above."""
    if MODULE in sys.modules or not _is_glibc():
        yield
        return
    import ctypes

    stand_in = types.ModuleType(MODULE, "ctypes.util for glibc's own libraries")
    stand_in.find_library = find_library  # type: ignore[attr-defined]
    sys.modules[MODULE] = stand_in
    ctypes.util = stand_in  # type: ignore[attr-defined]
    try:
        yield
    finally:
        del sys.modules[MODULE]
        delattr(ctypes, "util")
