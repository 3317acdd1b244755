"""Every operator mistake ends in one line on stderr and exit code 2, never a traceback.

A table of bad invocations walks every command. Most run in-process (``CliRunner`` goes
through the same group that shortens click's usage errors); the ``serve`` cases run the
real console script against a port held by a real listener, and the cases that need
another environment (no matplotlib, a read-only root) run in a subprocess too.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from persisting.cli import app

runner = CliRunner()
PERSISTING = str(Path(sys.executable).with_name("persisting"))
MODEL = "meta-llama/Llama-3-8B"


@dataclass(frozen=True)
class Bad:
    """A bad invocation: its arguments (``{work}`` is the test's folder) and a piece of
    the one line it must print."""

    args: tuple[str, ...]
    says: str
    env: tuple[tuple[str, str], ...] = ()

    def argv(self, work: Path) -> list[str]:
        return [a.replace("{work}", str(work)) for a in self.args]


def bad(*args: str, says: str, **env: str) -> Bad:
    return Bad(args, says, tuple(env.items()))


BAD_INVOCATIONS = [
    # usage errors: the flag named, one line, a pointer to --help
    bad("plan", "--layers", "32", says="give the workload (--prefix-tokens, --prefixes, --rps)"),
    bad("nosuch", says="No such command 'nosuch'"),
    bad("compact", "--older-than", "-1", says="Invalid value for '--older-than'"),
    bad("inspect", "--config", "{work}/missing.toml", says="'--config'"),
    # settings
    bad("stats", "--config", "{work}/broken.toml", says="broken.toml is not valid TOML"),
    bad("inspect", "--config", "{work}/typo.toml", says="did you mean kv.memory_bytes?"),
    bad("inspect", says="mean PERSISTING_KV__MEMORY_BYTES?", PERSISTING_KV__MEMORY_BYTE="1"),
    bad("config", "show", "--config", "{work}/typo.toml", says="unknown setting kv.memory_byte"),
    # plan: flags as typed
    bad("plan", "--model", "llama-3.1-8b", "--prefix-tokens", "256", "--prefixes", "1",
        "--rps", "1", "--tp", "3", says="--tp=3 does not split --kv-heads=8 evenly"),
    bad("plan", "--model", "llama-9", "--prefix-tokens", "256", "--prefixes", "1",
        "--rps", "1", says="unknown --model 'llama-9'; presets: llama-3-8b"),
    bad("plan", "--bytes-per-token", "70272", "--tp", "8", "--prefix-tokens", "256",
        "--prefixes", "1", "--rps", "1", says="say whether TP splits it: --mla"),
    bad("plan", "--layers", "61", "--kv-heads", "1", "--head-dim", "576", "--prefix-tokens",
        "256", "--prefixes", "1", "--rps", "1", says="looks like an MLA latent"),
    bad("plan", "--model", "qwen2.5-7b", "--prefix-tokens", "256", "--prefixes", "1",
        "--rps", "1", "--fill", "1.5", says="--fill must be in (0, 1]"),
    bad("plan", "--model", "qwen2.5-7b", "--prefix-tokens", "256", "--prefixes", "1",
        "--rps", "1", "--disk-bytes", "3XB", says="--disk-bytes must be a size"),
    # bench
    bad("bench", "generate", "{work}/no/such/t.jsonl", says="folder {work}/no/such does not"),
    bad("bench", "generate", "{work}/t.jsonl", "--rate", "0", says="rate must be > 0"),
    bad("bench", "replay", "{work}/broken.jsonl", says="header"),
    bad("bench", "replay", "{work}/trace.jsonl", "--plot", "{work}/no/such/folder/p.png",
        says="--plot {work}/no/such/folder/p.png: folder {work}/no/such/folder does not exist"),
    bad("bench", "replay", "{work}/trace.jsonl", "--storage-path", "{work}/a-file",
        says="--storage-path {work}/a-file is a file, not a folder"),
    bad("bench", "replay", "{work}/trace.jsonl", "--memory-bytes", "8XB",
        says="--memory-bytes must be a size"),
    bad("bench", "replay", "{work}/trace.jsonl", "--server", "localhost:8610",
        says="--server localhost:8610: a host name is not resolved: use 127.0.0.1"),
    bad("bench", "replay", "{work}/trace.jsonl", "--server", "127.0.0.1:8610",
        "--storage-path", "{work}/root", says="not with --server"),
    bad("bench", "replay", "{work}/trace.jsonl", "--model", "org/unknown",
        says="no known KV size for 'org/unknown'"),
    # storage root commands
    bad("inspect", "--storage-path", "{work}/nope", says="no storage root at {work}/nope"),
    bad("inspect", "--storage-path", "{work}/a-file", says="is a file, not a storage root"),
    bad("stats", "--storage-path", "{work}/nope", says="no storage root at {work}/nope"),
    bad("stats", "--storage-path", "{work}/root", "--metrics-url", "http://127.0.0.1:1/",
        says="not both"),
    bad("stats", "--metrics-url", "ftp://example/metrics", says="must start with http://"),
    bad("compact", "--storage-path", "{work}/root", "no/such", says="no model 'no/such'"),
    bad("drop", "no/such-model", "--storage-path", "{work}/nope", says="no storage root"),
    bad("drop", MODEL, "--storage-path", "{work}/root", says="refusing to drop"),
    bad("quarantine", MODEL, "--storage-path", "{work}/nope", says="no storage root"),
    bad("quarantine", MODEL, "--add-key", "{work}/nope", "--storage-path", "{work}/root",
        says="cannot read key file"),
    # service commands that fail before any server starts
    bad("prewarm", MODEL, "--key", "x", "--storage-path", "{work}/nope", says="no storage root at"),
    bad("prewarm", MODEL, "--storage-path", "{work}/root", says="give --key (one or more)"),
    bad("demo", "--storage-path", "{work}/a-file", says="--storage-path {work}/a-file is a file"),
    bad("serve", "--storage-path", "{work}/a-file", says="--storage-path {work}/a-file is a file"),
]  # fmt: skip


@pytest.fixture
def work(tmp_path: Path) -> Path:
    """A folder with the files the bad invocations name: a broken TOML, one with a typo, a
    file where a folder is expected, a trace, a broken trace and a storage root."""
    (tmp_path / "broken.toml").write_text("[kv\nmemory_bytes = 5\n")
    (tmp_path / "typo.toml").write_text("[kv]\nmemory_byte = 5\n")
    (tmp_path / "a-file").write_text("not a folder\n")
    from persisting.cli.config_sample import sample_toml

    (tmp_path / "sample.toml").write_text(sample_toml())  # `models = []`, as shipped
    (tmp_path / "broken.jsonl").write_text('{"format": "something-else"}\n')
    header = {"format": "persisting-trace", "version": 1, "model": MODEL, "vocab_size": 100}
    request = {"id": "r0", "t": 0.0, "tokens": list(range(8))}
    (tmp_path / "trace.jsonl").write_text(json.dumps(header) + "\n" + json.dumps(request) + "\n")
    (tmp_path / "root" / "kv" / "meta-llama%2FLlama-3-8B").mkdir(parents=True)
    return tmp_path


def one_line_error(stderr: str, stdout: str, says: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("Error: "), stderr
    assert says in lines[0], (says, stderr)
    assert "Traceback" not in stderr + stdout
    assert stdout == "", stdout


@pytest.mark.parametrize("case", BAD_INVOCATIONS, ids=lambda c: " ".join(c.args)[:60])
def test_a_bad_invocation_is_one_line_and_exit_code_2(case: Bad, work: Path) -> None:
    env = {"COLUMNS": "80", **dict(case.env)}  # narrow: one line must survive wrapping
    result = runner.invoke(app, case.argv(work), env=env)
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    one_line_error(result.stderr, result.stdout, case.says.replace("{work}", str(work)))


def test_every_command_has_a_bad_invocation() -> None:
    import typer.main

    group = typer.main.get_command(app)
    commands = {
        f"{name} {sub}" if hasattr(cmd, "commands") else name
        for name, cmd in group.commands.items()  # type: ignore[attr-defined]
        for sub in (getattr(cmd, "commands", None) or {"": None})
    }
    walked = {
        " ".join(c.args[:2]) if c.args[0] in ("bench", "config") else c.args[0]
        for c in BAD_INVOCATIONS
    }
    missing = {c.strip() for c in commands} - walked - {"config sample"}  # takes no input
    assert not missing, f"commands without a bad invocation: {sorted(missing)}"


# --- the cases a subprocess shows: serve against real ports, another environment ---------


def run(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")}
    full.update(COLUMNS="80", **(env or {}))
    return subprocess.run(
        [PERSISTING, *args], capture_output=True, text=True, timeout=120, env=full, cwd=cwd
    )


@contextlib.contextmanager
def listener() -> Iterator[int]:
    """A port held by a real listening socket for as long as the block runs."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_serve_mistakes_are_one_line(work: Path) -> None:
    root = str(work / "root")
    with listener() as taken:
        cases = [
            (["--addr", f"127.0.0.1:{taken}"], f"--addr 127.0.0.1:{taken}: the port is already"),
            (["--metrics-port", str(taken)], f"--metrics-port 127.0.0.1:{taken}: the port is"),
            (["--addr", "localhost"], "--addr must be IP:PORT (e.g. 127.0.0.1:8610), got"),
            (["--addr", "999.1.1.1:99999"], "999.1.1.1 is not an IP address; the port must be"),
            (["--storage-path", str(work / "a-file")], "is a file, not a folder"),
            (["--config", str(work / "broken.toml")], "broken.toml is not valid TOML"),
            (["--seed", "kvstore-1:8610"], "--seed kvstore-1:8610: kvstore-1 is a host name"),
        ]  # fmt: skip
        for extra, says in cases:
            args = ["serve", "--storage-path", root, "-m", MODEL, "--addr", "127.0.0.1:0", *extra]
            proc = run(*args)
            assert proc.returncode == 2, (extra, proc.stdout, proc.stderr)
            one_line_error(proc.stderr, proc.stdout, says)
        demo = run("demo", "--storage-path", str(work / "a-file"))
        assert demo.returncode == 2
        one_line_error(demo.stderr, demo.stdout, "is a file, not a folder")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_pulsings_own_port_error_becomes_one_line(work: Path) -> None:
    """A port taken between the check and the bind (a race) is Pulsing's error: the
    __PULSING_ERROR__ JSON it raises is translated, not printed."""
    script = """
import asyncio, os, sys
import pulsing
from persisting.cli.service import pulsing_errors
from persisting.config import PersistingSettings
from persisting.errors import ConfigError
settings = PersistingSettings(service={"addr": "127.0.0.1:{port}"})
try:
    with pulsing_errors(settings):
        asyncio.run(pulsing.init(addr=settings.service.addr))
except ConfigError as exc:
    print("ConfigError:", exc, flush=True)
    os._exit(0)
print("no error", flush=True)
os._exit(1)
"""
    with listener() as taken:
        proc = subprocess.run(
            [sys.executable, "-c", script.replace("{port}", str(taken))],
            capture_output=True,
            text=True,
            timeout=90,
        )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == (
        f"ConfigError: 127.0.0.1:{taken}: the port is already in use (another server?)"
    )


def test_plot_without_matplotlib_is_refused_before_the_replay(work: Path) -> None:
    fake = work / "site"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    proc = run(
        "bench", "replay", str(work / "trace.jsonl"), "--plot", str(work / "p.png"),
        env={"PYTHONPATH": str(fake)},
    )  # fmt: skip
    assert proc.returncode == 2
    one_line_error(proc.stderr, proc.stdout, "--plot needs matplotlib, which is not installed")


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[list[str]]:
    """``path`` read-only for the commands run under the prefix this yields: a mode for a
    normal user; for root (whom modes do not stop) a read-only bind mount, made here or in
    a private mount namespace."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        try:
            yield []
        finally:
            path.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "--bind", str(path), str(path)], capture_output=True)
    if mounted.returncode == 0:
        try:
            remount = ["mount", "-o", "remount,ro,bind", str(path)]
            subprocess.run(remount, check=True, capture_output=True)
            yield []
        finally:
            subprocess.run(["umount", str(path)], capture_output=True)
        return
    # No mount privilege: a user and mount namespace of our own can still bind read-only.
    mount = f'mount --bind {path} {path} && mount -o remount,ro,bind {path} && exec "$@"'
    yield ["unshare", "--map-root-user", "--mount", "sh", "-c", mount, "sh"]


def test_a_read_only_root_is_read_by_stats_and_refused_by_compact(work: Path) -> None:
    """``stats`` only reads (it works on a root this user may not write); ``compact``
    writes, and says why it cannot."""
    root = work / "root"
    full = {k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")}
    with read_only(root) as prefix:
        read = subprocess.run(
            [*prefix, PERSISTING, "stats", "--storage-path", str(root), "--json"],
            capture_output=True, text=True, timeout=120, env=full,
        )  # fmt: skip
        write = subprocess.run(
            [*prefix, PERSISTING, "compact", "--storage-path", str(root)],
            capture_output=True, text=True, timeout=120, env=full,
        )  # fmt: skip
    assert read.returncode == 0, read.stdout + read.stderr
    assert MODEL in json.loads(read.stdout)["models"]
    assert write.returncode == 2, write.stdout + write.stderr
    one_line_error(write.stderr, write.stdout, f"--storage-path {root} is read-only for this user")


def test_version_and_completion() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    from persisting import __version__

    assert result.stdout.startswith(f"persisting {__version__} (python ")
    assert "pulsing 0.1.2" in result.stdout
    shown = runner.invoke(app, ["--help"], env={"COLUMNS": "160"})
    assert "--install-completion" in shown.stdout and "--show-completion" in shown.stdout
