"""The README's "Limits" table says what `Limits()` holds: each bound, in the words the table
uses, is there with today's number, and no field of `Limits` is left out unless it bounds
nothing a client sends."""

from __future__ import annotations

from pathlib import Path

import attrs

from pcc_plugin.limits import DEFAULT, DRA_SOCKET, Limits

README = Path(__file__).resolve().parent.parent / "README.md"
# Not a client's bound: how the DRA socket treats silence (its row says so in words), how
# long the daemon's own teardown waits, and the kernel's queue of connections not accepted yet.
UNSAID = {"idle_client", "teardown_grace", "backlog"}


def said(limits: Limits) -> dict[str, str]:
    """Each field, as the README's table words it."""

    def seconds(value: float) -> str:
        return f"{value:g} s"

    return {
        "connections": f"{limits.connections} connections at once",
        "first_request_timeout": (
            f"{seconds(limits.first_request_timeout)} to send the HTTP/2 preface and a first call"
        ),
        "idle_timeout": f"{seconds(limits.idle_timeout)} without an open call",
        "calls_per_connection": f"{limits.calls_per_connection} calls at once per connection",
        "message_bytes": f"{limits.message_bytes // 2**20} MiB per message",
        "window": f"{round(limits.window / 1024)} KiB flow-control windows",
        "large_message_budget": f"share {limits.large_message_budget // 2**20} MiB in all",
        "receive_timeout": f"{seconds(limits.receive_timeout)} to receive a request",
        "unary_timeout": f"{seconds(limits.unary_timeout)} to answer a unary call",
        "container_requests": f"at most {limits.container_requests} container requests",
        "claims": f"at most {limits.claims} claims per call",
        "claim_bytes": f"a claim's namespace, name and UID in at most {limits.claim_bytes} bytes",
        "read_claims_timeout": (
            f"read from the API server within {seconds(limits.read_claims_timeout)}"
        ),
        "answer_within": f"every call answered within {seconds(limits.answer_within)}",
        "http_connections": f"{limits.http_connections} connections at once",
        "http_timeout": f"{seconds(limits.http_timeout)} for the whole exchange",
        "http_request_head": f"request head at most {limits.http_request_head // 1024} KiB",
    }


def limits_table() -> str:
    text = README.read_text()
    section = text[text.index("\n## Limits\n") :]
    return " ".join(section[: section.index("\n## ", 1)].split())


def test_the_readme_says_every_limit_as_it_is() -> None:
    table = limits_table()
    wording = said(DEFAULT)
    assert wording.keys() | UNSAID == {field.name for field in attrs.fields(Limits)}
    missing = {name: words for name, words in wording.items() if words not in table}
    assert not missing, f"the README's Limits table does not say: {missing}"
    dra_silence = f"{DRA_SOCKET.first_request_timeout:g} s to send the HTTP/2 preface, then kept"
    assert DRA_SOCKET.idle_client
    assert dra_silence in table


def test_a_changed_limit_is_caught() -> None:
    table = limits_table()
    changed = said(attrs.evolve(DEFAULT, claims=DEFAULT.claims + 1, idle_timeout=61.0))
    assert changed["claims"] not in table
    assert changed["idle_timeout"] not in table
