"""Modules a dependency imports for a feature the daemon never uses, loaded at first use.

trio imports hmac for the cookies of DTLS (`trio._dtls`), which the daemon
never speaks. hmac imports hashlib, and hashlib's import asks OpenSSL for
every digest it has: about 5 ms of every start, and 0.5 MiB of libcrypto's
pages resident for good. trio also imports idna for host names beyond ASCII
(`trio._socket`), which the daemon never resolves: 0.15 MiB and 2 ms more.
Within `loaded_at_first_use(*TRIO_UNUSED)`, `import hmac` gives a stand-in,
and the first attribute read from it imports the real module, so that trio's
DTLS and such names would still work. tests/test_first_use.py pins that trio
reads nothing of either at import; `_betterproto2.load` does the same for
betterproto2's json.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from collections.abc import Iterator
from typing import Any

TRIO_UNUSED = ("hmac", "idna")


class StandIn(types.ModuleType):
    """Imports the module it stands for at its first attribute read, and reads from it."""

    def __getattr__(self, attribute: str) -> Any:
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), attribute)


@contextlib.contextmanager
def loaded_at_first_use(*names: str) -> Iterator[None]:
    """Within: `import <name>` gives a `StandIn`, for each name not imported already."""
    stand_ins = {
        name: StandIn(name, f"{name}, imported at its first use (pcc_plugin._first_use)")
        for name in names
        if name not in sys.modules
    }
    sys.modules.update(stand_ins)
    try:
        yield
    finally:
        for name, stand_in in stand_ins.items():
            if sys.modules.get(name) is stand_in:
                del sys.modules[name]
