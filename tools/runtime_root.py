"""The image's runtime root: Debian's Python and the files of the packages it needs, nothing else.

The Containerfile's build stage runs this with the target platform's base mounted read-only at
BASE. It only reads files, so it runs on the building machine's platform for every target:

    python3 runtime_root.py BASE ROOT VENV

From BASE's dpkg database it takes the packages of the interpreter that /usr/bin/python3 names
(python3.X-minimal, libpython3.X-stdlib), base-files (/etc/os-release, by which scanners know
the distribution), those with the libraries that the compiled modules of the virtual
environment VENV link (manylinux wheels may link libstdc++, which Python does not), and what
they depend on (Depends and Pre-Depends, recursively). It copies their files into ROOT as dpkg
lists them, less documentation (the copyright file stays: it carries the licence, which
scanners read), glibc's iconv modules and every program but the interpreter. A package left
with nothing but documentation is left out whole, and so are its dependencies unless something
else needs them: base-files pre-depends on awk for its maintainer scripts, and no awk comes
along. debconf (which tzdata depends on for its questions at install), dpkg and install-info
(for readline-common's manual) are left out by name. Each package with files in ROOT is
recorded as distroless images record theirs, for scanners: /var/lib/dpkg/status.d/<package>
(its status entry) and <package>.md5sums (of the files kept). No shell, dpkg, apt or coreutils
comes along: Python depends on none of them.

Errors a user can cause (a base without Debian's python3, a build stage of another Python
version) end in one line and exit 1.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import sys
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Literal, NoReturn

# Documentation, and the debuggers' helpers (libstdc++'s Python scripts for gdb).
DOCUMENTATION = (
    "/usr/share/doc/",
    "/usr/share/gdb/",
    "/usr/share/gcc/",
    "/usr/share/doc-base/",
    "/usr/share/man/",
    "/usr/share/info/",
    "/usr/share/lintian/",
    "/usr/share/locale/",
    "/usr/share/bug/",
    "/usr/share/menu/",
)
# glibc's iconv modules (gconv): iconv(3) loads them, and nothing here calls it. Python's codecs
# are its own, and the charsets of C.UTF-8, the image's only locale, are built into glibc.
# A third of libc6's size, 8 to 20 MB by architecture.
ICONV_MODULES = re.compile(r"^/usr/lib/[^/]+/gconv(/|$)")
STATUS_D = "var/lib/dpkg/status.d"
# Dependencies for the maintainer scripts alone, never of a running program: debconf (tzdata's
# questions), dpkg and install-info (readline-common's info manual).
FOR_MAINTAINER_SCRIPTS = {"debconf", "cdebconf", "dpkg", "install-info"}


def fail(message: str) -> NoReturn:
    print(f"runtime_root: {message}", file=sys.stderr)
    raise SystemExit(1)


def paragraphs(text: str) -> Iterator[str]:
    for block in re.split(r"\n\s*\n", text):
        if block.strip():
            yield block.strip("\n") + "\n"


def field(paragraph: str, name: str) -> str:
    """A field's value, continuation lines joined."""
    found = re.search(rf"^{name}:[ \t]*(.*(?:\n[ \t].*)*)", paragraph, re.M | re.I)
    return " ".join(found[1].split()) if found else ""


class Base:
    """The target's base: its files and dpkg's record of them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        status = path / "var/lib/dpkg/status"
        if not status.is_file():
            fail("BASE_IMAGE has no dpkg database (/var/lib/dpkg/status): it must be Debian's")
        self.packages = {}
        for paragraph in paragraphs(status.read_text()):
            if field(paragraph, "Status").split()[-1:] == ["installed"]:
                self.packages[field(paragraph, "Package")] = paragraph
        self.provided: dict[str, str] = {}
        for name, paragraph in sorted(self.packages.items()):
            for item in field(paragraph, "Provides").split(","):
                if item.strip():
                    self.provided.setdefault(item.split()[0].split(":")[0], name)

    def host(self, path: PurePosixPath) -> Path:
        return self.path / str(path).lstrip("/")

    def info(self, name: str, suffix: str) -> Path:
        """dpkg's info file of `name` (a multi-arch package's is name:arch.suffix)."""
        arch = field(self.packages[name], "Architecture")
        qualified = self.path / f"var/lib/dpkg/info/{name}:{arch}.{suffix}"
        return qualified if qualified.exists() else qualified.with_name(f"{name}.{suffix}")

    def dependencies(self, name: str) -> list[str]:
        """What `name` pre-depends and depends on; of alternatives (a | b), the first installed."""
        paragraph = self.packages[name]
        found = []
        relations = f"{field(paragraph, 'Pre-Depends')},{field(paragraph, 'Depends')}"
        for relation in relations.split(","):
            choices = [c.split()[0].split(":")[0] for c in relation.split("|") if c.strip()]
            if not choices:
                continue
            chosen = next((c for c in choices if c in self.packages), None)
            chosen = chosen or next((self.provided[c] for c in choices if c in self.provided), None)
            if chosen is None:
                fail(f"{name} depends on {relation.strip()}, which BASE_IMAGE does not have")
            if chosen not in FOR_MAINTAINER_SCRIPTS:
                found.append(chosen)
        return found

    def resolve(self, path: PurePosixPath) -> tuple[PurePosixPath, list[PurePosixPath]]:
        """`path` with the symbolic links of its parents followed inside the base, and those
        links (Debian's /lib -> usr/lib and the like), which the root needs too."""
        current = PurePosixPath("/")
        parts = list(path.parts[1:])
        links: list[PurePosixPath] = []
        for _ in range(64):
            if len(parts) <= 1:
                return current.joinpath(*parts), links
            current /= parts.pop(0)
            if self.host(current).is_symlink():
                links.append(current)
                target = PurePosixPath(os.readlink(self.host(current)))
                parts = [*target.parts[1 if target.is_absolute() else 0 :], *parts]
                current = PurePosixPath("/") if target.is_absolute() else current.parent
        fail(f"{path}: too many symbolic links in BASE_IMAGE")


def is_program(path: Path) -> bool:
    """A file that runs by itself: an executable script (not a Python module: the standard
    library has some with a #! line), or an ELF program. Of the libraries, the dynamic loader
    and libc.so.6 also run, and stay: every program needs them."""
    mode = path.lstat().st_mode
    if not stat.S_ISREG(mode) or not mode & 0o111:
        return False
    with path.open("rb") as f:
        head = f.read(64)
        if head.startswith(b"#!"):
            return not path.name.endswith(".py")
        if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2:  # 64-bit ELF only
            return False
        order: Literal["little", "big"] = "little" if head[5] == 1 else "big"
        e_type = int.from_bytes(head[16:18], order)
        if e_type == 2:  # ET_EXEC
            return True
        if e_type != 3 or path.name.startswith("libc.so"):  # ET_DYN: a library or a PIE program
            return False
        # A PIE program names its loader (PT_INTERP); a library does not.
        phoff = int.from_bytes(head[32:40], order)
        size, count = int.from_bytes(head[54:56], order), int.from_bytes(head[56:58], order)
        f.seek(phoff)
        headers = f.read(size * count)
    return any(int.from_bytes(headers[i : i + 4], order) == 3 for i in range(0, len(headers), size))


def needed(path: Path) -> list[str]:
    """The libraries (DT_NEEDED) that a 64-bit ELF shared object or program links."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return []
    order: Literal["little", "big"] = "little" if data[5] == 1 else "big"

    def number(offset: int, size: int) -> int:
        return int.from_bytes(data[offset : offset + size], order)

    phoff, size, count = number(32, 8), number(54, 2), number(56, 2)
    segments = [phoff + i * size for i in range(count)]
    # (virtual address, file offset, size) of each PT_LOAD, to find the string table.
    loads = [(number(h + 16, 8), number(h + 8, 8), number(h + 32, 8)) for h in segments
             if number(h, 4) == 1]  # fmt: skip
    dynamic = next((h for h in segments if number(h, 4) == 2), None)  # PT_DYNAMIC
    if dynamic is None:
        return []
    entries = [
        (number(at, 8), number(at + 8, 8))
        for at in range(
            number(dynamic + 8, 8), number(dynamic + 8, 8) + number(dynamic + 32, 8), 16
        )
    ]
    strtab = next(value for tag, value in entries if tag == 5)  # DT_STRTAB, an address
    offset = next(o + strtab - a for a, o, n in loads if a <= strtab < a + n)
    names = []
    for tag, value in entries:
        if tag == 0:  # DT_NULL
            break
        if tag == 1:  # DT_NEEDED
            end = data.index(b"\0", offset + value)
            names.append(data[offset + value : end].decode())
    return names


def is_loader(path: PurePosixPath) -> bool:
    """The dynamic loader, which the kernel opens as it would a program: it keeps its x bit."""
    return path.name.startswith(("ld-linux", "ld64.so"))


class Entry:
    """One path of a package, as dpkg lists it and where it really is."""

    def __init__(self, listed: str, path: PurePosixPath, links: list[PurePosixPath]) -> None:
        self.listed = listed
        self.path = path
        self.links = links


def entries(base: Base, name: str, interpreter: PurePosixPath) -> list[Entry]:
    """The paths of `name` that the root gets: no documentation, no program but `interpreter`."""
    kept = []
    for line in base.info(name, "list").read_text().splitlines():
        if line in ("", "/.") or not line.startswith("/"):
            continue
        if line.startswith(DOCUMENTATION) and not line.endswith("/copyright"):
            continue
        if ICONV_MODULES.match(line):
            continue
        path, links = base.resolve(PurePosixPath(line))
        source = base.host(path)
        if not source.is_symlink() and not source.exists():
            continue  # diverted, or removed by a maintainer script
        if path != interpreter and is_program(source):
            continue
        kept.append(Entry(line, path, links))
    return kept


def has_content(base: Base, found: list[Entry]) -> bool:
    """Anything but directories and documentation."""
    return any(
        not e.listed.startswith(DOCUMENTATION) and not base.host(e.path).is_dir() for e in found
    )


def copy(base: Base, root: Path, entry: Entry, interpreter: PurePosixPath) -> None:
    for link in [*entry.links, entry.path]:
        source, target = base.host(link), root / str(link).lstrip("/")
        if source.is_symlink() and not target.is_symlink():
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(source), target)
    source, target = base.host(entry.path), root / str(entry.path).lstrip("/")
    if source.is_symlink():
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    if source.is_dir():
        target.mkdir(exist_ok=True)
        shutil.copystat(source, target)
    elif source.is_file():
        shutil.copy2(source, target)
        # Nothing but the interpreter and its loader runs: the rest loses its x bits, the
        # standard library's modules with a #! line and libc.so.6 among them.
        if entry.path != interpreter and not is_loader(entry.path):
            target.chmod(target.stat().st_mode & ~0o111)


def record(base: Base, root: Path, name: str, found: list[Entry]) -> None:
    """The package's status entry, and the md5sums of its files that the root has."""
    status_d = root / STATUS_D
    status_d.mkdir(parents=True, exist_ok=True)
    (status_d / name).write_text(base.packages[name])
    sums = base.info(name, "md5sums")
    if sums.exists():
        listed = {e.listed.lstrip("/") for e in found}
        lines = [line for line in sums.read_text().splitlines() if line[34:] in listed]
        (status_d / f"{name}.md5sums").write_text("".join(f"{line}\n" for line in lines))


def dangling(root: Path, link: Path) -> bool:
    """A symbolic link in the root whose target, followed inside the root, is not there."""
    current = link
    for _ in range(64):
        if not current.is_symlink():
            return not current.exists()
        target = Path(os.readlink(current))
        if target.is_absolute():
            current = root / target.relative_to("/")
        else:
            current = current.parent / target
    return True


def libraries_for(base: Base, environment: Path) -> list[str]:
    """The packages of `base` that have the libraries that the compiled modules of the virtual
    environment `environment` link and do not bring themselves (libstdc++ for C++ ones)."""
    objects = [p for p in environment.rglob("*.so*") if p.is_file() and not p.is_symlink()]
    bundled = {p.name for p in environment.rglob("*.so*")}
    wanted = {name for p in objects for name in needed(p)} - bundled
    owners: dict[str, str] = {}
    for name in sorted(base.packages):
        for line in base.info(name, "list").read_text().splitlines():
            if "/lib" in line and PurePosixPath(line).name in wanted:
                owners.setdefault(PurePosixPath(line).name, name)
    missing = sorted(wanted - set(owners))
    if missing:
        fail(
            f"the virtual environment's compiled modules link {', '.join(missing)}, which no "
            "package of BASE_IMAGE has: install the package that has it in BASE_IMAGE"
        )
    return sorted(set(owners.values()))


def main(base_path: Path, root: Path, environment: Path) -> None:
    base = Base(base_path)
    python3 = base.host(PurePosixPath("/usr/bin/python3"))
    if not python3.is_symlink() or not re.fullmatch(r"python3\.\d+", os.readlink(python3)):
        fail("BASE_IMAGE has no /usr/bin/python3 -> python3.X from Debian's python3 package")
    version = os.readlink(python3).removeprefix("python")
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if version != here:
        fail(
            f"BASE_IMAGE has Python {version}, the build stage {here}: the bytecode and the "
            "virtual environment are made for the build stage's; use one BASE_IMAGE for both"
        )
    roots = [f"python{version}-minimal", f"libpython{version}-stdlib", "base-files"]
    missing = [name for name in roots if name not in base.packages]
    if missing:
        fail(f"BASE_IMAGE lacks {', '.join(missing)} (Debian's python3 and base-files)")
    interpreter = PurePosixPath(f"/usr/bin/python{version}")
    roots += libraries_for(base, environment)

    included: dict[str, list[Entry]] = {}
    seen: set[str] = set()
    pending = list(roots)
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        found = entries(base, name, interpreter)
        if has_content(base, found):
            included[name] = found
            pending += base.dependencies(name)
    for name, found in sorted(included.items()):
        for entry in found:
            copy(base, root, entry, interpreter)
        record(base, root, name, found)
    # Links to what was left out (a program, documentation).
    for link in sorted(p for p in root.rglob("*") if p.is_symlink()):
        if dangling(root, link):
            link.unlink()
    # The loader's path in every program (/lib64/ld-linux-x86-64.so.2 on amd64) goes through
    # Debian's merged-/usr links, which dpkg does not list.
    for link in sorted(base_path.glob("lib*")):
        target = root / link.name
        if link.is_symlink() and not target.is_symlink() and (root / "usr" / link.name).is_dir():
            os.symlink(os.readlink(link), target)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        fail("usage: runtime_root.py BASE ROOT VENV")
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
