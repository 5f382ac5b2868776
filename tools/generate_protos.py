"""Generate both protobuf packages from protos/ into a directory.

    python tools/generate_protos.py OUT

writes OUT/_proto (betterproto2 messages, grpclib base and stub: the daemon's)
and OUT/_pb (protobuf classes: the simulated kubelet's). `nox -s protos`
copies them into pcc_plugin/, and tests/test_protos.py regenerates them to
catch drift. It always runs protoc from the repository root, because the
betterproto2 compiler formats its output with the ruff configuration of the
working directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = Path("protos")
SIM_INIT = '"""Protobuf classes for the simulated kubelet (generated)."""\n'


def generate(out: Path) -> None:
    betterproto_out, sim_out = out / "_proto", out / "_pb"
    betterproto_out.mkdir(parents=True)
    sim_out.mkdir(parents=True)
    # protoc finds the betterproto2 plugin on PATH, next to this interpreter.
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    subprocess.run(
        [
            sys.executable, "-m", "grpc_tools.protoc",
            f"--proto_path={PROTOS}",
            "--python_betterproto2_out="
            f"client_generation=async,server_generation=async:{betterproto_out}",
            f"--python_out={sim_out}",
            f"--pyi_out={sim_out}",
            *sorted(str(PROTOS / proto.name) for proto in (ROOT / PROTOS).glob("*.proto")),
        ],
        cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    (sim_out / "__init__.py").write_text(SIM_INIT)


if __name__ == "__main__":
    generate(Path(sys.argv[1]).resolve())
