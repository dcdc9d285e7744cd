"""Which nng addresses the pipeline accepts, and why: the rule behind "only lanes reach a lane".

- `ipc://PATH`: a socket file in the run directory, which is 0700 and the user's alone, so
  only the user's own processes can connect (filesystem permissions).
- `tls+tcp://HOST:PORT`: nng's TLS transport with mutual authentication. Both ends show a
  certificate signed by the pipeline's own CA ([tls]); a peer without one never completes
  the handshake, so no message of its reaches a socket.
- `tcp://HOST:PORT`: no authentication at all, so only on loopback (127.0.0.0/8, ::1,
  localhost), where the peer is at least on this machine, unless `tls.insecure_tcp` says
  the network is trusted some other way.

Nothing else (ws://, inproc://, ...) is a pipeline address.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

LOCAL_SCHEMES = frozenset({"ipc"})
PLAIN_SCHEMES = frozenset({"tcp", "tcp4", "tcp6"})
TLS_SCHEMES = frozenset({"tls+tcp", "tls+tcp4", "tls+tcp6"})


def scheme(address: str) -> str:
    return address.partition("://")[0].lower()


def is_tls(address: str) -> bool:
    return scheme(address) in TLS_SCHEMES


def host(address: str) -> str:
    """The host part of a tcp-like address ("" when it binds every interface: tcp://:PORT)."""
    try:
        return urlsplit(address).hostname or ""
    except ValueError:  # an unbalanced [ in the host
        return ""


def is_loopback(name: str) -> bool:
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check(setting: str, address: str, *, tls_files: bool, insecure_tcp: bool) -> None:
    """Raise ValueError, in one line naming `setting`, for an address the pipeline must not use."""
    kind = scheme(address)
    if kind in LOCAL_SCHEMES or (not address and setting.startswith("listen.")):
        return
    if kind in TLS_SCHEMES:
        if not tls_files:
            raise ValueError(
                f"{setting} = {address!r} needs tls.ca_file, tls.cert_file and tls.key_file "
                "(make them with `speclanes certs make`)"
            )
        return
    if kind in PLAIN_SCHEMES:
        if not (insecure_tcp or is_loopback(host(address))):
            raise ValueError(
                f"{setting} = {address!r} is plain tcp:// off loopback, which anyone on the network "
                "could reach: use tls+tcp:// with [tls] certificates, or set tls.insecure_tcp = true"
            )
        return
    raise ValueError(f"{setting} = {address!r}: use ipc://, tls+tcp:// or (loopback only) tcp://")
