#!/usr/bin/env bash
# Set up a virtual environment with Persisting, its test tools and LMCache (CPU-only).
#
#   bash scripts/install.sh            # creates ./.venv
#   VENV=/path/to/venv bash scripts/install.sh
#
# torch is pinned to 2.13.0 here (not in pyproject): on these machines that pin takes the
# CPU build already on disk, while an unpinned torch downloads a multi-GB CUDA build.
# LMCache 0.5.6 is installed with --no-deps plus its pure-Python dependencies, because its
# declared dependencies include CUDA-only packages.
#
# Into an existing environment (vLLM, SGLang) without touching its torch:
#
#   PERSISTING_EXISTING_ENV=1 VENV=/opt/vllm/.venv bash scripts/install.sh
#
# installs Persisting (no test tools) into $VENV with the torch and numpy already there
# held at their versions (a pip constraint), and leaves LMCache to the engine's own
# installation. It refuses an environment without torch.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

if [ "${PERSISTING_EXISTING_ENV:-0}" = "1" ]; then
  if [ ! -x "$VENV/bin/python" ]; then
    echo "install.sh: no Python environment at $VENV (set VENV to the engine's venv)" >&2
    exit 2
  fi
  constraints=$(mktemp)
  trap 'rm -f "$constraints"' EXIT
  if ! "$VENV/bin/python" - "$constraints" <<'PYTHON'
import sys
from importlib import metadata

held = []
for name in ("torch", "numpy"):
    try:
        held.append(f"{name}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        if name == "torch":
            sys.exit(f"install.sh: no torch in {sys.prefix}: this mode keeps an engine's torch")
with open(sys.argv[1], "w") as f:
    f.write("\n".join(held) + "\n")
print("install.sh: keeping", ", ".join(held))
PYTHON
  then
    exit 2
  fi
  "$VENV/bin/python" -m pip install --quiet -c "$constraints" -e .
  "$VENV/bin/python" -c "import persisting, torch; print('persisting', persisting.__version__, 'torch', torch.__version__, '(kept)')"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install --quiet --upgrade pip
$PIP install --quiet 'torch==2.13.0' 'numpy<=2.2.6'
$PIP install --quiet -e '.[dev,hf]' 'torch==2.13.0' 'numpy<=2.2.6'
if [ "${PERSISTING_SKIP_LMCACHE:-0}" != "1" ]; then
  $PIP install --quiet -r requirements/lmcache-cpu.txt 'torch==2.13.0' 'numpy<=2.2.6'
  $PIP install --quiet --no-deps 'lmcache==0.5.6'
  # LMCache's own storage_backend_io harness ships only in its sdist: keep it in
  # ~/.cache/persisting/lmcache-0.5.6/ for benchmarks/lmcache_bench.py (and its test).
  "$VENV/bin/python" benchmarks/lmcache_harness.py --fetch
fi
"$VENV/bin/python" -c "import persisting, torch; print('persisting', persisting.__version__, 'torch', torch.__version__)"
