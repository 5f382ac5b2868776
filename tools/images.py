"""The image for four architectures: local Debian bases, podman builds, archives and SBOMs.

``nox -s image`` drives this module; it needs root, podman and debootstrap, and for each foreign
architecture a qemu-user binfmt_misc handler with the F flag (``.ci/run`` registers them). Every
architecture is built from the one Containerfile on a debootstrapped Debian base of its own
architecture. The build stage runs on this machine's base and installs wheels for the target
(uv's ``--python-platform``), so under emulation only the image's last check runs at build time.
A foreign base is debootstrap's first stage, its packages then unpacked and recorded natively
(``unpack_and_record``): no program of the base runs under emulation while it is made.

What a build leaves behind (``nox -s e2e`` reads the native one):

- ``build/images/pcc-device-plugin-linux-<arch>.tar``: a docker-archive tarball per architecture
  (Go's spelling: amd64, arm64, ppc64le, s390x), named ``localhost/pcc-device-plugin:<version>``
  inside, the name the manifests use;
- in podman's store, ``localhost/pcc-device-plugin:<version>-<arch>`` per architecture. No
  manifest list: podman 4.3's ``podman images`` fails for every image once the store holds one
  made of local images (containers/podman#19757), and so would the next build;
- in CACHE, the debootstrap tarball of each base, keyed on what it is built from; in podman's
  store, the base imported from it (``localhost/pcc-device-plugin-base:<key>``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import fcntl
import hashlib
import io
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
import tomllib
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parent.parent
ARCHIVES = ROOT / "build" / "images"
LOGS = ROOT / "build" / "logs"
CACHE = Path(os.environ.get("PCC_IMAGE_CACHE", "/var/cache/pcc-device-plugin")) / "bases"
NAME = "localhost/pcc-device-plugin"
BASE_NAME = "localhost/pcc-device-plugin-base"

# Debian 13 (trixie, Python 3.13) for each architecture, but where the Debian archive that these
# machines reach lacks its current files: it serves trixie's point release 13.8 for amd64 and
# arm64, but not for ppc64el and s390x (libc6, zlib1g, libexpat1, openssl... answer 404), so
# those two stay on Debian 12 (bookworm, Python 3.11) until it does. PCC_IMAGE_SUITE names one
# suite for all four. Each image's build stage runs on this machine's base of the same suite: the
# two Pythons must be one version. Bases of each suite are keyed apart.
SUITES = {"amd64": "trixie", "arm64": "trixie", "ppc64le": "bookworm", "s390x": "bookworm"}
# The Debian release (/etc/os-release's VERSION_ID) and Python of each suite.
RELEASES = {"bookworm": ("12", "3.11"), "trixie": ("13", "3.13")}
PACKAGES = "python3,python3-venv"
# A foreign base is only read for the image's runtime root.
FOREIGN_PACKAGES = "python3"
DEBIAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What this machine trusts and how it reaches the package index: only for the base of this
# machine's architecture, the build stage's, the one base whose Python downloads anything. The
# foreign bases stay plain Debian (and update-ca-certificates is not run under emulation).
EXTRA_CAS = Path("/usr/local/share/ca-certificates")
PIP_CONF = Path("/etc/pip.conf")
# uv (in the Containerfile's build stage) trusts the base's CA store, as Debian's pip does.
UV_TOML = "system-certs = true\n"
RECIPE = 4  # bump when the recipe below changes in a way the key cannot see

Log = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class Arch:
    name: str  # Go and OCI: amd64, arm64, ppc64le, s390x
    debian: str  # dpkg's architecture
    machine: str  # uname -m, qemu's name, and the binfmt_misc handler's (qemu-<machine>)
    elf_machine: int  # e_machine of its ELF files
    byteorder: Literal["little", "big"]  # EI_DATA of its ELF files

    @property
    def platform(self) -> str:
        return f"linux/{self.name}"


ARCHES = {
    a.name: a
    for a in (
        Arch("amd64", "amd64", "x86_64", 62, "little"),
        Arch("arm64", "arm64", "aarch64", 183, "little"),
        Arch("ppc64le", "ppc64el", "ppc64le", 21, "little"),
        Arch("s390x", "s390x", "s390x", 22, "big"),
    )
}
# This machine's architecture (uname -m says arm64 on macOS), None if it is none of the four.
NATIVE = next((a for a in ARCHES.values() if os.uname().machine in (a.machine, a.name)), None)


def version() -> str:
    """The project's version: pyproject's, or pcc_plugin.__version__ when it is dynamic."""
    with (ROOT / "pyproject.toml").open("rb") as f:
        project = tomllib.load(f)["project"]
    if "version" in project:
        return str(project["version"])
    found = re.search(
        r'^__version__ = "([^"]+)"$', (ROOT / "pcc_plugin" / "__init__.py").read_text(), re.M
    )
    assert found, "pcc_plugin/__init__.py has no __version__ line"
    return found[1]


def arch_tag(arch: Arch) -> str:
    """The image of one architecture in podman's store."""
    return f"{NAME}:{version()}-{arch.name}"


def manifest_list() -> str:
    """The name inside each archive: the manifests' image, a manifest list in a registry."""
    return f"{NAME}:{version()}"


def archive_path(arch: Arch) -> Path:
    return ARCHIVES / f"pcc-device-plugin-linux-{arch.name}.tar"


def selected(names: str | None) -> list[Arch]:
    """Architectures from a comma-separated list (PCC_IMAGE_ARCHES); all four when empty."""
    if not names:
        return list(ARCHES.values())
    unknown = sorted(set(names.split(",")) - set(ARCHES))
    if unknown:
        raise ValueError(f"unknown architecture {', '.join(unknown)}; known: {', '.join(ARCHES)}")
    return [ARCHES[n] for n in ARCHES if n in names.split(",")]


# Emulation.

BINFMT = Path("/proc/sys/fs/binfmt_misc")


def emulation_problem(arch: Arch) -> str | None:
    """Why this machine cannot run `arch`'s programs, in one line, or None if it can.

    A foreign architecture needs qemu-user's binfmt_misc handler, enabled and with the F flag
    (the kernel opens the interpreter when it is registered, so it works in chroots and builds).
    """
    if arch == NATIVE:
        return None
    if NATIVE is None:
        return f"cannot build on {os.uname().machine}: only on {', '.join(ARCHES)}"
    handler = BINFMT / f"qemu-{arch.machine}"
    if not (BINFMT / "status").exists():
        return f"cannot run {arch.name} programs: binfmt_misc is not mounted at {BINFMT}"
    if not handler.exists():
        return f"cannot run {arch.name} programs: no binfmt_misc handler {handler.name}"
    lines = handler.read_text().splitlines()
    flags = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("flags:")), "")
    if "enabled" not in lines:
        return f"cannot run {arch.name} programs: {handler} is disabled"
    if "F" not in flags:
        return f"cannot run {arch.name} programs: {handler} lacks the F flag (has {flags!r})"
    return None


# ELF files, to check that an image holds its own architecture's code.


def elf_arch(path: Path) -> Arch | None:
    """The architecture of an ELF file by its header, None if it is not ELF (or none of ours)."""
    with path.open("rb") as f:
        header = f.read(20)
    if len(header) < 20 or header[:4] != b"\x7fELF":
        return None
    byteorder: Literal["little", "big"]
    if header[5] == 1:
        byteorder = "little"
    elif header[5] == 2:
        byteorder = "big"
    else:
        return None
    machine = int.from_bytes(header[18:20], byteorder)
    return next(
        (a for a in ARCHES.values() if (a.elf_machine, a.byteorder) == (machine, byteorder)),
        None,
    )


def elf_interpreter(path: Path) -> str | None:
    """The program interpreter (PT_INTERP) that a 64-bit ELF program names, None if none."""
    with path.open("rb") as f:
        header = f.read(64)
        if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2:
            return None
        order: Literal["little", "big"] = "little" if header[5] == 1 else "big"
        phoff = int.from_bytes(header[32:40], order)
        size, count = int.from_bytes(header[54:56], order), int.from_bytes(header[56:58], order)
        f.seek(phoff)
        table = f.read(size * count)
        for start in range(0, len(table) - size + 1, size):
            entry = table[start : start + size]
            if int.from_bytes(entry[0:4], order) == 3:  # PT_INTERP
                offset = int.from_bytes(entry[8:16], order)
                length = int.from_bytes(entry[32:40], order)
                f.seek(offset)
                return f.read(length).rstrip(b"\0").decode()
    return None


# Bases.


def suite(arch: Arch) -> str:
    """The Debian suite of `arch`'s image: SUITES, or PCC_IMAGE_SUITE for every architecture."""
    chosen = os.environ.get("PCC_IMAGE_SUITE") or SUITES[arch.name]
    if chosen not in RELEASES:
        raise ValueError(f"PCC_IMAGE_SUITE={chosen}: known suites are {', '.join(RELEASES)}")
    return chosen


# A base: a suite for an architecture.
Base = tuple[str, Arch]


def _base_key(base: Base) -> str:
    suite_name, arch = base
    digest = hashlib.sha256(f"v{RECIPE} {suite_name} {arch.debian} minbase".encode())
    if arch != NATIVE:
        digest.update(f"unpacked {FOREIGN_PACKAGES}".encode())
    else:
        digest.update(PACKAGES.encode())
        digest.update(f"build stage's base {UV_TOML!r}".encode())
        for ca in extra_cas():
            digest.update(ca.name.encode() + b"\0" + ca.read_bytes())
        if PIP_CONF.exists():
            digest.update(b"pip.conf\0" + PIP_CONF.read_bytes())
    return f"{suite_name}-{arch.name}-{digest.hexdigest()[:12]}"


def extra_cas() -> list[Path]:
    return sorted(EXTRA_CAS.glob("**/*.crt"))


def _exists(ref: str) -> bool:
    return subprocess.run(["podman", "image", "exists", ref], check=False).returncode == 0


def _image_id(ref: str) -> str:
    return subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Id}}", ref],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def _unmount_below(path: Path) -> None:
    """Unmount whatever a failed debootstrap left mounted inside `path` (its /proc, /sys)."""
    with open("/proc/self/mounts") as mounts:
        targets = [line.split()[1] for line in mounts]
    for target in sorted(targets, key=len, reverse=True):
        if Path(target).is_relative_to(path):
            subprocess.run(["umount", "--lazy", target], check=False)


def run_logged(argv: Sequence[str], log_file: Path) -> None:
    """Run `argv` with its output in `log_file`; on failure, raise with the log's last lines."""
    with log_file.open("ab") as out:
        out.write(f"$ {' '.join(argv)}\n".encode())
        out.flush()
        result = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        tail = log_file.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(
            f"{argv[0]} exited {result.returncode} (log: {log_file}):\n" + "\n".join(tail)
        )


def _debootstrap(base: Base, tarball: Path, log: Log) -> None:
    """Debian minbase with python3 (and venv and this machine's CAs for the build stage's) for
    `arch`, as a tarball."""
    suite_name, arch = base
    log_file = LOGS / f"debootstrap-{suite_name}-{arch.name}.log"
    log_file.unlink(missing_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
        rootfs = Path(tmp) / "rootfs"
        try:
            if arch == NATIVE:
                run_logged(
                    [
                        "debootstrap", "--variant=minbase", f"--include={PACKAGES}", suite_name,
                        str(rootfs),
                    ],
                    log_file,
                )  # fmt: skip
                _reach_the_index_as_this_machine(rootfs, log_file)
            else:
                # The first stage only: it downloads and unpacks, natively.
                run_logged(
                    [
                        "debootstrap", "--foreign", f"--arch={arch.debian}", "--variant=minbase",
                        f"--include={FOREIGN_PACKAGES}", suite_name, str(rootfs),
                    ],
                    log_file,
                )  # fmt: skip
                unpack_and_record(rootfs)
            for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
                for entry in (rootfs / cache).glob("*"):
                    if entry.is_file():
                        entry.unlink()
            partial = Path(tmp) / "base.tar"
            run_logged(
                [
                    "tar", "--numeric-owner", "--exclude=./dev/*", "--exclude=./proc/*",
                    "--exclude=./sys/*", "-C", str(rootfs), "-cf", str(partial), ".",
                ],
                log_file,
            )  # fmt: skip
            os.replace(partial, tarball)
        finally:
            _unmount_below(rootfs)
    log(f"base {suite_name} {arch.name}: debootstrap took {time.monotonic() - started:.0f} s")


def unpack_and_record(rootfs: Path) -> None:
    """What debootstrap's second stage leaves that the image is made of, without running a
    program of the root: the packages the first stage downloaded but did not unpack, unpacked,
    and every package recorded in dpkg's database as installed, with its file list and
    checksums.

    The second stage runs each package's maintainer scripts, under emulation for a foreign
    architecture: 2.5 (bookworm s390x) to 21 (trixie arm64) minutes of CPU per base. What they
    make (the standard library's bytecode, ld.so.cache, /etc/passwd, alternatives) is not
    listed by any package, and the image takes only listed files (runtime_root.py) and compiles
    its bytecode itself.
    """
    state = rootfs / "debootstrap"
    required = set((state / "required").read_text().split())
    info = rootfs / "var/lib/dpkg/info"
    index = _priorities(rootfs)
    status = []
    for line in (state / "debpaths").read_text().splitlines():
        name, deb = line.split()
        deb_file = rootfs / deb.lstrip("/")
        data = subprocess.run(
            ["dpkg-deb", "--fsys-tarfile", str(deb_file)], capture_output=True, check=True
        ).stdout
        if name not in required:  # the first stage unpacked those
            # As dpkg does, through the root's /bin -> usr/bin links (merged /usr).
            subprocess.run(
                ["tar", "--keep-directory-symlink", "-xf", "-", "-C", str(rootfs)],
                input=data,
                check=True,
            )
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            paths = ["/" + member.name.removeprefix(".").strip("/") for member in tar]
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(["dpkg-deb", "--control", str(deb_file), tmp], check=True)
            control = {f.name: f.read_bytes() for f in Path(tmp).iterdir()}
        # Field -> what follows its colon, continuation lines included, in the package's order.
        paragraph = control["control"].decode()
        fields = dict(re.findall(r"^([\w-]+):(.*(?:\n[ \t].*)*)", paragraph, re.M))
        # dpkg's name for the files of a package that can be installed for several architectures.
        if fields.get("Multi-Arch", "").strip() == "same":
            name = f"{name}:{fields['Architecture'].strip()}"
        listed = "".join(f"{path.rstrip('/') or '/.'}\n" for path in paths)
        (info / f"{name}.list").write_text(listed)
        if "md5sums" in control:
            (info / f"{name}.md5sums").write_bytes(control["md5sums"])
        fields["Status"] = " install ok installed"
        # The priority dpkg records after a second stage: the archive's for the required
        # packages (their records come from its index), the package's own for the rest.
        if fields["Package"].strip() in required:
            fields.update(index.get(fields["Package"].strip(), {}))
        # A line of conffiles is a path, after flags (remove-on-upgrade) if any.
        conffiles = [
            line.split()[-1]
            for line in control.get("conffiles", b"").decode().splitlines()
            if line.strip() and (rootfs / line.split()[-1].lstrip("/")).is_file()
        ]
        if conffiles:
            fields["Conffiles"] = "".join(
                f"\n {path} {hashlib.md5((rootfs / path.lstrip('/')).read_bytes()).hexdigest()}"
                for path in conffiles
            )
        ordered = sorted(fields, key=lambda f: DPKG_FIELDS.index(f) if f in DPKG_FIELDS else 99)
        status.append("".join(f"{f}:{fields[f]}\n" for f in ordered) + "\n")
    (rootfs / "var/lib/dpkg/status").write_text("".join(status))
    shutil.rmtree(state)
    # The second stage's work that the image shows: debootstrap, in a container, made /proc a
    # link to the host's for it, and base-files' maintainer script moves /var/run and /var/lock
    # into /run.
    if (rootfs / "proc").is_symlink():
        (rootfs / "proc").unlink()
        (rootfs / "proc").mkdir(mode=0o755)
    for moved, target in (("var/run", "/run"), ("var/lock", "/run/lock")):
        if not (rootfs / moved).is_symlink():
            (rootfs / moved).rmdir()
            (rootfs / moved).symlink_to(target)


# The order of the fields of dpkg's status file; others follow in the package's order.
DPKG_FIELDS = [
    "Package", "Essential", "Protected", "Status", "Priority", "Section", "Installed-Size",
    "Origin", "Maintainer", "Bugs", "Architecture", "Multi-Arch", "Source", "Version",
    "Config-Version", "Replaces", "Provides", "Depends", "Pre-Depends", "Recommends", "Suggests",
    "Breaks", "Conflicts", "Enhances", "Conffiles", "Description",
]  # fmt: skip


def _priorities(rootfs: Path) -> dict[str, dict[str, str]]:
    """Package -> its Priority in the archive's index that debootstrap downloaded."""
    found = {}
    for index in (rootfs / "var/lib/apt/lists").glob("*_Packages"):
        for package, priority in re.findall(
            r"^Package: (\S+)\n(?:[^\n]+\n)*?Priority:( \S+)$", index.read_text(), re.M
        ):
            found[package] = {"Priority": priority}
    return found


def _reach_the_index_as_this_machine(rootfs: Path, log_file: Path) -> None:
    """What this machine trusts and how it reaches the index, and uv told to trust the base's
    CA store."""
    trust_as_this_machine(rootfs, log_file)
    (rootfs / "etc/uv").mkdir(exist_ok=True)
    (rootfs / "etc/uv/uv.toml").write_text(UV_TOML)


def trust_as_this_machine(rootfs: Path, log_file: Path) -> None:
    """This machine's extra CAs (a TLS-intercepting proxy's) and its pip.conf, in a Debian
    root (tools/pythons.py's too)."""
    cas = extra_cas()
    for ca in cas:
        shutil.copy(ca, rootfs / "usr/local/share/ca-certificates" / ca.name)
    if cas:
        run_logged(["chroot", str(rootfs), "update-ca-certificates"], log_file)
    if PIP_CONF.exists():
        shutil.copy(PIP_CONF, rootfs / "etc/pip.conf")


def base_images(arches: Iterable[Arch], log: Log) -> dict[Base, str]:
    """The local Debian bases that the images of `arches` are built on, imported into podman;
    debootstrapped when missing: each architecture's of its suite, and this machine's of each
    of those suites (the build stages').

    The debootstraps that are needed run at once (each is mostly download). The tarball in
    CACHE and the image in podman's store are both keyed on the recipe (and for this machine's
    architecture on its extra CAs and pip.conf); those of another key for the same suite and
    architecture are removed.
    """
    assert NATIVE is not None, "emulation_problem() tells first"
    wanted = {(suite(a), a) for a in arches} | {(suite(a), NATIVE) for a in arches}
    order = list(ARCHES.values())
    bases = sorted(wanted, key=lambda base: (base[0], order.index(base[1])))
    CACHE.mkdir(parents=True, exist_ok=True)
    LOGS.mkdir(parents=True, exist_ok=True)
    with _locked(CACHE / ".lock", log):
        return _base_images(bases, log)


@contextlib.contextmanager
def _locked(path: Path, log: Log) -> Iterator[None]:
    """One builder of bases at a time on this machine; what a killed one left is removed."""
    with path.open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another build of the bases ({path} is locked)")
            fcntl.flock(lock, fcntl.LOCK_EX)
        for leftover in path.parent.glob("tmp*"):
            _unmount_below(leftover)
            shutil.rmtree(leftover, ignore_errors=True)
        yield


def _base_images(bases: list[Base], log: Log) -> dict[Base, str]:
    keys = {base: _base_key(base) for base in bases}
    refs = {base: f"{BASE_NAME}:{keys[base]}" for base in bases}
    tarballs = {base: CACHE / f"{keys[base]}.tar" for base in bases}
    to_bootstrap = [b for b in bases if not _exists(refs[b]) and not tarballs[b].exists()]
    if to_bootstrap:
        log(f"debootstrap {', '.join(f'{s} {a.name}' for s, a in to_bootstrap)} at once")
        with concurrent.futures.ThreadPoolExecutor(len(to_bootstrap)) as pool:
            futures = [pool.submit(_debootstrap, b, tarballs[b], log) for b in to_bootstrap]
            for future in futures:
                future.result()
    in_store = subprocess.run(
        ["podman", "images", "--format", "{{.Repository}}:{{.Tag}}", BASE_NAME],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for base in bases:
        suite_name, arch = base
        prefix = f"{suite_name}-{arch.name}-"
        # Bases of another key (the recipe or this machine's CAs changed).
        for stale in CACHE.glob(f"{prefix}*.tar"):
            if stale != tarballs[base]:
                stale.unlink()
        for name in in_store:
            if name.startswith(f"{BASE_NAME}:{prefix}") and name != refs[base]:
                subprocess.run(["podman", "rmi", name], capture_output=True, check=False)
        if _exists(refs[base]):
            log(f"base {suite_name} {arch.name}: {refs[base]} (cached)")
            continue
        subprocess.run(
            [
                "podman", "import", "--quiet", "--os", "linux", "--arch", arch.name,
                "--change", f"ENV PATH={DEBIAN_PATH}", str(tarballs[base]), refs[base],
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        log(f"base {suite_name} {arch.name}: {refs[base]} (imported from {tarballs[base]})")
    return refs


# The SBOM tool: syft (Anchore), built from its module with Go, once per version of syft and of
# Go, into the cache; the Go module proxy (GOPROXY) is where it comes from.

SYFT = "github.com/anchore/syft/cmd/syft"
SYFT_VERSION = "v1.57.2"
TOOLS = CACHE.parent / "tools"


def _go() -> str:
    go = shutil.which("go")
    if go is None:
        raise RuntimeError("the SBOM tool (syft) is built with Go: `go` is not on PATH")
    return go


def sbom_tool(log: Log) -> Path:
    """syft's binary, built when it is not in the cache (a few minutes of CPU, once)."""
    go = _go()
    go_version = subprocess.run(
        [go, "env", "GOVERSION"], capture_output=True, text=True, check=True
    ).stdout.strip()
    binary = TOOLS / f"syft-{SYFT_VERSION}-{go_version}-unoptimised" / "syft"
    if binary.exists():
        return binary
    TOOLS.mkdir(parents=True, exist_ok=True)
    LOGS.mkdir(parents=True, exist_ok=True)
    with _locked(TOOLS / ".lock", log):
        if binary.exists():
            return binary
        started = time.monotonic()
        log_file = LOGS / "sbom-tool.log"
        log_file.unlink(missing_ok=True)
        with tempfile.TemporaryDirectory(dir=TOOLS) as tmp:
            # A build cache of its own, deleted with the directory: 1.1 GB that nothing reuses
            # once the binary is cached. The modules (GOMODCACHE) stay where Go keeps them.
            env = {
                **os.environ,
                "GOBIN": tmp,
                "GOCACHE": str(Path(tmp) / "go-build"),
                "CGO_ENABLED": "0",
            }
            # Without optimisation, inlining, DWARF and symbol tables, as tools/e2e/builds.py
            # builds kubelet: 189 s of CPU instead of 342, and it writes the same SBOMs.
            with log_file.open("ab") as out:
                result = subprocess.run(
                    [go, "install", "-trimpath", "-gcflags=all=-N -l -dwarf=false",
                     "-ldflags=-s -w", f"{SYFT}@{SYFT_VERSION}"],
                    stdout=out, stderr=subprocess.STDOUT, env=env, check=False,
                )  # fmt: skip
            if result.returncode != 0:
                tail = log_file.read_text(errors="replace").splitlines()[-10:]
                raise RuntimeError(f"go install {SYFT}@{SYFT_VERSION} failed:\n" + "\n".join(tail))
            binary.parent.mkdir(exist_ok=True)
            os.replace(Path(tmp) / "syft", binary)
        for stale in TOOLS.glob("syft-*"):
            if stale != binary.parent:
                shutil.rmtree(stale, ignore_errors=True)
        log(f"SBOM tool: syft {SYFT_VERSION} built in {time.monotonic() - started:.0f} s")
    return binary


def sbom_path(arch: Arch) -> Path:
    """The SBOM beside the image's archive."""
    return ARCHIVES / f"pcc-device-plugin-linux-{arch.name}.spdx.json"


def write_sbom(arch: Arch, tool: Path) -> Path:
    """An SPDX 2.3 JSON SBOM of the saved archive (what a node gets): every Debian package that
    status.d records and every Python distribution, with their versions."""
    target = sbom_path(arch)
    partial = target.with_suffix(".partial")
    subprocess.run(
        [str(tool), "scan", "--quiet", f"docker-archive:{archive_path(arch)}",
         "--source-name", "pcc-device-plugin", "--source-version", version(),
         "--output", f"spdx-json={partial}"],
        check=True,
        # Nothing from the network: no check for a newer syft.
        env={**os.environ, "SYFT_CHECK_FOR_APP_UPDATE": "false"},
    )  # fmt: skip
    os.replace(partial, target)
    return target


# Images.


def _podman_images(*filters: str) -> set[str]:
    listing = subprocess.run(
        ["podman", "images", "--all", "--quiet", "--no-trunc", *filters],
        capture_output=True,
        text=True,
        check=True,
    )
    return {image_id.removeprefix("sha256:") for image_id in listing.stdout.split()}


@contextlib.contextmanager
def removing_intermediates(arches: Iterable[Arch]) -> Iterator[None]:
    """Remove the untagged images that the builds for `arches` leave: their build stages, and
    the images of an earlier build whose tags (arch_tag) the new ones took.

    Not forced: an image that another build on this machine is using stays.
    """
    before = _podman_images()
    earlier = {_image_id(arch_tag(a)) for a in arches if _exists(arch_tag(a))}
    try:
        yield
    finally:
        dangling = _podman_images("--filter", "dangling=true")
        leftovers = (dangling - before) | (dangling & earlier)
        if leftovers:
            subprocess.run(["podman", "rmi", *sorted(leftovers)], capture_output=True, check=False)


def build(arch: Arch, bases: dict[Base, str], run: Callable[..., object]) -> str:
    """Build the Containerfile for `arch` on its base; return its tag (arch_tag).

    The build stage runs on this machine's base of `arch`'s suite (BUILD_BASE_IMAGE), and the
    runtime root comes from `arch`'s (BASE_IMAGE). Bases are passed by image ID: podman 4.3
    applies the first stage's platform to the second stage's lookup by name, and an ID is
    looked up as it is.
    """
    tag = arch_tag(arch)
    assert NATIVE is not None, "emulation_problem() tells first"
    run(
        "podman", "build", "--isolation=chroot", "--pull=never", "--platform", arch.platform,
        "--build-arg", f"BUILD_BASE_IMAGE={_image_id(bases[(suite(arch), NATIVE)])}",
        "--build-arg", f"BASE_IMAGE={_image_id(bases[(suite(arch), arch)])}",
        "--tag", tag, "--file", str(ROOT / "Containerfile"), str(ROOT),
        external=True,
    )  # fmt: skip
    return tag


def size(ref: str) -> int:
    return int(
        subprocess.run(
            ["podman", "image", "inspect", "--format", "{{.Size}}", ref],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )


def save_archive(arch: Arch) -> Path:
    """arch_tag(arch) as a docker-archive tarball named like the manifest list, by rename.

    The name inside is the manifests' image (``localhost/pcc-device-plugin:<version>``), as a
    node of that architecture has it after pulling the manifest list from a registry. The name
    is freed first (remove_manifest_list) and given back after.
    """
    target = archive_path(arch)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".tar.partial")
    partial.unlink(missing_ok=True)
    name = manifest_list()
    remove_manifest_list()
    subprocess.run(["podman", "tag", arch_tag(arch), name], check=True)
    try:
        subprocess.run(
            ["podman", "save", "--quiet", "--format", "docker-archive", "--output", str(partial),
             name],
            check=True,
        )  # fmt: skip
    finally:
        subprocess.run(["podman", "untag", arch_tag(arch), name], check=True)
    os.replace(partial, target)
    return target


def remove_manifest_list() -> None:
    """Free manifest_list()'s name: drop a manifest list of that name (an earlier build made
    one; not its images), or untag a plain image that an interrupted save left with it.

    By name, not through `podman images`, which a manifest list of local images breaks
    (containers/podman#19757).
    """
    name = manifest_list()
    if _exists(name):
        removed = subprocess.run(["podman", "manifest", "rm", name], capture_output=True)
        if removed.returncode != 0:  # a plain image holds the name
            subprocess.run(["podman", "untag", name, name], capture_output=True, check=False)
