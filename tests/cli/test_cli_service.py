"""`persisting demo`, `serve` and `prewarm` through the real console script and processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.service.service_helpers import (
    MODEL,
    REPO,
    free_port,
    key,
    kill_group,
    processes,
    run_client,
    server_env,
    spawn,
    wait_for_log,
)
from tests.timing import wait_until

PERSISTING = str(Path(sys.executable).with_name("persisting"))


@pytest.mark.timeout(180)
def test_demo_runs_a_bounded_session_and_exits(tmp_path: Path) -> None:
    out = subprocess.run(
        [PERSISTING, "demo", "--json", "--storage-path", str(tmp_path / "root")],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["bit_exact"] is True
    assert report["lookup_tokens"] > report["lookup_tokens_after_evict"] > 0
    assert report["prewarmed_chunks"] > 0
    assert (tmp_path / "root" / "kv").is_dir() and (tmp_path / "root" / "queue").is_dir()


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_serve_answers_clients_exposes_metrics_and_takes_prewarm_events(tmp_path: Path) -> None:
    root = tmp_path / "root"
    port, metrics_port = free_port(), free_port()
    log = tmp_path / "serve.log"
    env = server_env(root)
    with processes() as procs:
        server = spawn(
            [
                PERSISTING,
                "serve",
                "--storage-path",
                str(root),
                "-m",
                MODEL,
                "--addr",
                f"127.0.0.1:{port}",
                "--metrics-port",
                str(metrics_port),
            ],
            env,
            log,
        )
        procs.append(server)
        wait_for_log(log, "serving", server)
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        before = _scrape(metrics_url)
        seeds = [f"127.0.0.1:{port}"]
        result = run_client("roundtrip", {"seeds": seeds})
        assert result["single_exact"] and result["batched_exact"], result
        after = _scrape(metrics_url)
        assert "persisting_kv" in after and after != before

        assert run_client("put_keys", {"seeds": seeds, "start": 100, "stop": 104})["stored"] == 4
        published = subprocess.run(
            [
                PERSISTING,
                "prewarm",
                MODEL,
                "--evict",
                "--json",
                "--storage-path",
                str(root),
                *[arg for i in (100, 101) for arg in ("--key", str(key(i)))],
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            cwd=REPO,
        )
        assert published.returncode == 0, published.stderr
        evict = json.loads(published.stdout)
        (consumer,) = evict.pop("consumers")  # the server's, which will apply it
        assert f"pid {server.pid} " in consumer
        assert evict == {"model": MODEL, "op": "evict", "published": 1, "topic": "kv-events"}
        wait_until(
            lambda: (
                run_client("present_keys", {"seeds": seeds, "start": 100, "stop": 104})["present"]
                == 2
            ),
            "the evict event published by `persisting prewarm` applied",
        )
        tokens = subprocess.run(
            [
                PERSISTING,
                "prewarm",
                MODEL,
                "--json",
                "--storage-path",
                str(root),
                "--tokens",
                str(_tokens(tmp_path)),
                "--chunk-size",
                "16",
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            cwd=REPO,
        )
        assert tokens.returncode == 0 and json.loads(tokens.stdout)["published"] == 1

        bad = subprocess.run(
            [PERSISTING, "prewarm", MODEL, "--storage-path", str(root)],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
            cwd=REPO,
        )
        assert bad.returncode == 2 and "--key" in bad.stderr

        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 0
        kill_group(server)


def _tokens(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.txt"
    path.write_text(" ".join(str(t) for t in range(1024)))
    return path


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_serve_logs_a_banner_and_a_stop_line_as_json(tmp_path: Path) -> None:
    from persisting import __version__

    root = tmp_path / "root"
    log = tmp_path / "serve.log"
    port = free_port()
    with processes() as procs:
        server = spawn(
            [
                PERSISTING,
                "serve",
                "--storage-path",
                "root",  # relative: the banner shows it absolute
                "-m",
                MODEL,
                "--addr",
                f"127.0.0.1:{port}",
                "--metrics-port",
                "0",
                "--log-json",
                "--log-level",
                "info",
                "--no-events",
            ],
            server_env(root),
            log,
            cwd=tmp_path,
        )
        procs.append(server)
        # The banner, then a line per store: read once the store's line is there too (read
        # after the banner alone, a run found it not yet written).
        wait_for_log(log, '"event": "store"', server)
        records = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
        banner = next(r for r in records if r.get("event") == "serving")
        assert banner["version"] == __version__
        assert banner["storage_path"] == str(root)
        assert banner["models"] == [MODEL] and banner["addr"] == f"127.0.0.1:{port}"
        assert banner["passphrase_from"].startswith("generated")
        metrics_url = banner["metrics_url"]
        assert metrics_url and not metrics_url.endswith(":0/metrics")  # the port bound
        assert "persisting_kv" in _scrape(metrics_url)
        store = next(r for r in records if r.get("event") == "store")
        assert store["model"] == MODEL and store["memory_bytes"] == 64 << 20
        assert store["disk_bytes"] == 512 << 20 and store["durability"] == "sync"
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 0
    records = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    assert any(r.get("event") == "stopped" and r["actor"] == "kvstore" for r in records)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_demo_without_a_root_leaves_nothing_behind(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")}
    out = subprocess.run(
        [PERSISTING, "demo", "--json"],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=tmp_path,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["bit_exact"] is True
    assert report["storage_path"].endswith("(temporary, removed)")
    assert list(tmp_path.iterdir()) == []  # no ./persisting-data
    assert not Path(report["storage_path"].split(" ")[0]).exists()


def test_config_show_prints_sizes_with_units(tmp_path: Path) -> None:
    config = tmp_path / "p.toml"
    config.write_text('[kv]\nmemory_bytes = "512MiB"\ndisk_bytes = 1000\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")}
    out = subprocess.run(
        [PERSISTING, "config", "show", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    lines = {line.strip() for line in out.stdout.splitlines()}
    assert {"memory_bytes = 512MiB", "disk_bytes = 1000B", "max_value_bytes = 1GiB"} <= lines
    assert "key_dtype = 'bfloat16'" in lines
