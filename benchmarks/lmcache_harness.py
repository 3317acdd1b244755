"""LMCache 0.5.6's own ``storage_backend_io`` harness, as shipped, with the plugin beside
LocalDiskBackend.

The harness (``benchmarks/storage_backend_io/storage_backend_io_benchmark.py``) ships in
LMCache's sdist, not its wheel. :func:`harness_path` finds it in a cache, or fetches the
sdist with pip and keeps the harness's directory there:

- ``$PERSISTING_LMCACHE_HARNESS`` (a directory holding the file), else
- ``$XDG_CACHE_HOME/persisting/lmcache-0.5.6/storage_backend_io/`` (``~/.cache/...``), else
- ``pip download --no-binary lmcache --no-deps --no-build-isolation lmcache==0.5.6``, with
  ``--no-clean`` and a private ``TMPDIR``: on a machine without CUDA pip then fails to
  prepare the sdist's metadata (its setup builds CUDA extensions), but the sdist is
  already unpacked under that ``TMPDIR``, where the harness is taken from. The file's
  SHA-256 must be the one 0.5.6 shipped (:data:`HARNESS_SHA256`).

``scripts/install.sh`` fetches it into the cache (``python benchmarks/lmcache_harness.py
--fetch``). Each run is a fresh process (``--run``), as an independent check runs it: the
harness's ``run()`` with ``write_bench=False`` and ``verify_integrity=True``, LMCache's
``LocalDiskBackendBenchmark`` for LocalDisk and, for the plugin, a subclass of its
``StorageBackendBenchmark`` that differs from LMCache's own backend subclasses only in the
backend it builds (``PersistingKVBackend`` with ``persisting.storage_path``). Everything
else is LMCache's: the ``AdHocMemoryAllocator`` its ``LocalCPUBackend`` reads land in (a
fresh tensor per read), the ``kv_shape (28, 2, chunk, 8, 128)`` bfloat16 chunks, the
``batched_submit_put_task`` slices, the ``batched_get_blocking`` slices, the integrity check.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

VERSION = "0.5.6"
HARNESS = "storage_backend_io_benchmark.py"
#: SHA-256 of ``benchmarks/storage_backend_io/storage_backend_io_benchmark.py`` in 0.5.6.
HARNESS_SHA256 = "acca3bb95585daeec70d628603bc95ec5e0930c2ef65527e67c36e451a27879b"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(base) / "persisting" / f"lmcache-{VERSION}" / "storage_backend_io"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _fetch(into: Path) -> Path:
    """Download LMCache's sdist with pip and keep its ``storage_backend_io`` directory."""
    with tempfile.TemporaryDirectory(prefix="lmcache-sdist-") as tmp:
        env = dict(os.environ, TMPDIR=tmp, NO_CUDA_EXT="1")
        done = subprocess.run(
            [
                sys.executable,
                *("-m", "pip", "download", "--no-binary", "lmcache", "--no-deps"),
                *("--no-build-isolation", "--no-clean", "--disable-pip-version-check"),
                *("-d", tmp, f"lmcache=={VERSION}"),
            ],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        found = glob.glob(f"{tmp}/pip-*/lmcache*/benchmarks/storage_backend_io/{HARNESS}")
        archives = glob.glob(f"{tmp}/lmcache-{VERSION}.tar.gz")
        if not found and archives:  # metadata prepared (a CUDA host): unpack the archive
            shutil.unpack_archive(archives[0], tmp)
            found = glob.glob(f"{tmp}/lmcache-{VERSION}/benchmarks/storage_backend_io/{HARNESS}")
        if not found:
            raise RuntimeError(
                f"could not get LMCache {VERSION}'s sdist with pip:\n{done.stderr[-2000:]}"
            )
        source = Path(found[0])
        if _sha256(source) != HARNESS_SHA256:
            raise RuntimeError(f"{source} is not the harness LMCache {VERSION} shipped")
        into.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".fetch-", dir=into.parent))
        shutil.copytree(source.parent, staging, dirs_exist_ok=True)
        shutil.rmtree(into, ignore_errors=True)
        staging.rename(into)
    return into / HARNESS


def harness_path(fetch: bool = True) -> Path:
    """The harness file: from ``$PERSISTING_LMCACHE_HARNESS``, the cache, or pip."""
    override = os.environ.get("PERSISTING_LMCACHE_HARNESS")
    candidates = [Path(override) / HARNESS] if override else []
    candidates.append(cache_dir() / HARNESS)
    for path in candidates:
        if path.is_file() and _sha256(path) == HARNESS_SHA256:
            return path
    if not fetch:
        raise FileNotFoundError(f"LMCache's harness is not in {cache_dir()}")
    return _fetch(cache_dir())


def load_harness(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("storage_backend_io_benchmark", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _persisting_benchmark(harness: ModuleType) -> type:
    """The harness's backend benchmark for the plugin (built the way its others are)."""
    from persisting.lmcache_backend import PersistingKVBackend

    class PersistingBackendBenchmark(harness.StorageBackendBenchmark):
        def __init__(self, storage_path: str, options: dict[str, Any], **kwargs: Any):
            super().__init__("persisting", **kwargs)
            self.storage_path = storage_path
            self.options = options

        @property
        def extra_config_keys(self) -> dict:
            return {"persisting.storage_path": self.storage_path, **self.options}

        def _create_backend(self, config, metadata, loop, local_cpu_backend):
            return PersistingKVBackend(
                config=config,
                dst_device="cpu",
                metadata=metadata,
                local_cpu_backend=local_cpu_backend,
                loop=loop,
            )

        def _close_backend(self) -> None:
            self._backend.close()

    return PersistingBackendBenchmark


def run_once(
    backend: str,
    directory: Path,
    num_ops: int,
    concurrency: int,
    chunk_size: int,
    options: dict[str, Any],
) -> dict[str, Any]:
    """One write + read run of the harness in this process (see the module docstring)."""
    harness = load_harness(harness_path(fetch=False))
    common = dict(
        num_ops=num_ops,
        concurrency=concurrency,
        use_odirect=False,
        alignment=4096,
        write_bench=False,
        chunk_size=chunk_size,
        verify_integrity=True,
    )
    bench: Any
    if backend == "local_disk":
        bench = harness.LocalDiskBackendBenchmark(
            local_disk_dir=str(directory) + "/", max_disk_gb=64.0, **common
        )
    else:
        bench = _persisting_benchmark(harness)(str(directory), options, **common)
    return dict(bench.run())


def run_child(
    backend: str,
    directory: Path,
    num_ops: int,
    concurrency: int,
    chunk_size: int,
    options: dict[str, Any],
) -> dict[str, Any]:
    """:func:`run_once` in a fresh process; its result (plus the load average at start)."""
    load = os.getloadavg()[0]
    args = [sys.executable, __file__, "--run", backend, "--dir", str(directory)]
    args += ["--num-ops", str(num_ops), "--concurrency", str(concurrency)]
    args += ["--chunk-size", str(chunk_size)]
    for key, value in options.items():
        args += ["--persisting", f"{key}={value}"]
    env = dict(os.environ, LMCACHE_LOG_LEVEL=os.environ.get("LMCACHE_LOG_LEVEL", "WARNING"))
    done = subprocess.run(args, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"harness run of {backend} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["load_average"] = load
    return dict(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fetch", action="store_true", help="fetch into the cache, print path")
    parser.add_argument("--run", choices=["local_disk", "persisting"])
    parser.add_argument("--dir", type=Path)
    parser.add_argument("--num-ops", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--persisting", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    if args.fetch:
        print(harness_path())
        return
    if args.run is None or args.dir is None:
        parser.error("--run needs --dir (or use --fetch)")
    options = dict(item.split("=", 1) for item in args.persisting)
    start = time.perf_counter()
    result = run_once(args.run, args.dir, args.num_ops, args.concurrency, args.chunk_size, options)
    result["process_s"] = time.perf_counter() - start
    print(json.dumps(result))


if __name__ == "__main__":
    main()
