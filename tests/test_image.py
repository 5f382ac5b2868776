"""The built images, checked from their filesystems, and the plugin started from each.

``nox -s image`` builds the image for each architecture on a local Debian base of that
architecture and runs this file with ``PCC_IMAGES`` set to ``arch=image,...`` (Go's names:
amd64, arm64, ppc64le, s390x); elsewhere these tests skip. Every test runs once per image, a
foreign architecture's programs under qemu-user (binfmt_misc with the F flag, so they run in
the chroot; arm64 with qemu's cheap pointer authentication, see ``emulation_env``). They need
root, podman, ``unshare``, ``chroot``, ``nsenter`` and ``ip``:
``podman run`` cannot start containers in this sandbox, so the plugin is started the way a
container runtime would start it, by hand. In private mount and network namespaces (the mounts
vanish with the last process, even when a test fails) the image's root filesystem is made
read-only as the hardened overlay asks, gets /proc and a small /dev, and every hostPath volume
of the rendered hardened DaemonSet is bind-mounted where the manifest mounts it, from a fake
host; the entry point then runs under ``chroot --userspec`` as the image's user, with exactly
the image's environment.

What is checked inside the image: no file that can run but the interpreter, its dynamic loader
and the entry point, and no shell, dpkg, apt, perl or coreutils program even as a dangling link;
no compiler or build tool on the image's PATH; no pip, setuptools, wheel or uv, no test suites,
no plain bytecode, no build stage leftovers, wheels, .deb files or VCS data; the simulated
kubelet's dependencies (grpc, protobuf) not installed. /var/lib/dpkg/status.d records exactly
the Debian packages whose files are in the image (each file checked against dpkg's checksum),
the environment's distributions are the lock's, and the SBOM beside the archive lists exactly
both with their versions. Every command that the README and docs/ tell users to run with
``kubectl exec`` runs in the container's namespaces, as written, with the daemon as PID 1 (on
this machine's architecture; on the others each command's program is checked to be there).

``test_architecture`` fails if the image's Python, a compiled module or a wheel in its virtual
environment is of another architecture than the image says it is: by the ELF header of the
interpreter and of every shared object, by the tags of every installed wheel, and by what the
interpreter itself reports when it runs. ``PCC_IMAGE_REPORT`` names a file that gets one JSON
line per image with its start → registered time.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from subprocess import CompletedProcess

import pytest
from manifests_support import (
    NAME,
    PLUGIN_DIR,
    RESOURCE,
    ROOT,
    Obj,
    daemonsets,
    flag,
    host_mounts,
    plugin_container,
    project_version,
)
from packaging.markers import Marker
from packaging.utils import canonicalize_name

from pcc_plugin.sim import Daemon, FakeNode, SimKubelet

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import images

IMAGES = dict(item.split("=", 1) for item in os.environ.get("PCC_IMAGES", "").split(",") if item)
pytestmark = pytest.mark.skipif(
    not IMAGES, reason="runs in `nox -s image`, which builds the images (needs root and podman)"
)
REPORT = os.environ.get("PCC_IMAGE_REPORT")

VENV = "/opt/pcc-device-plugin"
ENTRY_POINT = f"{VENV}/bin/pcc-device-plugin"
DEPLOYMENT = "manifests/overlays/hardened"
BUILD_TOOLS = ("cc", "gcc", "g++", "c++", "clang", "cpp", "make", "ld", "as")
SHARES = 16
STATUS_D = "var/lib/dpkg/status.d"


def run(*argv: str, timeout: float = 60) -> str:
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    assert result.returncode == 0, (
        f"{shlex.join(argv)} exited {result.returncode}:\n{result.stderr}"
    )
    return result.stdout


@pytest.fixture(scope="module", params=[a for a in images.ARCHES if a in IMAGES], ids=str)
def arch(request: pytest.FixtureRequest) -> images.Arch:
    return images.ARCHES[request.param]


@pytest.fixture(scope="module")
def image(arch: images.Arch) -> str:
    return IMAGES[arch.name]


@pytest.fixture(scope="module")
def inspected(image: str) -> Obj:
    found: Obj = json.loads(run("podman", "image", "inspect", image))[0]
    return found


@pytest.fixture(scope="module")
def config(inspected: Obj) -> Obj:
    image_config: Obj = inspected["Config"]
    return image_config


def emulated(arch: images.Arch) -> bool:
    return arch != images.NATIVE


def patience(arch: images.Arch) -> float:
    """How much longer than at home a wait may take: qemu-user is some 10 times slower."""
    return 4.0 if emulated(arch) else 1.0


@pytest.fixture(scope="module")
def rootfs(image: str) -> Iterator[Path]:
    """The root filesystem of a container created (never started) from the image.

    Like a runtime's, it is writable until the start test makes it read-only, so mount points
    can be made in it; podman removes it with the container.
    """
    container = f"pcc-image-test-{os.getpid()}"
    run("podman", "create", "--name", container, image)
    try:
        yield Path(run("podman", "mount", container).strip())
    finally:
        subprocess.run(["podman", "umount", container], capture_output=True, check=False)
        subprocess.run(["podman", "rm", "--force", container], capture_output=True, check=False)


def user_spec(config: Obj) -> str:
    user = config.get("User") or "0"
    uid, _, gid = user.partition(":")
    assert uid.isdigit(), f"the image's USER {user!r} must be numeric for chroot --userspec"
    return f"{uid}:{gid or uid}"


def emulation_env(rootfs: Path) -> list[str]:
    """What qemu-user is told for this image's programs, when they are emulated.

    Debian 13's arm64 programs authenticate pointers (PAC); qemu-user's default CPU does so
    with the architecture's QARMA algorithm in software, which made the emulated daemon start
    three times slower than Debian 12's. Its implementation-defined algorithm is as correct for
    a program and cheap: the emulated figures then measure the image, not that algorithm.
    """
    arch = images.elf_arch(in_image(rootfs, f"{VENV}/bin/python"))
    if arch != images.NATIVE and arch == images.ARCHES["arm64"]:
        return ["QEMU_CPU=max,pauth-impdef=on"]
    return []


def image_argv(config: Obj, rootfs: Path, *args: str) -> list[str]:
    """The entry point under chroot, as the image's user, with only the image's environment
    (and what qemu-user is told, for a foreign image)."""
    chroot = shutil.which("chroot")
    assert chroot, "chroot (coreutils) is not installed"
    return [
        "env",
        "-i",
        *config.get("Env", []),
        *emulation_env(rootfs),
        chroot,
        f"--userspec={user_spec(config)}",
        str(rootfs),
        *config["Entrypoint"],
        *args,
    ]


def test_metadata(config: Obj) -> None:
    assert config["User"] == "0"
    assert config["Entrypoint"] == [ENTRY_POINT]
    labels = config["Labels"]
    assert labels["org.opencontainers.image.version"] == project_version()
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert labels["org.opencontainers.image.title"] == NAME


def in_image(rootfs: Path, path: str) -> Path:
    """`path` inside the image, its symbolic links followed inside the image too."""
    current = PurePosixPath("/")
    parts = list(PurePosixPath(path).parts[1:])
    for _ in range(100):
        if not parts:
            return rootfs / str(current).lstrip("/")
        current /= parts.pop(0)
        host = rootfs / str(current).lstrip("/")
        if host.is_symlink():
            target = PurePosixPath(os.readlink(host))
            parts = list(target.parts[1:] if target.is_absolute() else target.parts) + parts
            current = PurePosixPath("/") if target.is_absolute() else current.parent
    raise AssertionError(f"{path}: too many symbolic links in the image")


def test_architecture(arch: images.Arch, inspected: Obj, config: Obj, rootfs: Path) -> None:
    """The image is of the architecture it was built for, through and through."""
    assert (inspected["Os"], inspected["Architecture"]) == ("linux", arch.name)
    # The entry point runs the virtual environment's python, which is the base's interpreter.
    entry_point = in_image(rootfs, ENTRY_POINT)
    assert entry_point.read_text().splitlines()[0] == f"#!{VENV}/bin/python"
    interpreter = in_image(rootfs, f"{VENV}/bin/python")
    assert interpreter.is_relative_to(rootfs), interpreter
    assert images.elf_arch(interpreter) == arch, f"{interpreter} is not {arch.name}"
    venv = rootfs / VENV.lstrip("/")
    objects = sorted(venv.rglob("*.so*"))
    assert objects, "no compiled modules: greenlet and multidict have some"
    wrong = [
        f"{p.relative_to(venv)}: {images.elf_arch(p)}"
        for p in objects
        if images.elf_arch(p) != arch
    ]
    assert not wrong, f"shared objects not for {arch.name}: {wrong}"
    tags = [
        line.removeprefix("Tag: ")
        for wheel in venv.glob("lib/python3*/site-packages/*.dist-info/WHEEL")
        for line in wheel.read_text().splitlines()
        if line.startswith("Tag: ")
    ]
    platforms = {tag.rsplit("-", 1)[1] for tag in tags}
    assert "any" in platforms
    wrong_tags = sorted(p for p in platforms if p != "any" and not p.endswith(f"_{arch.machine}"))
    assert not wrong_tags, f"wheels for other platforms than {arch.machine}: {wrong_tags}"
    # And the interpreter, run (under qemu-user when foreign), says so itself.
    python = f"{VENV}/bin/python"
    argv = image_argv({**config, "Entrypoint": [python]}, rootfs, "-c", MACHINE)
    assert run(*argv, timeout=60 * patience(arch)).split() == [arch.machine, "64bit"]


MACHINE = "import platform; print(platform.machine(), platform.architecture()[0])"


def test_entry_point_help(arch: images.Arch, config: Obj, rootfs: Path) -> None:
    output = run(*image_argv(config, rootfs, "--help"), timeout=60 * patience(arch))
    assert output.startswith("usage: pcc-device-plugin")
    for option in ("--pcc-device", "--pcc-socket-path", "--resource-name", "--resource-count"):
        assert option in output
    for option in ("--device-plugin-path", "--host-root", "--v"):
        assert option in output


IMPORT_ALL = """
import importlib, pkgutil, pcc_plugin
names = [m.name for m in pkgutil.iter_modules(pcc_plugin.__path__)]
# The simulated kubelet is test code: .containerignore keeps it out of the image.
assert "sim" not in names, names
# __main__ would start the daemon.
names = [n for n in names if n != "__main__"]
for name in names:
    importlib.import_module("pcc_plugin." + name)
import yaml
print(len(names), "with_libyaml=%s" % yaml.__with_libyaml__)
"""


def test_every_daemon_module_imports(arch: images.Arch, config: Obj, rootfs: Path) -> None:
    """All runtime dependencies are there for this platform, PyYAML's source build included."""
    python = f"{VENV}/bin/python"
    argv = image_argv({**config, "Entrypoint": [python]}, rootfs, "-c", IMPORT_ALL)
    count, libyaml = run(*argv, timeout=60 * patience(arch)).split()
    assert int(count) >= 5
    # Built from its sdist without a compiler: pure Python, as on every architecture.
    assert libyaml == "with_libyaml=False"


def walk(rootfs: Path) -> Iterator[Path]:
    """Every file, link and directory in the image, symbolic links not followed."""
    for directory, dirnames, filenames in os.walk(rootfs):
        for name in dirnames + filenames:
            yield Path(directory) / name


def image_path(rootfs: Path, path: Path) -> str:
    return os.path.normpath("/" + str(path.relative_to(rootfs)))


def runnable(path: Path) -> bool:
    """A file that the kernel would run: an x bit, and an ELF header or a #! line."""
    if path.is_symlink() or not path.is_file() or not path.stat().st_mode & 0o111:
        return False
    with path.open("rb") as f:
        head = f.read(4)
    return head == b"\x7fELF" or head.startswith(b"#!")


def test_no_program_but_python_and_the_daemon(rootfs: Path) -> None:
    """The only files that can run: the interpreter, its dynamic loader, the entry point."""
    interpreter = in_image(rootfs, f"{VENV}/bin/python")
    loader = images.elf_interpreter(interpreter)
    assert loader, f"{interpreter} names no dynamic loader"
    expected = {
        image_path(rootfs, p)
        for p in (interpreter, in_image(rootfs, loader), rootfs / ENTRY_POINT.lstrip("/"))
    }
    found = {image_path(rootfs, p) for p in walk(rootfs) if runnable(p)}
    assert found == expected, f"programs the daemon does not run: {sorted(found - expected)}"


def test_no_shell_package_manager_or_coreutils(rootfs: Path) -> None:
    """Not even as a dangling link, nor the libraries of perl, apt or debconf."""
    names = {"sh", "bash", "dash", "busybox", "dpkg", "apt", "apt-get", "perl", "ls", "cat",
             "env", "kill", "chroot", "ldconfig", "debconf"}  # fmt: skip
    found = [
        image_path(rootfs, p)
        for p in walk(rootfs)
        if not p.is_dir() or p.is_symlink()
        if p.name in names or p.name.startswith(("libperl", "libapt", "libdpkg", "Debconf"))
    ]
    found += [image_path(rootfs, p) for p in walk(rootfs) if p.name in ("perl5", "perl-base")]
    assert not found


def test_nothing_but_the_plugin(config: Obj, rootfs: Path) -> None:
    path = next(e.split("=", 1)[1] for e in config["Env"] if e.startswith("PATH="))
    found = [
        f"{directory}/{tool}"
        for directory in path.split(":")
        for tool in BUILD_TOOLS
        if os.path.lexists(f"{rootfs}{directory}/{tool}")
    ]
    assert not found, f"build tools in the image: {found}"
    (site,) = (rootfs / VENV.lstrip("/")).glob("lib/python3*/site-packages")
    for package in ("pip", "setuptools", "wheel", "uv", "tests", "grpc", "google"):
        assert not (site / package).exists(), package
    # No test suites of dependencies (trio's alone was 3.5 MB).
    suites = [image_path(rootfs, p) for p in site.rglob("*") if p.name in ("tests", "_tests")]
    assert not suites
    # Bytecode only as the image loads it (PYTHONOPTIMIZE=2), never checked against sources.
    plain = [
        image_path(rootfs, p) for p in walk(rootfs) if re.search(r"\.cpython-\d+\.pyc$", p.name)
    ]
    assert not plain, f"bytecode that PYTHONOPTIMIZE=2 never loads: {plain[:5]}"
    compiled = [p for p in walk(rootfs) if p.name.endswith(".opt-2.pyc")]
    sources = {p.parent.parent / f"{p.name.split('.')[0]}.py" for p in compiled}
    stdlib = in_image(rootfs, f"/usr/lib/python{python_version(rootfs)}")
    missing = [
        image_path(rootfs, p)
        for top in (stdlib, rootfs / VENV.lstrip("/"))
        for p in walk(top)
        if p.suffix == ".py" and p not in sources and "/test/" not in str(p)
    ]
    assert not missing, f"sources without bytecode: {missing[:5]}"
    # Hash-based and unchecked (PEP 552 flags 0b01): no stat of the source at each import.
    checked = [image_path(rootfs, p) for p in compiled if p.read_bytes()[4:8] != b"\1\0\0\0"]
    assert not checked, f"bytecode checked against its source: {checked[:5]}"
    # Only the entry point and the interpreter's links in the environment's bin.
    scripts = sorted(p.name for p in (rootfs / VENV.lstrip("/") / "bin").iterdir())
    assert [n for n in scripts if not n.startswith("python")] == ["pcc-device-plugin"], scripts
    for leftover in ("src", "dist", "opt/build", "root/.cache", "runtime", "debian"):
        assert not (rootfs / leftover).exists(), leftover
    assert not list((rootfs / "opt").rglob(".git"))
    assert not [p for p in walk(rootfs) if p.suffix in (".whl", ".deb")]


def test_debian_release(arch: images.Arch, rootfs: Path) -> None:
    """The suite's Debian release and its Python (Debian 13's 3.13 where the archive serves
    it, tools/images.py says which), and what scanners read to know the distribution."""
    release, python = images.RELEASES[images.suite(arch)]
    os_release = dict(
        line.split("=", 1)
        for line in in_image(rootfs, "/etc/os-release").read_text().splitlines()
        if "=" in line
    )
    assert (os_release["ID"], os_release["VERSION_ID"]) == ("debian", f'"{release}"')
    assert in_image(rootfs, f"{VENV}/bin/python") == rootfs / f"usr/bin/python{python}"


def dpkg_records(rootfs: Path) -> dict[str, dict[str, str]]:
    """Package -> its fields, from /var/lib/dpkg/status.d as distroless images have it."""
    records = {}
    for entry in sorted((rootfs / STATUS_D).iterdir()):
        if entry.suffix != ".md5sums":
            fields = dict(re.findall(r"^([\w-]+): ?(.*(?:\n .*)*)", entry.read_text(), re.M))
            assert fields["Package"] == entry.name
            records[entry.name] = fields
    return records


def test_dpkg_records_are_exactly_the_packages_in_the_image(
    arch: images.Arch, rootfs: Path
) -> None:
    """Every file that did not come from a package (the plugin's environment, the bytecode
    compiled in the build) is owned by one package recorded in status.d, with dpkg's checksum;
    every package recorded there owns a file that is not its documentation."""
    assert not (rootfs / "var/lib/dpkg/status").exists()
    assert not (rootfs / "var/lib/dpkg/info").exists()
    records = dpkg_records(rootfs)
    owners: dict[str, str] = {}
    wrong = []
    for name, fields in records.items():
        assert fields["Status"] == "install ok installed", name
        assert fields["Architecture"] in (arch.debian, "all"), name
        sums = rootfs / STATUS_D / f"{name}.md5sums"
        listed = [line.split(None, 1) for line in sums.read_text().splitlines()]
        listed += [
            line.split()[1::-1] for line in fields.get("Conffiles", "").splitlines() if line.strip()
        ]
        for md5, path in listed:
            # As dpkg lists it: through Debian's /lib -> usr/lib link on Debian 12.
            found = in_image(rootfs, "/" + path.lstrip("/"))
            if found.is_file() and not found.is_symlink():
                owners[image_path(rootfs, found)] = name
                if hashlib.md5(found.read_bytes()).hexdigest() != md5:
                    wrong.append(path)
    assert not wrong, f"files that differ from their package's: {wrong}"
    made_here = (VENV, f"/{STATUS_D}", "/etc/hosts", "/etc/resolv.conf", "/etc/hostname")
    unowned = [
        path
        for path in map(lambda p: image_path(rootfs, p), walk(rootfs))
        if (rootfs / path.lstrip("/")).is_file()
        and not (rootfs / path.lstrip("/")).is_symlink()
        and not path.startswith(made_here)
        and "/__pycache__/" not in path
        and path not in owners
    ]
    assert not unowned, f"files of no recorded package: {unowned[:10]}"
    content = {owner for path, owner in owners.items() if not path.startswith("/usr/share/doc/")}
    assert set(records) == content, f"recorded without files: {sorted(set(records) - content)}"
    interpreter = f"python{python_version(rootfs)}-minimal"
    assert {interpreter, "libc6", "base-files"} <= set(records)


def python_version(rootfs: Path) -> str:
    return in_image(rootfs, f"{VENV}/bin/python").name.removeprefix("python")


def python_distributions(rootfs: Path) -> dict[str, str]:
    """Normalised name -> version of each distribution in the plugin's environment."""
    (site,) = (rootfs / VENV.lstrip("/")).glob("lib/python3*/site-packages")
    found: dict[str, str] = {}
    for metadata in site.glob("*.dist-info/METADATA"):
        fields = dict(re.findall(r"^(Name|Version): (.*)$", metadata.read_text(), re.M))
        found[canonicalize_name(fields["Name"])] = fields["Version"]
    return found


def test_python_distributions_are_the_lock(arch: images.Arch, rootfs: Path) -> None:
    """Each distribution with its metadata, at the version the runtime lock pins for it."""
    environment = {
        "python_version": python_version(rootfs),
        "platform_machine": arch.machine,
        "sys_platform": "linux",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
    }
    lock = (ROOT / "requirements" / "runtime.txt").read_text()
    pinned: dict[str, str] = {
        canonicalize_name(name): version
        for name, version, marker in re.findall(r"^([\w.-]+)==(\S+)(?: ; ([^\\]+))?", lock, re.M)
        if not marker or Marker(marker.strip()).evaluate(environment)
    }
    assert python_distributions(rootfs) == {**pinned, NAME: project_version()}


def sbom_packages(sbom: Obj) -> dict[str, dict[str, str]]:
    """Package URL type (deb, pypi) -> name -> version, of every package the SBOM lists."""
    found: dict[str, dict[str, str]] = {}
    for package in sbom["packages"]:
        for ref in package.get("externalRefs", []):
            if ref["referenceType"] == "purl":
                purl = urllib.parse.urlsplit(ref["referenceLocator"])
                kind, _, name_version = purl.path.partition("/")
                name, _, version = name_version.rpartition("@")
                found.setdefault(kind, {})[urllib.parse.unquote(name.rpartition("/")[2])] = (
                    urllib.parse.unquote(version)
                )
    return found


def test_sbom_lists_exactly_the_images_packages(
    arch: images.Arch, inspected: Obj, rootfs: Path
) -> None:
    """The SPDX SBOM beside the image's archive (written by `nox -s image` from that archive)
    names this image and lists every Debian package recorded in it and every Python
    distribution in it, with their versions, and nothing else of those kinds."""
    path = images.sbom_path(arch)
    assert path.exists(), f"no SBOM beside the image: {path}"
    sbom = json.loads(path.read_text())
    assert sbom["spdxVersion"] == "SPDX-2.3"
    # syft notes the layer of each file it read: they must be this image's.
    layers = set(re.findall(r"layerID: (sha256:[0-9a-f]{64})", path.read_text()))
    assert layers, "the SBOM names no layer"
    assert layers <= set(inspected["RootFS"]["Layers"]), "the SBOM of another image"
    listed = sbom_packages(sbom)
    debian = {name: fields["Version"] for name, fields in dpkg_records(rootfs).items()}
    assert listed.get("deb") == debian
    assert listed.get("pypi") == python_distributions(rootfs)
    # Each Debian package as the image's architecture has it (or for all architectures).
    arches = {
        urllib.parse.parse_qs(urllib.parse.urlsplit(ref["referenceLocator"]).query)["arch"][0]
        for package in sbom["packages"]
        for ref in package.get("externalRefs", [])
        if ref["referenceType"] == "purl" and ref["referenceLocator"].startswith("pkg:deb/")
    }
    assert arches <= {arch.debian, "all"}, arches


def test_size(rootfs: Path) -> None:
    venv = rootfs / VENV.lstrip("/")
    size = sum(p.stat().st_size for p in venv.rglob("*") if p.is_file() and not p.is_symlink())
    # About 20 MiB when measured; the base is most of the rest (nox -s image prints both sizes).
    assert size < 40 * 2**20, f"the plugin's environment holds {size / 2**20:.1f} MiB"


def hardened_daemonset() -> Obj:
    (found,) = daemonsets(DEPLOYMENT)
    return found


def container_start_script(
    daemonset: Obj, rootfs: Path, host_root: Path, argv: list[str], *, pid_namespace: bool = False
) -> list[str]:
    """Mount what the manifest mounts, from the fake host, then exec ``argv`` (the entry point).

    Runs in private mount and network namespaces (loopback up, as a runtime brings it up):
    nothing here is seen outside or outlives it. With `pid_namespace`, in a PID namespace of
    its own too, where the entry point is PID 1 as in a pod (unshare forks to enter it).
    """
    container = plugin_container(daemonset)
    context = container["securityContext"]
    steps = ["set -eu", f"root={shlex.quote(str(rootfs))}"]
    mounts = [
        (m["mountPath"], s["path"], m.get("readOnly", False)) for m, s in host_mounts(daemonset)
    ]
    for mount_path, _, _ in mounts:
        (rootfs / mount_path.lstrip("/")).mkdir(parents=True, exist_ok=True)
    if context.get("readOnlyRootFilesystem"):
        steps += ['mount --bind "$root" "$root"', 'mount -o remount,bind,ro "$root"']
    steps += [
        f"{shlex.quote(ip_command())} link set lo up",
        'mount -t proc proc "$root/proc"',
        'mount -t tmpfs -o nosuid,mode=755 tmpfs "$root/dev"',
        "for node in null zero full random urandom tty; do "
        ': > "$root/dev/$node"; mount --bind "/dev/$node" "$root/dev/$node"; done',
    ]
    for mount_path, host_path, read_only in mounts:
        source = host_root / host_path.lstrip("/")
        # kubelet's check for hostPath type Directory, which the manifests use throughout.
        assert source.is_dir(), f"FailedMount: {host_path} is not a directory on the fake host"
        target = f'"$root"{shlex.quote(mount_path)}'
        steps.append(f"mount --bind {shlex.quote(str(source))} {target}")
        if read_only:
            steps.append(f"mount -o remount,bind,ro {target}")
    steps.append(f"exec {shlex.join(argv)}")
    # --net: a network namespace of its own, as the pod has (no hostNetwork), so the metrics
    # port cannot clash with the machine's; kubelet's unix sockets are reached by path.
    command = "\n".join(steps)
    pid = ["--pid", "--fork", "--kill-child"] if pid_namespace else []
    return ["unshare", "--mount", "--net", *pid, "--propagation", "private", "sh", "-c", command]


def ip_command() -> str:
    ip = shutil.which("ip")
    assert ip, "ip (iproute2) is not installed: it brings the container's loopback up"
    return ip


@pytest.fixture
def fake_host() -> Iterator[FakeNode]:
    """/dev/sev-guest (a symlink to /dev/null) and /var/run/pcc under a fake host root."""
    node = FakeNode.create()
    yield node
    node.remove()


def start_from_image(
    config: Obj,
    rootfs: Path,
    node: FakeNode,
    log_path: Path,
    *more_args: str,
    pid_namespace: bool = False,
) -> tuple[Daemon, Obj]:
    daemonset = hardened_daemonset()
    container = plugin_container(daemonset)
    assert user_spec(config) == "{0}:{0}".format(container["securityContext"]["runAsUser"])
    argv = image_argv(config, rootfs, *container["args"], *more_args)
    script = container_start_script(
        daemonset, rootfs, node.host_root, argv, pid_namespace=pid_namespace
    )
    return Daemon(script, log_path), container


def test_plugin_registers_allocates_and_stops(
    arch: images.Arch, config: Obj, rootfs: Path, fake_host: FakeNode, tmp_path: Path
) -> None:
    plugin_dir = fake_host.host_root / PLUGIN_DIR.lstrip("/")
    kubelet = SimKubelet(plugin_dir)
    kubelet.start()
    started = time.monotonic()
    daemon, container = start_from_image(config, rootfs, fake_host, tmp_path / "plugin.log")
    try:
        assert flag(container, "device-plugin-path", PLUGIN_DIR) == PLUGIN_DIR
        daemon.wait_for_log("Registered device plugin with Kubelet", timeout=60 * patience(arch))
        kubelet.wait_for(
            lambda: list(kubelet.devices(RESOURCE).values()) == ["Healthy"] * SHARES,
            timeout=30 * patience(arch),
        )
        (registration,) = kubelet.registrations
        record_start(arch, registration.answered_at - started)
        assert registration.accepted
        assert registration.resource_name == RESOURCE
        own_socket = plugin_dir / registration.endpoint
        assert stat.S_ISSOCK(own_socket.stat().st_mode)

        device_id = sorted(kubelet.devices(RESOURCE))[0]
        (response,) = kubelet.allocate(
            RESOURCE, [[device_id]], timeout=5 * patience(arch)
        ).container_responses
        # kubelet is given the host's paths, not the ones under the plugin's --host-root.
        assert [(d.container_path, d.host_path, d.permissions) for d in response.devices] == [
            ("/dev/sev-guest", "/dev/sev-guest", "rw")
        ]
        assert [(m.container_path, m.host_path, m.read_only) for m in response.mounts] == [
            ("/var/run/pcc", "/var/run/pcc", False)
        ]

        assert daemon.terminate(signal.SIGTERM, timeout=30 * patience(arch)) == 0
        assert not own_socket.exists()
    finally:
        daemon.close()
        kubelet.stop()


def record_start(arch: images.Arch, seconds: float) -> None:
    """One JSON line in PCC_IMAGE_REPORT: from the container's start to Register accepted."""
    if REPORT:
        line = {"arch": arch.name, "emulated": emulated(arch), "start_to_registered_s": seconds}
        with open(REPORT, "a") as report:
            report.write(json.dumps(line) + "\n")


def test_missing_device_is_waited_for_with_the_documented_log(
    arch: images.Arch, config: Obj, rootfs: Path, fake_host: FakeNode, tmp_path: Path
) -> None:
    """As shipped, a device that comes up after the plugin is waited for, not exited on."""
    fake_host.device.unlink()
    plugin_dir = fake_host.host_root / PLUGIN_DIR.lstrip("/")
    kubelet = SimKubelet(plugin_dir)
    kubelet.start()
    daemon, _ = start_from_image(config, rootfs, fake_host, tmp_path / "plugin.log")
    try:
        line = daemon.wait_for_log("detect device", timeout=60 * patience(arch))
        assert "waiting for /host/dev/sev-guest before serving: detect device " in line
        assert "/host/dev/sev-guest failed: No such file or directory" in line
        assert not kubelet.registrations
        fake_host.device.symlink_to("/dev/null")
        daemon.wait_for_log("Registered device plugin with Kubelet", timeout=30 * patience(arch))
        assert daemon.proc.poll() is None
    finally:
        daemon.close()
        kubelet.stop()


DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
EXEC = re.compile(r"kubectl (?:-n [\w-]+ )?exec [^`\n]*? -- (?P<command>[^`\n]+)")
# What the docs' placeholders stand for here.
PLACEHOLDERS = {"<node>": "node-a"}


def documented_exec_commands() -> list[tuple[str, list[str]]]:
    """Every command that the README and docs/ tell users to run in the plugin's container
    (``kubectl ... exec <pod> -- <command>``), as (document: command, argv)."""
    found = []
    for doc in DOCS:
        for match in EXEC.finditer(doc.read_text().replace("\\\n", " ")):
            command = match["command"].strip()
            argv = [
                re.sub("|".join(PLACEHOLDERS), lambda m: PLACEHOLDERS[m[0]], arg)
                for arg in shlex.split(command)
            ]
            found.append((f"{doc.name}: {command}", argv))
    return found


def container_pid(daemon: Daemon) -> int:
    """The host's PID of the container's PID 1: the one child of unshare --fork."""
    children = Path(f"/proc/{daemon.pid}/task/{daemon.pid}/children").read_text().split()
    (child,) = children
    return int(child)


def in_container(pid: int, config: Obj, argv: list[str], timeout: float) -> CompletedProcess[str]:
    """`argv` as ``kubectl exec`` runs it: in the namespaces and root of the container whose
    PID 1 is `pid`, with only the image's environment, argv[0] found on the image's PATH."""
    nsenter = shutil.which("nsenter")
    assert nsenter, "nsenter (util-linux) is not installed"
    return subprocess.run(
        ["env", "-i", *config.get("Env", []),
         nsenter, f"--target={pid}", "--mount", "--net", "--pid", "--root", "--wd", *argv],
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def test_every_command_the_docs_run_in_the_container_has_its_program(
    config: Obj, rootfs: Path
) -> None:
    """What each documented command runs is on the image's PATH: no shell, no coreutils."""
    path = next(e.split("=", 1)[1] for e in config["Env"] if e.startswith("PATH="))
    commands = documented_exec_commands()
    assert len(commands) >= 5, commands
    missing = [
        where
        for where, argv in commands
        if not any(runnable(in_image(rootfs, f"{d}/{argv[0]}")) for d in path.split(":"))
    ]
    assert not missing, f"programs not in the image: {missing}"


def test_every_command_the_docs_run_in_the_container_works(
    arch: images.Arch, config: Obj, rootfs: Path, fake_host: FakeNode, tmp_path: Path
) -> None:
    """The image has no shell and no coreutils: each documented command runs as written, and
    does what the docs say (the doctor passes, the signals reach the daemon).

    On this machine's architecture only: the programs are the same Python on the others,
    which the test above checks are there, and each run under QEMU takes seconds.
    """
    if emulated(arch):
        pytest.skip("run on this machine's architecture; the programs' presence is checked")
    commands = documented_exec_commands()
    plugin_dir = fake_host.host_root / PLUGIN_DIR.lstrip("/")
    kubelet = SimKubelet(plugin_dir)
    kubelet.start()
    daemon, _ = start_from_image(
        config, rootfs, fake_host, tmp_path / "plugin.log", pid_namespace=True
    )
    try:
        daemon.wait_for_log("Registered device plugin with Kubelet", timeout=60 * patience(arch))
        pid = container_pid(daemon)
        # Each distinct command once: several documents give the same one.
        distinct = {tuple(argv): where for where, argv in reversed(commands)}
        for argv_tuple, where in distinct.items():
            argv = list(argv_tuple)
            result = in_container(pid, config, argv, timeout=60 * patience(arch))
            output = result.stdout + result.stderr
            if "--mode=dra" in argv:
                # This daemon serves the device-plugin API, so the DRA doctor's checks of the
                # driver's sockets fail (nox -s cluster runs it against the DRA driver).
                assert result.returncode == 1, f"{where}: exit {result.returncode}\n{output}"
                assert re.search(r"\d+ passed, \d+ warned, [1-9]\d* failed", output), output
                continue
            assert result.returncode == 0, f"{where}: exit {result.returncode}\n{output}"
            if argv[1:2] == ["doctor"]:
                assert re.search(r"\d+ passed, \d+ warned, 0 failed", output), output
            if "readyz" in where:
                assert "ok" in output.lower(), output
            for signum, logged in (("SIGUSR1", "State on SIGUSR1"), ("SIGHUP", "SIGHUP")):
                if signum in where:
                    daemon.wait_for_log(logged, timeout=10 * patience(arch))
        stop = ["python3", "-c", "import os, signal; os.kill(1, signal.SIGTERM)"]
        assert in_container(pid, config, stop, timeout=60 * patience(arch)).returncode == 0
        assert daemon.proc.wait(30 * patience(arch)) == 0
    finally:
        daemon.close()
        kubelet.stop()
