"""The doctor's small HTTP client, for the daemon's /readyz and /metrics."""

from __future__ import annotations

import os

import trio

from pcc_plugin.doctor.kubelet import CHECK_TIMEOUT

MAX_HTTP_RESPONSE = 1024 * 1024


def loopback(bind_address: str) -> tuple[str, int]:
    """Where to reach a server bound to `bind_address` from this host."""
    host, _, port = bind_address.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return host, int(port)


async def http_get(host: str, port: int, path: str) -> tuple[int, str]:
    """The status code and body of GET `path`; raises OSError, trio.TooSlowError, ValueError."""
    authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    request = f"GET {path} HTTP/1.1\r\nHost: {authority}\r\nConnection: close\r\n\r\n"
    response = b""
    with trio.fail_after(CHECK_TIMEOUT):
        async with await trio.open_tcp_stream(host, port) as stream:
            await stream.send_all(request.encode())
            while len(response) < MAX_HTTP_RESPONSE:
                chunk = await stream.receive_some(MAX_HTTP_RESPONSE)
                if not chunk:
                    break
                response += chunk
    head, _, body = response.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].split()
    if len(status_line) < 2 or not status_line[0].startswith(b"HTTP/"):
        raise ValueError(f"not an HTTP response: {head[:80]!r}")
    return int(status_line[1]), body.decode("utf-8", errors="replace")


def connect_failure(exc: OSError) -> str:
    # trio raises one OSError for all attempts, with each attempt's error as its cause.
    cause = exc.__cause__
    attempts = cause.exceptions if isinstance(cause, BaseExceptionGroup) else (exc,)
    reasons = {
        os.strerror(attempt.errno)
        for attempt in attempts
        if isinstance(attempt, OSError) and attempt.errno
    }
    return ", ".join(sorted(reasons)) or str(exc)
