#!/usr/bin/env bash
# Set up a virtual environment with Persisting, its test tools, LMCache (CPU-only) and the
# vLLM engine environment the engine tests run in.
#
#   bash scripts/install.sh            # creates ./.venv (and ./.venv-vllm)
#   VENV=/path/to/venv bash scripts/install.sh
#
# torch is pinned to 2.13.0 here (not in pyproject): on these machines that pin takes the
# CPU build already on disk, while an unpinned torch downloads a multi-GB CUDA build.
# LMCache 0.5.6 is installed with --no-deps plus its pure-Python dependencies, because its
# declared dependencies include CUDA-only packages (so the `lmcache` extra, which names
# LMCache for CUDA hosts, is not used here; requirements/lmcache-cpu.txt has the rest of it).
# The extras installed: service (Pulsing), hf (transformers), plot (matplotlib), dev.
# Then scripts/install_engine_env.sh builds ./.venv-vllm: vLLM 0.32's CPU build and LMCache,
# with Persisting installed into it the way an engine's users do (below); the engine tests
# (tests/engines/) and benchmarks/vllm_ttft.py run engines there; and ./.venv-vllm-0.34 over
# it: vLLM 0.34's wheel (what GPU users install) without its dependencies, whose Python classes
# the tier's and the CPU worker's engine tests run against too. PERSISTING_SKIP_VLLM=1
# leaves both out (the engine tests then fail), PERSISTING_SKIP_LMCACHE=1 leaves LMCache out of
# .venv. Then scripts/install_sglang_env.sh builds ./.venv-sglang: SGLang 0.5.23's storage
# classes on CPU, with Persisting installed into it the same way; the SGLang tests
# (tests/sglang/) and benchmarks/sglang_l3_bench.py run there. PERSISTING_SKIP_SGLANG=1
# leaves it out (the SGLang tests then fail).
#
# Into an existing environment (vLLM, SGLang) without touching what the engine installed:
#
#   PERSISTING_EXISTING_ENV=1 VENV=/opt/vllm/.venv bash scripts/install.sh
#
# installs Persisting's core (no test tools, no Pulsing; PERSISTING_EXTRAS=lmcache,hf adds
# extras; PERSISTING_EXTRAS=service adds Pulsing, past its pydantic cap: see below) into $VENV in editable mode with every distribution already there held at its
# version by a pip constraint: pip only adds what is missing (pylance, xxhash, ...), and fails
# rather than move a version the engine depends on. What the installed distributions require
# of ones not installed is a constraint too: what pip adds is at a version they accept (an
# engine installed with --no-deps still declares its pins). LMCache comes from the engine's own
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
import re
import sys
from importlib import metadata

try:
    torch = metadata.version("torch")
except metadata.PackageNotFoundError:
    sys.exit(f"install.sh: no torch in {sys.prefix}: this mode keeps an engine's torch")
def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()


held = {}
dists = [d for d in metadata.distributions() if canonical(d.metadata["Name"] or "")]
for dist in dists:
    name = canonical(dist.metadata["Name"])
    if name != "persisting":
        held[name] = dist.version
# What installed distributions require of distributions not installed (an engine installed
# with --no-deps, or a dependency left out): pip may add such a distribution for Persisting,
# but only at a version its dependents accept (SGLang's python-dateutil<3, which
# lance-namespace would otherwise bring at 4.x). Extras and URL requirements are left out.
wanted = []
for dist in dists:
    if canonical(dist.metadata["Name"]) == "persisting":
        continue
    for line in dist.requires or []:
        spec, _, marker = line.partition(";")
        if "extra ==" in marker or "@" in spec:
            continue
        match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*\(?([^)]*)\)?", spec)
        if not match or not match.group(2).strip() or canonical(match.group(1)) in held:
            continue
        wanted.append(f"{canonical(match.group(1))}{match.group(2).strip()}"
                      + (f"; {marker.strip()}" if marker.strip() else ""))
with open(sys.argv[1], "w") as f:
    f.writelines(f"{name}=={version}\n" for name, version in sorted(held.items()))
    f.writelines(f"{line}\n" for line in sorted(set(wanted)))
print(f"install.sh: holding the {len(held)} installed distributions at their versions"
      f" (torch {torch}, numpy {held.get('numpy', '-')}), and {len(set(wanted))} requirements"
      f" they make of distributions not installed")
PYTHON
  then
    exit 2
  fi
  extras=${PERSISTING_EXTRAS:-}
  if [[ ",$extras," == *",service,"* ]]; then
    # Pulsing 0.1.2 caps pydantic at 2.11.7 in its metadata, below what vLLM 0.32+ holds
    # (2.12+), so pip cannot install the service extra as declared here. Pulsing does not
    # import pydantic: it goes in without its declared requirements, the ones it imports
    # (uvloop, aiohttp, hyperparameter) and the extra's others under the same constraint.
    service=$("$VENV/bin/python" -c 'import tomllib; print(" ".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["service"]))')
    pulsing=$(tr ' ' '\n' <<<"$service" | grep '^pulsing')
    others=$(tr ' ' '\n' <<<"$service" | { grep -v '^pulsing' || true; } | tr '\n' ' ')
    # shellcheck disable=SC2086
    if ! "$VENV/bin/python" -m pip install --quiet --no-deps "$pulsing" \
        || ! "$VENV/bin/python" -m pip install --quiet -c "$constraints" \
          "uvloop>=0.21.0" "aiohttp>=3.9.0" "hyperparameter>=0.5.0" $others; then
      echo "install.sh: the service extra's requirements conflict with a version this environment holds (pip says which, above)" >&2
      exit 1
    fi
    extras=$(tr ',' '\n' <<<"$extras" | { grep -v '^service$' || true; } | paste -sd, -)
  fi
  target=.
  if [ -n "$extras" ]; then
    target=".[${extras}]"
  fi
  if ! "$VENV/bin/python" -m pip install --quiet -c "$constraints" -e "$target"; then
    echo "install.sh: Persisting's requirements conflict with a version this environment holds (pip says which, above); nothing installed was changed" >&2
    exit 1
  fi
  "$VENV/bin/python" -c "import persisting, torch; print('persisting', persisting.__version__, 'torch', torch.__version__, '(kept)')"
  exit 0
fi

# The tests put a server and a client on two hosts (network namespaces joined by a veth
# pair): they need iproute2 (ip, ss), which slim images lack. CI runs as root.
if ! command -v ip >/dev/null 2>&1 || ! command -v ss >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2 >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2 >/dev/null; }
  else
    echo "install.sh: iproute2 (ip, ss) is missing: the two-host tests need it (run as root to install)" >&2
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/python -m pip"
$PIP install --quiet --upgrade pip
$PIP install --quiet 'torch==2.13.0' 'numpy<=2.2.6'
$PIP install --quiet -e '.[dev,hf,service,plot]' 'torch==2.13.0' 'numpy<=2.2.6'
if [ "${PERSISTING_SKIP_LMCACHE:-0}" != "1" ]; then
  $PIP install --quiet -r requirements/lmcache-cpu.txt 'torch==2.13.0' 'numpy<=2.2.6'
  $PIP install --quiet --no-deps 'lmcache==0.5.6'
  # LMCache's own storage_backend_io harness ships only in its sdist: keep it in
  # ~/.cache/persisting/lmcache-0.5.6/ for benchmarks/lmcache_bench.py (and its test).
  "$VENV/bin/python" benchmarks/lmcache_harness.py --fetch
fi
"$VENV/bin/python" -c "import persisting, torch; print('persisting', persisting.__version__, 'torch', torch.__version__)"
if [ "${PERSISTING_SKIP_VLLM:-0}" != "1" ]; then
  bash scripts/install_engine_env.sh
fi
if [ "${PERSISTING_SKIP_SGLANG:-0}" != "1" ]; then
  bash scripts/install_sglang_env.sh
fi
