"""What pcc_plugin._first_use relies on in the stack, pinned: an upgrade that reads hmac,
idna, greenlet or ssl at import, or needs ssl where it was optional, fails here; and a
stand-in gives the real module at its first use."""

from __future__ import annotations

from fresh_interpreter import json_of

# Fresh interpreters: in this one the stack, hmac and ssl are imported already. The stack is
# imported as pcc_plugin.main does.
STACK_IMPORTED = """
import json, sys
from pcc_plugin._first_use import (
    SSL_OPTIONAL, STACK_UNUSED, StandIn, imported_without, loaded_at_first_use
)
with loaded_at_first_use(*STACK_UNUSED):
    with imported_without("ssl"):
        for module in SSL_OPTIONAL:
            __import__(module)
    import asyncio, grpclib.client, grpclib.server, trio, trio_asyncio
MODULES = ("hmac", "hashlib", "_hashlib", "idna", "greenlet", "ssl", "_ssl")

async def open_and_close_a_channel():  # as the daemon does, in an asyncio loop under trio
    async with trio_asyncio.open_loop():
        grpclib.client.Channel(path="/nonexistent/socket").close()

trio.run(open_and_close_a_channel)
before = {
    "stand-ins": [
        isinstance(module, StandIn)
        for module in (
            trio._dtls.hmac, trio._socket._idna, trio_asyncio._sync.greenlet, trio._ssl._stdlib_ssl
        )
    ],
    "without ssl": [grpclib.client._ssl, asyncio.base_events.ssl, asyncio.sslproto.ssl],
    "imported": sorted(m for m in MODULES if m in sys.modules),
}
first_use = [
    trio._dtls.hmac.compare_digest(b"cookie", b"cookie"),
    trio._socket._idna.encode("b\\u00fccher.example", uts46=True).decode(),
    trio_asyncio._sync.greenlet.getcurrent() is not None,
    trio._ssl._stdlib_ssl.SSLError.__name__,
]
import greenlet, hmac, idna, ssl
print(json.dumps({
    "before": before,
    "first use": first_use,
    "real now": not any(isinstance(m, StandIn) for m in (greenlet, hmac, idna, ssl)),
    "imported": sorted(m for m in MODULES if m in sys.modules),
}))
"""
READ_WITHIN = """
import json, sys
from pcc_plugin._first_use import StandIn, loaded_at_first_use
with loaded_at_first_use("colorsys"):
    import colorsys as early
    hsv = early.rgb_to_hsv(1.0, 0.0, 0.0)
    import colorsys as later
print(json.dumps({
    "hsv": hsv,
    "later is real": not isinstance(later, StandIn),
    "in sys.modules": sys.modules["colorsys"] is later,
}))
"""
ALREADY_IMPORTED = """
import colorsys, json, sys
from pcc_plugin._first_use import loaded_at_first_use
with loaded_at_first_use("colorsys"):
    import colorsys as within
print(json.dumps(within is colorsys))
"""
IMPORTED_WITHOUT = """
import json, sys
from pcc_plugin._first_use import StandIn, imported_without, loaded_at_first_use
with loaded_at_first_use("colorsys"):
    stand_in = sys.modules["colorsys"]
    with imported_without("colorsys", "json"):
        try:
            import colorsys
        except ImportError as error:
            within = type(error).__name__
    after_within = sys.modules["colorsys"] is stand_in
with imported_without("colorsys"):
    pass
import colorsys
print(json.dumps({
    "within": within,
    "json, imported already": "json" in sys.modules,
    "the stand-in back after": after_within,
    "real after": not isinstance(colorsys, StandIn) and colorsys.rgb_to_hsv(0.0, 0.0, 1.0)[0],
}))
"""
NEVER_USED = """
import json, sys
from pcc_plugin._first_use import loaded_at_first_use
with loaded_at_first_use("colorsys"):
    import colorsys
print(json.dumps("colorsys" in sys.modules))
"""


def test_the_stack_reads_nothing_it_does_not_use_and_gets_it_at_first_use() -> None:
    assert json_of(STACK_IMPORTED) == {
        "before": {
            "stand-ins": [True, True, True, True],
            "without ssl": [None, None, None],
            "imported": [],
        },
        "first use": [True, "xn--bcher-kva.example", True, "SSLError"],
        "real now": True,
        "imported": ["_hashlib", "_ssl", "greenlet", "hashlib", "hmac", "idna", "ssl"],
    }


def test_a_read_within_imports_the_real_module_for_later_imports_too() -> None:
    assert json_of(READ_WITHIN) == {
        "hsv": [0.0, 1.0, 1.0],
        "later is real": True,
        "in sys.modules": True,
    }


def test_a_module_imported_already_is_left_alone() -> None:
    assert json_of(ALREADY_IMPORTED) is True


def test_a_stand_in_never_read_leaves_no_module_behind() -> None:
    assert json_of(NEVER_USED) is False


def test_imported_without_hides_a_module_or_its_stand_in_and_only_within() -> None:
    assert json_of(IMPORTED_WITHOUT) == {
        "within": "ModuleNotFoundError",
        "json, imported already": True,
        "the stand-in back after": True,
        "real after": 0.6666666666666666,
    }
