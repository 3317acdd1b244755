"""The data path's TLS: a certificate made per server, and clients that trust that one only
(real handshakes over a socket pair)."""

from __future__ import annotations

import socket
import ssl
import threading

import pytest

from persisting.errors import ProtocolError
from persisting.service.bulk.tls import ServerIdentity, check_pinned, client_context


def _serve_once(identity: ServerIdentity, sock: socket.socket, reply: bytes) -> threading.Thread:
    def run() -> None:
        try:
            with identity.context.wrap_socket(sock, server_side=True) as tls:
                tls.sendall(reply)
                tls.recv(1)
        except (ssl.SSLError, OSError):
            pass  # the client refused us

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_client_pinned_to_a_servers_certificate_speaks_tls_13_with_it() -> None:
    identity = ServerIdentity.generate()
    left, right = socket.socketpair()
    server = _serve_once(identity, right, b"hello")
    with client_context(identity.cert_pem).wrap_socket(left) as tls:
        check_pinned(tls, identity.cert_pem)
        assert tls.version() == "TLSv1.3"
        assert tls.recv(5) == b"hello"
        tls.sendall(b"x")
    server.join(10)


def test_a_client_refuses_any_other_certificate_even_another_persisting_servers() -> None:
    pinned, other = ServerIdentity.generate(), ServerIdentity.generate()
    assert pinned.cert_pem != other.cert_pem  # made per server
    left, right = socket.socketpair()
    server = _serve_once(other, right, b"secret")
    with pytest.raises(ssl.SSLCertVerificationError):
        client_context(pinned.cert_pem).wrap_socket(left)
    left.close()
    server.join(10)
    with pytest.raises(ProtocolError, match="pinned"):  # and the exact bytes are compared
        left2, right2 = socket.socketpair()
        server = _serve_once(other, right2, b"x")
        loose = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        loose.check_hostname = False
        loose.verify_mode = ssl.CERT_NONE
        with loose.wrap_socket(left2) as tls:
            check_pinned(tls, pinned.cert_pem)
    server.join(10)


def test_the_server_speaks_nothing_older_than_tls_13() -> None:
    identity = ServerIdentity.generate()
    left, right = socket.socketpair()
    server = _serve_once(identity, right, b"x")
    old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    old.load_verify_locations(cadata=identity.cert_pem)
    old.check_hostname = False
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    with pytest.raises(ssl.SSLError):
        old.wrap_socket(left)
    left.close()
    server.join(10)
