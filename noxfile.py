"""Development sessions. Every session installs from the lock files in requirements/."""

from __future__ import annotations

import hashlib
import importlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.sessions = ["lint", "typecheck", "tests"]
nox.options.reuse_existing_virtualenvs = True

ROOT = Path(__file__).parent
GENERATED = ROOT / "pcc_plugin" / "_proto"
SIM_GENERATED = ROOT / "pcc_plugin" / "sim" / "_pb"
LOCK_PYTHON = "3.11"


def install_dev(session: nox.Session) -> None:
    """The locked development set plus this project, without resolving anything anew."""
    session.install("-r", "requirements/dev.txt")
    session.install("--no-deps", "-e", ".")


# Tests mostly wait on daemons and sockets, so more workers than cores still pay.
TEST_WORKERS = "4"


@nox.session
def tests(session: nox.Session) -> None:
    """Unit and integration tests: the real daemon against the simulated kubelet.

    Not here, each in a session of its own: the manifest schema matrix (manifests), restart
    storms, floods and fuzzing (slow), the image (image), a real kubelet (e2e).
    """
    install_dev(session)
    session.log("covers: flags, wire format, gRPC server limits, registration, restarts, "
                "health, metrics, doctor, profiles, CDI, live configuration, signals, rollouts "
                "(slow layers: nox -s slow manifests image e2e)")  # fmt: skip
    session.run(
        "pytest", "-n", TEST_WORKERS, "-m", "not slow", "--ignore=tests/test_manifests.py",
        *session.posargs,
    )  # fmt: skip


@nox.session
def slow(session: nox.Session) -> None:
    """Restart storms (300 kubelet restarts), connection floods, memory bounds, fuzzing."""
    install_dev(session)
    session.run("pytest", "-n", TEST_WORKERS, "-m", "slow", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    install_dev(session)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    install_dev(session)
    session.run("mypy")


@nox.session
def demo(session: nox.Session) -> None:
    """The daemon against the simulated kubelet on a fake node, told in plain words."""
    install_dev(session)
    session.run("python", "-m", "pcc_plugin.sim.demo", *session.posargs)


@nox.session
def protos(session: nox.Session) -> None:
    """Regenerate pcc_plugin/_proto and pcc_plugin/sim/_pb from protos/."""
    install_dev(session)
    with tempfile.TemporaryDirectory() as tmp:
        session.run("python", "tools/generate_protos.py", tmp)
        for name, target in (("_proto", GENERATED), ("_pb", SIM_GENERATED)):
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(Path(tmp) / name, target)


@nox.session(venv_backend="none")
def lock(session: nox.Session) -> None:
    """Recompile requirements/*.txt from pyproject.toml and requirements/dev.in."""
    common = ["uv", "pip", "compile", "--universal", "--python-version", LOCK_PYTHON, "--quiet"]
    # Hashes for the runtime lock: the Containerfile installs it with --require-hashes.
    session.run(
        *common, "--generate-hashes", "pyproject.toml", "-o", "requirements/runtime.txt",
        external=True,
    )  # fmt: skip
    session.run(
        *common, "pyproject.toml", "--extra", "sim", "requirements/dev.in",
        "-o", "requirements/dev.txt", external=True,
    )  # fmt: skip


# Shipping: manifests, Containerfile, image.

IMAGE_ARCHES = ("x86_64", "aarch64", "ppc64le", "s390x")
IMAGE_CACHE = Path(os.environ.get("PCC_IMAGE_CACHE", "/var/cache/pcc-device-plugin"))
BASE_SUITE = "bookworm"
BASE_PACKAGES = "python3,python3-venv"
DEBIAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
EXTRA_CAS = Path("/usr/local/share/ca-certificates")
# The image session leaves its images here as docker-archive tarballs; nox -s e2e reads them.
IMAGE_ARCHIVES = ROOT / "build" / "images"
NATIVE_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)


@nox.session
def manifests(session: nox.Session) -> None:
    """Render, validate and check manifests/ and docs/deploy.md; lint the Containerfile.

    Every kustomization is rendered by `kubectl kustomize` and validated offline against the
    Kubernetes schemas (tests/test_manifests.py states the versions); hadolint runs on the
    Containerfile; every locked runtime dependency must have a wheel for each image architecture.
    """
    if shutil.which("kubectl") is None:
        session.error(
            "nox -s manifests needs kubectl (Debian package kubectl; .ci/run installs it)"
        )
    install_dev(session)
    session.run("kubectl", "version", "--client", external=True)
    session.run(
        "pytest", "tests/test_manifests.py", *session.posargs, env={"PCC_REQUIRE_KUBECTL": "1"}
    )
    session.run("hadolint", "Containerfile")
    # The same exceptions to "wheels only" as the Containerfile's pip install makes.
    from_source = re.findall(r"--no-binary=(\S+)", (ROOT / "Containerfile").read_text())
    for arch in IMAGE_ARCHES:
        session.log(f"{arch}-manylinux_2_28: wheels for every runtime dependency but {from_source}")
        session.run(
            _uv(), "pip", "compile", "--quiet", "--no-deps", "--only-binary", ":all:",
            *(f"--no-binary={name}" for name in from_source),
            "--python-version", LOCK_PYTHON, "--python-platform", f"{arch}-manylinux_2_28",
            "requirements/runtime.txt", "-o", os.devnull, external=True,
        )  # fmt: skip


def _uv() -> str:
    """uv on PATH, or the one installed beside nox (pipx, `pip install nox uv`)."""
    found = shutil.which("uv")
    if found:
        return found
    uv_bin: str = importlib.import_module("uv").find_uv_bin()
    return uv_bin


def _podman_images() -> set[str]:
    listing = subprocess.run(
        ["podman", "images", "--all", "--quiet", "--no-trunc"],
        capture_output=True,
        text=True,
        check=True,
    )
    return set(listing.stdout.split())


def _unmount_below(path: Path) -> None:
    """Unmount whatever a failed debootstrap left mounted inside `path` (its /proc, /sys)."""
    with open("/proc/self/mounts") as mounts:
        targets = [line.split()[1] for line in mounts]
    for target in sorted(targets, key=len, reverse=True):
        if Path(target).is_relative_to(path):
            subprocess.run(["umount", "--lazy", target], check=False)


def local_base_image(session: nox.Session) -> str:
    """Debian minbase with python3 and venv, imported into podman; cached on this machine.

    The debootstrap tree is kept as a tarball in IMAGE_CACHE and the imported image in podman's
    store, both keyed by the recipe. This machine's extra CA certificates go into the base, so
    that pip inside `podman build` trusts what the host trusts (here a TLS-inspecting proxy);
    the image never leaves the machine.
    """
    cas = sorted(EXTRA_CAS.glob("**/*.crt"))
    digest = hashlib.sha256(f"v1 {BASE_SUITE} minbase {BASE_PACKAGES}".encode())
    for ca in cas:
        digest.update(ca.read_bytes())
    key = f"{BASE_SUITE}-{digest.hexdigest()[:12]}"
    ref = f"localhost/pcc-device-plugin-base:{key}"
    if subprocess.run(["podman", "image", "exists", ref], check=False).returncode == 0:
        session.log(f"base image {ref}: cached")
        return ref
    IMAGE_CACHE.mkdir(parents=True, exist_ok=True)
    tarball = IMAGE_CACHE / f"base-{key}.tar"
    if not tarball.exists():
        with tempfile.TemporaryDirectory(dir=IMAGE_CACHE) as tmp:
            rootfs = Path(tmp) / "rootfs"
            try:
                session.run(
                    "debootstrap", "--variant=minbase", f"--include={BASE_PACKAGES}",
                    BASE_SUITE, str(rootfs), external=True, silent=True,
                )  # fmt: skip
                for ca in cas:
                    shutil.copy(ca, rootfs / "usr/local/share/ca-certificates" / ca.name)
                if cas:
                    session.run(
                        "chroot", str(rootfs), "update-ca-certificates", external=True, silent=True
                    )
                for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
                    for entry in (rootfs / cache).glob("*"):
                        if entry.is_file():
                            entry.unlink()
                partial = Path(tmp) / "base.tar"
                session.run(
                    "tar", "--numeric-owner", "--exclude=./dev/*", "--exclude=./proc/*",
                    "--exclude=./sys/*", "-C", str(rootfs), "-cf", str(partial), ".",
                    external=True,
                )  # fmt: skip
                os.replace(partial, tarball)
            finally:
                _unmount_below(rootfs)
        for stale in IMAGE_CACHE.glob("base-*.tar"):
            if stale != tarball:
                stale.unlink()
    session.run(
        "podman",
        "import",
        "--change",
        f"ENV PATH={DEBIAN_PATH}",
        str(tarball),
        ref,
        external=True,
        silent=True,
    )
    return ref


@nox.session
def image(session: nox.Session) -> None:
    """Build the image from the Containerfile on a local Debian base, check it, start it.

    Only BASE_IMAGE is overridden. tests/test_image.py checks the image's contents and starts
    the plugin from its filesystem against the simulated kubelet. Every image this session
    builds is removed from podman at the end, failed or not; the base stays cached, and the
    checked image stays as build/images/pcc-device-plugin-linux-<arch>.tar (docker-archive),
    which nox -s e2e runs.
    """
    missing = [
        tool
        for tool in ("podman", "debootstrap", "unshare", "chroot", "kubectl")
        if shutil.which(tool) is None
    ]
    if os.geteuid() != 0 or missing:
        session.error(
            "nox -s image needs root and podman, debootstrap, unshare, chroot, kubectl "
            f"(.ci/run installs them); missing: {', '.join(missing) or 'root'}"
        )
    install_dev(session)
    base = local_base_image(session)
    tag = f"localhost/pcc-device-plugin:nox-{os.getpid()}"
    before = _podman_images()
    try:
        build_image(session, base, tag)
        for ref in (base, tag):
            size = subprocess.run(
                ["podman", "image", "inspect", "--format", "{{.Size}}", ref],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            session.log(f"image size: {ref}: {int(size) / 1e6:.0f} MB")
        session.run(
            "pytest",
            "tests/test_image.py",
            *session.posargs,
            env={"PCC_IMAGE": tag, "PCC_REQUIRE_KUBECTL": "1"},
        )
        save_image(session, tag, NATIVE_ARCH)
    finally:
        created = _podman_images() - before
        if created:
            subprocess.run(["podman", "rmi", "--force", *sorted(created)], check=False)


def build_image(session: nox.Session, base: str, tag: str) -> None:
    """The image from the Containerfile on `base`, tagged `tag` in podman's store."""
    session.run(
        "podman", "build", "--isolation=chroot", "--pull=never",
        "--build-arg", f"BASE_IMAGE={base}", "--tag", tag, "--file", "Containerfile", ".",
        external=True,
    )  # fmt: skip


def image_archive(arch: str) -> Path:
    """Where the image session leaves the image of `arch` (Go's name: amd64, arm64, ...)."""
    return IMAGE_ARCHIVES / f"pcc-device-plugin-linux-{arch}.tar"


def save_image(session: nox.Session, tag: str, arch: str) -> Path:
    """`tag` as a docker-archive tarball at image_archive(arch), written by rename."""
    target = image_archive(arch)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".tar.partial")
    partial.unlink(missing_ok=True)
    session.run(
        "podman", "save", "--quiet", "--format", "docker-archive", "--output", str(partial), tag,
        external=True,
    )  # fmt: skip
    os.replace(partial, target)
    session.log(f"image archive: {target.relative_to(ROOT)} ({target.stat().st_size / 1e6:.0f} MB)")
    return target


def _image_inputs() -> list[Path]:
    """What the Containerfile copies (see .containerignore), and the Containerfile itself."""
    files = [ROOT / name for name in ("Containerfile", "pyproject.toml", "README.md")]
    files.append(ROOT / "requirements" / "runtime.txt")
    files += (
        p for p in (ROOT / "pcc_plugin").rglob("*") if p.is_file() and "__pycache__" not in p.parts
    )
    return files


def native_image_archive(session: nox.Session) -> Path:
    """The image for this machine's architecture as a docker-archive tarball.

    Left by `nox -s image` (which CI runs first); built here the same way when it is missing or
    older than what goes into the image. Only images this call creates are removed again.
    """
    archive = image_archive(NATIVE_ARCH)
    if archive.exists():
        built = archive.stat().st_mtime
        newer = [str(p.relative_to(ROOT)) for p in _image_inputs() if p.stat().st_mtime > built]
        if not newer:
            session.log(f"image archive: {archive.relative_to(ROOT)} (left by nox -s image)")
            return archive
        session.log(f"image archive is older than {', '.join(sorted(newer)[:3])}: rebuilding")
    base = local_base_image(session)
    tag = f"localhost/pcc-device-plugin:nox-{os.getpid()}"
    before = _podman_images()
    try:
        build_image(session, base, tag)
        return save_image(session, tag, NATIVE_ARCH)
    finally:
        created = _podman_images() - before
        if created:
            subprocess.run(["podman", "rmi", "--force", *sorted(created)], check=False)


# A real kubelet.


@nox.session
def e2e(session: nox.Session) -> None:
    """The image as static pods on a real kubelet and containerd; see docs/e2e.md.

    Needs root, containerd, runc, Go, kubectl, and podman and debootstrap when the image archive
    must be built (.ci/run installs them). Kubelet is built from source once per version into
    the cache directory. Arguments go to `python -m e2e` (e.g. --keep-logs, --variant=plugin).
    """
    env = {"PYTHONPATH": str(ROOT / "tools")}
    install_dev(session)
    session.run("python", "-m", "e2e", "preflight", env=env)
    session.run("python", "-m", "e2e.protos", "--check", env=env)
    archive = native_image_archive(session)
    session.run(
        "python", "-m", "e2e", "--plugin-image", str(archive), *session.posargs,
        env=env, interrupt_timeout=150,
    )  # fmt: skip


# Load and faults.


@nox.session
def bench(session: nox.Session) -> None:
    """The real daemon against the simulated kubelet: one table of figures, PASS/MISS per target.

    About two minutes on 2 cores; BENCHMARKS.md records a run. Arguments go to bench/run.py
    (--quick, --json PATH, --strict).
    """
    install_dev(session)
    session.run("python", "-m", "bench.run", *session.posargs)
