"""Modules a dependency imports for a feature the daemon never uses, loaded at first use.

trio imports hmac for the cookies of DTLS (`trio._dtls`), which the daemon
never speaks. hmac imports hashlib, and hashlib's import asks OpenSSL for
every digest it has: about 5 ms of every start, and 0.5 MiB of libcrypto's
pages resident for good. Within `loaded_at_first_use("hmac")`, `import hmac`
gives a stand-in, and the first attribute read from it imports the real
module, so that trio's DTLS would still work. tests/test_first_use.py pins
that trio reads nothing of hmac at import; `_betterproto2.load` does the same
for betterproto2's json.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from collections.abc import Iterator
from typing import Any


class StandIn(types.ModuleType):
    """Imports the module it stands for at its first attribute read, and reads from it."""

    def __getattr__(self, attribute: str) -> Any:
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), attribute)


@contextlib.contextmanager
def loaded_at_first_use(name: str) -> Iterator[None]:
    """Within: `import <name>` gives a `StandIn`, unless the module is imported already."""
    if name in sys.modules:
        yield
        return
    stand_in = StandIn(name, f"{name}, imported at its first use (pcc_plugin._first_use)")
    sys.modules[name] = stand_in
    try:
        yield
    finally:
        if sys.modules.get(name) is stand_in:
            del sys.modules[name]
