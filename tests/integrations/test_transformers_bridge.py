"""The transformers bridge with a real (tiny, random-weight) Llama and a real store: a
restored prefix gives the same logits, bit for bit, as the cache it was saved from."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from persisting.errors import InvalidValueError, LayoutMismatchError
from persisting.integrations.transformers import (
    Geometry,
    _geometry_key,
    dtype_name,
    forward,
    load_prefix,
    save_prefix,
    saved_geometry,
)
from persisting.kv import KVStore, TokenHasher, open_kv_store
from tests import child_env
from tests.integrations.hf_helpers import CHUNK, KV_HEADS, MODEL, prompt, tiny_llama
from tests.service.service_helpers import free_port, processes, start_serve, wait_for_log


def store_at(root: Path, **options) -> KVStore:
    options.setdefault("memory_bytes", 64 << 20)
    return open_kv_store(root, MODEL, disk_bytes=256 << 20, chunk_size=CHUNK, **options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_suffix_logits_with_the_restored_cache_equal_those_with_the_original(
    root: Path, dtype: torch.dtype
) -> None:
    model = tiny_llama(dtype)
    ids = prompt(300, seed=1)  # 4 whole chunks of 64 and a tail of 44
    with torch.no_grad(), store_at(root) as store:
        _, original = forward(model, ids[:, :256])
        assert save_prefix(store, ids[:, :256], original) == 256
        record = store.layout(_geometry_key(store.token_hasher())).nbytes  # the geometry
        assert store.stats()["put_bytes_disk"] == 4 * 2 * 3 * CHUNK * 32 * dtype.itemsize + record
        expected, _ = forward(model, ids[:, 256:], original)

        n, restored = load_prefix(store, ids, num_kv_heads=KV_HEADS, dtype=dtype)
        assert n == 256 and restored.get_seq_length() == 256
        got, _ = forward(model, ids[:, n:], restored)
    assert got.dtype == dtype
    assert torch.equal(got, expected)


def test_a_shared_prefix_restores_up_to_the_first_chunk_that_differs(root: Path) -> None:
    model = tiny_llama()
    ids = prompt(256, seed=2)
    other = ids.clone()
    other[0, 150] = (other[0, 150] + 1) % 256  # differs inside the third chunk
    with torch.no_grad(), store_at(root, memory_bytes=0) as store:
        _, cache = forward(model, ids)
        save_prefix(store, ids, cache)
        n, restored = load_prefix(store, other, num_kv_heads=KV_HEADS, dtype=torch.float32)
        assert n == 128
        for old, new in zip(cache.layers, restored.layers, strict=True):
            assert torch.equal(new.keys, old.keys[:, :, :128])
            assert torch.equal(new.values, old.values[:, :, :128])
        # At most what the caller asks for, in whole chunks.
        n, _ = load_prefix(store, ids, num_kv_heads=KV_HEADS, dtype=torch.float32, max_tokens=200)
        assert n == 192
        # Keys carry the dtype: a bf16 model finds nothing a float32 one stored.
        n, empty = load_prefix(store, ids, num_kv_heads=KV_HEADS, dtype=torch.bfloat16)
        assert n == 0 and empty.get_seq_length() == 0


def test_saving_again_copies_only_new_chunks(root: Path) -> None:
    model = tiny_llama()
    ids = prompt(320, seed=3)
    with torch.no_grad(), store_at(root) as store:
        _, short = forward(model, ids[:, :128])
        assert save_prefix(store, ids[:, :128], short) == 128
        _, longer = forward(model, ids)
        assert save_prefix(store, ids, longer) == 320
        stats = store.stats()
        # Two batches of chunks, 2 + 3, and the geometry record put once beside them.
        assert stats["disk_items"] == 5 + 1 and stats["put_stored"] == 2 + 1


def test_a_damaged_chunk_ends_the_restored_prefix_before_it(root: Path) -> None:
    model = tiny_llama()
    ids = prompt(256, seed=4)
    hasher = TokenHasher(MODEL, chunk_size=CHUNK, dtype="float")
    keys = [key for _s, _e, key in hasher.process_tokens(ids[0].numpy())]
    with torch.no_grad(), store_at(root) as store:
        # Chunk 2's key already holds a value of another layout (first writer wins).
        store.put(keys[2], torch.zeros(2, 3, CHUNK, 16))
        _, cache = forward(model, ids)
        save_prefix(store, ids, cache)
        assert store.lookup_prefix(keys) == 4
        n, restored = load_prefix(store, ids, num_kv_heads=KV_HEADS, dtype=torch.float32)
    assert n == 128 and restored.get_seq_length() == 128


def test_bad_inputs_are_refused_clearly(root: Path) -> None:
    model = tiny_llama()
    with torch.no_grad(), store_at(root) as store:
        _, batch_of_two = forward(model, prompt(128, 5).repeat(2, 1))
        with pytest.raises(InvalidValueError, match=r"want \[1, heads"):
            save_prefix(store, prompt(128, 5), batch_of_two)
        with pytest.raises(InvalidValueError, match="not a KV cache"):
            save_prefix(store, prompt(128, 5), object())
        with pytest.raises(InvalidValueError, match="pass hasher="):
            load_prefix(object(), prompt(128, 5), num_kv_heads=2, dtype=torch.float32)
        with pytest.raises(InvalidValueError, match=r"cannot be stored; supported: .*float32"):
            dtype_name(torch.complex64)
        assert dtype_name("float32") == dtype_name(torch.float32) == "float"


def test_after_save_prefix_the_stores_own_token_lookups_find_the_chunks(root: Path) -> None:
    model = tiny_llama(torch.float32)
    ids = prompt(256, seed=11)
    with torch.no_grad(), store_at(root) as store:
        _, cache = forward(model, ids)
        assert store.lookup_tokens(ids[0].tolist()) == 0  # nothing saved yet
        assert save_prefix(store, ids, cache) == 256
        assert store.key_dtype == "float"
        assert store.lookup_tokens(ids[0].tolist()) == 256
        plan = store.plan_tokens(ids[0].tolist(), recompute_tokens_per_s=1e12)
        assert plan.hit_tokens == 256
    # Another process (a fresh store) says which dtype, in any spelling.
    with store_at(root) as again:
        assert again.lookup_tokens(ids[0].tolist()) == 0  # keys say float, lookups bfloat16
        assert again.lookup_tokens(ids[0].tolist(), dtype="float32") == 256
        assert again.lookup_tokens(ids[0].tolist(), dtype=torch.float32) == 256
        n, restored = load_prefix(again, ids, num_kv_heads=KV_HEADS, dtype="float32")
        assert n == 256 and restored.get_seq_length() == 256


def test_a_wrong_head_count_head_size_or_layer_count_is_a_typed_error_never_a_cache(
    root: Path,
) -> None:
    model = tiny_llama()  # 2 KV heads of 16, 3 layers
    ids = prompt(256, seed=12)
    with torch.no_grad(), store_at(root) as store:
        _, cache = forward(model, ids)
        save_prefix(store, ids, cache)
        assert saved_geometry(store, store.token_hasher()) == Geometry(KV_HEADS, 16, 3)
        for heads in (1, 4, 8):  # what was saved says 2
            with pytest.raises(LayoutMismatchError, match="saved with 2 KV heads of 16"):
                load_prefix(store, ids, num_kv_heads=heads, dtype=torch.float32)
        for other in (tiny_llama(kv_heads=4), tiny_llama(kv_heads=1), tiny_llama(layers=2)):
            with pytest.raises(LayoutMismatchError):  # the model restored into differs
                load_prefix(store, ids, model=other)
        with pytest.raises(LayoutMismatchError, match="the model restored into has 2"):
            load_prefix(store, ids, model=model, num_kv_heads=4)
        n, restored = load_prefix(store, ids, model=model, max_tokens=255)
        assert n == 192 and restored.get_seq_length() == 192
        # Chunks of another geometry under the same model name are refused at save.
        _, four_heads = forward(tiny_llama(kv_heads=4), ids)
        with pytest.raises(LayoutMismatchError, match="another model under the same name"):
            save_prefix(store, ids, four_heads)


def test_without_a_geometry_record_the_model_still_catches_a_mismatch(root: Path) -> None:
    model = tiny_llama()
    ids = prompt(256, seed=13)
    with torch.no_grad(), store_at(root) as store:
        _, cache = forward(model, ids)
        save_prefix(store, ids, cache)
        store.remove(_geometry_key(store.token_hasher()))  # as saved by an older version
        assert saved_geometry(store, store.token_hasher()) is None
        with pytest.raises(LayoutMismatchError, match="the model's 4 KV heads of 16 make 64"):
            load_prefix(store, ids, model=tiny_llama(kv_heads=4))
        with pytest.raises(LayoutMismatchError, match=r"3 layer.*the model has .* 2 layer"):
            forward(tiny_llama(layers=2), ids[:, :1], load_prefix(store, ids, model=model)[1])


def test_forward_refuses_a_prompt_with_nothing_left_to_compute_and_a_foreign_cache(
    root: Path,
) -> None:
    model = tiny_llama()
    ids = prompt(128, seed=14)
    with torch.no_grad(), store_at(root) as store:
        _, cache = forward(model, ids)
        save_prefix(store, ids, cache)
        n, restored = load_prefix(store, ids, model=model)
        assert n == 128
        with pytest.raises(InvalidValueError, match="nothing left to compute"):
            forward(model, ids[:, n:], restored)
        with pytest.raises(LayoutMismatchError, match="the cache holds 2 KV heads"):
            forward(tiny_llama(kv_heads=4), ids[:, -1:], restored)
        with pytest.raises(InvalidValueError, match="pass model="):
            load_prefix(store, ids, dtype=torch.float32)


@pytest.mark.slow
def test_through_the_service_client_in_another_process(tmp_path: Path) -> None:
    port = free_port()
    with processes() as procs:
        log = tmp_path / "server.log"
        procs.append(
            start_serve(
                tmp_path / "root",
                port,
                log,
                PERSISTING_MODELS=MODEL,
                PERSISTING_KV__CHUNK_SIZE=str(CHUNK),
            )
        )
        wait_for_log(log, "persisting: serving", procs[0])
        result = run_client_task({"seeds": [f"127.0.0.1:{port}"]})
    assert result == {"saved": 256, "loaded": 256, "exact": True}


def run_client_task(args: dict) -> dict:
    """tests/integrations/hf_client_task.py in a fresh process; its RESULT line."""
    import json
    import os
    import subprocess

    env = child_env({k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")})
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("hf_client_task.py")), json.dumps(args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        start_new_session=True,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise AssertionError(f"client failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
