#!/usr/bin/env bash
# Build the environment benchmarks/fleet_mooncake_bench.py runs Mooncake Store in:
# mooncake-transfer-engine-non-cuda 0.3.13.post1 (mooncake.store, mooncake_master) in a venv
# of its own, so Mooncake never becomes a dependency of Persisting or of its tests.
#
#   bash scripts/install_mooncake.sh                   # creates ./.venv-mooncake
#   MOONCAKE_VENV=/path/to/venv bash scripts/install_mooncake.sh
#
# Every Mooncake extension links libibverbs.so.1, even for TCP: where it is missing and we
# are root, apt installs libibverbs1. A second run finds everything in place.
set -euo pipefail
cd "$(dirname "$0")/.."
MOONCAKE_VENV=${MOONCAKE_VENV:-.venv-mooncake}
PY=${PYTHON:-python3}
MOONCAKE_VERSION=0.3.13.post1

if ! ldconfig -p | grep -q 'libibverbs\.so\.1 '; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "install_mooncake.sh: installing libibverbs1"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
  else
    echo "install_mooncake.sh: libibverbs.so.1 is missing; install libibverbs1 as root" >&2
    exit 1
  fi
fi

if [ ! -x "$MOONCAKE_VENV/bin/python" ]; then
  "$PY" -m venv "$MOONCAKE_VENV"
fi
if ! "$MOONCAKE_VENV/bin/python" -c "
import sys
from importlib import metadata
try:
    sys.exit(0 if metadata.version('mooncake-transfer-engine-non-cuda') == '$MOONCAKE_VERSION' else 1)
except metadata.PackageNotFoundError:
    sys.exit(1)
"; then
  echo "install_mooncake.sh: installing mooncake-transfer-engine-non-cuda $MOONCAKE_VERSION"
  "$MOONCAKE_VENV/bin/python" -m pip install --quiet \
    "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION"
fi
"$MOONCAKE_VENV/bin/python" -c "from mooncake.store import MooncakeDistributedStore, ReplicateConfig"
test -x "$MOONCAKE_VENV/bin/mooncake_master"
echo "install_mooncake.sh: Mooncake Store ready in $MOONCAKE_VENV"
