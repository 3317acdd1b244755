"""TLS 1.3 for data connections: a certificate made per server, pinned by its clients.

A server makes a fresh key pair and a self-signed certificate when it starts
(:meth:`ServerIdentity.generate`, with the ``cryptography`` package); the private key
never leaves the process (written to a private file only for ``load_cert_chain`` and
removed at once). ``hello`` hands the certificate to each client over the control path,
which Pulsing's passphrase protects, and the client trusts that certificate and nothing
else (:func:`client_context`, and the exact bytes are compared after the handshake): no
certificate authority and no host name enter into it. Who may use a connection is still
the session's credential, sent as the first frame inside the encrypted stream.
"""

from __future__ import annotations

import datetime
import functools
import os
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path

from persisting.errors import ProtocolError

#: How long a server's certificate is valid (a server lives far shorter; clocks may skew).
VALIDITY = datetime.timedelta(days=3650)


@dataclass(frozen=True)
class ServerIdentity:
    """A server's certificate (PEM, what clients pin) and the context that serves it."""

    cert_pem: str
    context: ssl.SSLContext

    @classmethod
    def generate(cls) -> ServerIdentity:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "persisting data path")])
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        cert_pem = cert.public_bytes(serialization.Encoding.PEM).decode()
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        with tempfile.TemporaryDirectory(prefix="persisting-tls-") as private:  # mode 0700
            cert_file, key_file = Path(private) / "cert.pem", Path(private) / "key.pem"
            cert_file.write_text(cert_pem)
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(key_pem)
            context.load_cert_chain(cert_file, key_file)
        return cls(cert_pem, context)


@functools.lru_cache(maxsize=64)
def client_context(cert_pem: str) -> ssl.SSLContext:
    """A TLS 1.3 client context that trusts ``cert_pem`` (a server's own certificate) only."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False  # the pinned certificate names the server, not a host
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=cert_pem)
    return context


def check_pinned(sock: ssl.SSLSocket, cert_pem: str) -> None:
    """ProtocolError unless the peer showed exactly the pinned certificate."""
    if sock.getpeercert(binary_form=True) != ssl.PEM_cert_to_DER_cert(cert_pem):
        raise ProtocolError("the data path's server showed a certificate other than the pinned one")


__all__ = ["ServerIdentity", "check_pinned", "client_context"]
