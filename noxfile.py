"""Development sessions. Every session installs from the lock files in requirements/."""

from __future__ import annotations

import shutil
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


@nox.session
def tests(session: nox.Session) -> None:
    install_dev(session)
    session.run("pytest", *session.posargs)


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
