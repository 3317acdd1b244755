"""Every engine adapter keeps one behaviour (``adapter_suite``) on both kinds of store: a
local root opened in this process, and a cluster of one real ``persisting serve`` member
process with a passphrase, reached from a client process of its own (as an engine is).
Both stores come from the engine adapters' one opener, configured the way an engine's
settings say it (``storage_path`` or ``cluster``).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from persisting.errors import ConfigError
from persisting.integrations.common import EngineSettings, open_engine_store, read_settings
from tests.integrations.adapter_suite import ADAPTERS, CHECKS, run_suite
from tests.service.service_helpers import REPO, free_port, processes, start_serve, wait_for_log

pytestmark = pytest.mark.timeout(300)
ALL_OK = {check.__name__: "ok" for check in CHECKS}


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_every_adapter_on_a_local_root(adapter: str, tmp_path: Path) -> None:
    engine = ADAPTERS[adapter]()
    settings = read_settings(
        EngineSettings, {"storage_path": str(tmp_path), "disk_bytes": "64MiB"}, where="test"
    )
    with open_engine_store(settings, engine.namespace) as store:
        assert store.kind == "local"
        assert run_suite(engine, store) == ALL_OK


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One member, serving every adapter's namespace, with a passphrase in a private file."""
    tmp = tmp_path_factory.mktemp("adapter-cluster")
    secret = secrets.token_hex(16)
    passphrase_file = tmp / "passphrase"
    passphrase_file.write_text(secret)
    passphrase_file.chmod(0o600)
    port = free_port()
    namespaces = ",".join(ADAPTERS[name]().namespace for name in sorted(ADAPTERS))
    with processes() as procs:
        log = tmp / "serve.log"
        procs.append(
            start_serve(
                tmp / "root",
                port,
                log,
                PERSISTING_MODELS=namespaces,
                PERSISTING_SERVICE__PASSPHRASE=secret,
            )
        )
        wait_for_log(log, "persisting: serving", procs[0])
        yield {"seeds": [f"127.0.0.1:{port}"], "passphrase_file": str(passphrase_file)}


@pytest.mark.slow
@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_every_adapter_on_a_cluster(adapter: str, cluster: dict[str, Any]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")}
    env["PYTHONPATH"] = str(REPO)
    args = json.dumps({"adapter": adapter, "cluster": cluster})
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "integrations" / "adapter_suite.py"), args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        start_new_session=True,
    )
    results = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert results, f"{adapter} on the cluster:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert json.loads(results[-1][len("RESULT ") :]) == {"kind": "cluster", **ALL_OK}


def test_the_store_is_a_root_or_a_cluster_never_both(tmp_path: Path) -> None:
    cluster = {"seeds": ["10.0.0.1:8610"], "passphrase_file": str(tmp_path / "p")}
    with pytest.raises(ConfigError, match="not both"):
        read_settings(
            EngineSettings, {"storage_path": str(tmp_path), "cluster": cluster}, where="t"
        )
    with pytest.raises(ConfigError, match=r"needs storage_path .* or cluster"):
        read_settings(EngineSettings, {"disk_bytes": "1GiB"}, where="t")
    with pytest.raises(ConfigError, match=r"unknown key 'cluster\.seed'"):
        read_settings(EngineSettings, {"cluster": {"seed": ["a:1"]}}, where="t")
    with pytest.raises(ConfigError, match="HOST:PORT"):
        read_settings(EngineSettings, {"cluster": {"seeds": ["nohost"]}}, where="t")
    with pytest.raises(ConfigError, match=r"unknown key 'storage_pth' \(did you mean"):
        read_settings(EngineSettings, {"storage_pth": "/p"}, where="t")
    with pytest.raises(ConfigError, match="disk_bytes must be a size"):
        read_settings(EngineSettings, {"storage_path": "/p", "disk_bytes": "lots"}, where="t")
    settings = read_settings(EngineSettings, {"cluster": cluster}, where="t")
    assert settings.cluster is not None and settings.cluster.name == "kvstore"


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_values_the_memory_tier_alone_holds_are_read_too(adapter: str, tmp_path: Path) -> None:
    """With a memory tier and writes behind (nothing on disk yet), reads take the values
    from memory: into one buffer or into parts."""
    engine = ADAPTERS[adapter]()
    settings = read_settings(EngineSettings, {"storage_path": str(tmp_path)}, where="test")
    store = open_engine_store(
        settings, engine.namespace, memory_bytes=32 << 20, durability="write_back"
    )
    with store:
        assert run_suite(engine, store) == ALL_OK
