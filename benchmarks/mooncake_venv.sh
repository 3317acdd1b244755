#!/usr/bin/env bash
# A separate venv with Mooncake Store for benchmarks/remote_bench.py (never the project's
# .venv: Mooncake is only a point of comparison). Its .so files need libibverbs even for TCP.
#
#   bash benchmarks/mooncake_venv.sh [/path/to/venv]     # default: ./.venv-mooncake
#   .venv/bin/python benchmarks/remote_bench.py --mooncake-python ./.venv-mooncake/bin/python
set -euo pipefail
VENV=${1:-.venv-mooncake}
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q libibverbs1 >/dev/null
fi
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet 'mooncake-transfer-engine-non-cuda==0.3.13.post1' numpy
"$VENV/bin/python" -c "import mooncake.store; print('mooncake store ok')"
