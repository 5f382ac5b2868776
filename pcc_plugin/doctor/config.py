"""The check that the daemon runs the --config file as it is now."""

from __future__ import annotations

import re

import trio

from pcc_plugin.doctor.http import http_get, loopback
from pcc_plugin.doctor.report import DAEMON_LOG, Result, failed, passed, skipped, warned

_RUNNING = re.compile(r"^pcc_device_plugin_config_info\{(?P<labels>[^}]*)\} ", re.MULTILINE)
_HASH = re.compile(r'hash="(?P<hash>[^"]*)"')
_RELOAD_FAILED = re.compile(r"^pcc_device_plugin_config_last_reload_successful 0", re.MULTILINE)


async def check_config(
    config_file: str, bind_address: str, digest: str, problem: str | None
) -> Result:
    """PASS if the daemon runs the file as it is (`digest`, the hash of the bytes read); WARN if
    it does not yet; FAIL if the file is invalid (`problem`), which the daemon refuses too,
    keeping what it runs."""
    check = "config"
    if problem is not None:
        return failed(
            check,
            f"{problem}; the daemon keeps running the configuration it had",
            "fix the file: the daemon applies it by itself once it is valid",
        )
    if not bind_address:
        return skipped(check, "metrics are off: what the daemon runs cannot be read")
    try:
        status, body = await http_get(*loopback(bind_address), "/metrics")
    except (OSError, trio.TooSlowError, ValueError):
        return skipped(check, "the daemon's /metrics does not answer (see readyz below)")
    running = _RUNNING.search(body) if status == 200 else None
    found = _HASH.search(running.group("labels")) if running else None
    if found is None:
        return skipped(check, "the daemon's /metrics shows no configuration")
    if found.group("hash") == digest:
        return passed(check, f"the daemon runs {config_file} as it is now (hash {digest})")
    refused = " and refused it: it is invalid" if _RELOAD_FAILED.search(body) else ""
    return warned(
        check,
        f"{config_file} (hash {digest}) is not what the daemon runs (hash "
        f"{found.group('hash')}): the daemon has not applied it yet{refused}",
        "it applies a changed file by itself, and at once on SIGHUP (kill -HUP 1 in its pod); "
        f"if it refused the file, its log says why: 'Configuration not reloaded' ({DAEMON_LOG})",
    )
