"""Running documentation: fenced blocks of a Markdown file, and processes for examples.

A fenced block may be preceded (blank lines aside) by one marker comment saying how the
tests treat it:

* ``<!-- no-test: why -->``: not run (the reason is required);
* ``<!-- background: why -->``: a shell block that runs until stopped (a server); it is
  started in the background, the blocks after it run, and it is stopped at the end;
* ``<!-- file: NAME -->``: the block's text is written to ``NAME`` in the working directory.

Every other ``python`` block runs in a fresh interpreter, every ``bash`` block with
``bash -euo pipefail``, both in the same working directory, in document order.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from contextlib import ExitStack, suppress
from dataclasses import dataclass, replace
from pathlib import Path

from tests.timing import wait_until

REPO = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!--\s*([a-z-]+):\s*(.+?)\s*-->$")
MARKERS = ("no-test", "background", "file")
RUN_LANGUAGES = ("python", "bash")


@dataclass(frozen=True)
class Block:
    """One fenced block: its language, text, marker (if any) and first line number."""

    language: str
    code: str
    line: int
    marker: str | None = None
    argument: str | None = None

    def where(self) -> str:
        return f"{self.language} block at line {self.line}"


def fenced_blocks(markdown: str) -> list[Block]:
    """The fenced blocks of ``markdown`` in order, each with the marker comment before it."""
    blocks: list[Block] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        opening = lines[i]
        if not opening.startswith("```"):
            i += 1
            continue
        language = opening[3:].strip()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise AssertionError(f"unclosed fence at line {i + 1}")
        marker = argument = None
        previous = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        if previous.strip().startswith("<!--"):
            match = MARKER.match(previous.strip())
            if match is None or match.group(1) not in MARKERS:
                raise AssertionError(f"unknown marker before line {i + 1}: {previous!r}")
            marker, argument = match.group(1), match.group(2)
        code = "\n".join(lines[i + 1 : end]) + "\n"
        blocks.append(Block(language, code, i + 2, marker, argument))
        i = end + 1
    return blocks


def substitute(blocks: list[Block], replacements: dict[str, str]) -> list[Block]:
    """The blocks with each ``old`` text replaced by ``new`` (e.g. fixed ports by free ones)."""
    out = []
    for block in blocks:
        code = block.code
        for old, new in replacements.items():
            code = code.replace(old, new)
        out.append(replace(block, code=code))
    return out


def free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (held together while picked)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def run_env(**extra: str) -> dict[str, str]:
    """The environment blocks and examples run in: the project's interpreter directory
    (``.venv/bin``) first on PATH, no PERSISTING_* settings inherited from the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["COLUMNS"] = "120"
    env.update(extra)
    return env


def run_block(block: Block, cwd: Path, env: dict[str, str], timeout_s: float) -> str:
    """Run one python or bash block to completion; its output (fails on a non-zero exit)."""
    if block.language == "python":
        script = cwd.parent / f"block_line_{block.line}.py"  # readable tracebacks
        script.write_text(block.code)
        args = [sys.executable, str(script)]
    else:
        args = ["bash", "-euo", "pipefail", "-c", block.code]
    proc = subprocess.run(
        args,
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        start_new_session=True,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"{block.where()} failed ({proc.returncode}):\n{block.code}\n{output}"
    )
    return output


@dataclass
class Background:
    """A background block's process, its log and the loopback ports its text names."""

    block: Block
    proc: subprocess.Popen[bytes]
    log: Path
    ports: list[int]

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start_background(
    block: Block, cwd: Path, env: dict[str, str], stack: ExitStack, timeout_s: float = 60
) -> Background:
    """Start a background block in its own process group (stopped by ``stack``) and wait
    until every 127.0.0.1 port its text names accepts connections."""
    log = cwd.parent / f"background_line_{block.line}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", block.code],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    running = Background(
        block, proc, log, [int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", block.code)]
    )
    stack.callback(stop_group, proc)
    for port in running.ports:
        wait_until(
            lambda port=port: listening(running, port), f"{block.where()}: port {port}", timeout_s
        )
    return running


def listening(running: Background, port: int) -> bool:
    """Whether ``port`` accepts connections; AssertionError if the block exited first."""
    if running.proc.poll() is not None:
        raise AssertionError(
            f"{running.block.where()} exited ({running.proc.returncode}):\n{running.output()}"
        )
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 20) -> None:
    """SIGTERM the process group (servers stop cleanly on it), SIGKILL what is left."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=grace_s)


def run_example(name: str, *args: str, cwd: Path, timeout_s: float = 150) -> str:
    """Run ``examples/<name>`` as a user would (fresh interpreter, own process group);
    return its stdout after checking it exited 0 and said it was done."""
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "examples" / name), *args],
        cwd=cwd,
        env=run_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # SIGINT first: the example's finally blocks stop the servers it started (they run
        # in their own process groups), then SIGKILL whatever is left of its group.
        os.killpg(proc.pid, signal.SIGINT)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        finally:
            stop_group(proc, grace_s=5)
        raise AssertionError(f"{name} ran past {timeout_s}s:\n{stdout}\n{stderr}") from None
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{stdout}\n{stderr}"
    assert stdout.rstrip().endswith(f"{name.removesuffix('.py')}: done"), stdout
    return stdout
