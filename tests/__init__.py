"""Persisting's test suite, a package: helpers are imported as ``tests.<area>.<module>``.

A child Python that a test starts (a script of this folder, or ``python -c``) imports them
the same way; :func:`child_env` puts the repository root on its path.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with the repository root first on
    ``PYTHONPATH``, so a child process can ``import tests.<area>.<module>``."""
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), out.get("PYTHONPATH")) if p)
    return out
