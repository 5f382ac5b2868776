"""Modules the stack imports for features the daemon never uses, loaded at first use.

trio imports hmac for the cookies of DTLS (`trio._dtls`), which the daemon
never speaks. hmac imports hashlib, and hashlib's import asks OpenSSL for
every digest it has: about 5 ms of every start, and 0.5 MiB of libcrypto's
pages resident for good. trio also imports idna for host names beyond ASCII
(`trio._socket`), which the daemon never resolves: 0.15 MiB and 2 ms more.
trio-asyncio imports greenlet for the event loop it runs outside trio, which
the daemon never starts: 1.1 MiB. And trio imports ssl for TLS, which the
daemon never speaks on its unix sockets, and reads nothing of it until then.
Within `loaded_at_first_use(*STACK_UNUSED)`, `import hmac` gives a stand-in,
and the first attribute read from it imports the real module, so that TLS,
DTLS and such names would still work.

asyncio and grpclib read ssl at import and grpclib at every channel it opens,
but both run on a Python built without it: imported first, within
`imported_without("ssl")` (SSL_OPTIONAL), they are imported as there, and never
load libssl and libcrypto (4.3 MiB resident for good, and 5 to 10 ms of every
start).

tests/test_first_use.py pins that the stack reads nothing of these at import
and that the daemon never loads them; `_betterproto2.load` does the same for
betterproto2's json.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import types
from collections.abc import Iterator
from typing import Any

STACK_UNUSED = ("hmac", "idna", "greenlet", "ssl")
SSL_OPTIONAL = ("asyncio", "grpclib.client")


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


@contextlib.contextmanager
def imported_without(*names: str) -> Iterator[None]:
    """Within: `import <name>` raises ImportError, as on a Python built without it, for each
    name not imported already (a stand-in is not)."""
    hidden = {}
    for name in names:
        present = sys.modules.get(name)
        if present is None or isinstance(present, StandIn):
            hidden[name] = present
            sys.modules[name] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        for name, present in hidden.items():
            if name in sys.modules and sys.modules[name] is None:
                if present is None:
                    del sys.modules[name]
                else:
                    sys.modules[name] = present
