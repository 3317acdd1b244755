"""Time to first token: full prefill against restoring the prefix's KV from Persisting.

    python benchmarks/ttft_bench.py [--models llama-3.1-8b qwen2.5-32b]
                                    [--prefixes 4096 16384 32768] [--suffix 128] [--json out.json]
    python benchmarks/ttft_bench.py --tiny [--json out.json]      # CPU, seconds (the tests)

Models are random-weight ``LlamaForCausalLM`` built from configs with real shapes (no
weights downloaded); the 32B shape runs only when the GPU has the memory. For each prefix
length P, with a suffix of S tokens (P + S is the prompt):

- ``full``: prefill of all P + S tokens (the baseline; median of 3);
- the prefix's KV is saved (``save_prefix``), and the suffix's logits computed with the
  original cache are the reference every restore is compared with (``torch.equal``);
- ``memory_get``: restore from the memory tier the way a caller can today: lookup,
  ``batched_get`` (pageable CPU tensors), ``.to(device)``, cache assembly, suffix prefill;
- ``memory_ring``: ``load_prefix``: ``get_into`` pinned staging buffers, each sent up while
  the next is read (persisting.cuda), then the suffix prefill;
- ``disk_get`` / ``disk_ring``: the same from a store with no memory tier, after
  ``posix_fadvise(DONTNEED)`` on every store file (cold);
- load or recompute: the disk bandwidth measured so far and the prefill rate of ``full``
  decide (``plan_load``) whether the cold prefix is worth loading; the TTFT that decision
  gives is reported with whether it was ever worse than recomputing.

Each row reports the breakdown, the TTFT cut (1 - restore / full) and the bit-exact checks.
Once the store itself takes device tensors (issue 12), ``memory_get``/``disk_get`` measure
that path instead. Before each cold phase the disk is left to settle (``os.sync`` and a
pause, ``--settle-s``): these virtual disks keep flushing long after ``fsync`` returns.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from persisting.cuda import shared_copier
from persisting.integrations.transformers import (
    cache_from_chunks,
    dtype_name,
    forward,
    load_prefix,
    save_prefix,
)
from persisting.kv import KVStore, TokenHasher, open_kv_store
from persisting.kv.paths.load_plan import HitChunk, TierBandwidth

GiB = 1 << 30

#: Real shapes (the 32B one is Qwen2.5-32B's, on Llama's architecture). bf16 on a GPU.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=131072,
    ),
    "qwen2.5-32b": dict(
        vocab_size=152064,
        hidden_size=5120,
        intermediate_size=27648,
        num_hidden_layers=64,
        num_attention_heads=40,
        num_key_value_heads=8,
        max_position_embeddings=131072,
        attention_bias=True,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    ),
}
#: GPU memory a shape needs for 32k-token runs (weights, KV twice over, activations).
NEEDS_GIB = {"llama-3.1-8b": 40, "qwen2.5-32b": 100, "tiny": 0}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[float, Any]:
    """(seconds, result) of ``fn``, with the device's queued work included."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def settle(seconds: float) -> None:
    os.sync()
    time.sleep(seconds)


def drop_cache(directory: Path) -> None:
    """posix_fadvise(DONTNEED) on every file under ``directory``: the next reads are cold."""
    for dirpath, _dirs, files in os.walk(directory):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def build_model(name: str, device: torch.device, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[name])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        with device:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


class Run:
    """One model on one device: its store settings and the restore paths it times."""

    def __init__(self, model: Any, device: torch.device, chunk_size: int, workdir: Path):
        self.model = model
        self.device = device
        self.chunk_size = chunk_size
        self.workdir = workdir
        config = model.config
        self.kv_heads = config.num_key_value_heads
        self.dtype = model.dtype
        self.hasher = TokenHasher("bench/ttft", chunk_size=chunk_size, dtype=dtype_name(self.dtype))
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        self.kv_bytes_per_token = (
            2 * config.num_hidden_layers * self.kv_heads * head_dim * self.dtype.itemsize
        )
        self.copier = shared_copier(device)
        self.disk_bandwidth = TierBandwidth()

    def store(self, directory: Path, prefix: int, memory: bool) -> KVStore:
        kv = self.kv_bytes_per_token * prefix
        return open_kv_store(
            directory,
            "bench/ttft",
            memory_bytes=int(kv * 1.25) + (64 << 20) if memory else 0,
            disk_bytes=int(kv * 1.5) + (256 << 20),
            durability="sync",
            chunk_size=self.chunk_size,
        )

    def restore_get(self, store: KVStore, ids: torch.Tensor, prefix: int) -> dict[str, Any]:
        """Today's caller path: lookup, batched_get, .to(device), assemble, suffix."""
        keys = [key for _s, _e, key in self.hasher.process_tokens(ids[0, :prefix].numpy())]
        out: dict[str, Any] = {}
        out["lookup_s"], hits = timed(self.device, lambda: store.lookup_prefix(keys))
        out["get_s"], values = timed(self.device, lambda: store.batched_get(keys[:hits]))
        if any(v is None for v in values):
            raise RuntimeError("a chunk the lookup found could not be read")
        nbytes = sum(v.numel() * v.element_size() for v in values)
        out["h2d_s"], chunks = timed(self.device, lambda: [v.to(self.device) for v in values])
        out["build_s"], cache = timed(self.device, lambda: cache_from_chunks(chunks, self.kv_heads))
        n = hits * self.chunk_size
        out["suffix_s"], (logits, _cache) = timed(
            self.device, lambda: forward(self.model, ids[:, n:].to(self.device), cache)
        )
        out["ttft_s"] = sum(out[k] for k in ("lookup_s", "get_s", "h2d_s", "build_s", "suffix_s"))
        out["tokens"] = n
        out["read_gbps"] = nbytes / out["get_s"] / 1e9 if out["get_s"] > 0 else None
        return {**out, "_logits": logits, "_bytes": nbytes}

    def restore_ring(self, store: KVStore, ids: torch.Tensor, prefix: int) -> dict[str, Any]:
        """load_prefix: get_into pinned staging, each chunk sent up while the next is read."""
        out: dict[str, Any] = {}
        out["load_s"], (n, cache) = timed(
            self.device,
            lambda: load_prefix(
                store,
                ids,
                num_kv_heads=self.kv_heads,
                dtype=self.dtype,
                device=self.device,
                max_tokens=prefix,
                hasher=self.hasher,
                copier=self.copier,
            ),
        )
        out["suffix_s"], (logits, _cache) = timed(
            self.device, lambda: forward(self.model, ids[:, n:].to(self.device), cache)
        )
        out["ttft_s"] = out["load_s"] + out["suffix_s"]
        out["tokens"] = n
        return {**out, "_logits": logits, "_bytes": n * self.kv_bytes_per_token}

    def row(self, prefix: int, suffix: int, seed: int, settle_s: float) -> dict[str, Any]:
        vocab = self.model.config.vocab_size
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (1, prefix + suffix), generator=g)
        on_device = ids.to(self.device)
        with torch.inference_mode():
            forward(self.model, on_device[:, : min(prefix, 256)], logits_to_keep=1)  # warm-up
            fulls = [
                timed(self.device, lambda: forward(self.model, on_device, logits_to_keep=suffix))[0]
                for _ in range(3)
            ]
            full = statistics.median(fulls)
            _, original = forward(self.model, on_device[:, :prefix], logits_to_keep=1)
            directory = self.workdir / f"p{prefix}"
            row: dict[str, Any] = {"prefix": prefix, "suffix": suffix, "full_s": full}
            with self.store(directory, prefix, memory=True) as store:
                row["save_s"], saved = timed(
                    self.device,
                    functools.partial(
                        save_prefix, store, ids[:, :prefix], original, hasher=self.hasher
                    ),
                )
                if saved != prefix:
                    raise RuntimeError(f"saved {saved} of {prefix} tokens")
                expected, _ = forward(self.model, on_device[:, prefix:], original)
                del original
                for path, restore in (
                    ("memory_get", self.restore_get),
                    ("memory_ring", self.restore_ring),
                ):
                    runs = [restore(store, ids, prefix) for _ in range(3)]
                    best = sorted(runs, key=lambda r: r["ttft_s"])[1]  # the median run
                    row[path] = self.report(best, runs, expected)
            for path, restore in (("disk_get", self.restore_get), ("disk_ring", self.restore_ring)):
                with self.store(directory, prefix, memory=False) as store:
                    settle(settle_s)
                    drop_cache(directory)
                    result = restore(store, ids, prefix)
                    self.disk_bandwidth.record(
                        "disk", result["_bytes"], result.get("get_s") or result["load_s"]
                    )
                    row[path] = self.report(result, [result], expected)
            shutil.rmtree(directory, ignore_errors=True)
        row["raw_h2d_gbps"] = self.raw_h2d_gbps(min(prefix * self.kv_bytes_per_token, GiB))
        for path in ("memory_get", "memory_ring", "disk_get", "disk_ring"):
            r = row[path]
            r["ttft_cut"] = 1 - r["ttft_s"] / full
            r["restore_gbps"] = (
                r["tokens"] * self.kv_bytes_per_token / (r["ttft_s"] - r["suffix_s"]) / 1e9
            )
            r["vs_raw_h2d"] = r["restore_gbps"] / row["raw_h2d_gbps"]
        row["load_or_recompute"] = self.decide(row, prefix, suffix)
        return row

    def raw_h2d_gbps(self, nbytes: int) -> float:
        """The physical path: one copy from pinned host memory (plain memory on a CPU)."""
        pinned = self.device.type == "cuda"
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        host.fill_(1)
        target = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        runs = [
            timed(self.device, lambda: target.copy_(host, non_blocking=pinned))[0] for _ in range(3)
        ]
        return nbytes / statistics.median(runs) / 1e9

    def report(
        self, best: dict[str, Any], runs: list[dict[str, Any]], expected: Any
    ) -> dict[str, Any]:
        exact = all(torch.equal(r["_logits"], expected) for r in runs)
        return {**{k: v for k, v in best.items() if not k.startswith("_")}, "bit_exact": exact}

    def decide(self, row: dict[str, Any], prefix: int, suffix: int) -> dict[str, Any]:
        """What load-or-recompute makes of the cold disk hit, from the bandwidth measured so
        far and this prompt's prefill rate (the decision a store would take)."""
        rate = (prefix + suffix) / row["full_s"]
        chunk_bytes = self.kv_bytes_per_token * self.chunk_size
        hits = [HitChunk("disk", self.chunk_size, chunk_bytes)] * (prefix // self.chunk_size)
        plan = self.disk_bandwidth.plan(hits, rate)
        disk = min(row["disk_get"]["ttft_s"], row["disk_ring"]["ttft_s"])
        ttft = disk if plan.load_tokens else row["full_s"]
        return {
            "disk_gbps": (self.disk_bandwidth.bytes_per_s("disk") or 0) / 1e9,
            "prefill_tokens_per_s": rate,
            "load_tokens": plan.load_tokens,
            "choice": "load" if plan.load_tokens else "recompute",
            "ttft_s": ttft,
            "never_worse": ttft <= row["full_s"],
            "bandwidth_from": "this run's cold reads so far, this prompt's included",
        }


def run_model(
    name: str,
    args: argparse.Namespace,
    device: torch.device,
    entry: dict[str, Any],
    save: Callable[[], None],
) -> None:
    """Every prefix of one model into ``entry``, row by row, with ``save()`` after each (a
    run cut short by a time limit keeps what it measured)."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = build_model(name, device, dtype)
    workdir = Path(tempfile.mkdtemp(prefix="ttft-", dir=args.workdir))
    try:
        run = Run(model, device, args.chunk_size, workdir)
        entry.update(model=name, kv_bytes_per_token=run.kv_bytes_per_token, rows=[])
        warm = torch.zeros(
            1, min(args.prefixes[0], 4096) + args.suffix, dtype=torch.long, device=device
        )
        with torch.inference_mode():
            for _ in range(2):  # first calls pay for kernels, allocator growth, thread pools
                forward(model, warm, logits_to_keep=1)
        for i, prefix in enumerate(args.prefixes):
            row = run.row(prefix, args.suffix, seed=100 + i, settle_s=args.settle_s)
            entry["rows"].append(row)
            print_row(name, row)
            save()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


def print_row(name: str, row: dict[str, Any]) -> None:
    def cell(path: str) -> str:
        r = row[path]
        exact = "" if r["bit_exact"] else " NOT-EXACT"
        return f"{r['ttft_s']:.3f}s ({r['ttft_cut']:+.0%}){exact}"

    lor = row["load_or_recompute"]
    print(
        f"{name:14} P={row['prefix']:6}  full {row['full_s']:.3f}s  "
        f"mem get {cell('memory_get')}  mem ring {cell('memory_ring')}  "
        f"disk get {cell('disk_get')}  disk ring {cell('disk_ring')}  "
        f"L/R: {lor['choice']} {lor['ttft_s']:.3f}s  "
        f"ring/raw H2D {row['memory_ring']['vs_raw_h2d']:.2f}x",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama-3.1-8b", "qwen2.5-32b"])
    parser.add_argument("--prefixes", nargs="+", type=int, default=[4096, 16384, 32768])
    parser.add_argument("--suffix", type=int, default=128)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--settle-s", type=float, default=3.0)
    parser.add_argument("--workdir", default=None, help="where stores are made (default: tmp)")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU, in seconds")
    args = parser.parse_args(argv)
    if args.tiny:
        args.models, args.prefixes, args.suffix = ["tiny"], [256, 512], 16
        args.chunk_size, args.device, args.settle_s = 32, "cpu", 0.0
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    total_gib = (
        torch.cuda.get_device_properties(device).total_memory / GiB if device.type == "cuda" else 0
    )
    import transformers

    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tiny": args.tiny,
        "models": [],
        "skipped": [],
    }

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))

    for name in args.models:
        if device.type == "cuda" and total_gib < NEEDS_GIB[name]:
            report["skipped"].append(f"{name}: needs {NEEDS_GIB[name]} GiB, has {total_gib:.0f}")
            print(report["skipped"][-1], flush=True)
            continue
        entry: dict[str, Any] = {"model": name, "rows": []}
        report["models"].append(entry)
        run_model(name, args, device, entry, save)
    exact = all(
        row[p]["bit_exact"]
        for m in report["models"]
        for row in m["rows"]
        for p in ("memory_get", "memory_ring", "disk_get", "disk_ring")
    )
    print(f"bit-exact: {exact}")
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
