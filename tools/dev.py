#!/usr/bin/env python3
"""Run the project's nox sessions with nothing but python3 (3.11 to 3.15):

    python3 tools/dev.py -s demo      # the demo
    python3 tools/dev.py              # the default sessions: lint, typecheck, tests
    python3 tools/dev.py -s bench     # any session, any nox argument

Nothing is installed into that python3, so a distribution's own interpreter works as it is
(Debian's and Ubuntu's refuse `pip install` outside a virtual environment, PEP 668). The
first run fetches uv, a pinned release whose SHA-256 is checked, into .cache/dev/ in the
repository, with this python3's pip (`pip download`: pip's own configuration, PIP_INDEX_URL
or pip.conf, says where from); uv then runs the pinned nox, and nox's sessions make their
virtual environments with uv from this same python3. uv trusts the system's certificate
store, as Python does (UV_SYSTEM_CERTS=true, unless it is set already).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import io
import os
import platform
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# The CPython versions CI tests, as pyproject.toml's requires-python says (a test checks both).
OLDEST, NEWEST = (3, 11), (3, 15)
NOX_VERSION = "2026.10.20"
UV_VERSION = "0.13.9"
# The wheel of that uv release for each machine, and its SHA-256 as PyPI publishes it.
UV_WHEELS = {
    "x86_64": (
        f"uv-{UV_VERSION}-py3-none-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "d7f459fe4fd247d830351c75686d3996ace3c6f3f728eb0e85a30b7ada0cef19",
    ),
    "aarch64": (
        f"uv-{UV_VERSION}-py3-none-manylinux_2_17_aarch64.manylinux2014_aarch64"
        ".musllinux_1_1_aarch64.whl",
        "5435c5ce14a56431208ca0996416d310f1598e8c2c8ba707688985a16bb82dbe",
    ),
    "ppc64le": (
        f"uv-{UV_VERSION}-py3-none-manylinux_2_17_ppc64le.manylinux2014_ppc64le.whl",
        "c5dbdb7c8737cd183a9dce95b39cfd1f3d54ec2a27a1bb58f160293f9ba2c805",
    ),
    "s390x": (
        f"uv-{UV_VERSION}-py3-none-manylinux_2_17_s390x.manylinux2014_s390x.whl",
        "a6e845f387e4ed55bb59342957a9179e24a631fcc7668bda3426ae1cef8ed4b9",
    ),
}
# uv's switch to the system's certificate store (in uv 0.13; --system-certs on its command line).
SYSTEM_CERTS = "UV_SYSTEM_CERTS"
ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "dev" / f"uv-{UV_VERSION}"


def fail(message: str) -> None:
    print(f"tools/dev.py: {message}", file=sys.stderr)
    raise SystemExit(2)


def uv_binary() -> Path:
    binary = CACHE / "uv"
    if binary.exists():
        return binary
    machine = platform.machine()
    if sys.platform != "linux" or machine not in UV_WHEELS:
        fail(
            f"no pinned uv for {sys.platform}/{machine}: install uv {UV_VERSION} and nox "
            f"{NOX_VERSION} yourself (e.g. pipx install nox=={NOX_VERSION}) and run nox"
        )
    CACHE.mkdir(parents=True, exist_ok=True)
    # Several runs may start at once (CI runs two); one fetches, the others wait for it.
    with open(CACHE / "fetch.lock", "wb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not binary.exists():
            install(binary, *UV_WHEELS[machine])
    return binary


def install(binary: Path, filename: str, sha256: str) -> None:
    if importlib.util.find_spec("pip") is None:
        fail(f"needs pip for {sys.executable} to fetch uv (Debian: apt-get install python3-pip)")
    print(f"tools/dev.py: fetching uv {UV_VERSION} with pip (once)", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=CACHE) as download:
        fetch = [
            sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
            "--only-binary=:all:", "--dest", download, f"uv=={UV_VERSION}",
        ]  # fmt: skip
        if subprocess.run(fetch, check=False).returncode != 0:
            fail(
                f"pip could not fetch uv {UV_VERSION} (above); pip's configuration says where "
                "from: set PIP_INDEX_URL for a mirror"
            )
        wheel = Path(download) / filename
        if not wheel.exists():
            fail(f"pip fetched {os.listdir(download)}, not {filename}")
        data = wheel.read_bytes()
    if hashlib.sha256(data).hexdigest() != sha256:
        fail(f"{filename} does not have the expected SHA-256: refusing to run it")
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        content = archive.read(f"uv-{UV_VERSION}.data/scripts/uv")
    # Written under a name of its own and closed before the rename: exec fails (ETXTBSY) on a
    # file any process still holds open for writing.
    descriptor, staged = tempfile.mkstemp(dir=CACHE, prefix="uv.")
    with os.fdopen(descriptor, "wb") as file:
        file.write(content)
    os.chmod(staged, 0o755)
    os.replace(staged, binary)


def python_problem(version: tuple[int, ...], executable: str) -> str | None:
    """Why this project cannot run on Python `version`, in one line, or None."""
    if OLDEST <= tuple(version[:2]) <= NEWEST:
        return None
    tested = "{}.{} to {}.{}".format(*OLDEST, *NEWEST)
    return (
        f"needs Python {tested} (what CI tests), this is "
        f"{'.'.join(map(str, version[:3]))} ({executable}); run it with one of those "
        f"(e.g. python3.{NEWEST[1]} tools/dev.py)"
    )


def main() -> None:
    problem = python_problem(tuple(sys.version_info[:3]), sys.executable)
    if problem:
        fail(problem)
    uv = uv_binary()
    env = {**os.environ, "PATH": f"{uv.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    # uv trusts only the roots it bundles unless told otherwise; Python, which fetched uv, and
    # pip trust the system's store, where a TLS-intercepting proxy's root is installed.
    env.setdefault(SYSTEM_CERTS, "true")
    command = [
        str(uv), "tool", "run", "--python", sys.executable, "--from", f"nox=={NOX_VERSION}",
        "nox", "--noxfile", str(ROOT / "noxfile.py"), *sys.argv[1:],
    ]  # fmt: skip
    os.execve(command[0], command, env)


if __name__ == "__main__":
    main()
