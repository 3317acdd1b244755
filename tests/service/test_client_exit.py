"""A blocking client left open at interpreter exit is closed then (issue 25, item 2): the
process exits 0 and the server sees its session end at once, pins included, instead of
at the session TTL (set to ten minutes here, so only a goodbye can end it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service.service_helpers import (
    REPO,
    free_port,
    processes,
    start_serve,
    wait_for_log,
)

pytestmark = pytest.mark.timeout(300)

SETTINGS = """
from persisting.config import PersistingSettings
from tests.service.service_helpers import MODEL, key, tensor
settings = PersistingSettings(
    models=[MODEL], service={"discovery_timeout_s": 30, "request_timeout_s": 20}
)
"""

PIN_AND_EXIT = (
    SETTINGS
    + """
import sys
from persisting.service import SyncKVCacheClient
client = SyncKVCacheClient.connect(seeds=[sys.argv[1]], model=MODEL, settings=settings)
i = int(sys.argv[2])
client.put(key(i), tensor(i))
assert client.pin(key(i))
print("pinned", flush=True)
"""  # and exits without close()
)

SERVER_FIGURES = (
    SETTINGS
    + """
import json, os, sys
from persisting.service import SyncKVCacheClient
client = SyncKVCacheClient.connect(seeds=[sys.argv[1]], model=MODEL, settings=settings)
(figures,) = client.stats()["members"].values()
print("RESULT " + json.dumps(figures["service"]), flush=True)
client.close()
os._exit(0)
"""
)


def run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )


@pytest.mark.slow
def test_a_client_left_open_at_exit_ends_its_session_and_exits_cleanly(tmp_path: Path) -> None:
    port = free_port()
    with processes() as procs:
        log = tmp_path / "server.log"
        procs.append(
            start_serve(tmp_path / "root", port, log, PERSISTING_SERVICE__LEASE_TTL_S="600")
        )
        wait_for_log(log, "serving", procs[0], timeout_s=120)
        seed = f"127.0.0.1:{port}"
        for i in range(3):
            done = run(PIN_AND_EXIT, seed, str(i))
            assert done.returncode == 0, done.stderr[-2000:]
            assert "pinned" in done.stdout
        figures = run(SERVER_FIGURES, seed)
        line = next(x for x in figures.stdout.splitlines() if x.startswith("RESULT "))
        service = json.loads(line[len("RESULT ") :])
        assert service["sessions"] == 1  # the one asking; the three before said goodbye
        assert service["pins"] == 0
