"""docs/user-guide.md does not rot: its blocks run in order, its servers serve, its YAML loads
the LMCache plugin, its links resolve, and the one block it does not run is the README's
install command."""

from __future__ import annotations

import json
import os
import re
import subprocess
from contextlib import ExitStack
from pathlib import Path

import pytest

from persisting.lance_store import StorageRoot
from persisting.queue.positions import ConsumerPositions
from tests.docs.docs_helpers import (
    REPO,
    RUN_LANGUAGES,
    Background,
    Block,
    fenced_blocks,
    free_ports,
    run_block,
    run_env,
    start_background,
    substitute,
)
from tests.timing import wait_until

GUIDE = REPO / "docs" / "user-guide.md"
MODEL = "meta-llama/Llama-3-8B"
#: The guide's server addresses; the test gives each a free port instead.
FIXED_ADDR = re.compile(r"127\.0\.0\.1:(86\d\d)\b")


def guide_blocks() -> list[Block]:
    return fenced_blocks(GUIDE.read_text())


def events_applied(root: Path, expected: int) -> None:
    """Wait until the server's event consumer has committed past ``expected`` events."""
    positions = ConsumerPositions(StorageRoot(root).queue_bucket_dir("kv-events", 0))
    wait_until(lambda: positions.get("kv-service/kvstore") == expected, f"{expected} events")


def with_free_ports(blocks: list[Block]) -> tuple[list[Block], dict[str, str]]:
    fixed = sorted({port for b in blocks for port in FIXED_ADDR.findall(b.code)})
    ports = free_ports(len(fixed))
    mapping = {
        f"127.0.0.1:{old}": f"127.0.0.1:{new}" for old, new in zip(fixed, ports, strict=True)
    }
    return substitute(blocks, mapping), mapping


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_guide_runs_in_order(tmp_path: Path) -> None:
    blocks, addrs = with_free_ports(guide_blocks())
    work = tmp_path / "work"
    work.mkdir()
    env = run_env()
    outputs: dict[int, str] = {}
    servers: list[Background] = []
    with ExitStack() as stack:
        for block in blocks:
            if block.marker == "no-test":
                continue
            if block.marker == "file":
                (work / str(block.argument)).write_text(block.code)
            elif block.marker == "background":
                assert block.language == "bash", block.where()
                servers.append(start_background(block, work, env, stack))
            else:
                assert block.language in RUN_LANGUAGES or block.language in ("", "promql"), (
                    f"{block.where()}: a language the tests neither run nor write to a file"
                )
                if block.language in RUN_LANGUAGES:
                    outputs[block.line] = run_block(block, work, env, timeout_s=120)

        # Every server stayed up while the blocks after it ran against it.
        assert len(servers) == 3
        for server in servers:
            assert server.proc.poll() is None, server.output()
        # The server started by Pulsing's own launcher answers the guide's client as well.
        launcher = next(s for s in servers if "pulsing actor" in s.block.code)
        client = next(b for b in blocks if "KVCacheClient.connect(seeds=[" in b.code)
        served = addrs["127.0.0.1:8610"]
        rerun = substitute([client], {served: f"127.0.0.1:{launcher.ports[0]}"})[0]
        run_block(rerun, work, env, timeout_s=120)
        # The server applied the events the guide published: the evict removed the chunks.
        events_applied(work / "persisting-data", expected=2)
        inventory = subprocess.run(
            ["persisting", "inspect", "--json"],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        chunks = {m["model"]: m["chunks"] for m in json.loads(inventory.stdout)["models"]}
        assert chunks == {MODEL: 0, "demo/llama": 5, "demo/llama-fp32": 2}

    by_text = {block.code: outputs.get(block.line, "") for block in blocks}

    def output_of(fragment: str) -> str:
        (code,) = [code for code in by_text if fragment in code]
        return by_text[code]

    assert "torch 2.13.0" in output_of("torch.version.cuda")
    settings_output = output_of("PERSISTING_CONFIG")
    assert "refused: invalid settings: kv.durability" in settings_output
    assert "did you mean kv.memory_bytes?" in settings_output
    assert "chunks on disk" in output_of("batched_put(keys, values, chain=True)")
    assert "memory False" in output_of('durability="async"')
    assert "disk True" in output_of("KVCacheClient.connect(seeds=[")
    assert "bit_exact" in output_of("persisting demo") and "true" in output_of("persisting demo")
    prewarm = output_of("persisting prewarm")  # a line per prewarm, then the evict's JSON
    assert prewarm.startswith("published 1 prewarm event(s) for meta-llama/Llama-3-8B")
    evict = json.loads(prewarm[prewarm.index("{") :])
    (consumer,) = evict.pop("consumers")  # the live server's consumer will apply it
    assert "event consumer of persisting server 'kvstore'" in consumer
    assert evict == {
        "model": MODEL,
        "op": "evict",
        "published": 1,
        "topic": "kv-events",
        "hash_scheme": "persisting",  # how the tokens were hashed
        "chunk_size": 256,
    }
    assert "persisting-data" in output_of("settings_from_extra_config")
    inventory = output_of("persisting inspect")
    assert MODEL in inventory and "demo/llama" in inventory and "kv-events" in inventory

    serving = [s for s in servers if "persisting serve" in s.block.code]
    assert all("persisting: serving meta-llama/Llama-3-8B" in s.output() for s in serving)
    for root in ("persisting-data", "launcher-data", "secure-data"):
        assert (work / root / "kv" / "meta-llama%2FLlama-3-8B").is_dir(), root
    assert (work / "persisting-data" / "queue" / "prefill%2Frequests").is_dir()
    assert (work / "demo-data" / "kv" / "demo%2Ftiny-llama").is_dir()


def test_only_the_install_blocks_are_left_out_and_one_is_the_readmes() -> None:
    blocks = guide_blocks()
    skipped = [b for b in blocks if b.marker == "no-test"]
    assert len(skipped) == 2  # the install commands, and the same install by hand
    install = skipped[0].code
    assert "pip install -c keep.txt -e ." in skipped[1].code
    readme = [b for b in fenced_blocks((REPO / "README.md").read_text()) if b.language == "bash"]
    readme_commands = {line for b in readme for line in b.code.splitlines() if line.strip()}
    assert "bash scripts/install.sh && .venv/bin/python -m pytest" in readme_commands
    install_commands = {line.split("#")[0].strip() for line in install.splitlines()}
    assert readme_commands <= install_commands  # the README's commands, verbatim
    script = (REPO / "scripts" / "install.sh").read_text()
    assert "PERSISTING_SKIP_LMCACHE=1 bash scripts/install.sh" in install
    assert "PERSISTING_SKIP_LMCACHE" in script
    assert "PERSISTING_EXISTING_ENV=1 VENV=" in install and "PERSISTING_EXISTING_ENV" in script
    guide = GUIDE.read_text()
    # The pins the guide tells a hand install to use are the ones the script uses.
    for pin in ("torch==2.13.0", "numpy<=2.2.6", "lmcache==0.5.6"):
        assert pin in guide and pin in script, pin
    assert "requirements/lmcache-cpu.txt" in guide and "--no-deps" in script
    assert (REPO / "requirements" / "lmcache-cpu.txt").is_file()
    # Everything else in Python or shell is run, or is a server run in the background.
    for block in blocks:
        if block.language in RUN_LANGUAGES:
            assert block.marker in (None, "background", "no-test"), block.where()


@pytest.mark.slow
def test_the_guides_lmcache_yaml_loads_the_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("lmcache", reason="LMCache is not installed (PERSISTING_SKIP_LMCACHE=1?)")
    import torch
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    (yaml_block,) = [b for b in guide_blocks() if b.argument == "lmcache.yaml"]
    monkeypatch.chdir(tmp_path)  # its storage path is relative
    for name in [k for k in os.environ if k.startswith("PERSISTING_")]:
        monkeypatch.delenv(name)
    (tmp_path / "lmcache.yaml").write_text(yaml_block.code)
    config = LMCacheEngineConfig.from_file("lmcache.yaml")
    config.max_local_cpu_size = 0.05  # GB: the guide's 5 GB CPU tier is more than a test needs
    metadata = LMCacheMetadata(
        model_name=MODEL,
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=(4, 2, config.chunk_size, 2, 32),
        chunk_size=config.chunk_size,
    )
    manager = StorageManager(config, metadata, EventManager())
    try:
        plugin = manager.storage_backends.get("PersistingBackend")
        assert type(plugin).__name__ == "PersistingKVBackend", list(manager.storage_backends)
        stats = plugin.stats()  # type: ignore[union-attr]
        assert stats["put_failed"] == 0
    finally:
        manager.close()
    assert (tmp_path / "persisting-data").is_dir()


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", markdown, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_every_relative_link_resolves() -> None:
    text = GUIDE.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert len(relative) >= 10
    for link in relative:
        path, _, anchor = link.partition("#")
        target = (GUIDE.parent / path).resolve() if path else GUIDE
        assert target.exists(), link
        if anchor:
            assert anchor in _anchors(target.read_text()), link
    for name in re.findall(r"`([a-z_]+\.py)`", text):
        if name.endswith(("_native.py", "_plugin.py", "_client.py", "_job.py", "_pulsing.py")):
            assert (REPO / "examples" / name).is_file(), name
