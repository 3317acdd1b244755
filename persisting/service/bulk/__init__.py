"""The data path: every value moves on connections made for bytes, never in a Pulsing
message.

Sessions, pins, placement and errors stay on the control path (Pulsing, with its
passphrase); ``hello`` hands each session a credential for this path, and a data
connection that does not present one is closed before it is sent a byte.

* :mod:`.frames` -- the one stream protocol: frames, payloads, checksums, the requests,
  and the one codec of them (no I/O: each side's loop drives it);
* :mod:`.stream` -- a connection's non-blocking socket steps, the server's and the
  client's alike;
* :mod:`.tls` -- the per-server certificate clients pin, TLS 1.3 contexts;
* :mod:`.conn` -- one connection on the server's side, every wait bounded by a deadline;
* :mod:`.requests` -- the gets and puts the server answers;
* :mod:`.server` -- the listeners (TCP, Unix socket), admission, caps.

The client's side is :mod:`persisting.service.client.link`.
"""
