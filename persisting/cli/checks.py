"""Operator input checked before any work starts, with messages that name the flag typed.

A replay that runs for minutes and then cannot write its plot, or a server that opens every
store and then finds its port taken, wastes the operator's time and ends in a traceback.
Each check here raises :class:`~persisting.errors.ConfigError` (exit code 2, one line).
"""

from __future__ import annotations

import errno
import importlib
import os
import socket
from pathlib import Path

from persisting.config import socket_address
from persisting.errors import ConfigError


def output_file(path: Path, flag: str) -> Path:
    """``path`` can be written: its folder exists and is writable, and it is not a folder."""
    if path.is_dir():
        raise ConfigError(f"{flag} {path} is a folder, not a file")
    folder = path.parent
    if not folder.is_dir():
        raise ConfigError(f"{flag} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: folder {folder} is not writable")
    return path


def storage_folder(path: Path, flag: str = "--storage-path") -> Path:
    """``path`` is a folder, or can be created as one (its nearest existing parent is a
    writable folder): a storage root that serve, demo or a replay may create."""
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{flag} {path} is a file, not a folder")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{flag} {path} is not writable")
        return path
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path} cannot be created: {parent} is not writable")
    return path


def writable_root(path: Path, why: str, flag: str = "--storage-path") -> Path:
    """An existing storage root this process may write to (``why`` says what needs it)."""
    if not path.is_dir():
        raise ConfigError(
            f"no storage root at {path} (check {flag} or PERSISTING_STORAGE_PATH)"
            if not path.exists()
            else f"{flag} {path} is a file, not a storage root"
        )
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path} is read-only for this user: {why}")
    return path


def listen_address(text: str, flag: str) -> tuple[str, int]:
    """``IP:PORT`` that this host can listen on now (the port is free)."""
    host, port = socket_address(text, flag)
    free_port(host, port, flag)
    return host, port


def free_port(host: str, port: int, flag: str) -> None:
    """ConfigError if ``host:port`` cannot be bound (taken, or not this host's address).

    Bound with SO_REUSEADDR, as servers do, so a port in TIME_WAIT is not reported; the
    check is advisory (another process may take the port next), the server's own bind is
    what counts.
    """
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"{flag} {host}:{port}: the port is already in use (another server?)"
                ) from exc
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigError(
                    f"{flag} {host}:{port}: {host} is not an address of this host"
                ) from exc
            raise ConfigError(f"{flag} {host}:{port}: cannot listen there: {exc.strerror}") from exc


def module_for(flag: str, module: str, install: str) -> None:
    """ConfigError if ``module`` (needed by ``flag``) cannot be imported."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"{flag} needs {module}, which is not installed ({install})") from exc


__all__ = [
    "free_port",
    "listen_address",
    "module_for",
    "output_file",
    "storage_folder",
    "writable_root",
]
