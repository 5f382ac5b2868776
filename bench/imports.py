"""What the daemon imports: time before it registers (-X importtime), and memory per import."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
from collections.abc import Sequence

from bench.harness import ROOT, WAIT, Bench
from bench.report import Report, mib
from pcc_plugin.sim import unneeded_imports

# Imported cumulatively in this order, each step in a fresh interpreter: roughly the order in
# which `python -m pcc_plugin` imports them. A step lists modules separated by commas.
IMPORT_STEPS: tuple[tuple[str, str], ...] = (
    ("attrs", "attrs"),
    ("asyncio, grpclib's client (+ h2, hpack, multidict), no ssl", "asyncio,grpclib.client"),
    ("trio", "trio"),
    ("trio_asyncio", "trio_asyncio"),
    ("grpclib's server", "grpclib.server"),
    ("betterproto2 and the generated code", "pcc_plugin._proto.v1beta1"),
    ("asyncinotify (+ ctypes)", "asyncinotify"),
    ("rest of the daemon (pcc_plugin.supervisor)", "pcc_plugin.main,pcc_plugin.supervisor"),
    ("pcc_plugin.http_server (metrics on)", "pcc_plugin.http_server"),
    ("h11 (at the first HTTP request)", "h11"),
)
_IMPORT_LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)$")


# Of the modules measured, those that import neither asyncio nor grpclib.
_NEITHER_ASYNCIO_NOR_GRPCLIB = ("attrs", "trio", "h11")


def _as_the_daemon_imports(modules: Sequence[str]) -> str:
    """Source that imports `modules` as the daemon starts (pcc_plugin.main): no garbage
    collected; betterproto2's version read without importlib.metadata; the imports with
    trio's library lookups answered, what the stack does not need loaded at first use, and
    generated code taken from the cache where there is one; asyncio and grpclib first,
    without ssl, when they are among what `modules` import; betterproto2 loaded before the
    first module that uses it."""
    imports = [f"    import {module}\n" for module in modules]
    users = [i for i, m in enumerate(modules) if m.startswith(("pcc_plugin", "betterproto2"))]
    if users:
        imports.insert(users[0], "    _betterproto2.load()\n")
    if any(module not in _NEITHER_ASYNCIO_NOR_GRPCLIB for module in modules):
        imports.insert(
            0,
            "    with _first_use.imported_without('ssl'):\n"
            "        for _module in _first_use.SSL_OPTIONAL:\n"
            "            __import__(_module)\n",
        )
    if not imports:
        return "pass\n"
    return (
        "import gc\n"
        "gc.disable()\n"
        "from pcc_plugin import _betterproto2, _first_use, _generated_code, _library_lookups\n"
        "_betterproto2.install()\n"
        "with _library_lookups.glibc_sonames(), "
        "_first_use.loaded_at_first_use(*_first_use.STACK_UNUSED), "
        "_generated_code.compiled_at_build():\n"
    ) + "".join(imports)


# The daemon's stack imported as the daemon imports it, and none of our other modules: beside
# the daemon's start, what is left is what our own code and the registration add. It exits
# as soon as imported: a daemon's start is timed to its registration, not to a finalized exit.
_STACK = ("trio", "betterproto2.grpclib", "attrs", "asyncinotify", "grpclib.client",
          "grpclib.server", "trio_asyncio")  # fmt: skip
STACK_AS_THE_DAEMON_IMPORTS_IT = _as_the_daemon_imports(_STACK) + "import os\nos._exit(0)\n"
_REPORT_RSS = (
    "for _line in open('/proc/self/status'):\n"
    "    if _line.startswith('VmRSS:'):\n"
    "        print(_line.split()[1])\n"
)


def import_time_before_registering(bench: Bench) -> None:
    """The daemon's own `-X importtime` lines up to its registration, summed by package."""
    report = bench.report
    report.section("imports before registering (-X importtime of one start, metrics on)")
    daemon, _ = bench.start(env={"PYTHONPROFILEIMPORTTIME": "1"})
    # The daemon logs it once Register has returned, a moment after kubelet accepted.
    daemon.wait_for_log("Registered device plugin with Kubelet", WAIT)
    bench.stop(daemon)
    log = daemon.log_text()
    before = log[: log.index("Registered device plugin with Kubelet")]
    by_package: collections.Counter[str] = collections.Counter()
    modules = set()
    for line in before.splitlines():
        match = _IMPORT_LINE.match(line)
        if match:
            self_us, _, _, module = match.groups()
            modules.add(module)
            by_package[_package(module)] += int(self_us)
    total = sum(by_package.values())
    report.figures["import_time_us"] = dict(by_package)
    report.add("modules imported / their import time", f"{len(modules)} / {total / 1000:.0f} ms")
    for package, micros in by_package.most_common(8):
        report.add(f"  {package}", f"{micros / 1000:.1f} ms")
    found = unneeded_imports(modules)
    report.add("imported before registering, not needed for it", ", ".join(found) or "none")


def _package(module: str) -> str:
    if module.startswith("pcc_plugin"):
        return "pcc_plugin (ours, with generated code)"
    top = module.split(".")[0]
    return "stdlib and other" if top.startswith("_") or top in sys.stdlib_module_names else top


def import_rss(modules: Sequence[str], runs: int, env: dict[str, str]) -> float:
    """VmRSS in kB of a fresh interpreter after importing `modules`, lowest of `runs`."""
    source = _as_the_daemon_imports(modules) + _REPORT_RSS
    figures = []
    for _ in range(runs):
        output = subprocess.run(
            [sys.executable, "-c", source],
            capture_output=True, text=True, check=True, cwd=ROOT,
            env={**os.environ, **env}, timeout=WAIT,
        ).stdout  # fmt: skip
        figures.append(float(output))
    return min(figures)


def import_table(report: Report, runs: int, env: dict[str, str]) -> None:
    report.section("VmRSS of imports, fresh interpreters: 'adds' cumulative in this order, 'alone'")
    bare = import_rss([], runs, env)
    report.add("bare interpreter (this venv, site on)", mib(bare))
    cumulative: list[str] = []
    previous = bare
    table = {"bare": bare}
    for label, modules in IMPORT_STEPS:
        cumulative += modules.split(",")
        total = import_rss(cumulative, runs, env)
        alone = import_rss(modules.split(","), runs, env)
        report.add(
            f"+ {label}",
            f"adds {(total - previous) / 1024:+.1f}, alone {(alone - bare) / 1024:+.1f}, "
            f"total {mib(total)}",
        )
        table[label] = total
        previous = total
    report.figures["imports_kib"] = table
