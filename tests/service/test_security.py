"""Nothing answers an unauthenticated peer: a default `persisting serve`, attacked by a
local user of another uid (we run as root: the attacker is a forked child at uid 65534).

The attack itself is ``tests/reliability/harness_service_attack.py`` (its figures are in
docs/reliability.md): a pickle whose unpickling would create a file as the server's user,
sent through every door the attacker can find -- Pulsing without the passphrase, raw bytes
to its port and to the data port, the data path's Unix socket, also with its folder
opened up so that only the peer-credential check stands. Against an old server, the
pickle ran and Pulsing answered.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service.service_helpers import MODEL, REPO, free_port, server_env

PERSISTING = str(Path(sys.executable).with_name("persisting"))
HARNESS = "tests.reliability.harness_service_attack"  # run as a module from the repository

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
def test_another_user_gets_nothing_executed_and_no_answer_from_a_default_server() -> None:
    out = subprocess.run(
        [sys.executable, "-m", HARNESS, "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO,
    )
    result = json.loads(out.stdout[out.stdout.index("{") :])
    assert result["attacker_uid"] == 65534
    assert result["executed"] is False, "the server unpickled an attacker's object"
    assert result["answered"] == dict.fromkeys(result["doors"], 0), result["doors"]
    doors = result["doors"]
    assert doors["passphrase_file"] == ["PermissionError"]
    assert doors["data_socket"] == ["PermissionError"]  # its folder is private
    assert doors["data_socket_opened_up"][0].startswith("no answer")  # peer credentials
    assert doors["data_port"][0].startswith("no answer")  # no credential: not a byte
    assert doors["pulsing_without_passphrase"][0].get("answered") is not True
    # Raw bytes to the port: at most a TLS alert (record type 0x15), never a frame of the
    # service's HTTP/2 transport (a server without TLS answers with its SETTINGS frame).
    assert all(r == "" or r.startswith("\x15\x03") for r in doors["raw_bytes_to_the_port"])
    assert result["server_alive_after"] and result["legit_client_connected_unconfigured"]
    assert out.returncode == 0


@pytest.mark.slow
def test_a_non_loopback_address_without_a_passphrase_is_one_line_and_exit_2(
    tmp_path: Path,
) -> None:
    env = server_env(tmp_path / "root")
    out = subprocess.run(
        [
            PERSISTING,
            "serve",
            "--storage-path",
            str(tmp_path / "root"),
            "-m",
            MODEL,
            "--addr",
            f"0.0.0.0:{free_port()}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert out.returncode == 2, out.stderr
    assert "not a loopback address" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    launcher = subprocess.run(
        [
            str(Path(sys.executable).with_name("pulsing")),
            "actor",
            "actors.kv_cache_storage.KVCacheStorageActor",
            "-",
            "--name",
            "kvstore",
            "--addr",
            f"0.0.0.0:{free_port()}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=REPO,
    )
    assert launcher.returncode == 2, launcher.stdout + launcher.stderr
    assert "not a loopback address" in launcher.stderr
    assert "Traceback" not in launcher.stderr, launcher.stderr
