"""The server's log: one setup for both launch paths, a start-up banner and a stop line.

``service.log_level`` and ``service.log_format`` (``text`` or ``json``: one JSON object per
line, for log shippers) configure the ``persisting`` loggers; ``persisting serve
--log-level/--log-json`` only set those. The banner says what an operator checks first:
version, absolute storage root, models, address, the metrics port actually bound, each
store's tiers and sizes, and where the passphrase comes from (never the passphrase).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Mapping
from typing import Any

from persisting import __version__

#: The logger every server-side line goes to.
logger = logging.getLogger("persisting.service")

_HANDLER_NAME = "persisting-server"
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message and any ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name, value in vars(record).items():
            if name not in _STANDARD and not name.startswith("_"):
                out[name] = value
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    """Send the ``persisting`` loggers to stderr at ``level`` (idempotent: reconfigures)."""
    root = logging.getLogger("persisting")
    root.setLevel(level.upper())
    for handler in list(root.handlers):
        if handler.get_name() == _HANDLER_NAME:
            root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root.addHandler(handler)
    root.propagate = False


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << (shift - 4)) == 0:
            return f"{nbytes / (1 << shift):g} {unit}"
    return f"{nbytes} B"


def log_banner(
    *,
    name: str,
    addr: str,
    storage_path: str,
    stores: Mapping[str, Any],
    metrics_url: str | None,
    passphrase_from: str,
) -> None:
    """The start-up banner: one summary line, then one line per served store."""
    models = sorted(stores)
    logger.info(
        "persisting: serving %s as %r at %s (persisting %s, storage %s, metrics %s, passphrase %s)",
        ", ".join(models) or "any namespace its clients open",
        name,
        addr,
        __version__,
        storage_path,
        metrics_url or "off",
        passphrase_from,
        extra={
            "event": "serving",
            "version": __version__,
            "models": models,
            "actor": name,
            "addr": addr,
            "storage_path": storage_path,
            "metrics_url": metrics_url,
            "passphrase_from": passphrase_from,
        },
    )
    for model in models:
        store = stores[model]
        figures = store.stats()
        tiers: dict[str, Any] = {
            "memory_bytes": int(figures.get("memory_capacity", 0)),
            "disk_bytes": int(figures.get("disk_capacity", 0)),
            "durability": str(figures.get("durability")),
            "shared_pool": store.shared_pool is not None,
            "disk_items": int(figures.get("disk_items", 0)),
        }
        logger.info(
            "persisting: model %s: memory %s%s, disk %s (%d chunks stored), durability %s",
            model,
            _size(tiers["memory_bytes"]),
            " (shared pool)" if tiers["shared_pool"] else "",
            _size(tiers["disk_bytes"]) if tiers["disk_bytes"] else "off",
            tiers["disk_items"],
            tiers["durability"],
            extra={"event": "store", "model": model, **tiers},
        )


def log_bulk(endpoint: Mapping[str, Any] | None, error: str | None = None) -> None:
    """Where the data path listens (or why it cannot)."""
    if endpoint is None:
        logger.error(
            "persisting: cannot open the data path: %s",
            error,
            extra={"event": "bulk", "bulk": None, "error": error},
        )
        return
    logger.info(
        "persisting: data path at %s:%s (%s) and %s",
        endpoint["host"],
        endpoint["port"],
        "TLS 1.3 off loopback" if endpoint.get("cert") else "plain bytes, checksummed",
        endpoint["unix"],
        extra={"event": "bulk", "bulk": {k: v for k, v in endpoint.items() if k != "cert"}},
    )


def log_stop(name: str, started: float, counters: Mapping[str, int]) -> None:
    """The stop line: how long the server ran and what it answered."""
    requests = sum(v for k, v in counters.items() if k.startswith("op_"))
    uptime = round(time.monotonic() - started, 1)
    logger.info(
        "persisting: stopped %r after %.1fs (%d requests, %d errors)",
        name,
        uptime,
        requests,
        counters.get("errors", 0),
        extra={"event": "stopped", "actor": name, "uptime_s": uptime, "requests": requests},
    )


__all__ = [
    "JsonFormatter",
    "configure_logging",
    "log_banner",
    "log_bulk",
    "log_stop",
    "logger",
]
