"""pynng TLS settings for a socket on a `tls+tcp://` address, from the [tls] files.

Both ends authenticate (auth_mode required): a listener asks every dialer for a certificate
signed by the pipeline's CA, and a dialer checks the listener's certificate against the same
CA and against the host it dialed (the certificate must name it: nng with Mbed TLS 3.6 checks
nothing unless the server name is set, so it is set from the address). A peer without such a
certificate fails the handshake and never gets a pipe, so no message of its is received.
Measured with pynng 0.9 / nng 1.11 / Mbed TLS 3.6.3: no certificate, one from another CA,
and a listener whose certificate names another host are all refused (tests/test_tls.py).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pynng

from pipeline.protocol import address
from pipeline.protocol.config import Config, Tls


class TlsError(ValueError):
    """The [tls] files are missing, unreadable, open to others, or not what nng can use."""


def _read(setting: str, path: str, private: bool = False) -> str:
    try:
        if private and (mode := stat.S_IMODE(os.stat(path).st_mode)) & 0o077:
            raise TlsError(f"tls.{setting} {path} is open to other users (mode {mode:o}): chmod 600 it")
        return Path(path).read_text()
    except OSError as exc:
        raise TlsError(f"cannot read tls.{setting} {path}: {exc.strerror}") from None


def tls_config(tls: Tls | None, url: str, *, server: bool) -> pynng.TLSConfig:
    """The TLS configuration of one socket: server mode for a listener, client mode (checking
    that the peer's certificate names the host in `url`) for a dialer."""
    if tls is None or not tls.configured():
        raise TlsError(f"{url} needs tls.ca_file, tls.cert_file and tls.key_file")
    ca, cert = _read("ca_file", tls.ca_file), _read("cert_file", tls.cert_file)
    key = _read("key_file", tls.key_file, private=True)
    mode = pynng.TLSConfig.MODE_SERVER if server else pynng.TLSConfig.MODE_CLIENT
    try:
        return pynng.TLSConfig(
            mode,
            server_name=None if server else address.host(url),
            ca_string=ca,
            own_cert_string=cert,
            own_key_string=key,
            auth_mode=pynng.TLSConfig.AUTH_MODE_REQUIRED,
        )
    except pynng.NNGException as exc:
        raise TlsError(f"the [tls] files cannot be used ({tls.ca_file}, {tls.cert_file}): {exc}") from None


def socket_options(url: str, tls: Tls | None, *, server: bool) -> dict[str, pynng.TLSConfig]:
    """Keyword arguments for a pynng socket that will listen on (`server`) or dial `url`:
    its TLS configuration for tls+tcp://, nothing for any other address."""
    return {"tls_config": tls_config(tls, url, server=server)} if address.is_tls(url) else {}


def check_files(config: Config) -> None:
    """Fail now, in one line, if this configuration's TLS sockets could not be made: before a
    supervisor starts lanes that would fail on them one restart after another."""
    urls = (getattr(config.addresses, name) for name in config.addresses.__struct_fields__)
    if (first := next((url for url in urls if address.is_tls(url)), None)) is not None:
        tls_config(config.tls, first, server=True)
