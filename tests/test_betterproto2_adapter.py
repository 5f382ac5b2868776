"""What pcc_plugin._betterproto2 relies on in betterproto2, pinned: an upgrade fails here."""

from __future__ import annotations

import ast
import typing
from importlib.metadata import version
from pathlib import Path

import pytest
from fresh_interpreter import output_of

from pcc_plugin import _betterproto2


def test_the_stand_in_has_what_betterproto2_imports_from_its_own_module() -> None:
    names = output_of(
        "import betterproto2._version as v; "
        "print(' '.join(sorted(n for n in vars(v) if not n.startswith('_') or n == '__version__')))"
    ).split()
    assert set(names) - {"metadata"} == {"__version__", "check_compiler_version"}


def test_the_version_is_the_one_importlib_metadata_finds() -> None:
    assert _betterproto2.installed_version() == version("betterproto2")


def test_the_generated_code_imports_without_importlib_metadata_typing_extensions_or_json() -> None:
    output = output_of(
        "import sys, typing\n"
        "from pcc_plugin import _betterproto2\n"
        "_betterproto2.install()\n"
        "_betterproto2.load()\n"
        "import betterproto2\n"
        "from pcc_plugin._proto import v1beta1\n"
        "print(betterproto2.__version__, 'importlib.metadata' in sys.modules,\n"
        "      'typing_extensions' in sys.modules, betterproto2.Self is typing.Self,\n"
        "      'json' in sys.modules)\n"
        "print(v1beta1.Device(id='a', health='Healthy').to_json(), 'json' in sys.modules)\n"
    )
    assert output.splitlines() == [
        f"{version('betterproto2')} False False True False",
        '{"id": "a", "health": "Healthy"} True',
    ]


def test_betterproto2_takes_from_typing_extensions_only_what_is_typings_own() -> None:
    import betterproto2
    import typing_extensions

    taken = set()
    for path in Path(betterproto2.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                assert "typing_extensions" not in {alias.name for alias in node.names}, path
            elif isinstance(node, ast.ImportFrom) and node.module == "typing_extensions":
                taken |= {alias.name for alias in node.names}
    assert taken == {"Self"}
    for name in taken:
        assert getattr(typing_extensions, name) is getattr(typing, name)


def test_the_check_is_betterproto2s_rule() -> None:
    from pcc_plugin._proto import v1beta1

    _betterproto2.compiler_version_check(version("betterproto2"))(v1beta1._COMPILER_VERSION)
    check = _betterproto2.compiler_version_check("0.10.3")
    check("0.10.0")
    with pytest.raises(ImportError, match="regenerate"):
        check("0.11.0")
    with pytest.raises(ImportError):
        check("1.10.0")
