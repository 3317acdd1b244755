"""deploy/: the systemd unit and the container recipe are rendered and checked, and the
settings they start a server with are valid.

The unit is verified by ``systemd-analyze verify`` (the check systemd itself makes) after
pointing it at this checkout, as docs/operating.md tells an operator to; the Dockerfile is
parsed by dockerfile-parse and checked instruction by instruction (no image is built: that
needs a daemon and the network).
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dockerfile_parse import DockerfileParser

from persisting.config import PersistingSettings
from tests.docs.docs_helpers import REPO, fenced_blocks

DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "persisting.service"
DOCKERFILE = DEPLOY / "Dockerfile"
OPERATING = REPO / "docs" / "operating.md"
PERSISTING = str(Path(sys.executable).with_name("persisting"))


def rendered_unit(tmp_path: Path) -> Path:
    """The unit pointed at this checkout, as the doc's ``sed`` does."""
    path = tmp_path / "persisting.service"
    path.write_text(UNIT.read_text().replace("/opt/persisting", str(REPO)))
    return path


def unit_sections(text: str) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    parser.read_string(text)
    return parser


def unit_environment(text: str) -> dict[str, str]:
    """``Environment=K=V`` lines of a unit (repeated keys: configparser keeps the last)."""
    found = re.findall(r"^Environment=(\S+?)=(\S+)$", text, flags=re.M)
    return dict(found)


def config_show(env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("PERSISTING_")}
    full.update(env)
    return subprocess.run(
        [PERSISTING, "config", "show", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=full,
        cwd=cwd,
    )


def test_the_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    unit = rendered_unit(tmp_path)
    sections = unit_sections(unit.read_text())
    assert set(sections.sections()) == {"Unit", "Service", "Install"}
    exec_start = shlex.split(sections.get("Service", "ExecStart"))
    assert Path(exec_start[0]).is_file(), exec_start  # the rendered path is this checkout's
    assert exec_start[1:] == ["serve"]
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is not installed: install systemd to verify the unit")
    verify = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert verify.returncode == 0, verify.stderr
    # Unknown keys and bad values are only warnings to verify: there must be none.
    assert str(unit) not in verify.stderr, verify.stderr


def test_the_unit_starts_serve_with_valid_settings(tmp_path: Path) -> None:
    from persisting.cli.app import EXIT_BAD_INPUT

    text = UNIT.read_text()
    sections = unit_sections(text)
    service = sections["Service"]
    assert service["RestartPreventExitStatus"] == str(EXIT_BAD_INPUT)  # a settings mistake
    assert service["KillSignal"] == "SIGTERM" and service["User"] == "persisting"
    env = unit_environment(text)
    assert env["PERSISTING_CONFIG"] == "/etc/persisting/persisting.toml"
    storage = env["PERSISTING_STORAGE_PATH"]
    assert storage == service["WorkingDirectory"] == f"/var/lib/{service['StateDirectory']}"
    assert storage in service["ReadWritePaths"].split()
    # The settings the unit gives the server, with the sample installed where it says.
    shown = config_show(
        {"PERSISTING_CONFIG": str(DEPLOY / "persisting.toml"), "PERSISTING_STORAGE_PATH": storage},
        tmp_path,
    )
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["storage_path"] == storage
    # The doc installs the unit the way this test renders it.
    doc = OPERATING.read_text()
    assert 'sed "s#/opt/persisting#$PWD#" deploy/persisting.service' in doc


def dockerfile() -> DockerfileParser:
    return DockerfileParser(path=str(DOCKERFILE))


def instructions(parsed: DockerfileParser, name: str) -> list[str]:
    return [i["value"] for i in parsed.structure if i["instruction"] == name]


def test_the_container_recipe_parses_and_holds_together(tmp_path: Path) -> None:
    parsed = dockerfile()
    kinds = [i["instruction"] for i in parsed.structure if i["instruction"] != "COMMENT"]
    assert kinds[0] == "FROM"
    known = {"FROM", "ENV", "RUN", "COPY", "USER", "WORKDIR", "VOLUME", "EXPOSE", "STOPSIGNAL"}
    assert set(kinds) <= known | {"ENTRYPOINT", "CMD"}, set(kinds) - known
    base = parsed.baseimage
    assert ":" in base and not base.endswith(":latest"), base  # a pinned base image
    # Runs unprivileged, stops on SIGTERM, in exec form (so the signal reaches serve).
    assert instructions(parsed, "USER") == ["persisting"]
    assert instructions(parsed, "STOPSIGNAL") == ["SIGTERM"]
    entrypoint = json.loads(instructions(parsed, "ENTRYPOINT")[-1])
    command = json.loads(instructions(parsed, "CMD")[-1])
    assert Path(entrypoint[0]).name == "persisting" and command == ["serve"]
    # torch pinned and from the CPU index, like scripts/install.sh pins it.
    installs = " ".join(instructions(parsed, "RUN"))
    assert "https://download.pytorch.org/whl/cpu 'torch==2.13.0'" in installs
    assert "torch==2.13.0" in (REPO / "scripts" / "install.sh").read_text()
    assert (
        entrypoint[0].startswith("/opt/persisting/bin/")
        and "python -m venv /opt/persisting" in installs
    )
    # What it copies exists, and the build context leaves the virtualenv out.
    for copy in instructions(parsed, "COPY"):
        source = copy.split()[0]
        assert (REPO / source).exists(), copy
    assert ".venv" in (REPO / ".dockerignore").read_text().split()
    # The port it exposes is the settings' default, and the settings it bakes in are valid.
    default_port = PersistingSettings.model_construct().service.addr.rsplit(":", 1)[1]
    assert instructions(parsed, "EXPOSE") == [default_port]
    env = dict(parsed.envs)
    assert env["PERSISTING_CONFIG"] == "/etc/persisting/persisting.toml"
    assert "deploy/persisting.toml /etc/persisting/persisting.toml" in instructions(parsed, "COPY")
    shown = config_show(
        {
            "PERSISTING_CONFIG": str(DEPLOY / "persisting.toml"),
            "PERSISTING_STORAGE_PATH": env["PERSISTING_STORAGE_PATH"],
        },
        tmp_path,
    )
    assert shown.returncode == 0, shown.stderr


def docker_run() -> list[str]:
    (block,) = [b.code for b in fenced_blocks(OPERATING.read_text()) if "docker run" in b.code]
    line = block.replace("\\\n", " ")
    return shlex.split(next(cmd for cmd in line.splitlines() if "docker run" in cmd))


def test_the_documented_docker_run_gives_the_memory_tier_its_shared_memory() -> None:
    argv = docker_run()
    shm = next(a for a in argv if a.startswith("--shm-size="))
    size = shm.split("=", 1)[1]
    assert size.endswith("g"), size
    memory = PersistingSettings.load(DEPLOY / "persisting.toml").kv.memory_bytes
    assert int(size[:-1]) << 30 > memory  # the memory tier and a margin
    assert "--network" in argv and argv[argv.index("--network") + 1] == "host"
    volume = argv[argv.index("-v") + 1]
    assert volume.endswith(":" + dict(dockerfile().envs)["PERSISTING_STORAGE_PATH"])
    envs = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "-e")
    settings = PersistingSettings(
        models=envs["PERSISTING_MODELS"].split(","),
        service={"addr": envs["PERSISTING_SERVICE__ADDR"]},
    )
    assert settings.models == ["meta-llama/Llama-3.1-8B"]
    # The recipe's own header shows the same command.
    header = " ".join(
        line.lstrip("# ").rstrip("\\").strip()
        for line in DOCKERFILE.read_text().splitlines()
        if line.startswith("#")
    )
    assert " ".join(argv[:-1]) in header.replace("  ", " ")
