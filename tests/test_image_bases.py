"""A foreign architecture's base without debootstrap's emulated second stage (tools/images.py's
``unpack_and_record``): from what the first stage leaves, the root and dpkg's database as the
second stage would leave them, without running a program of the root.

Two small packages stand in for Debian's: one the first stage unpacked (required), one it only
downloaded. ``nox -s image`` checks the real bases' outcome in every image (test_image.py).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import images

pytestmark = pytest.mark.skipif(
    shutil.which("dpkg-deb") is None, reason="needs dpkg-deb (Debian's dpkg)"
)


def deb(tmp_path: Path, control: str, files: dict[str, bytes], conffiles: str = "") -> Path:
    """A package built with dpkg-deb from `control` and `files` (path -> content)."""
    tree = tmp_path / "tree"
    shutil.rmtree(tree, ignore_errors=True)
    (tree / "DEBIAN").mkdir(parents=True)
    (tree / "DEBIAN/control").write_text(control)
    sums = "".join(f"{hashlib.md5(data).hexdigest()}  {path}\n" for path, data in files.items())
    (tree / "DEBIAN/md5sums").write_text(sums)
    if conffiles:
        (tree / "DEBIAN/conffiles").write_text(conffiles)
    for path, data in files.items():
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        (tree / path).write_bytes(data)
    name = control.split("\n", 1)[0].removeprefix("Package: ")
    built = tmp_path / f"{name}.deb"
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "--build", str(tree), str(built)],
        check=True,
        capture_output=True,
    )
    return built


ALPHA = """Package: libalpha1
Version: 1.0-1
Architecture: s390x
Maintainer: Someone <someone@example.org>
Installed-Size: 10
Section: libs
Priority: standard
Multi-Arch: same
Homepage: https://example.org/alpha
Description: a library
 that the first stage unpacked
"""
BETA = """Package: beta
Version: 2.0-1
Architecture: s390x
Maintainer: Someone <someone@example.org>
Priority: optional
Depends: libalpha1 (>= 1.0)
Description: a program
"""


def test_a_first_stage_root_is_unpacked_and_recorded_as_the_second_stage_would(
    tmp_path: Path,
) -> None:
    rootfs = tmp_path / "rootfs"
    archives = rootfs / "var/cache/apt/archives"
    for directory in ("usr/bin", "var/lib/dpkg/info", "var/lib/apt/lists", "var/run", "var/lock"):
        (rootfs / directory).mkdir(parents=True)
    archives.mkdir(parents=True)
    (rootfs / "bin").symlink_to("usr/bin")  # merged /usr
    (rootfs / "proc").symlink_to("/proc")  # debootstrap's in a container
    alpha = deb(
        tmp_path,
        ALPHA,
        {"etc/alpha.conf": b"setting = 1\n", "usr/lib/s390x-linux-gnu/libalpha.so.1": b"\x7fELF"},
        conffiles="/etc/alpha.conf\n",
    )
    beta = deb(tmp_path, BETA, {"bin/beta": b"#!/bin/sh\n"})
    shutil.move(alpha, archives / "libalpha1_1.0-1_s390x.deb")
    shutil.move(beta, archives / "beta_2.0-1_s390x.deb")
    # What the first stage leaves: the required package unpacked, the index, its state.
    subprocess.run(
        f"dpkg-deb --fsys-tarfile {archives}/libalpha1_1.0-1_s390x.deb | tar -xf - -C {rootfs}",
        shell=True,
        check=True,
    )
    (rootfs / "etc/alpha.conf").write_text("setting = 1\n")
    (rootfs / "var/lib/apt/lists/mirror_dists_bookworm_main_binary-s390x_Packages").write_text(
        "Package: libalpha1\nVersion: 1.0-1\nPriority: optional\nSection: libs\n\n"
        "Package: beta\nVersion: 2.0-1\nPriority: important\n"
    )
    state = rootfs / "debootstrap"
    state.mkdir()
    (state / "required").write_text("libalpha1\n")
    (state / "debpaths").write_text(
        "libalpha1 /var/cache/apt/archives/libalpha1_1.0-1_s390x.deb\n"
        "beta /var/cache/apt/archives/beta_2.0-1_s390x.deb\n"
    )

    images.unpack_and_record(rootfs)

    # Unpacked through /bin -> usr/bin, as dpkg does, the link kept.
    assert (rootfs / "bin").is_symlink()
    assert (rootfs / "usr/bin/beta").read_bytes() == b"#!/bin/sh\n"
    info = rootfs / "var/lib/dpkg/info"
    assert (info / "libalpha1:s390x.list").read_text() == (
        "/.\n/etc\n/etc/alpha.conf\n/usr\n/usr/lib\n/usr/lib/s390x-linux-gnu\n"
        "/usr/lib/s390x-linux-gnu/libalpha.so.1\n"
    )
    assert (info / "beta.list").read_text() == "/.\n/bin\n/bin/beta\n"
    assert (info / "beta.md5sums").read_text() == (
        f"{hashlib.md5(b'#!/bin/sh' + bytes([10])).hexdigest()}  bin/beta\n"
    )
    conf_md5 = hashlib.md5(b"setting = 1\n").hexdigest()
    # dpkg's field order; the archive's priority for the required package, the package's own
    # for the other; fields dpkg does not know last.
    assert (rootfs / "var/lib/dpkg/status").read_text() == (
        "Package: libalpha1\nStatus: install ok installed\nPriority: optional\nSection: libs\n"
        "Installed-Size: 10\nMaintainer: Someone <someone@example.org>\nArchitecture: s390x\n"
        "Multi-Arch: same\nVersion: 1.0-1\n"
        f"Conffiles:\n /etc/alpha.conf {conf_md5}\n"
        "Description: a library\n that the first stage unpacked\n"
        "Homepage: https://example.org/alpha\n"
        "\n"
        "Package: beta\nStatus: install ok installed\nPriority: optional\n"
        "Maintainer: Someone <someone@example.org>\nArchitecture: s390x\nVersion: 2.0-1\n"
        "Depends: libalpha1 (>= 1.0)\nDescription: a program\n"
        "\n"
    )
    # What base-files' maintainer script does that the image shows, and a /proc of its own.
    assert (rootfs / "var/run").readlink() == Path("/run")
    assert (rootfs / "var/lock").readlink() == Path("/run/lock")
    assert (rootfs / "proc").is_dir()
    assert not (rootfs / "proc").is_symlink()
    assert not state.exists()
