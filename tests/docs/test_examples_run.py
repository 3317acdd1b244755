"""Every script under examples/ runs as a user runs it and shows what it says it shows.

Each example runs in a fresh interpreter (its own process group, bounded in time) on a
storage root under the test's directory; the test checks its exit code, the lines it
prints, and what it left on disk. Servers the examples start must be gone afterwards.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from tests.docs.docs_helpers import REPO, run_example

MODEL_DIR = "meta-llama%2FLlama-3-8B"


def assert_lines(stdout: str, expected: list[str]) -> None:
    lines = stdout.splitlines()
    missing = [line for line in expected if line not in lines]
    assert not missing, f"missing lines {missing} in:\n{stdout}"


def assert_server_stopped(stdout: str) -> None:
    """The example printed the address it served on; nothing listens there any more."""
    (port,) = re.findall(r"^starting: persisting serve .*--addr 127\.0\.0\.1:(\d+)$", stdout, re.M)
    assert "server stopped (exit code 0)" in stdout.splitlines()
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", int(port))) != 0, "the example left its server"


def test_every_example_is_run_by_this_file() -> None:
    scripts = {p.name for p in (REPO / "examples").glob("*.py") if not p.name.startswith("_")}
    tested = set(re.findall(r'run_example\(\s*"([a-z_]+\.py)"', Path(__file__).read_text()))
    assert scripts == tested


@pytest.mark.timeout(120)
def test_kv_native(tmp_path: Path) -> None:
    root = tmp_path / "root"
    out = run_example("kv_native.py", "--storage-path", str(root), cwd=tmp_path)
    assert_lines(
        out,
        [
            "put -> tier=disk durable=True",
            "put of an existing key stores nothing: stored=False",
            "get -> (2, 4, 64, 128) torch.bfloat16, bit-exact: True",
            "lookup_tokens(same prompt)  = 256 tokens",
            "lookup_tokens(other prompt) = 128 tokens",
            "after removing chunk 2, lookup_prefix(keys) = 1 chunk(s)",
            "get with another dtype expected -> None",
            "pinned chunk removed without force: False",
            "after unpin, removed without force: True",
            "reopened: 2 of 4 chunks present",
            "get after reopen bit-exact: True (disk hits: 1, memory hits: 0)",
            "async: put -> tier=memory durable=False",
            "async: on_complete -> tier=disk durable=True",
            "write_back: put -> tier=memory durable=False",
            "write_back: disk_items before close = 0",
            "write_back: reopened after close, disk_items = 1",
        ],
    )
    namespaces = {p.name for p in (root / "kv").iterdir() if not p.name.startswith(".")}
    assert namespaces == {MODEL_DIR, "demo%2Fwrite-behind", "demo%2Fwrite-back"}


@pytest.mark.timeout(120)
def test_kv_native_cleans_up_its_temporary_root(tmp_path: Path) -> None:
    out = run_example("kv_native.py", cwd=tmp_path)
    (root,) = re.findall(r"^storage root: (.+)$", out, re.M)
    assert "reopened: 2 of 4 chunks present" in out.splitlines()
    assert not Path(root).exists()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_lmcache_plugin(tmp_path: Path) -> None:
    pytest.importorskip("lmcache", reason="LMCache is not installed (PERSISTING_SKIP_LMCACHE=1?)")
    root = tmp_path / "root"
    out = run_example("lmcache_plugin.py", "--storage-path", str(root), cwd=tmp_path)
    assert_lines(
        out,
        [
            "  storage_plugin.PersistingBackend.module_path: persisting.lmcache_backend",
            "LMCache backends: ['LocalCPUBackend', 'PersistingBackend']",
            "stored 64 tokens: 4 chunks in the plugin",
            "after clearing LMCache's CPU tier, lookup = 64 tokens",
            "retrieved 64 tokens from the plugin, bit-exact: True",
            "plugin store: disk_items=4 corruptions=0",
            "new engine on the same root: lookup = 64 tokens, bit-exact: True",
        ],
    )
    assert (root / "lmcache.yaml").is_file() and (root / "kv" / MODEL_DIR).is_dir()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_lmcache_mp_adapter(tmp_path: Path) -> None:
    pytest.importorskip("lmcache", reason="LMCache is not installed (PERSISTING_SKIP_LMCACHE=1?)")
    root = tmp_path / "root"
    usage = 4 * (4096 + 2 * 4 * 16 * 256 * 2)  # four 64 KiB chunks, each with its header
    # Twice on one root: the second run finds its chunks in L2 already (a used root), and
    # still reads them back from L2 once L1 is empty.
    for _run in range(2):
        out = run_example("lmcache_mp_adapter.py", "--storage-path", str(root), cwd=tmp_path)
        assert_lines(
            out,
            [
                "L2 adapters: ['PersistingL2Adapter']",
                f"stored 4 chunks: L2 holds 4, usage {usage} bytes",
                "after clearing L1: prefetch found 4 chunks in L2, bit-exact: True",
                "status: healthy=True io_errors=0",
                f"restarted: prefetch found 4 chunks in L2, bit-exact: True, usage {usage} bytes",
                "lmcache_mp_adapter: done",
            ],
        )
    assert (root / "kv" / "lmcache").is_dir()


@pytest.mark.slow
@pytest.mark.timeout(2400)  # two engine processes and two server starts: minutes when loaded
def test_vllm_lmcache_mp(tmp_path: Path) -> None:
    """The LMCache MP recipe behind real vLLM engines (the engine environment .venv-vllm):
    a new engine reuses the prompt from Persisting after the server was SIGKILLed."""
    root = tmp_path / "root"
    out = run_example(
        "vllm_lmcache_mp.py", "--storage-path", str(root), cwd=tmp_path, timeout_s=2300
    )
    first = re.search(r"^first engine: reused (\d+) of 1500 prompt tokens$", out, re.M)
    again = re.search(r"^new engine: reused (\d+) of 1500 prompt tokens$", out, re.M)
    assert first and again, out
    assert int(first.group(1)) == 0
    assert int(again.group(1)) >= 1024
    chunks = re.search(r"^chunks in Persisting: (\d+)$", out, re.M)
    assert chunks and int(chunks.group(1)) >= 1500 // 256, out
    assert_lines(out, ["same greedy token ids: True"])
    assert (root / "kv" / "lmcache").is_dir()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_service_client(tmp_path: Path) -> None:
    root = tmp_path / "root"
    out = run_example("service_client.py", "--storage-path", str(root), cwd=tmp_path)
    assert re.search(r"^connected to 127\.0\.0\.1:\d+; same-host fast path: True$", out, re.M)
    assert_lines(
        out,
        [
            "put 3 chunks -> tier=disk durable=True",
            "batched_get -> 3 hits, 1 miss; bit-exact: True",
            "lookup_tokens -> 192 of 256 tokens (the 4th chunk is missing)",
            "message-path client: same_host=False, get bit-exact: True",
            "lookup_tokens now -> 256 tokens",
            "server stats: memory_items=4 disk_items=4 get_hits=4 get_misses=1",
        ],
    )
    assert_server_stopped(out)
    assert (root / "kv" / MODEL_DIR).is_dir()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_prewarm_job(tmp_path: Path) -> None:
    root = tmp_path / "root"
    out = run_example("prewarm_job.py", "--storage-path", str(root), cwd=tmp_path)
    assert_lines(
        out,
        [
            "stored the document: 4 chunks on disk",
            "server before the job: {'memory_items': 0, 'disk_items': 4, 'events_applied': 0}",
            "published 1 prewarm event (tokens of the document)",
            "server after the prewarm: {'memory_items': 4, 'disk_items': 4, 'events_applied': 1}",
            "  -> {'model': 'meta-llama/Llama-3-8B', 'op': 'evict', 'published': 1, "
            "'topic': 'kv-events'}, applied by 1 live consumer(s)",
            "lookup of the document after the evict: 192 of 256 tokens",
            "server at the end: {'memory_items': 3, 'disk_items': 3, 'events_applied': 2}",
        ],
    )
    assert_server_stopped(out)
    assert (root / "queue" / "kv-events" / "bucket_0" / "data.lance").is_dir()


@pytest.mark.timeout(120)
def test_queue_pulsing(tmp_path: Path) -> None:
    root = tmp_path / "root"
    out = run_example("queue_pulsing.py", "--storage-path", str(root), cwd=tmp_path)
    assert_lines(
        out,
        [
            "wrote and read back 10 records in this process",
            "after a restart: 10 records; last: id=req-9 prompt_tokens=109 "
            "embedding=[0.0, 9.0, 18.0, 27.0]",
            "consumer 'billing' read offsets [0, 1, 2] and committed",
        ],
    )
    assert re.search(r"^reopened 'billing' resumed at offset 3 \(\d+ more records\)$", out, re.M)
    bucket = root / "queue" / "prefill%2Frequests" / "bucket_0"
    assert (bucket / "data.lance").is_dir() and (bucket / "consumers").is_dir()
