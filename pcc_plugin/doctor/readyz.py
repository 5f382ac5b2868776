"""The check of the daemon's /readyz."""

from __future__ import annotations

import trio

from pcc_plugin.doctor.http import connect_failure, http_get, loopback
from pcc_plugin.doctor.kubelet import CHECK_TIMEOUT
from pcc_plugin.doctor.report import DAEMON_LOG, Result, failed, passed, skipped


async def check_readyz(bind_address: str) -> Result:
    check = "readyz"
    if not bind_address:
        return skipped(check, "metrics and probes are off (--metrics-bind-address is empty)")
    host, port = loopback(bind_address)
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/readyz"
    try:
        status, body = await http_get(host, port, "/readyz")
    except OSError as exc:
        return failed(
            check,
            f"cannot connect to {url}: {connect_failure(exc)}",
            "the daemon is not running, runs with another --metrics-bind-address (give the "
            "doctor its flags), or could not listen (its log says 'cannot listen on')",
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
