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
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

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
fi
"$VENV/bin/python" -c "import persisting, torch; print('persisting', persisting.__version__, 'torch', torch.__version__)"
