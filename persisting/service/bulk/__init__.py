"""The bulk data path: values of clients on other hosts move on TCP connections made for
bytes, not in Pulsing actor messages.

Sessions, leases, placement and errors stay on the control path (Pulsing, with its
passphrase); ``hello`` hands each session a credential for this path, and a data
connection that cannot prove it holds one is closed before it is sent a single byte.

* :mod:`.auth` -- the per-session credential and the connection handshake (HMAC over a
  counter that is never accepted twice);
* :mod:`.stream` -- one connection's bytes: header frames, payloads received straight into
  their destination and hashed as they land, payloads sent from the server's memory tier or
  (``sendfile``) from a payload file; optionally sealed (AES-GCM records);
* :mod:`.server` -- the listener, its caps, and the get and put requests it answers;
* :mod:`.client` -- a client's connections to one member, and its gets and puts over them.
"""
