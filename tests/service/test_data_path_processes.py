"""The data path's bounds against whole processes: a server started as ``persisting serve``
runs, attackers and clients in processes of their own (real sockets throughout).

* 64 connections that trickle a byte every 2 s into the data port never authenticate: each
  is cut at the handshake's deadline (5 s in all), and a new client meanwhile gets every
  value it asks for (its connections wait, or are tried again, until a slot is free);
* 8 same-host connections that asked for 2 MiB each and read nothing do not stop another
  client's puts, and are closed by the deadline of a value (``request_timeout_s``).
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.service.service_helpers import (
    REPO,
    free_port,
    processes,
    run_client,
    start_serve,
    wait_for_log,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _data_port(log: Path) -> int:
    found = re.search(r"data path at 127\.0\.0\.1:(\d+)", log.read_text())
    assert found, log.read_text()
    return int(found.group(1))


def test_connections_trickling_into_the_data_port_do_not_stop_a_new_clients_gets(
    tmp_path: Path,
) -> None:
    port = free_port()
    with processes() as procs:
        log = tmp_path / "server.log"
        procs.append(start_serve(tmp_path / "root", port, log))
        wait_for_log(log, "data path at", procs[0])
        seeds = [f"127.0.0.1:{port}"]
        assert run_client("put_keys", {"seeds": seeds, "start": 0, "stop": 8})["stored"] == 8
        data_port = _data_port(log)
        attackers = [socket.create_connection(("127.0.0.1", data_port)) for _ in range(64)]
        stop = threading.Event()

        def trickle() -> None:  # one byte of a credential frame every 2 s, on each
            while not stop.wait(2.0):
                for sock in attackers:
                    with contextlib.suppress(OSError):  # cut already
                        sock.send(b"\x10")

        threading.Thread(target=trickle, daemon=True).start()
        try:
            got = run_client(
                "get_keys",
                {"seeds": seeds, "start": 0, "stop": 8, "same_host": False,
                 "request_timeout_s": 30.0},
            )  # fmt: skip
        finally:
            stop.set()
            for sock in attackers:
                sock.close()
        assert got["hit"] == 8, got
        assert got["errors"] == [], got
        assert got["client"].get("member_failures", 0) == 0, got  # busy, never taken for dead
        assert "refused the session" not in log.read_text()


def test_stalled_same_host_readers_do_not_stop_another_clients_puts(tmp_path: Path) -> None:
    port = free_port()
    with processes() as procs:
        log = tmp_path / "server.log"
        procs.append(
            start_serve(tmp_path / "root", port, log, PERSISTING_SERVICE__REQUEST_TIMEOUT_S="5")
        )
        wait_for_log(log, "data path at", procs[0])
        seeds = [f"127.0.0.1:{port}"]
        env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
        stalled = subprocess.Popen(
            [sys.executable, str(REPO / "tests/service/client_tasks.py"), "stalled_readers",
             json.dumps({"seeds": seeds, "count": 8})],
            env=env, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        procs.append(stalled)  # type: ignore[arg-type]
        assert stalled.stdout is not None and stalled.stdin is not None
        lines = []
        for line in stalled.stdout:
            lines.append(line)
            if line.startswith("READY"):
                break
        assert lines and lines[-1].startswith("READY"), "".join(lines)
        puts = run_client("timed_puts", {"seeds": seeds, "count": 4})
        assert puts["stored"] == 4, puts  # each went through beside the stalled readers
        # The client then reads each connection to its end: the server closes each at the
        # deadline of its value (request_timeout_s = 5 s).
        stalled.stdin.write("check\n")
        stalled.stdin.flush()
        result = next(
            json.loads(line[len("RESULT ") :])
            for line in stalled.stdout
            if line.startswith("RESULT ")
        )
        assert result == {"stalled": 8, "closed": 8}, result
