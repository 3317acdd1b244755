"""The Pulsing workarounds live in one module that names the release they were written
against: upgrading Pulsing without revisiting them fails here, and each call site points
back to that module. (The workarounds' behaviour is tested where it shows: the bounded
wait in tests/queue/test_queue_api.py, the launcher in tests/service/, against a real
Pulsing.)"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from persisting import pulsing_compat
from persisting.pulsing_compat import PULSING_VERSION, is_pool_exhausted

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]


def test_the_workarounds_belong_to_the_installed_and_pinned_pulsing() -> None:
    assert pulsing_compat.installed_pulsing_version() == PULSING_VERSION, (
        "Pulsing was upgraded: revisit every entry of persisting/pulsing_compat.py, then "
        "set PULSING_VERSION"
    )
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert f"pulsing=={PULSING_VERSION}" in extras["optional-dependencies"]["service"]


def test_every_call_site_names_the_compat_module() -> None:
    for site in pulsing_compat.CALL_SITES:
        assert "pulsing_compat" in (REPO / site).read_text(), site


def test_no_other_module_names_a_pulsing_release() -> None:
    """A workaround tied to a Pulsing release says so in pulsing_compat, nowhere else
    (the CLI's version line reads the installed version, it names none)."""
    pattern = re.compile(r"Pulsing \d+\.\d+")
    for package in ("persisting", "actors"):
        for path in (REPO / package).rglob("*.py"):
            if path.name != "pulsing_compat.py":
                assert not pattern.search(path.read_text()), path


def test_pool_exhaustion_is_recognised_by_its_message() -> None:
    assert is_pool_exhausted(RuntimeError("send failed: Connection pool exhausted (16)"))
    assert not is_pool_exhausted(ConnectionResetError("Connection reset by peer"))
