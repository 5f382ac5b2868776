"""pcc_plugin._generated_code: a start finds every piece of generated code in the cache written
by another process, and what it finds is what compiling the source would give."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import attr._make
import attrs
from fresh_interpreter import json_of

from pcc_plugin import _generated_code
from pcc_plugin._generated_code import GeneratedCode, compiled_at_build, read

# A fresh interpreter (its own hash seed, so attrs' salts differ from the writer's) imports as
# the daemon does, and checks every code object it is given against a compile of its source.
# Without columns, as in the image: a salt's length may differ from the cached one's.
CHECKED_START = """
import json, sys
from pathlib import Path
from pcc_plugin import _generated_code
from pcc_plugin.main import import_the_daemon

checked = {"given": 0, "differing": [], "resalted": 0}
code = _generated_code.GeneratedCode.code

def checked_code(self, source, filename, flags):
    given = code(self, source, filename, flags)
    checked["given"] += 1
    if given != compile(source, filename, "exec", flags, dont_inherit=True):
        checked["differing"].append(filename)
    salt = _generated_code._ATTRS_SALT.search(source)
    if salt:
        out = _generated_code._SALT_TAKEN_OUT
        taken_out = source[: salt.start(1)] + out + source[salt.end(1) :]
        entry = self.cached.get((taken_out, filename, flags))
        if entry is not None and entry[1] != int(salt[1]):
            checked["resalted"] += 1
    return given

_generated_code.GeneratedCode.code = checked_code
cache = Path(sys.argv[1])
with _generated_code.compiled_at_build(cache) as generated:
    import_the_daemon()
if sys.argv[2] == "write":
    generated.write(cache)
print(json.dumps({**checked, "compiled": generated.compiled, "used": len(generated.used)}))
"""


def start(cache: Path, then: str) -> dict[str, Any]:
    result: dict[str, Any] = json_of(
        CHECKED_START, str(cache), then, options=("-X", "no_debug_ranges")
    )
    return result


def test_a_start_takes_all_its_generated_code_from_the_cache_another_wrote(tmp_path: Path) -> None:
    cache = tmp_path / "generated.marshal"
    first = start(cache, "write")
    # No cache yet: everything compiled, as without one (a source met twice, once).
    assert first["compiled"] == first["used"]
    assert first["given"] >= first["used"]
    assert first["differing"] == []
    second = start(cache, "read")
    assert second["compiled"] == 0
    assert second["used"] == first["used"]
    assert second["given"] == first["given"]
    assert second["differing"] == []
    # attrs' salted __hash__ methods came with the writer's salt and were given this
    # process's; the first start's salts are in the sources it compiled, so none there.
    assert first["resalted"] == 0
    assert second["resalted"] >= 10


def test_a_cache_this_interpreter_cannot_use_is_no_cache(tmp_path: Path) -> None:
    with compiled_at_build(tmp_path / "none") as generated:
        attrs.frozen(type("Box", (), {"__annotations__": {"size": "int"}}))
    assert generated.compiled == len(generated.used) == 1
    good = tmp_path / "good"
    generated.write(good)
    assert len(read(good)) == 1
    data = good.read_bytes()
    header = _generated_code._HEADER
    damaged = {
        "missing": None,
        "truncated": data[: len(data) // 2],
        "another interpreter's": b"x" * len(header) + data[len(header) :],
        "not a dict": header + b"N",
        "empty": b"",
    }
    for name, content in damaged.items():
        path = tmp_path / name
        if content is not None:
            path.write_bytes(content)
        assert read(path) == {}, name


def test_a_class_made_within_behaves_as_one_made_without(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with compiled_at_build(cache) as writer:
        first = attrs.frozen(type("Pair", (), {"__annotations__": {"a": "int", "b": "str"}}))
        made = dataclasses.make_dataclass("Row", [("n", int)], frozen=True)
    writer.write(cache)
    with compiled_at_build(cache) as reader:
        second = attrs.frozen(type("Pair", (), {"__annotations__": {"a": "int", "b": "str"}}))
        again = dataclasses.make_dataclass("Row", [("n", int)], frozen=True)
    assert reader.compiled == 0
    assert len(reader.used) == len(writer.used)
    assert second(1, "x") == second(1, "x")
    assert second(1, "x") != second(2, "x")
    assert hash(second(1, "x")) == hash(second(1, "x"))
    assert repr(second(1, "x")) == repr(first(1, "x")) == "Pair(a=1, b='x')"
    assert again(3) == again(3)
    assert repr(again(3)) == repr(made(3)) == "Row(n=3)"
    # Outside, attrs and dataclasses compile with the built-ins again.
    assert "compile" not in vars(attr._make)
    assert "exec" not in vars(dataclasses)


def test_the_salt_is_replaced_wherever_the_compiler_put_it() -> None:
    name = "<attrs generated methods module.Class>"
    # attrs' __hash__ of a class with a field, and of one without: a tuple of constants only,
    # which the compiler folds into one constant.
    for field in ("\n        self.x,", ""):
        source = f"def __hash__(self):\n    return hash((\n        1234567,{field}\n    ))\n"
        writer = GeneratedCode({})
        writer.code(source, name, 0)
        # Of the same length: code with columns keeps the cached salt's.
        other_salt = source.replace("1234567", "-123456")
        given = GeneratedCode(writer.used).code(other_salt, name, 0)
        assert given == compile(other_salt, name, "exec", 0, True)
        assert given != compile(source, name, "exec", 0, True)
