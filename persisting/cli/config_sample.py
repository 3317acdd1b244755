"""A ``persisting.toml`` with every setting at its default, written from the settings model.

``persisting config sample`` prints it; ``deploy/persisting.toml`` is its output, kept in
sync by a test, so a new setting shows up in the sample (with its docstring as the comment)
as soon as it is added to :mod:`persisting.config`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from persisting.config import PersistingSettings, parse_bytes, setting_fields, size_text


def _toml_value(value: Any, *, size: bool) -> str:
    if size:
        return json.dumps(size_text(int(value)))
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Path):
        return json.dumps(str(value))
    return json.dumps(value)


def is_size(model: type[BaseModel], name: str) -> bool:
    """Whether setting ``name`` of ``model`` is a size (takes and shows units)."""
    metadata = model.model_fields[name].metadata
    return any(getattr(m, "func", None) is parse_bytes for m in metadata)


def _doc_lines(text: str | None) -> list[str]:
    return [f"# {' '.join(line.split())}" for line in (text or "").strip().splitlines() if line]


def _model_lines(model: type[BaseModel], defaults: BaseModel) -> list[str]:
    lines: list[str] = []
    for name, info in model.model_fields.items():
        if setting_fields(model)[name] is not None:
            continue
        lines.extend(_doc_lines(info.description))
        value = getattr(defaults, name)
        if value is None:
            lines.append(f"# {name} =")
        else:
            lines.append(f"{name} = {_toml_value(value, size=is_size(model, name))}")
    return lines


def sample_toml() -> str:
    """A ``persisting.toml`` with every setting at its default, each with what it means."""
    defaults = PersistingSettings.model_construct()
    lines = [
        "# Persisting settings: every setting with its default (persisting config sample).",
        "# Environment variables override this file: PERSISTING_STORAGE_PATH,",
        "# PERSISTING_KV__MEMORY_BYTES, ... Sizes take units: 8GiB, 512MB, 16MiB or bytes.",
        "",
        *_model_lines(PersistingSettings, defaults),
    ]
    for name, section in setting_fields(PersistingSettings).items():
        if section is not None:
            lines += ["", *_doc_lines(section.__doc__), f"[{name}]"]
            lines += _model_lines(section, section())
    return "\n".join(lines) + "\n"


__all__ = ["is_size", "sample_toml"]
