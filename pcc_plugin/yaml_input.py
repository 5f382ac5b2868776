"""A YAML file read as untrusted input: bounded in size and cost, every problem one line.

The image has no libyaml, and PyYAML's pure-Python parser takes up to about
20 ms per KiB of the densest YAML (a flow list of one-character values). So a
file is refused, before or while it is parsed, when it has more than
MAX_BYTES, more than MAX_VALUES values once every alias is written out (an
alias of an alias of ... is refused as soon as the count passes), more than
MAX_ALIASES aliases, or more than MAX_DEPTH levels of nesting: the costliest
file that passes takes well under a second, and a refused one less. Besides,
it must be UTF-8, keys must be strings and unique within their mapping, and
no value may hold a NUL (no path, argument or environment variable can).
"""

from __future__ import annotations

import codecs
import hashlib
import os
import re
import stat
from typing import Any

import attrs
import yaml

MAX_BYTES = 128 * 1024
MAX_VALUES = 10_000
MAX_ALIASES = 64
MAX_DEPTH = 32
ROOT = "(top level)"

_SAVE_AS_UTF8 = "save it as UTF-8"
_STR = "tag:yaml.org,2002:str"
_MERGE = "tag:yaml.org,2002:merge"
_PLAIN_KEY = re.compile(r"[A-Za-z0-9_./<-]{1,64}")


@attrs.frozen
class Document:
    """A file's one YAML document, and a short hash of the very bytes it was read from: what
    runs is named by it (in /metrics), never by a second read that may find a newer file."""

    value: Any
    digest: str


class InputError(ValueError):
    """The file cannot be read as bounded YAML; one line naming the file and where in it."""


class KeyProblem(Exception):
    """A problem at a key path; the caller adds the file's name."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")


def child(where: str, key: object) -> str:
    """The key path of `key` below `where`, quoted unless it is a plain word."""
    shown = key if isinstance(key, str) and _PLAIN_KEY.fullmatch(key) else shown_value(key)
    return str(shown) if where == ROOT else f"{where}.{shown}"


def shown_value(value: object) -> str:
    """`value` as the one-line message shows it: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def read_document(path: str) -> Document:
    """The file's one YAML document as Python values, or InputError."""
    data = _read(path)
    text = _decoded(path, data)
    try:
        value = _parse(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        if isinstance(exc, _TooCostly):
            raise InputError(f"{path}:{at}: {exc.problem}") from None
        context = f"{exc.context}, " if exc.context else ""
        raise InputError(f"{path}: not valid YAML{at}: {context}{exc.problem}") from None
    except yaml.reader.ReaderError as exc:
        # Characters YAML does not allow (controls): a position, not a mark.
        raise InputError(
            f"{path}: not valid YAML at {_position(text[: exc.position])}: "
            f"character U+{exc.character:04X} is not allowed"
        ) from None
    except KeyProblem as exc:
        raise InputError(f"{path}: {exc}") from None
    return Document(value, hashlib.sha256(data).hexdigest()[:16])


def _parse(text: str) -> Any:
    loader = _BoundedLoader(text)
    try:
        root = loader.get_single_node()
        if root is None:
            return None
        _check_node(root, ROOT)
        return loader.construct_document(root)
    finally:
        loader.dispose()


def _read(path: str) -> bytes:
    try:
        # Non-blocking: a FIFO named by mistake must not hang the start.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise InputError(f"--config {path}: not a regular file")
            # Buffered: read() returns short only at the end of the file.
            with open(fd, "rb", closefd=False) as file:
                data = file.read(MAX_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as exc:
        raise InputError(f"--config {path}: {exc.strerror}") from None
    if len(data) > MAX_BYTES:
        raise InputError(f"{path}: is larger than {MAX_BYTES // 1024} KiB, the most it may be")
    return data


def _decoded(path: str, data: bytes) -> str:
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE, codecs.BOM_UTF32_BE)):
        raise InputError(
            f"{path}: is UTF-16 or UTF-32 (it starts with a byte-order mark); {_SAVE_AS_UTF8}"
        )
    nul = data.find(b"\0")
    if nul >= 0:
        before = data[:nul].decode(errors="replace")
        raise InputError(f"{path}: has a NUL byte at {_position(before)}; {_SAVE_AS_UTF8}")
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        before = data[: exc.start].decode()
        raise InputError(
            f"{path}: is not UTF-8: byte 0x{data[exc.start]:02x} at {_position(before)}; "
            + _SAVE_AS_UTF8
        ) from None


def _position(before: str) -> str:
    """Line and column of the character that follows the text `before`."""
    lines = before.split("\n")
    return f"line {len(lines)}, column {len(lines[-1]) + 1}"


class _TooCostly(yaml.MarkedYAMLError):
    """The document goes past a bound; `problem` says which."""


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that keeps count while composing, and refuses past the bounds."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self._values = 0
        self._aliases = 0
        self._depth = 0
        self._deepest = 0
        # Each finished node: its values and its levels, with aliases written out.
        self._shapes: dict[yaml.Node, tuple[int, int]] = {}

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        event: yaml.Event = self.peek_event()  # type: ignore[no-untyped-call]  # (untyped stub)
        mark: Any = event.start_mark  # the stubs allow the C extension's Mark too
        if isinstance(event, yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise _TooCostly(problem=f"more than {MAX_ALIASES} aliases", problem_mark=mark)
            anchored = self.anchors.get(event.anchor)
            if anchored is not None:
                if anchored not in self._shapes:
                    raise _TooCostly(
                        problem=f"alias *{event.anchor} stands for a value that contains it",
                        problem_mark=mark,
                    )
                values, levels = self._shapes[anchored]
                self._count(values, mark)
                self._reach(self._depth + levels, mark)
            # An unknown alias is the composer's own error.
            return super().compose_node(parent, index)
        self._depth += 1
        self._reach(self._depth, mark)
        values_before, deepest_before = self._values, self._deepest
        self._deepest = self._depth
        self._count(1, mark)
        node = super().compose_node(parent, index)
        assert node is not None, "every event but an alias makes a new node"
        self._shapes[node] = (self._values - values_before, self._deepest - self._depth + 1)
        self._deepest = max(deepest_before, self._deepest)
        self._depth -= 1
        return node

    def _count(self, values: int, mark: Any) -> None:
        self._values += values
        if self._values > MAX_VALUES:
            raise _TooCostly(
                problem=f"more than {MAX_VALUES} values (an alias counts the values it stands for)",
                problem_mark=mark,
            )

    def _reach(self, depth: int, mark: Any) -> None:
        if depth > MAX_DEPTH:
            raise _TooCostly(problem=f"nested more than {MAX_DEPTH} levels deep", problem_mark=mark)
        self._deepest = max(self._deepest, depth)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except ValueError as exc:
            # YAML resolves some values that Python refuses, e.g. the date 2001-13-45.
            raise yaml.constructor.ConstructorError(
                # Python's own advice after a ';' (e.g. sys.set_int_max_str_digits) is not ours.
                problem=f"cannot read {shown_value(node.value)}: {str(exc).split(';')[0]}",
                problem_mark=node.start_mark,
            ) from None


def _check_node(node: yaml.Node, where: str) -> None:
    """Keys are strings and unique, and no value holds a NUL."""
    if isinstance(node, yaml.ScalarNode):
        if "\0" in node.value:
            raise KeyProblem(where, "contains a NUL character")
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _check_node(item, f"{where}[{index}]")
    elif isinstance(node, yaml.MappingNode):
        first_lines: dict[str, int] = {}
        for key, value in node.value:
            line = key.start_mark.line + 1
            if key.tag == _MERGE:
                _check_node(value, child(where, "<<"))
                continue
            if not isinstance(key, yaml.ScalarNode):
                raise KeyProblem(where, f"the key at line {line} is not a string")
            path = child(where, key.value)
            if key.tag != _STR:
                kind = key.tag.rpartition(":")[2]
                raise KeyProblem(path, f"this key is read as {kind}, not a string: quote it")
            if key.value in first_lines:
                raise KeyProblem(
                    path, f"duplicate key at line {line} (first at line {first_lines[key.value]})"
                )
            first_lines[key.value] = line
            _check_node(value, path)
