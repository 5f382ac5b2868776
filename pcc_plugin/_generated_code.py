"""The code attrs and dataclasses generate at import, compiled once, when the image is built.

attrs writes the source of `__init__`, `__eq__`, `__hash__` and such for every class it makes
(trio's, outcome's and ours: 71 before the daemon registers) and dataclasses for
betterproto2's messages (55 functions); both compile that source at every start: 15 to 30 ms
of a start's CPU, where reading it compiled takes 2 to 3 ms. It is the same source every
time but for one number: the salt attrs writes into each `__hash__`, a hash of the class's
name, which differs from process to process. Within `compiled_at_build()`, they take the
code from CACHE instead, with this process's salt put in place of the one it was compiled
with, and compile what is not there as before. (A salt of another length than the cached
one leaves the columns of the code on its line as they were; the image keeps no columns,
PYTHONNODEBUGRANGES.)

CACHE is written in the image (`python -m pcc_plugin._generated_code`, which imports as the
daemon does); where there is none, as in a development checkout, every lookup misses. An
entry is keyed by the source (the salt taken out), the file name it is compiled under and
the compiler flags, and the file is read only by the interpreter version and optimization
level that wrote it: stale, foreign or damaged, it gives a miss, never different code.
tests/test_generated_code.py pins that a start finds everything there, and that what it
finds is what compiling the source would give; tests/test_image.py that the image's does.
"""

from __future__ import annotations
import __future__

import builtins
import contextlib
import dataclasses
import importlib.util
import marshal
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import CodeType
from typing import Any

import attr._make

CACHE = Path(__file__).with_name("_generated_code.marshal")
# Code objects and their marshal format belong to one interpreter version; -O and -OO
# compile differently.
_HEADER = b"pcc generated code 1 " + importlib.util.MAGIC_NUMBER + bytes([sys.flags.optimize])
# attrs' __hash__ hashes a tuple that starts with the salt.
_ATTRS_SALT = re.compile(r"hash\(\(\s*(-?\d+),")
_SALT_TAKEN_OUT = "<salt>"
# The flags `compile` and `exec` take from the module that calls them: attrs' module is
# compiled with `from __future__ import annotations`, dataclasses' with no future.
_ATTRS_FLAGS = __future__.annotations.compiler_flag
_DATACLASSES_FLAGS = 0

Key = tuple[str, str, int]
Entry = tuple[CodeType, int | None]


class GeneratedCode:
    """Code objects by source, file name and flags: those read from a cache, those used."""

    def __init__(self, cached: dict[Key, Entry], path: Path | None = None) -> None:
        self.cached = cached
        self.path = path
        self.used: dict[Key, Entry] = {}
        self.compiled = 0
        self.from_cache = 0

    def code(self, source: str, filename: str, flags: int) -> CodeType:
        salt = None
        match = _ATTRS_SALT.search(source)
        key_source = source
        if match:
            salt = int(match[1])
            key_source = source[: match.start(1)] + _SALT_TAKEN_OUT + source[match.end(1) :]
        key = (key_source, filename, flags)
        entry = self.used.get(key)
        if entry is None:
            entry = self.cached.get(key)
            if entry is not None:
                self.from_cache += 1
            else:
                self.compiled += 1
                code = builtins.compile(source, filename, "exec", flags, dont_inherit=True)
                entry = (code, salt)
            self.used[key] = entry
        code, cached_salt = entry
        if cached_salt is None or salt is None or cached_salt == salt:
            return code
        resalted: CodeType = _replaced(code, cached_salt, salt)
        return resalted

    def attrs_compile(
        self,
        source: Any,
        filename: str,
        mode: str,
        flags: int = 0,
        dont_inherit: bool = False,
        optimize: int = -1,
    ) -> CodeType:
        """`compile` as called in attr._make: attrs calls it with the first three."""
        if not dont_inherit:
            flags |= _ATTRS_FLAGS
        if isinstance(source, str) and mode == "exec" and optimize == -1:
            return self.code(source, filename, flags)
        code: CodeType = builtins.compile(source, filename, mode, flags, True, optimize)
        return code

    def dataclasses_exec(self, source: Any, globals: Any = None, locals: Any = None) -> None:
        """`exec` as dataclasses calls it, with the source of a function that makes one."""
        if isinstance(source, str):
            source = self.code(source, "<string>", _DATACLASSES_FLAGS)
        builtins.exec(source, globals, locals)

    def write(self, path: Path) -> None:
        path.write_bytes(_HEADER + marshal.dumps(self.used))


def _replaced(value: Any, old: int, new: int) -> Any:
    """`value` with the int `old` replaced by `new` in it: in a code object's constants, those
    of the code objects among them, and tuples (a constant tuple is folded into one)."""
    if type(value) is int:
        return new if value == old else value
    if type(value) is tuple:
        return tuple(_replaced(item, old, new) for item in value)
    if isinstance(value, CodeType):
        return value.replace(co_consts=_replaced(value.co_consts, old, new))
    return value


def read(path: Path) -> dict[Key, Entry]:
    """The cache at `path`; empty when there is none, or one this interpreter cannot use."""
    try:
        data = path.read_bytes()
        if not data.startswith(_HEADER):
            return {}
        cached = marshal.loads(data[len(_HEADER) :])
    except (OSError, EOFError, ValueError, TypeError):
        return {}
    return cached if isinstance(cached, dict) else {}


@contextlib.contextmanager
def compiled_at_build(path: Path | None = None) -> Iterator[GeneratedCode]:
    """Within: attrs and dataclasses take the code they generate from the cache at `path`
    (CACHE by default)."""
    path = path or CACHE
    generated = GeneratedCode(read(path), path)
    attr._make.compile = generated.attrs_compile  # type: ignore[attr-defined]
    dataclasses.exec = generated.dataclasses_exec  # type: ignore[attr-defined]
    try:
        yield generated
    finally:
        del attr._make.compile  # type: ignore[attr-defined]
        del dataclasses.exec  # type: ignore[attr-defined]


def main() -> None:
    """Write CACHE with what the daemon's imports generate."""
    from pcc_plugin.main import import_the_daemon

    with compiled_at_build() as generated:
        import_the_daemon()
    generated.write(CACHE)
    print(f"{CACHE}: {len(generated.used)} generated code objects")


if __name__ == "__main__":
    main()
