"""``vllm serve`` with PersistingConnector, as an operator runs it: vLLM's OpenAI-compatible
server (CPU build), requests over HTTP, two servers on one storage root.

The module fixture runs, on one root:

1. servers ``a`` and ``b`` start at once (each its own metrics ports); a 1,500-token prompt
   goes to ``a``; once its blocks are on disk the same prompt goes to ``b``, which reuses
   them (another engine's blocks: its scheduler finds them on a rescan, its worker on
   disk) -- both answer, with the same text;
2. ``persisting stats --metrics-url`` reads ``a``'s connector figures;
3. ``a``'s main process is SIGKILLed: its engine core and worker must not live on holding
   its metrics ports;
4. ``a2`` starts with ``a``'s ports on the same root and reuses the prompt;
5. ``b`` and ``a2`` are stopped with Ctrl-C: no temporary file is left on the root.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.engines.engine_helpers import (
    BLOCK,
    ENGINE_VENV,
    build_model,
    engine_env,
    free_port,
    persisting_cli,
    prompt_ids,
)
from tests.timing import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

PROMPT = prompt_ids(1500, 1)
BLOCKS = 1500 // BLOCK


class Server:
    """``vllm serve`` in a process group of its own, with PersistingConnector."""

    def __init__(self, model: Path, root: Path, work: Path, name: str, metrics_port: int):
        self.port = free_port()
        self.name = name
        self.log_path = work / f"{name}.log"
        extra = {
            "storage_path": str(root),
            "disk_bytes": "1GiB",
            "metrics_port": metrics_port,
            "refresh_interval_s": 0.5,
        }
        transfer = {
            "kv_connector": "PersistingConnector",
            "kv_connector_module_path": "persisting.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
        command = [
            str(ENGINE_VENV / "bin" / "vllm"), "serve", str(model),
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "2048", "--seed", "0",
            "--enable-prompt-tokens-details",
            # vLLM's default (0) SIGKILLs the engine core at once on Ctrl-C: give it time
            # to finish its stores and close the store, as docs/vllm.md tells operators.
            "--shutdown-timeout", "30",
            "--kv-transfer-config", json.dumps(transfer),
        ]  # fmt: skip
        env = {**engine_env(), "XDG_CACHE_HOME": str(work / "cache")}
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.model = str(model)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self, timeout: float = 900) -> None:
        try:
            wait_until(self.healthy, f"{self.name} ready", timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n{self.tail()}") from None

    def healthy(self) -> bool:
        """Whether /health answers 200 (AssertionError if the server exited)."""
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited {self.proc.returncode}")
        try:
            with urllib.request.urlopen(self.url("/health"), timeout=5) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def complete(self, prompt: list[int]) -> dict[str, Any]:
        body = {
            "model": self.model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
        }  # fmt: skip
        request = urllib.request.Request(
            self.url("/v1/completions"),
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600) as reply:
            answer = json.loads(reply.read())
        details = answer["usage"].get("prompt_tokens_details") or {}
        return {"text": answer["choices"][0]["text"], "cached": details.get("cached_tokens", 0)}

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url("/metrics"), timeout=30) as reply:
            return str(reply.read().decode())

    def group_alive(self) -> list[int]:
        """Processes still in the server's process group (its engine core, its worker)."""
        alive = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[2]) == self.proc.pid and fields[0] != "Z":  # pgrp, not a zombie
                alive.append(int(entry.name))
        return alive

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for pid in self.group_alive():
            os.kill(pid, signal.SIGKILL)

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


def payload_files(root: Path) -> int:
    return sum(1 for p in root.rglob("*.kv") if "payload" in p.parts)


def connector_gauge(port: int, name: str) -> float:
    """The connector's ``persisting_vllm_<name>`` summed over namespaces, as served on
    ``port`` (0 while the port does not answer yet)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return 0.0
    prefix = f"persisting_vllm_{name}{{"
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    return sum(float(line.rpartition(" ")[2]) for line in lines)


def port_free(port: int) -> bool:
    """Whether a server could listen on ``port`` (as the metrics server does: connections
    of the old one may linger in TIME_WAIT)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("vllm-serve")
    model = build_model(work / "llama", layers=2, hidden=256)
    root = work / "root"
    ports = {"a": free_port(), "b": free_port()}
    a = Server(model, root, work, "a", ports["a"])
    b = Server(model, root, work, "b", ports["b"])
    servers = [a, b]
    out: dict[str, Any] = {"ports": ports}
    try:
        a.wait_ready()
        b.wait_ready()
        out["a"] = a.complete(PROMPT)
        wait_until(lambda: payload_files(root) >= BLOCKS, "a's blocks on disk", 120)
        # b's scheduler finds them on its next rescan (its store's figures move with it)
        wait_until(lambda: connector_gauge(ports["b"], "disk_items") >= BLOCKS, "b's rescan", 120)
        out["b"] = b.complete(PROMPT)
        out["b_metrics"] = b.metrics()
        out["stats"] = json.loads(
            persisting_cli(
                "stats", "--metrics-url", f"http://127.0.0.1:{ports['a'] + 1}/metrics", "--json"
            )
        )
        os.kill(a.proc.pid, signal.SIGKILL)  # the server's main process only
        a.proc.wait()
        wait_until(lambda: not a.group_alive(), "a's engine gone", 120)
        out["orphans"] = a.group_alive()
        out["ports_free"] = port_free(ports["a"]) and port_free(ports["a"] + 1)
        a2 = Server(model, root, work, "a2", ports["a"])
        servers.append(a2)
        a2.wait_ready()
        out["a2"] = a2.complete(PROMPT)
        out["a2_metrics"] = a2.metrics()
        for server in (b, a2):  # a clean stop (Ctrl-C) of the servers still running
            server.stop()
        out["temporaries"] = sorted(str(p.relative_to(root)) for p in root.rglob("*.tmp"))
    finally:
        for server in servers:
            server.stop()
    return out


def test_a_second_server_on_the_root_reuses_the_first_ones_blocks(runs: dict[str, Any]) -> None:
    assert runs["a"]["cached"] == 0
    assert runs["b"]["cached"] >= 1024
    assert runs["b"]["text"] == runs["a"]["text"]


def test_a_restarted_server_reuses_the_prompt_over_http(runs: dict[str, Any]) -> None:
    assert runs["a2"]["cached"] >= 1024 and runs["a2"]["text"] == runs["a"]["text"]
    external = [
        float(line.rpartition(" ")[2])
        for line in runs["a2_metrics"].splitlines()
        if line.startswith("vllm:external_prefix_cache_hits_total")
    ]
    assert sum(external) >= 1024  # the connector's reuse, not vLLM's own prefix cache


def test_stats_reads_a_live_engines_connector_metrics(runs: dict[str, Any]) -> None:
    (figures,) = runs["stats"]["models"].values()
    assert figures["blocks_stored"] >= BLOCKS and figures["disk_items"] >= BLOCKS


def test_a_clean_stop_leaves_no_temporary_files(runs: dict[str, Any]) -> None:
    """Ctrl-C of the servers: nothing in flight is left behind (reservations, payloads
    being written; what the SIGKILLed server left was reclaimed by the next open)."""
    assert runs["temporaries"] == []


def test_a_killed_servers_engine_does_not_live_on(runs: dict[str, Any]) -> None:
    assert runs["orphans"] == [] and runs["ports_free"]
