"""Development sessions. Every session installs from the lock files in requirements/."""

from __future__ import annotations

import concurrent.futures
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nox

# tools/images.py builds the image for each architecture; the image sessions call it.
# tools/pythons.py gives the other Pythons CI tests on.
sys.path.insert(0, str(Path(__file__).resolve().parent / "tools"))
import images
import pythons as other_pythons

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
# What the default tests run with besides the project and its [sim] extra (pip: test_dev_tool
# runs tools/dev.py, which fetches uv with the interpreter's pip).
TEST_TOOLS = ("pytest", "pytest-trio", "pytest-xdist", "hypothesis", "prometheus-client",
              "jsonschema", "pip")  # fmt: skip


def run_default_tests(session: nox.Session) -> None:
    session.run(
        "pytest", "-n", TEST_WORKERS, "-m", "not slow", "--ignore=tests/test_manifests.py",
        *session.posargs,
    )  # fmt: skip


@nox.session
def tests(session: nox.Session) -> None:
    """Unit and integration tests: the real daemon against the simulated kubelet.

    Not here, each in a session of its own: the manifest schema matrix (manifests), restart
    storms, floods and fuzzing (slow), the image (image), a real kubelet (e2e).
    """
    install_dev(session)
    session.log("covers: flags, wire format, gRPC server limits, registration, restarts, "
                "health, metrics, doctor, profiles, CDI, live configuration, signals, rollouts, "
                "the DRA mode "
                "(slow layers: nox -s slow manifests image e2e)")  # fmt: skip
    run_default_tests(session)


def locked(*names: str) -> list[str]:
    """`name==version` of each, as requirements/dev.txt locks it."""
    pins = re.findall(
        r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / "requirements" / "dev.txt").read_text(), re.M
    )
    versions = {name.lower(): version for name, version in pins}
    return [f"{name}=={versions[name]}" for name in names]


def log_versions(session: nox.Session, *names: str) -> None:
    session.run(
        "python", "-c",
        "import sys; from importlib.metadata import version; "
        "print(', '.join(f'{n} {version(n)}' for n in sys.argv[1:]))",
        *names,
    )  # fmt: skip


DEPENDENCIES = ("trio", "grpclib", "h2", "hpack", "betterproto2", "asyncinotify",
         "attrs", "h11", "pyyaml", "httpx", "httpcore", "grpcio",
         "protobuf")  # fmt: skip


@nox.session
def tests_lowest(session: nox.Session) -> None:
    """The default tests on the lowest version pyproject.toml allows of each dependency it
    names (uv's lowest-direct resolution), the test tools as locked."""
    session.install("--resolution", "lowest-direct", "-e", ".[sim]", *locked(*TEST_TOOLS))
    log_versions(session, *DEPENDENCIES)
    run_default_tests(session)


@nox.session
def tests_lowest_h2(session: nox.Session) -> None:
    """The default tests with the lowest h2 and hpack that pyproject.toml allows (grpclib's
    HTTP/2 underneath), everything else as locked."""
    install_dev(session)
    resolved = session.run(
        _uv(), "pip", "compile", "--quiet", "--no-header", "--resolution", "lowest-direct",
        "--python-version", LOCK_PYTHON, "pyproject.toml",
        external=True, silent=True,
    )  # fmt: skip
    assert isinstance(resolved, str)
    floors = re.findall(r"^(?:h2|hpack)==\S+", resolved, re.M)
    session.install(*floors)
    log_versions(session, *DEPENDENCIES)
    run_default_tests(session)


@nox.session
def slow(session: nox.Session) -> None:
    """Restart storms (300 kubelet restarts), connection floods, memory bounds, fuzzing."""
    install_dev(session)
    session.run("pytest", "-n", TEST_WORKERS, "-m", "slow", *session.posargs)


# What `pythons` runs by default: the README's quick start on the newest Python, the tests on
# the ones between (the oldest, Debian 12's 3.11, runs every other session).
OTHER_PYTHONS = (("3.15", ("-s", "demo")), ("3.15", ()), ("3.13", ("-s", "tests")),
                 ("3.14", ("-s", "tests")))  # fmt: skip


@nox.session(venv_backend="none")
def pythons(session: nox.Session) -> None:
    """The README's two commands on Python 3.15 (Debian sid), the tests on 3.13 (pyenv) and
    3.14 (Debian sid), each as `python3.X tools/dev.py` in a namespace of its own (see
    tools/pythons.py). With versions as arguments, the README's two commands on each of them
    (`nox -s pythons -- 3.13 3.14`). Needs root, unshare, chroot, and debootstrap once.
    """
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("chroot") is None:
        session.error("nox -s pythons needs root, unshare and chroot (util-linux, coreutils)")
    plan = [(v, args) for v in session.posargs for args in (("-s", "demo"), ())]
    failed = []
    for version, args in plan or OTHER_PYTHONS:
        started = time.monotonic()
        try:
            status = other_pythons.run(version, args, session.log)
        except other_pythons.Unavailable as error:
            session.error(f"Python {version}: {error}")
        what = f"Python {version}: tools/dev.py {' '.join(args)}".rstrip()
        session.log(f"{what}: {'passed' if status == 0 else 'FAILED'} in "
                    f"{time.monotonic() - started:.0f} s")  # fmt: skip
        if status:
            failed.append(what)
    if failed:
        session.error(f"failed: {'; '.join(failed)}")


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


# Node Feature Discovery's Go module, at the version the NodeFeatureRule of
# manifests/components/node-feature-rule is checked against (v0.20 needs Go 1.27; the machines
# have 1.26), the module's hash as Go's checksum database has it, and the files the check
# reads: the CRDs, and the kernel feature source whose feature the rule matches.
NFD_MODULE = "sigs.k8s.io/node-feature-discovery@v0.19.0"
NFD_MODULE_SUM = "h1:9CYm16vjSIbNO5Z1Y67rcrfy51YWmy3+6wjiWzJbrC4="
NFD_FILES = ("deployment/base/nfd-crds/nfd-api-crds.yaml", "source/kernel/kernel.go")


def _nfd_files(session: nox.Session) -> Path:
    """A directory with NFD_FILES at their paths in the module, fetched once with `go mod
    download` (through GOPROXY, as Go is configured) and kept in .cache/manifests/, as
    tools/dev.py keeps uv in .cache/dev/."""
    cached = ROOT / ".cache" / "manifests" / NFD_MODULE.replace("/", "_")
    if all((cached / name).exists() for name in NFD_FILES):
        return cached
    if shutil.which("go") is None:
        session.error(
            f"nox -s manifests needs Go once, to fetch {NFD_MODULE} with `go mod download` "
            "(.ci/run checks for Go; the machines ship it)"
        )
    # Outside any module of ours: only the named module is downloaded, and Go checks it.
    with tempfile.TemporaryDirectory() as scratch:
        done = subprocess.run(
            ["go", "mod", "download", "-json", NFD_MODULE],
            cwd=scratch, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
    try:
        module = json.loads(done.stdout)
    except json.JSONDecodeError:
        module = {"Error": done.stderr.strip() or f"exit code {done.returncode}"}
    if done.returncode or module.get("Error"):
        session.error(f"go mod download {NFD_MODULE} failed: {module.get('Error')}")
    if module.get("Sum") != NFD_MODULE_SUM:
        session.error(f"{NFD_MODULE} has the hash {module.get('Sum')}, not {NFD_MODULE_SUM}")
    for name in NFD_FILES:
        target = cached / name
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".partial")
        partial.write_bytes((Path(module["Dir"]) / name).read_bytes())
        partial.replace(target)
    session.log(f"{NFD_MODULE}: {', '.join(NFD_FILES)} kept in {cached.relative_to(ROOT)}")
    return cached


@nox.session
def manifests(session: nox.Session) -> None:
    """Render, validate and check manifests/ and docs/deploy.md; lint the Containerfile.

    Every kustomization is rendered by `kubectl kustomize` and validated offline against the
    Kubernetes schemas (tests/test_manifests.py states the versions), the NodeFeatureRule
    against NFD's CRD; each mode's daemon runs under its hardened security context (as root);
    hadolint runs on the Containerfile; every locked runtime dependency must have a wheel for
    each image architecture.
    """
    if shutil.which("kubectl") is None:
        session.error(
            "nox -s manifests needs kubectl (Debian package kubectl; .ci/run installs it)"
        )
    install_dev(session)
    nfd = _nfd_files(session)
    session.run("kubectl", "version", "--client", external=True)
    session.run(
        "pytest", "tests/test_manifests.py", *session.posargs,
        env={"PCC_REQUIRE_KUBECTL": "1", "PCC_NFD_MODULE": str(nfd)},
    )  # fmt: skip
    session.run("hadolint", "Containerfile")
    # The same exceptions to "wheels only" as the Containerfile's pip install makes.
    from_source = re.findall(r"--no-binary=(\S+)", (ROOT / "Containerfile").read_text())
    for arch in (a.machine for a in images.ARCHES.values()):
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


def _image_tools_missing() -> str | None:
    missing = [
        tool
        for tool in ("podman", "debootstrap", "unshare", "chroot", "nsenter", "ip", "kubectl", "go")
        if shutil.which(tool) is None
    ]
    if os.geteuid() != 0 or missing:
        return (
            "needs root and podman, debootstrap, unshare, chroot, nsenter, ip, kubectl, and Go "
            f"for the SBOM tool (.ci/run installs them); missing: {', '.join(missing) or 'root'}"
        )
    return None


def _image_arches(session: nox.Session) -> list[images.Arch]:
    """PCC_IMAGE_ARCHES (comma-separated Go names; all four by default), each runnable here."""
    try:
        arches = images.selected(os.environ.get("PCC_IMAGE_ARCHES"))
    except ValueError as error:
        session.error(f"PCC_IMAGE_ARCHES: {error}")
    if images.NATIVE is None:
        session.error(
            f"nox -s image builds on {', '.join(images.ARCHES)}, not {os.uname().machine}"
        )
    for arch in arches:
        problem = images.emulation_problem(arch)
        if problem:
            session.error(f"nox -s image {problem} (.ci/run registers qemu-user-static's handlers)")
    return arches


@nox.session(venv_backend="none")
def image_bases(session: nox.Session) -> None:
    """Only the debootstrapped bases of `nox -s image`, its SBOM tool (syft, built with Go) and
    the Debian sid root of `nox -s pythons`, for CI to start early, in the background; each is
    cached.

    Mostly download, and a Go build, they can use the core the test suite leaves idle.
    """
    problem = _image_tools_missing()
    if problem:
        session.error(f"nox -s image_bases {problem}")
    started = time.monotonic()
    arches = _image_arches(session)
    assert images.NATIVE is not None
    images.remove_manifest_list()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        tool = pool.submit(images.sbom_tool, session.log)
        sid = pool.submit(other_pythons.sid_root, session.log)
        images.base_images([images.NATIVE, *arches], session.log)
        session.log(f"bases ready after {time.monotonic() - started:.0f} s")
        session.log(f"SBOM tool {tool.result()} ready after {time.monotonic() - started:.0f} s")
        try:
            session.log(
                f"Debian sid root {sid.result()} ready after {time.monotonic() - started:.0f} s"
            )
        except other_pythons.Unavailable as missing:
            # Not the image's: nox -s pythons says it again where it needs the root.
            session.warn(f"no Debian sid root for nox -s pythons: {missing}")


@nox.session
def image(session: nox.Session) -> None:
    """Build the image for each architecture, check it, start the plugin from it under emulation.

    The Containerfile, once per architecture (PCC_IMAGE_ARCHES, comma-separated; all four by
    default) on a local debootstrapped base of that architecture (cached, see tools/images.py).
    tests/test_image.py checks each image's contents, its SBOM and its architecture, and starts
    the plugin from its filesystem against the simulated kubelet. Leaves build/images/*.tar with
    an SPDX SBOM beside each (*.spdx.json, written by syft from the archive), and the images in
    podman's store (no manifest list: tools/images.py says why); removes the build's
    intermediate images.
    """
    problem = _image_tools_missing()
    if problem:
        session.error(f"nox -s image {problem}")
    arches = _image_arches(session)
    install_dev(session)
    started = time.monotonic()
    assert images.NATIVE is not None
    # First: an earlier build's manifest list makes podman's listings fail (tools/images.py).
    images.remove_manifest_list()
    bases = images.base_images([images.NATIVE, *arches], session.log)
    session.log(f"bases ready after {time.monotonic() - started:.0f} s")
    sbom_tool = images.sbom_tool(session.log)
    tags = {}
    with images.removing_intermediates(arches):
        for arch in arches:
            tags[arch] = images.build(arch, bases, session.run)
            archive = images.save_archive(arch)
            sbom = images.write_sbom(arch, sbom_tool)
            session.log(
                f"image {arch.name}: {tags[arch]}, {images.size(tags[arch]) / 1e6:.1f} MB; "
                f"{archive.relative_to(ROOT)} {archive.stat().st_size / 1e6:.1f} MB; "
                f"SBOM {sbom.relative_to(ROOT)}"
            )
    session.log(f"images built after {time.monotonic() - started:.0f} s")
    report = ROOT / "build" / "image-starts.json"
    report.unlink(missing_ok=True)
    session.run(
        "pytest",
        "tests/test_image.py",
        *session.posargs,
        env={
            "PCC_IMAGES": ",".join(f"{a.name}={t}" for a, t in tags.items()),
            "PCC_IMAGE_REPORT": str(report),
            "PCC_REQUIRE_KUBECTL": "1",
        },
    )
    if report.exists():
        for line in report.read_text().splitlines():
            session.log(f"start -> registered: {line}")
    session.log(f"nox -s image took {time.monotonic() - started:.0f} s")


def _image_inputs() -> list[Path]:
    """What the Containerfile copies (see .containerignore), and the Containerfile itself."""
    files = [ROOT / name for name in ("Containerfile", "pyproject.toml", "README.md")]
    files += [ROOT / "requirements" / "runtime.txt", ROOT / "tools" / "runtime_root.py"]
    files += (
        p for p in (ROOT / "pcc_plugin").rglob("*") if p.is_file() and "__pycache__" not in p.parts
    )
    return files


def native_image_archive(session: nox.Session) -> Path:
    """The image for this machine's architecture as a docker-archive tarball.

    Left by `nox -s image` (which CI runs first); built here the same way (tools/images.py)
    when it is missing or older than what goes into the image.
    """
    native = images.NATIVE
    if native is None:
        session.error(f"no image for {os.uname().machine}: only for {', '.join(images.ARCHES)}")
    archive = images.archive_path(native)
    if archive.exists():
        built = archive.stat().st_mtime
        newer = [str(p.relative_to(ROOT)) for p in _image_inputs() if p.stat().st_mtime > built]
        if not newer:
            session.log(f"image archive: {archive.relative_to(ROOT)} (left by nox -s image)")
            return archive
        session.log(f"image archive is older than {', '.join(sorted(newer)[:3])}: rebuilding")
    images.remove_manifest_list()
    bases = images.base_images([native], session.log)
    with images.removing_intermediates([native]):
        images.build(native, bases, session.run)
        images.save_archive(native)
    session.log(
        f"image archive: {archive.relative_to(ROOT)} ({archive.stat().st_size / 1e6:.0f} MB)"
    )
    return archive


# A real kubelet.


@nox.session
def e2e(session: nox.Session) -> None:
    """The image as static pods on a real kubelet and containerd; see docs/e2e.md.

    Needs root, runc, Go, kubectl, and podman and debootstrap when the image archive must be
    built (.ci/run installs them). Kubelet and containerd are built from source once per version
    into the cache directory (tools/e2e/builds.py). Arguments go to `python -m e2e` (e.g.
    --keep-logs, --variant=plugin, --race=N).
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


@nox.session
def cluster(session: nox.Session) -> None:
    """The image installed with kubectl, as the README says, on a one-node cluster; see
    docs/e2e.md.

    etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kubelet at kubelet's
    version, and containerd 2.x, each built from source once per version into the cache
    directory (tools/e2e/builds.py). Needs what the e2e needs, and openssl and the CNI plugins
    (containernetworking-plugins). Arguments go to `python -m e2e cluster` (e.g. --keep-logs).
    """
    env = {"PYTHONPATH": str(ROOT / "tools")}
    install_dev(session)
    session.run("python", "-m", "e2e", "preflight", "--cluster", env=env)
    archive = native_image_archive(session)
    session.run(
        "python", "-m", "e2e", "cluster", "--plugin-image", str(archive), *session.posargs,
        env=env, interrupt_timeout=150,
    )  # fmt: skip


# Load and faults.


@nox.session
def bench(session: nox.Session) -> None:
    """The real daemon against the simulated kubelet: one table of figures, PASS/MISS per target.

    2 to 3 minutes on 2 cores; BENCHMARKS.md records a run. Arguments go to bench/run.py
    (--quick, --json PATH, --strict; --compare [REV]: issue 36's before, after and Go peer
    side by side, bench/compare.py, which uses the uv on PATH and go).
    """
    install_dev(session)
    # tools/ for the e2e's Go yardstick, whose restarts it prints beside the daemon's.
    session.run(
        "python", "-m", "bench.run", *session.posargs, env={"PYTHONPATH": str(ROOT / "tools")}
    )


@nox.session
def scale(session: nox.Session) -> None:
    """N DRA drivers (100 of this tree's, then 100 of the Go reference) against a real etcd
    and kube-apiserver on 127.0.0.1: what each costs the API server, from its audit log; about
    40 minutes on 2 cores. No root, no kubelet. Needs Go and openssl: etcd and kube-apiserver
    are the cluster session's builds (tools/e2e/builds.py), the Go reference
    (kubernetes-sigs/dra-example-driver) is built by bench/scale/builds.py; both cached.
    Arguments go to `python -m bench.scale` (--quick, --nodes N, --idle S, --only pcc|go,
    --json PATH, --keep DIR); docs/dra.md records a run.
    """
    install_dev(session)
    session.run(
        "python", "-m", "bench.scale", *session.posargs, env={"PYTHONPATH": str(ROOT / "tools")}
    )
