"""The other CPythons CI tests on, beside Debian 12's 3.11: 3.13 (pyenv), 3.14 and 3.15 (sid).

``nox -s pythons`` drives this module; it needs root, unshare and chroot, and debootstrap the
first time. Python 3.14 and 3.15 come from a Debian sid root (debootstrap minbase with
python3.14, python3.15, pip and curl: what Debian testing and sid ship), made once and cached in
CACHE under a key of its recipe and of what this machine trusts and how it reaches the package
index (its extra CAs, its pip.conf). 3.13 is the machine's pyenv build.

Each command runs as a user of that Python would run it, `python3.X tools/dev.py ...` in the
repository, in a private mount namespace: for 3.14 and 3.15 chrooted into the sid root, with
the host's /proc, /sys, /dev and /tmp, the repository at its own path and the host's uv cache.
There the repository's .nox is build/pythons/nox-<version>, so each interpreter keeps
virtual environments of its own and the host's stay as they are.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import images

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("PCC_IMAGE_CACHE", "/var/cache/pcc-device-plugin")) / "pythons"
WORK = ROOT / "build" / "pythons"
SUITE = "sid"
# curl: the README's blocks use it, as a laptop has it.
PACKAGES = "python3.14,python3.15,python3-pip,ca-certificates,curl"
IN_ROOT = ("3.14", "3.15")
RECIPE = 1  # bump when the recipe below changes in a way the key cannot see
PYENV_ROOT = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))

Log = Callable[[str], None]


class Unavailable(Exception):
    """This machine cannot give that Python; the message says why and what to do."""


def _key() -> str:
    digest = hashlib.sha256(f"v{RECIPE} {SUITE} minbase {PACKAGES}".encode())
    for ca in images.extra_cas():
        digest.update(ca.name.encode() + b"\0" + ca.read_bytes())
    if images.PIP_CONF.exists():
        digest.update(b"pip.conf\0" + images.PIP_CONF.read_bytes())
    return f"{SUITE}-{digest.hexdigest()[:12]}"


def sid_root(log: Log) -> Path:
    """The Debian sid root, debootstrapped the first time (a minute or two, mostly download)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    root = CACHE / _key()
    with (CACHE / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if root.is_dir():
            return root
        for stale in CACHE.iterdir():
            if stale.is_dir() and stale.name.startswith(f"{SUITE}-"):
                shutil.rmtree(stale, ignore_errors=True)
        if shutil.which("debootstrap") is None:
            raise Unavailable("Python 3.14 and 3.15 come from a Debian sid root: needs debootstrap")
        started = time.monotonic()
        WORK.mkdir(parents=True, exist_ok=True)
        log_file = WORK / "debootstrap.log"
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            staged = Path(tmp) / "root"
            try:
                images.run_logged(
                    ["debootstrap", "--variant=minbase", f"--include={PACKAGES}", SUITE,
                     str(staged)],
                    log_file,
                )  # fmt: skip
                images.trust_as_this_machine(staged, log_file)
            except RuntimeError as failed:
                raise Unavailable(str(failed)) from None
            for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
                for entry in (staged / cache).glob("*"):
                    if entry.is_file():
                        entry.unlink()
            staged.rename(root)
        log(f"Debian {SUITE} root with Python {', '.join(IN_ROOT)}: debootstrap took "
            f"{time.monotonic() - started:.0f} s")  # fmt: skip
    return root


def pyenv_python(version: str) -> Path:
    """pyenv's newest build of `version` (3.13 -> ~/.pyenv/versions/3.13.N/bin/python3.13)."""
    found = sorted(
        PYENV_ROOT.glob(f"versions/{version}.*/bin/python{version}"),
        key=lambda path: [int(part) for part in path.parts[-3].split(".") if part.isdigit()],
    )
    if not found:
        raise Unavailable(
            f"no Python {version} under {PYENV_ROOT}/versions: install one "
            f"(pyenv install {version}) or leave {version} out (nox -s pythons -- 3.14 3.15)"
        )
    return found[-1]


# Mounted in the namespace before the command; $ROOT is the sid root, or empty on the host.
_NAMESPACE = """
set -e
nox_dir=$1; uv_cache=$2; root=$3; shift 3
repo=$(pwd)
if [ -n "$root" ]; then
    # A chroot whose / is no mount point cannot unshare again (the tests do): make it one.
    mount --bind "$root" "$root"
    for dir in proc sys dev; do mount --rbind "/$dir" "$root/$dir"; done
    mount --bind /tmp "$root/tmp"
    mkdir -p "$root$repo" "$root$uv_cache"
    mount --bind "$repo" "$root$repo"
    mount --bind "$uv_cache" "$root$uv_cache"
    cp /etc/resolv.conf "$root/etc/resolv.conf"
fi
mount --bind "$nox_dir" "$root$repo/.nox"
if [ -n "$root" ]; then
    exec chroot "$root" /bin/sh -c 'cd "$0" && exec "$@"' "$repo" "$@"
fi
exec "$@"
"""


def run(version: str, args: Sequence[str], log: Log) -> int:
    """`python<version> tools/dev.py <args>` as a user of that Python runs it; its exit code."""
    root = sid_root(log) if version in IN_ROOT else None
    python = f"python{version}" if root else str(pyenv_python(version))
    nox_dir = WORK / f"nox-{version}"
    nox_dir.mkdir(parents=True, exist_ok=True)
    (ROOT / ".nox").mkdir(exist_ok=True)
    uv_cache = Path(os.environ.get("UV_CACHE_DIR", Path.home() / ".cache" / "uv"))
    uv_cache.mkdir(parents=True, exist_ok=True)
    command = [python, "tools/dev.py", *args]
    where = f"in the Debian {SUITE} root" if root else "(pyenv)"
    log(f"Python {version} {where}: {' '.join(command)}")
    return subprocess.run(
        [
            "unshare", "--mount", "--propagation", "private", "--", "sh", "-c", _NAMESPACE,
            "sh", str(nox_dir), str(uv_cache), str(root or ""), *command,
        ],
        cwd=ROOT,
        check=False,
    ).returncode  # fmt: skip
