"""`pcc-device-plugin`: start the daemon (or, with `doctor` first, check the node); its exit
codes are in EPILOG.

`main` takes SIGTERM, SIGINT and SIGQUIT over before it imports anything of the
daemon, so a stop while it starts ends it with 0 too; the flags are read before
the daemon is imported, so `--help` and usage errors answer at once.
"""

from __future__ import annotations

import importlib
import logging
import os
import resource
import signal
import sys
from collections.abc import Sequence
from types import FrameType
from typing import NoReturn

log = logging.getLogger("pcc_plugin")

DESCRIPTION = (
    "Kubernetes device plugin for AMD SEV-SNP nodes: advertises shares of the "
    "guest device and gives each container the device and the PCC socket directory."
)
EPILOG = (
    "`pcc-device-plugin doctor [flags]` checks a node with the same flags. "
    "Flags also take Go's single-dash spelling (-v=1, -resource-count 8). "
    "Exit codes: 0 stopped by SIGTERM/SIGINT; 1 a fatal error, or with --exit-if-missing "
    "a device or PCC directory missing; 2 usage error; 130/143 forced by a second signal."
)


def _stop_while_starting(signum: int, frame: FrameType | None) -> None:
    # Nothing exists yet to clean up: no socket, no registration. The daemon's own
    # handling (supervisor.handle_signals) takes over before it creates any.
    os._exit(0)


def main(argv: Sequence[str] | None = None) -> NoReturn:
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
        signal.signal(signum, _stop_while_starting)
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "doctor":
        from pcc_plugin.doctor import cli

        cli.main(argv[1:])

    from pcc_plugin import configuration, flags, klog
    from pcc_plugin.resource import start_problem

    config, wants_version = flags.parse(argv, flags.PROG, DESCRIPTION, EPILOG)
    if wants_version:
        print(flags.version_text(config.verbosity))
        sys.exit(0)
    klog.configure(config.verbosity)
    try:
        served = configuration.read(config)
    except configuration.ConfigError as exc:
        flags.usage_error(flags.PROG, str(exc), exc.see)
    if config.exit_if_missing:
        for spec in served.specs:
            missing = start_problem(spec, config.host_root)
            if missing:
                log.error("%s", missing.message)
                sys.exit(1)
    raise_open_file_limit()

    from pcc_plugin import bridge, supervisor
    from pcc_plugin.errors import FatalError

    # The mode's own modules, before the imports settle (supervisor.py imports them where used).
    importlib.import_module(
        "pcc_plugin.dra.driver" if served.mode == "dra" else "pcc_plugin.plugin"
    )
    settle_after_imports()
    fatal: list[BaseException] = []
    try:
        bridge.run(supervisor.run_daemon, config, served)
    except* FatalError as group:
        fatal = _leaves(group)
    # Outside the except* block: Python before 3.11.4 (Debian 12's 3.11.2, the image's) wraps an
    # exception raised in one, SystemExit too, in a group and prints it with its traceback.
    for error in fatal:
        log.error("%s", error)
    exit_at_once(1 if fatal else 0)


def settle_after_imports() -> None:
    """Leave what the imports made out of every garbage collection, and let go of the source
    attrs keeps of every method it writes (for debuggers; some 0.2 MiB).

    The imports make some 35,000 objects that live as long as the process: a full
    collection walking them took 17 to 28 ms, now and then in the middle of kubelet's
    dial-back after a restart. They are frozen as they are, without a collection first: it
    took 8 to 11 ms of every start and found some 50 objects of garbage, which stay.
    """
    import gc
    import linecache

    linecache.clearcache()
    gc.freeze()


def exit_at_once(code: int) -> NoReturn:
    """Exit with `code` once the log is flushed, without the interpreter's teardown.

    By now the daemon has let go of all it holds outside the process (its sockets removed,
    kubelet's streams closed, the checkpoint's lock released); what is left is memory and
    descriptors, which the kernel frees at exit. The teardown would free the 400 modules'
    objects one by one first: 20 to 40 ms of every stop, which a rollout waits on.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def raise_open_file_limit() -> None:
    """Raise the soft limit on open files to the hard one, as Go programs do at start.

    The soft limit is often 1,024; connections beyond what the plugin keeps
    are closed at once, but a flood should meet the kernel's limit, not ours.
    """
    from pcc_plugin.klog import V1

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (OSError, ValueError) as exc:
            log.log(V1, "Open files: soft limit %d, hard %d; cannot raise it: %s", soft, hard, exc)
            return
    log.log(V1, "Open files: soft limit %d (was %d), hard limit %d", hard, soft, hard)


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    leaves: list[BaseException] = []
    for exc in group.exceptions:
        leaves.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return leaves
