"""What pcc_plugin._library_lookups relies on in trio and asyncinotify, pinned: an upgrade
that looks up other libraries at import, or none, fails here."""

from __future__ import annotations

import ctypes.util

from fresh_interpreter import json_of

from pcc_plugin import _library_lookups

# Fresh interpreters: in this one ctypes.util, trio and asyncinotify are imported already.
ASKED = """
import ctypes, json, sys, types
asked = []
stand_in = types.ModuleType("ctypes.util")
stand_in.find_library = lambda name: asked.append(name) or None
sys.modules["ctypes.util"] = ctypes.util = stand_in
import trio, asyncinotify
print(json.dumps(asked))
"""
DAEMON_IMPORTS = """
import json, sys
from pcc_plugin._library_lookups import glibc_sonames
with glibc_sonames():
    import trio, asyncinotify._ffi as ffi
from trio._core import _thread_cache
imported = sorted(m for m in ("shutil", "tempfile", "bz2", "lzma") if m in sys.modules)
import ctypes.util
print(json.dumps({
    "libc": ffi._libcname,
    "thread_names": _thread_cache.set_os_thread_name is not None,
    "ctypes.util is real": hasattr(ctypes.util, "_findSoname_ldconfig"),
    "imported": imported,
}))
"""


def test_trio_and_asyncinotify_ask_only_for_glibcs_own_libraries() -> None:
    assert set(json_of(ASKED)) == set(_library_lookups.GLIBC_SONAMES)


def test_the_answers_are_what_ldconfig_says() -> None:
    for name, soname in _library_lookups.GLIBC_SONAMES.items():
        assert ctypes.util.find_library(name) == soname


def test_the_imports_find_their_libraries_and_the_real_module_comes_back() -> None:
    assert json_of(DAEMON_IMPORTS) == {
        "libc": "libc.so.6",
        "thread_names": True,
        "ctypes.util is real": True,
        # What the real ctypes.util would have brought along.
        "imported": [],
    }


def test_other_names_are_looked_up_for_real() -> None:
    assert _library_lookups.find_library("m") == ctypes.util.find_library("m")
    with _library_lookups.glibc_sonames():
        assert _library_lookups.find_library("m") == ctypes.util.find_library("m")
