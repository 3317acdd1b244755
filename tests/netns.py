"""Two hosts on one machine: network namespaces joined by a veth pair.

A server runs in one namespace and a client in the other, each with its own address on a
private /24; traffic between them crosses a real (virtual) link instead of loopback. The
namespaces are created on entry and removed on exit, whatever happened (removing a
namespace removes its end of the pair, and with it the other end). Needs root and ``ip``
(iproute2, installed by ``scripts/install.sh`` where it is missing).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

#: ``ip`` as installed by iproute2.
IP = shutil.which("ip") or "/usr/sbin/ip"


def netns_available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not Path(IP).exists():
        return "the ip command (iproute2) is missing: run scripts/install.sh"
    return None


def _ip(*args: str) -> None:
    subprocess.run([IP, *args], check=True, capture_output=True, text=True, timeout=30)


class TwoHosts:
    """A server namespace and a client namespace, joined by a veth pair (see the module
    docstring). Addresses are ``10.<a>.<b>.1`` (server) and ``.2`` (client), picked from
    the process id and ``tag`` so parallel runs do not collide."""

    def __init__(self, tag: str = "t"):
        unique = (os.getpid() * 7 + sum(tag.encode())) % 60000
        base = f"pk{unique}{tag}"[:11]
        self.server_ns = f"{base}-s"
        self.client_ns = f"{base}-c"
        self._veth = (f"{base}a", f"{base}b")
        net = f"10.{200 + unique % 50}.{unique // 50 % 250}"
        self.server_ip = f"{net}.1"
        self.client_ip = f"{net}.2"

    def __enter__(self) -> TwoHosts:
        why = netns_available()
        if why is not None:
            raise RuntimeError(why)
        try:
            _ip("netns", "add", self.server_ns)
            _ip("netns", "add", self.client_ns)
            _ip("link", "add", self._veth[0], "type", "veth", "peer", "name", self._veth[1])
            for ns, dev, ip in (
                (self.server_ns, self._veth[0], self.server_ip),
                (self.client_ns, self._veth[1], self.client_ip),
            ):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()

    def remove(self) -> None:
        for ns in (self.server_ns, self.client_ns):
            subprocess.run([IP, "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run([IP, "link", "del", self._veth[0]], capture_output=True, timeout=30)

    @property
    def client_device(self) -> str:
        """The client's end of the link (its network device, in its namespace)."""
        return self._veth[1]

    def in_server(self, args: Sequence[str]) -> list[str]:
        """``args`` as a command run inside the server's namespace."""
        return [IP, "netns", "exec", self.server_ns, *args]

    def in_client(self, args: Sequence[str]) -> list[str]:
        """``args`` as a command run inside the client's namespace."""
        return [IP, "netns", "exec", self.client_ns, *args]

    def link(self, side: str, state: str) -> None:
        """Take a side's end of the link ``down`` or ``up`` (a member that hangs)."""
        ns, dev = (
            (self.server_ns, self._veth[0]) if side == "server" else (self.client_ns, self._veth[1])
        )
        _ip("-n", ns, "link", "set", dev, state)

    def kill_connections(self, port: int) -> str:
        """Kill every TCP connection to ``port`` in the server's namespace (``ss -K``: the
        kernel resets them); what ss printed."""
        out = subprocess.run(
            self.in_server(["ss", "-K", "-t", "state", "established", f"( sport = :{port} )"]),
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout + out.stderr


class Hosts:
    """``count`` hosts on one switch: a namespace each, joined by veth pairs to a bridge in
    a namespace of its own (a fleet's members and engine hosts). Host ``i`` has address
    ``10.<a>.<b>.<i + 1>``; nothing is reachable from the machine's own namespace."""

    def __init__(self, count: int, tag: str = "f"):
        unique = (os.getpid() * 11 + sum(tag.encode())) % 60000
        self._base = f"pk{unique}{tag}"[:9]
        self.switch_ns = f"{self._base}-sw"
        self.names = [f"{self._base}-h{i}" for i in range(count)]
        net = f"10.{150 + unique % 50}.{unique // 50 % 250}"
        self.ips = [f"{net}.{i + 1}" for i in range(count)]

    def __enter__(self) -> Hosts:
        why = netns_available()
        if why is not None:
            raise RuntimeError(why)
        try:
            _ip("netns", "add", self.switch_ns)
            _ip("-n", self.switch_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch_ns, "link", "set", "br0", "up")
            for i, (ns, ip) in enumerate(zip(self.names, self.ips, strict=True)):
                host_end, switch_end = f"{self._base}h{i}", f"{self._base}s{i}"
                _ip("netns", "add", ns)
                _ip("link", "add", host_end, "type", "veth", "peer", "name", switch_end)
                _ip("link", "set", host_end, "netns", ns)
                _ip("link", "set", switch_end, "netns", self.switch_ns)
                _ip("-n", self.switch_ns, "link", "set", switch_end, "master", "br0")
                _ip("-n", self.switch_ns, "link", "set", switch_end, "up")
                _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", host_end)
                _ip("-n", ns, "link", "set", host_end, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.remove()

    def remove(self) -> None:
        """Delete every namespace (each takes its ends of the veth pairs with it)."""
        for ns in [*self.names, self.switch_ns]:
            subprocess.run([IP, "netns", "del", ns], capture_output=True, timeout=30)

    def on(self, host: int, args: Sequence[str]) -> list[str]:
        """``args`` as a command run on host ``host``: in its network namespace, and in a
        UTS namespace of its own named ``host<i>``, so a process there does not take a
        process on another host for one on its own (a shared hostname would)."""
        script = 'hostname "$0" && exec "$@"'
        return [IP, "netns", "exec", self.names[host], "unshare", "--uts", "sh", "-c", script,
                f"host{host}", *args]  # fmt: skip


PYTHON = sys.executable

__all__ = ["IP", "PYTHON", "Hosts", "TwoHosts", "netns_available"]
