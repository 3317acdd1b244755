"""One owner per live root, and a server's health endpoints, with real `persisting serve`
processes: a second server of a served model, or a second event consumer of the topic,
exits non-zero with one line naming the live one; compact refuses a served model; prewarm
tells whether a consumer will apply its event; /healthz, /readyz and 404 on the metrics
port, with the service's own figures."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from persisting.lance_store import StorageRoot
from tests.service.service_helpers import (
    MODEL,
    OTHER_MODEL,
    REPO,
    free_port,
    kill_group,
    processes,
    run_client,
    server_env,
    spawn,
    wait_for_log,
)
from tests.timing import wait_until

PERSISTING = str(Path(sys.executable).with_name("persisting"))


def persisting(
    *args: str, env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PERSISTING, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
    )


def serve_args(root: Path, model: str, port: int, *extra: str) -> list[str]:
    return [
        PERSISTING,
        "serve",
        "--storage-path",
        str(root),
        "-m",
        model,
        "--addr",
        f"127.0.0.1:{port}",
        *extra,
    ]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_ready(base: str) -> dict:
    bodies: list[str] = []

    def ready() -> bool:
        status, body = get(f"{base}/readyz")
        bodies.append(body)
        return status == 200

    wait_until(ready, "/readyz answering 200")
    return json.loads(bodies[-1])


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1, (proc.returncode, proc.stderr)
    assert lines[0].startswith("Error: ")
    return lines[0]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_one_owner_per_live_root_and_the_health_endpoints(tmp_path: Path) -> None:
    root = tmp_path / "root"
    env = server_env(root)
    port, metrics_port = free_port(), free_port()
    base = f"http://127.0.0.1:{metrics_port}"
    with processes() as procs:
        first = spawn(
            serve_args(root, MODEL, port, "--metrics-port", str(metrics_port)),
            env,
            tmp_path / "first.log",
        )
        procs.append(first)
        wait_for_log(tmp_path / "first.log", "serving", first)

        # Health: live, ready once it has joined the cluster, 404 elsewhere.
        assert get(f"{base}/healthz") == (200, "ok\n")
        ready = wait_ready(base)
        assert ready["checks"] == {"stores": True, "consumer": True, "cluster": True}
        status, body = get(f"{base}/nope")
        assert status == 404 and "/metrics, /healthz, /readyz" in body
        result = run_client("roundtrip", {"seeds": [f"127.0.0.1:{port}"]})
        assert result["single_exact"] and result["batched_exact"], result
        figures = samples(get(f"{base}/metrics")[1])
        assert figures[("persisting_service_requests_total", frozenset({("op", "put")}))] > 0
        assert figures[("persisting_service_requests_total", frozenset({("op", "hello")}))] >= 1
        # A value of another dtype than its key's is refused by the server, counted by code;
        # a put of a key held with another layout is told apart from "already stored".
        checks = run_client("put_checks", {"seeds": [f"127.0.0.1:{port}"]})
        assert checks["refused"].startswith("InvalidValueError: a float value under key")
        assert checks["first"] == [True, False] and checks["same"] == [False, False]
        assert checks["other"] == [False, True], checks
        figures = samples(get(f"{base}/metrics")[1])
        errors = {
            dict(k[1])["code"]: v
            for k, v in figures.items()
            if k[0] == "persisting_service_errors_total"
        }
        assert errors.get("invalid_value", 0) >= 1, errors
        assert figures[("persisting_service_members_up", frozenset())] == 1
        assert figures[("persisting_service_ready", frozenset())] == 1
        assert ("persisting_service_sessions", frozenset()) in figures

        # A second server of the same model on this root: refused, one line, the holder.
        refused = one_line_error(
            subprocess.run(
                serve_args(root, MODEL, free_port()),
                capture_output=True,
                text=True,
                timeout=120,
                env=env,
                cwd=REPO,
            )
        )
        assert f"model '{MODEL}'" in refused and f"pid {first.pid} " in refused
        assert f"persisting server 'kvstore' on 127.0.0.1:{port}" in refused
        # Another model, same service name: its event consumer would be a second one.
        other_port = free_port()
        refused = one_line_error(
            subprocess.run(
                serve_args(root, OTHER_MODEL, other_port),
                capture_output=True,
                text=True,
                timeout=120,
                env=env,
                cwd=REPO,
            )
        )
        assert "consumer 'kv-service/kvstore' of topic 'kv-events'" in refused
        assert f"pid {first.pid} " in refused and "--no-events" in refused
        # Without a consumer it may serve the other model beside the first.
        second = spawn(
            serve_args(root, OTHER_MODEL, other_port, "--no-events"), env, tmp_path / "second.log"
        )
        procs.append(second)
        wait_for_log(tmp_path / "second.log", "serving", second)

        # compact refuses a model a live server serves, naming it.
        refused = one_line_error(persisting("compact", "--storage-path", str(root), env=env))
        assert "is served by pid" in refused and "--topic" in refused
        # inspect shows who serves what.
        inventory = json.loads(
            persisting("inspect", "--json", "--storage-path", str(root), env=env).stdout
        )
        owners = {m["model"]: m["owner"] for m in inventory["models"]}
        assert owners[MODEL]["live"] and owners[MODEL]["pid"] == first.pid
        assert owners[OTHER_MODEL]["live"] and owners[OTHER_MODEL]["pid"] == second.pid

        # prewarm says whether a live consumer will apply the event.
        key = f"{MODEL}@1@0@7@bfloat16"
        out = persisting(
            "prewarm", MODEL, "--key", key, "--json", "--storage-path", str(root), env=env
        )
        assert out.returncode == 0 and "Warning" not in out.stderr, out.stderr
        (consumer,) = json.loads(out.stdout)["consumers"]
        assert f"pid {first.pid} " in consumer
        other_key = f"{OTHER_MODEL}@1@0@7@bfloat16"
        out = persisting(
            "prewarm", OTHER_MODEL, "--key", other_key, "--storage-path", str(root), env=env
        )
        assert out.returncode == 0 and "no live consumer applies" in out.stderr
        assert f"serve ['{MODEL}']" in out.stderr

        first.send_signal(signal.SIGINT)
        assert first.wait(timeout=60) == 0
        kill_group(second)
    owner = StorageRoot(root).model_owner(MODEL)
    assert owner is not None and not owner.live  # released on a clean stop
