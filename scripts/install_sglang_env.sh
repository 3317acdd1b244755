#!/usr/bin/env bash
# Build the SGLang environment the SGLang tests and benchmarks/sglang_l3_bench.py run in:
# SGLang 0.5.23 with what its storage classes import on a CPU-only host, then Persisting
# installed into it the documented way (PERSISTING_EXISTING_ENV=1), as an SGLang user would
# install it. scripts/install.sh calls this; it can also be run alone.
#
#   bash scripts/install_sglang_env.sh                 # creates ./.venv-sglang
#   SGLANG_VENV=/path/to/venv bash scripts/install_sglang_env.sh
#
# No SGLang engine runs on a CPU-only host (its CPU kernels need a source build, and HiCache
# is gated to CUDA/ROCm), but its HiCache storage interface, backend factory, file backend
# and host memory pools do. SGLang is installed with --no-deps (its declared requirements
# pull CUDA wheels and torch 2.14.1), torch is the CPU build 2.13.0, and of SGLang's own
# requirement lines those named in requirements/sglang-cpu.txt are installed, at SGLang's
# pins. sgl_kernel, triton and torchvision are stubbed at run time, as SGLang's own CPU unit
# tests stub sgl_kernel (tests/sglang/sglang_kit.py). vLLM and SGLang cannot share one
# environment: their pins differ (openai, xgrammar, compressed-tensors, numba).
# About 1.5 GB and a minute or two; a second run finds SGLang in place and only reinstalls
# Persisting.
set -euo pipefail
cd "$(dirname "$0")/.."
SGLANG_VENV=${SGLANG_VENV:-.venv-sglang}
PY=${PYTHON:-python3}
SGLANG_VERSION=0.5.23
TORCH_VERSION=2.13.0

if [ ! -x "$SGLANG_VENV/bin/python" ]; then
  "$PY" -m venv "$SGLANG_VENV"
fi
PIP="$SGLANG_VENV/bin/python -m pip"

if ! "$SGLANG_VENV/bin/python" -c "
import sys
from importlib import metadata
try:
    sys.exit(0 if metadata.version('sglang') == '$SGLANG_VERSION' else 1)
except metadata.PackageNotFoundError:
    sys.exit(1)
"; then
  echo "install_sglang_env.sh: installing sglang $SGLANG_VERSION into $SGLANG_VENV"
  wheels=$(mktemp -d)
  trap 'rm -rf "$wheels"' EXIT
  $PIP install --quiet --upgrade pip
  $PIP install --quiet "torch==$TORCH_VERSION"
  $PIP download --quiet --no-deps -d "$wheels" "sglang==$SGLANG_VERSION"
  # SGLang's own requirement lines (markers kept: pip evaluates them) for the names listed
  # in requirements/sglang-cpu.txt; a listed name SGLang does not declare goes as written.
  "$SGLANG_VENV/bin/python" - "$wheels" requirements/sglang-cpu.txt \
    > "$wheels/sglang-requirements.txt" <<'PYTHON'
import re
import sys
import zipfile
from email.parser import Parser
from pathlib import Path


def project(line: str) -> str:
    return re.sub(r"[-_.]+", "-", re.split(r"[\s;<>=!~\[(]", line, maxsplit=1)[0]).lower()


(wheel,) = Path(sys.argv[1]).glob("sglang-*.whl")
with zipfile.ZipFile(wheel) as archive:
    (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
    meta = Parser().parsestr(archive.read(name).decode())
declared = {
    project(line): line for line in meta.get_all("Requires-Dist") or [] if "extra ==" not in line
}
for raw in Path(sys.argv[2]).read_text().splitlines():
    wanted = raw.split("#", 1)[0].strip()
    if wanted:
        print(declared.get(project(wanted), wanted))
PYTHON
  $PIP install --quiet -r "$wheels/sglang-requirements.txt" "torch==$TORCH_VERSION"
  $PIP install --quiet --no-deps "$wheels"/sglang-*.whl
fi

# Persisting, the way docs/sglang.md tells an SGLang user to install it.
# With its service extra (Pulsing): the engine adapters' cluster key joins a cluster of
# persisting serve members through the service's client.
PERSISTING_EXISTING_ENV=1 PERSISTING_EXTRAS=service VENV="$SGLANG_VENV" bash scripts/install.sh
