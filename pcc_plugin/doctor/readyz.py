"""The check of the daemon's /readyz, over a small HTTP client of its own."""

from __future__ import annotations

import os

import trio

from pcc_plugin.doctor.kubelet import CHECK_TIMEOUT
from pcc_plugin.doctor.report import DAEMON_LOG, Result, failed, passed, skipped

MAX_HTTP_RESPONSE = 65536


def _loopback(bind_address: str) -> tuple[str, int]:
    """Where to reach a server bound to `bind_address` from this host."""
    host, _, port = bind_address.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return host, int(port)


async def _http_get(host: str, port: int, path: str) -> tuple[int, str]:
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


def _connect_failure(exc: OSError) -> str:
    # trio raises one OSError for all attempts, with each attempt's error as its cause.
    cause = exc.__cause__
    attempts = cause.exceptions if isinstance(cause, BaseExceptionGroup) else (exc,)
    reasons = {
        os.strerror(attempt.errno)
        for attempt in attempts
        if isinstance(attempt, OSError) and attempt.errno
    }
    return ", ".join(sorted(reasons)) or str(exc)


async def check_readyz(bind_address: str) -> Result:
    check = "readyz"
    if not bind_address:
        return skipped(check, "metrics and probes are off (--metrics-bind-address is empty)")
    host, port = _loopback(bind_address)
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/readyz"
    try:
        status, body = await _http_get(host, port, "/readyz")
    except OSError as exc:
        return failed(
            check,
            f"cannot connect to {url}: {_connect_failure(exc)}",
            "the daemon is not running, runs with another --metrics-bind-address (give the "
            "doctor its flags), or could not listen (its log says 'Metrics and probes are off')",
        )
    except trio.TooSlowError:
        return failed(
            check,
            f"{url} did not answer within {CHECK_TIMEOUT:g} s",
            f"the daemon is stuck: restart its pod and report its log ({DAEMON_LOG})",
        )
    except ValueError as exc:
        return failed(
            check,
            f"{url} answered garbage: {exc}",
            "something else listens there: give the daemon another --metrics-bind-address",
        )
    reason = "; ".join(line.strip() for line in body.splitlines() if line.strip())
    if status == 200:
        return passed(check, f"{url} answers 200 {reason}")
    return failed(
        check,
        f"{url} answers {status}: {reason}",
        f"the reason says what the daemon waits for; the checks above and its log "
        f"({DAEMON_LOG}) say why",
    )
