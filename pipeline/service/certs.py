"""`speclanes certs make DIR --hosts a,b`: the pipeline's own certificate authority and one
certificate per host, for mutual TLS between lanes on `tls+tcp://` addresses.

The CA is private to one pipeline: a peer is a lane exactly when it holds a key whose
certificate this CA signed, so nothing else (a public CA, the system store) is ever trusted.
Each host's certificate names the host (a DNS name or an IP address, as peers dial it) and is
good both for serving and for dialing, since every lane does both.

Made with the `cryptography` package rather than the `openssl` command: it is a wheel that
installs anywhere pip does, the files come out the same on every machine, and the keys are
written 0600 from the start instead of fixed afterwards. Running the command again in the same
directory keeps the CA and signs the hosts given (new or renewed), so a host can be added
without re-issuing the others.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

CA_CERT, CA_KEY = "ca.pem", "ca.key"
DEFAULT_DAYS = 825


class CertError(ValueError):
    pass


def host_files(directory: Path, host: str) -> tuple[Path, Path]:
    """Where `make` puts a host's certificate and key: what its [tls] cert_file and key_file name."""
    return directory / f"{host}.pem", directory / f"{host}.key"


def _write(path: Path, data: bytes, mode: int) -> None:
    """Written under a temporary name with its final mode, then renamed: a key is never readable
    by others, not even for a moment, and a crash leaves no half-written file."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _san(host: str) -> x509.GeneralName:
    from cryptography import x509

    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _sign(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    days: int,
) -> x509.Certificate:
    """A CA certificate when `issuer` is None (self-signed), else a host's, signed by the CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now, is_ca = datetime.datetime.now(datetime.UTC), issuer is None
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name if is_ca else issuer[0].subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate clocks a little apart
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=0 if is_ca else None), True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
    )
    if issuer is None:  # the CA: signs host certificates, nothing else
        usage = dict.fromkeys(("key_cert_sign", "crl_sign"), True)
        return builder.add_extension(_key_usage(**usage), True).sign(key, hashes.SHA256())
    builder = builder.add_extension(x509.SubjectAlternativeName([_san(subject)]), False)
    builder = builder.add_extension(_key_usage(digital_signature=True), True)
    usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]  # lanes listen and dial
    builder = builder.add_extension(x509.ExtendedKeyUsage(usages), False)
    return builder.sign(issuer[1], hashes.SHA256())


def _key_usage(**flags: bool) -> x509.KeyUsage:
    from cryptography import x509

    names = ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment")
    names += ("key_agreement", "key_cert_sign", "crl_sign", "encipher_only", "decipher_only")
    return x509.KeyUsage(**{name: flags.get(name, False) for name in names})


def _new_key() -> ec.EllipticCurvePrivateKey:
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _load_or_make_ca(directory: Path, days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    if cert_path.exists() != key_path.exists():
        raise CertError(f"{directory} has only one of {CA_CERT} and {CA_KEY}: remove it or restore the other")
    if cert_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise CertError(f"{key_path} is not an EC key made by `speclanes certs make`")
        return x509.load_pem_x509_certificate(cert_path.read_bytes()), key
    key = _new_key()
    cert = _sign(f"speclanes CA {directory.resolve().name}", key, None, days)
    _write(key_path, _key_pem(key), 0o600)
    _write(cert_path, _cert_pem(cert), 0o644)
    return cert, key


def check_host(host: str) -> str:
    host = host.strip()
    if not host or "/" in host or host.startswith(".") or any(c.isspace() for c in host):
        raise CertError(f"not a host name or IP address: {host!r}")
    return host


def make(directory: Path, hosts: Sequence[str], days: int = DEFAULT_DAYS) -> list[Path]:
    """The CA (kept if `directory` has one) and a certificate and key per host; the files written."""
    names = [check_host(h) for h in hosts]
    if not names:
        raise CertError("name at least one host (--hosts a,b)")
    if days < 1:
        raise CertError(f"--days must be >= 1, got {days}")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    ca = _load_or_make_ca(directory, days)
    written = [directory / CA_CERT]
    for host in names:
        key = _new_key()
        cert_path, key_path = host_files(directory, host)
        _write(key_path, _key_pem(key), 0o600)
        _write(cert_path, _cert_pem(_sign(host, key, ca, days)), 0o644)
        written += [cert_path, key_path]
    return written
