"""A real vLLM engine (CPU build) driven by a JSON plan: the engine side of the engine tests
and of ``benchmarks/vllm_ttft.py``. Runs in the engine environment (``.venv-vllm``)::

    .venv-vllm/bin/python benchmarks/vllm_engine.py model DIR [--layers 2 --hidden 256]
    .venv-vllm/bin/python benchmarks/vllm_engine.py run PLAN.json OUT.json

``model`` builds a random-weight ``LlamaForCausalLM`` from a ``LlamaConfig`` (bf16
safetensors, no download; ``--seed`` picks the weights, ``--arch gemma3`` builds a hybrid
``Gemma3ForCausalLM`` instead: sliding-window and full-attention layers, two KV-cache
groups) and a word-level tokenizer trained here with ``tokenizers``.
``run`` starts one ``LLM`` with the plan's KV connector, then runs its steps in order:

- ``{"name": "a", "prompt": [len, seed], "max_tokens": 8}``: greedy generation of a prompt
  of random token ids; records the ids, ``num_cached_tokens`` (prompt tokens reused from the
  connector) and the seconds ``generate`` took (with ``max_tokens: 1``, the time to first
  token);
- ``{"action": "wait_files", "dir": D, "count": N}``: wait until D holds N files (stores
  land asynchronously, after the request finished);
- ``{"action": "damage", "dir": D}``: flip bytes in the middle of every file under D;
- ``{"action": "unreadable", "dir": D}``: replace every block file under D by a link to a
  directory (opening it works, reading it fails with an I/O error);
- ``{"action": "signal", "file": F}`` / ``{"action": "wait", "file": F}``: write / wait
  for a marker (engines in two processes);
- ``{"action": "scrape", "url": U}``: read a metrics page into the output;
- ``{"action": "settle"}``: ``os.sync()`` and a pause (benchmarks);
- ``{"action": "uncache", "dir": D}``: drop D's files from the page cache (cold reads);
- ``{"action": "kill"}``: SIGKILL this process and the engine's (its process group): no
  shutdown, no close, no flush. The output so far is written after every step.

Connectors: ``persisting`` (PersistingConnector with the plan's extra config), ``lmcache``
(vLLM's LMCacheMPConnector to a running ``lmcache server``), ``naive``
(``benchmarks/naive_file_spec.py``: one file per block, the baseline of the TTFT
benchmark), ``tiering-fs`` (vLLM's OffloadingConnector with its TieringOffloadingSpec and
``fs`` tier: GPU engines only), or none. The plan's ``gpu_memory_utilization`` is passed on
(GPU engines).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

VOCAB = 4096


def build_model(
    out: Path,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    max_len: int,
    seed: int = 0,
    arch: str = "llama",
) -> None:
    """A random-weight model and a word-level tokenizer for it, saved under ``out`` (its
    weights replaced if there already is one)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    words = [f"w{i}" for i in range(VOCAB - 4)]
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>", "<pad>"]
    )
    tokenizer.train_from_iterator([" ".join(words)], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.save_pretrained(out)
    shape = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_len,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        torch_dtype="bfloat16",
    )
    if arch == "gemma3":  # layers alternate: a 256-token sliding window, then full attention
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        layer_types = ["sliding_attention", "full_attention"] * -(-layers // 2)
        config: Any = Gemma3TextConfig(
            **shape, head_dim=hidden // heads, sliding_window=256, layer_types=layer_types[:layers]
        )
        architecture: Any = Gemma3ForCausalLM
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        config, architecture = LlamaConfig(**shape), LlamaForCausalLM
    torch.manual_seed(seed)
    for old in out.glob("*.safetensors"):
        old.unlink()
    model = architecture(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def prompt_ids(length: int, seed: int) -> list[int]:
    """``length`` random token ids (no special tokens), the same for the same seed."""
    return [int(t) for t in np.random.default_rng(seed).integers(4, VOCAB, length)]


# -- running an engine ------------------------------------------------------------------


def _transfer_config(connector: dict[str, Any] | None) -> Any:
    from vllm.config import KVTransferConfig

    if connector is None:
        return None
    kind = connector["kind"]
    if kind == "persisting":
        return KVTransferConfig(
            kv_connector="PersistingConnector",
            kv_connector_module_path="persisting.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=dict(connector["extra"]),
        )
    if kind == "lmcache":
        return KVTransferConfig(
            kv_connector="LMCacheMPConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "lmcache.mp.host": "tcp://localhost",
                "lmcache.mp.port": int(connector["port"]),
            },
        )
    if kind == "tiering-fs":  # vLLM's own tiered offloading with its fs tier (GPU engines)
        return KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": int(connector.get("cpu_bytes", 4 << 30)),
                "secondary_tiers": [{"type": "fs", "root_dir": connector["dir"]}],
            },
        )
    if kind == "naive":
        return KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "spec_name": "NaiveFileSpec",
                "spec_module_path": "naive_file_spec",
                "naive_dir": connector["dir"],
            },
        )
    raise ValueError(f"unknown connector {kind!r}")


def _files(directory: str) -> list[Path]:
    return [p for p in Path(directory).rglob("*") if p.is_file()]


def _payload_files(directory: str) -> list[Path]:
    """Files holding blocks: Persisting's payload files, or every file of a plain dir."""
    root = Path(directory)
    payload = [p for p in root.rglob("*") if p.is_file() and "payload" in p.parts]
    return payload or [p for p in _files(directory) if p.suffix != ".tmp"]


def _action(step: dict[str, Any]) -> dict[str, Any]:
    action = step["action"]
    if action == "wait_files":
        deadline = time.monotonic() + float(step.get("timeout", 120))
        while len(_payload_files(step["dir"])) < step["count"]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{step['dir']}: {len(_payload_files(step['dir']))} files")
            time.sleep(0.05)
        time.sleep(float(step.get("linger", 0.3)))
        return {"files": len(_payload_files(step["dir"]))}
    if action == "damage":
        damaged = 0
        for path in _payload_files(step["dir"]):
            size = path.stat().st_size
            with open(path, "r+b") as f:
                f.seek(size // 2)
                chunk = f.read(64)
                f.seek(size // 2)
                f.write(bytes(b ^ 0xFF for b in chunk))
            damaged += 1
        return {"damaged": damaged}
    if action == "unreadable":  # opening works, reading fails (EISDIR): an I/O error
        files = _payload_files(step["dir"])
        target = Path(tempfile.mkdtemp(prefix="unreadable-"))  # outside the storage root
        for path in files:
            path.unlink()
            path.symlink_to(target)
        return {"unreadable": len(files)}
    if action == "signal":
        Path(step["file"]).write_text("ready")
        return {}
    if action == "wait":
        deadline = time.monotonic() + float(step.get("timeout", 600))
        while not Path(step["file"]).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {step['file']}")
            time.sleep(0.1)
        time.sleep(float(step.get("linger", 0)))
        return {}
    if action == "scrape":
        with urllib.request.urlopen(step["url"], timeout=10) as reply:
            return {"text": reply.read().decode()}
    if action == "uncache":  # the block files leave the page cache: the next read is cold
        for path in _files(step["dir"]):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return {}
    if action == "kill":
        os.killpg(os.getpgrp(), signal.SIGKILL)
    if action == "settle":
        os.sync()
        time.sleep(float(step.get("seconds", 2.0)))
        return {}
    raise ValueError(f"unknown action {action!r}")


def run(plan: dict[str, Any], out_file: Path) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    options: dict[str, Any] = {}
    for name in ("block_size", "max_num_batched_tokens", "gpu_memory_utilization"):
        if plan.get(name):
            options[name] = plan[name]
    llm = LLM(
        model=plan["model"],
        dtype=plan.get("dtype", "bfloat16"),
        enforce_eager=True,
        max_model_len=plan.get("max_model_len", 2048),
        enable_prefix_caching=False,
        kv_transfer_config=_transfer_config(plan.get("connector")),
        seed=0,
        **options,
    )
    out: dict[str, Any] = {"startup_s": time.perf_counter() - start, "steps": []}
    for step in plan["steps"]:
        out_file.write_text(json.dumps(out))  # what was done so far, should the next step kill
        if "action" in step:
            out["steps"].append({"action": step["action"], **_action(step)})
            continue
        length, seed = step["prompt"]
        params = SamplingParams(temperature=0.0, max_tokens=step.get("max_tokens", 8), seed=0)
        began = time.perf_counter()
        (result,) = llm.generate(
            [TokensPrompt(prompt_token_ids=prompt_ids(length, seed))], params, use_tqdm=False
        )
        elapsed = time.perf_counter() - began
        out["steps"].append(
            {
                "name": step.get("name", f"{length}/{seed}"),
                "ids": list(result.outputs[0].token_ids),
                "cached": int(result.num_cached_tokens or 0),
                "seconds": elapsed,
            }
        )
    out["total_s"] = time.perf_counter() - start
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    model = sub.add_parser("model")
    model.add_argument("dir", type=Path)
    model.add_argument("--layers", type=int, default=2)
    model.add_argument("--hidden", type=int, default=256)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--kv-heads", type=int, default=4)
    model.add_argument("--max-len", type=int, default=4096)
    model.add_argument("--seed", type=int, default=0, help="which random weights")
    model.add_argument("--arch", choices=("llama", "gemma3"), default="llama")
    runner = sub.add_parser("run")
    runner.add_argument("plan", type=Path)
    runner.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "model":
        build_model(
            args.dir, args.layers, args.hidden, args.heads, args.kv_heads, args.max_len,
            seed=args.seed, arch=args.arch,
        )  # fmt: skip
        return
    plan = json.loads(args.plan.read_text())
    result = run(plan, args.out)
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # naive_file_spec, for vLLM
    main()
