"""What pcc_plugin._first_use relies on in trio, pinned: an upgrade that reads hmac or idna
at import fails here; and a stand-in gives the real module at its first use."""

from __future__ import annotations

from fresh_interpreter import json_of

# Fresh interpreters: in this one trio and hmac are imported already.
TRIO_IMPORTED = """
import json, sys
from pcc_plugin._first_use import TRIO_UNUSED, StandIn, loaded_at_first_use
with loaded_at_first_use(*TRIO_UNUSED):
    import trio
MODULES = ("hmac", "hashlib", "_hashlib", "idna")
before = {
    "stand-ins": [isinstance(trio._dtls.hmac, StandIn), isinstance(trio._socket._idna, StandIn)],
    "imported": sorted(m for m in MODULES if m in sys.modules),
}
first_use = [
    trio._dtls.hmac.compare_digest(b"cookie", b"cookie"),
    trio._socket._idna.encode("b\\u00fccher.example", uts46=True).decode(),
]
import hmac, idna
print(json.dumps({
    "before": before,
    "first use": first_use,
    "real now": not isinstance(hmac, StandIn) and not isinstance(idna, StandIn),
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
NEVER_USED = """
import json, sys
from pcc_plugin._first_use import loaded_at_first_use
with loaded_at_first_use("colorsys"):
    import colorsys
print(json.dumps("colorsys" in sys.modules))
"""


def test_trio_reads_nothing_of_hmac_or_idna_at_import_and_gets_them_at_first_use() -> None:
    assert json_of(TRIO_IMPORTED) == {
        "before": {"stand-ins": [True, True], "imported": []},
        "first use": [True, "xn--bcher-kva.example"],
        "real now": True,
        "imported": ["_hashlib", "hashlib", "hmac", "idna"],
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
