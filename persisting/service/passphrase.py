"""The service's passphrase: the one barrier between a Pulsing port and code execution.

Pulsing unpickles every incoming message before an actor sees it, so whoever can reach an
unauthenticated Pulsing port can run code in that process -- and every Pulsing process
listens on a TCP port, clients included. With a passphrase Pulsing speaks TLS and a peer
without it gets nothing decoded. So Persisting never starts Pulsing without one:

* a server uses ``service.passphrase`` when it is set; otherwise it uses (or, the first
  time, generates) a random passphrase kept in a file only its user can read, by default
  ``$XDG_STATE_HOME/persisting/passphrase`` (``~/.local/state/persisting/passphrase``), or
  ``service.passphrase_file``. A generated passphrase serves loopback only: a server on
  any other address, or joining seeds elsewhere, needs ``service.passphrase`` set;
* a client uses the passphrase it is given, else ``service.passphrase``, else that file:
  a client of the same user on the server's host connects with no configuration at all,
  the way notebook servers hand tokens to local browsers.

A file that another user owns, or that others may read, is refused rather than trusted.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path

from persisting.config import ServiceSettings
from persisting.errors import ConfigError

#: Bytes of randomness in a generated passphrase.
_PASSPHRASE_BYTES = 32


def passphrase_file(service: ServiceSettings) -> Path:
    """Where the generated passphrase of this user lives (``service.passphrase_file``)."""
    if service.passphrase_file is not None:
        return Path(service.passphrase_file).expanduser()
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "persisting" / "passphrase"


def is_loopback(addr: str) -> bool:
    """True for ``host:port`` addresses only this host can reach."""
    host = addr.rpartition(":")[0] if ":" in addr else addr
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_passphrase(path: Path) -> str | None:
    """The passphrase kept at ``path`` (None when there is none); ConfigError for a file
    this user does not own or others can read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"cannot read the service passphrase {path}: {exc.strerror}") from exc
    with os.fdopen(fd, "r", encoding="utf-8") as handle:
        info = os.fstat(handle.fileno())
        _check_private(path, info)
        text = handle.read().strip()
    return text or None


def _check_private(path: Path, info: os.stat_result) -> None:
    if info.st_uid != os.geteuid():
        raise ConfigError(f"{path} belongs to another user: refusing to use it as a passphrase")
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise ConfigError(f"{path} is readable by others: `chmod 600 {path}`, or remove it")


def generated_passphrase(path: Path) -> str:
    """The passphrase at ``path``, generated (mode 0600, folder 0700) if there is none.

    Two servers starting at once agree: the file appears whole (written aside, then
    linked into place), and whoever comes second reads the first one's.
    """
    existing = read_passphrase(path)
    if existing is not None:
        return existing
    folder = path.parent
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(folder, os.stat(folder))
    secret = secrets.token_urlsafe(_PASSPHRASE_BYTES)
    aside = folder / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(secret + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside)
    found = read_passphrase(path)
    if found is None:  # pragma: no cover - removed between our link and our read
        raise ConfigError(f"the service passphrase {path} vanished while it was created")
    return found


def server_passphrase(service: ServiceSettings, addr: str | None, seeds: Sequence[str]) -> str:
    """The passphrase a server starts Pulsing with (see the module docstring)."""
    if service.passphrase:
        return service.passphrase
    exposed = [a for a in [addr or "", *seeds] if a and not is_loopback(a)]
    if exposed:
        raise ConfigError(
            f"{exposed[0]} is not a loopback address: set a passphrase "
            "(--passphrase or PERSISTING_SERVICE__PASSPHRASE) to serve or join beyond this host"
        )
    return generated_passphrase(passphrase_file(service))


def client_passphrase(given: str | None, service: ServiceSettings) -> str:
    """The passphrase a client joins with (see the module docstring)."""
    if given:
        return given
    if service.passphrase:
        return service.passphrase
    path = passphrase_file(service)
    found = read_passphrase(path)
    if found is None:
        raise ConfigError(
            "no service passphrase: pass passphrase=, set PERSISTING_SERVICE__PASSPHRASE, "
            f"or run as the server's user on its host (it keeps one in {path})"
        )
    return found


__all__ = [
    "client_passphrase",
    "generated_passphrase",
    "is_loopback",
    "passphrase_file",
    "read_passphrase",
    "server_passphrase",
]
