"""`persisting bench replay --server`: a replay against a running server (its own process),
with hits split by the tier that served them."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service.service_helpers import (
    MODEL,
    REPO,
    free_port,
    kill_group,
    processes,
    server_env,
    spawn,
    wait_for_log,
)

PERSISTING = str(Path(sys.executable).with_name("persisting"))


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PERSISTING, *args], capture_output=True, text=True, timeout=150, env=env, cwd=REPO
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_replay_against_a_running_server_splits_hits_by_tier(tmp_path: Path) -> None:
    root, trace = tmp_path / "root", tmp_path / "trace.jsonl"
    port = free_port()
    # 256 KiB chunks (256 tokens x 1 KiB) in a 1 MiB memory tier: most hits come from disk
    env = server_env(root, PERSISTING_KV__MEMORY_BYTES="1MiB")
    generate = ["bench", "generate", str(trace), "--requests", "30", "--documents", "3"]
    generate += ["--doc-tokens", "512", "--suffix-tokens", "256", "--model", MODEL]
    assert run(*generate, env=env).returncode == 0
    with processes() as procs:
        log = tmp_path / "serve.log"
        server = spawn(
            [PERSISTING, "serve", "--storage-path", str(root), "--addr", f"127.0.0.1:{port}"],
            env,
            log,
        )
        procs.append(server)
        wait_for_log(log, "serving", server)
        replay = ["bench", "replay", str(trace), "--server", f"127.0.0.1:{port}"]
        replay += ["--bytes-per-token", "1024", "--json"]
        first = run(*replay, env=env)
        assert first.returncode == 0, first.stderr
        second = run(*replay, env=env)
        assert second.returncode == 0, second.stderr
        refused = run(*replay, "--storage-path", str(root), env=env)
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 0
        kill_group(server)
    cold, warm = json.loads(first.stdout), json.loads(second.stdout)
    for data in (cold, warm):
        assert data["target"] == f"server 127.0.0.1:{port}"
        assert data["mismatches"] == 0
        assert data["memory_hit_chunks"] + data["disk_hit_chunks"] == data["hit_chunks"]
    # cold: every document chunk after its first sighting; the suffixes are all new
    assert cold["hit_tokens"] == cold["best_hit_tokens"] > 0
    assert cold["disk_hit_chunks"] > 0  # the memory tier holds 4 chunks
    # warm: the server kept everything the first replay stored
    assert warm["hit_chunks"] == warm["chunks"] and warm["bytes_written"] == 0
    assert refused.returncode == 2
    assert "--storage-path set a local store: not with --server" in refused.stderr
