"""Mutual TLS on tls+tcp:// sockets, with real nng sockets on loopback and certificates made by
`speclanes certs make`: lanes holding the pipeline's certificates talk; a peer without one (no
certificate, one from another CA, plain tcp) gets no pipe and no answer, whichever side it is on."""

from __future__ import annotations

import stat
import threading
from pathlib import Path

import pynng
import pytest
from cryptography import x509

from pipeline.protocol.client import Client, PipelineError
from pipeline.protocol.config import Tls
from pipeline.protocol.messages import ErrorReply, StatusQuery, encode
from pipeline.protocol.tls import TlsError, check_files, socket_options
from pipeline.protocol.transport import dial, listen
from pipeline.service.certs import CertError, host_files, make

from .pipeline_harness import free_port

WAIT_MS = 1000  # a handshake on loopback takes milliseconds; a refused peer never gets a pipe


def tls_for(directory: Path, host: str) -> Tls:
    cert, key = host_files(directory, host)
    return Tls(ca_file=str(directory / "ca.pem"), cert_file=str(cert), key_file=str(key))


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tls") / "certs"
    make(directory, ["127.0.0.1", "127.0.0.2"])
    return directory


@pytest.fixture(scope="module")
def theirs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another pipeline's CA, with a certificate for the very same host."""
    directory = tmp_path_factory.mktemp("tls") / "other"
    make(directory, ["127.0.0.1"])
    return directory


def url() -> str:
    return f"tls+tcp://127.0.0.1:{free_port()}"


def delivered(listener: pynng.Socket, dialer: pynng.Socket) -> bool:
    """Whether a message sent by the dialer arrives at the listener within WAIT_MS."""
    dialer.send_timeout = listener.recv_timeout = WAIT_MS
    try:
        dialer.send(b"hello")
        return listener.recv() == b"hello"
    except pynng.Timeout:
        assert not listener.pipes  # nothing got through the handshake either
        return False


# --- making the certificates -----------------------------------------------------------


def test_certs_make_writes_a_private_ca_and_one_key_pair_per_host(ours):
    assert stat.S_IMODE(ours.stat().st_mode) == 0o700
    assert stat.S_IMODE((ours / "ca.key").stat().st_mode) == 0o600
    ca = x509.load_pem_x509_certificate((ours / "ca.pem").read_bytes())
    for host in ("127.0.0.1", "127.0.0.2"):
        cert_path, key_path = host_files(ours, host)
        assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        cert.verify_directly_issued_by(ca)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == [host]
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {u._name for u in usage} == {"serverAuth", "clientAuth"}  # every lane listens and dials
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_certs_make_again_keeps_the_ca_and_adds_a_host(tmp_path):
    make(tmp_path / "c", ["a.example"])
    before = (tmp_path / "c" / "ca.pem").read_bytes()
    written = make(tmp_path / "c", ["b.example"])
    assert (tmp_path / "c" / "ca.pem").read_bytes() == before
    assert written == [tmp_path / "c" / "ca.pem", *host_files(tmp_path / "c", "b.example")]
    ca = x509.load_pem_x509_certificate(before)
    cert = x509.load_pem_x509_certificate(host_files(tmp_path / "c", "b.example")[0].read_bytes())
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["b.example"]


@pytest.mark.parametrize(
    ("hosts", "days", "problem"),
    [
        ([], 10, "at least one host"),
        (["a/b"], 10, "not a host"),
        ([" "], 10, "not a host"),
        (["a"], 0, "--days"),
    ],
)
def test_certs_make_refuses_bad_input(tmp_path, hosts, days, problem):
    with pytest.raises(CertError, match=problem):
        make(tmp_path / "c", hosts, days)


def test_certs_make_refuses_half_a_ca(tmp_path):
    make(tmp_path / "c", ["a"])
    (tmp_path / "c" / "ca.key").unlink()
    with pytest.raises(CertError, match=r"only one of ca.pem and ca.key"):
        make(tmp_path / "c", ["b"])


def test_the_cli_makes_certificates(tmp_path, capsys):
    from pipeline.cli import main

    assert main(["certs", "make", str(tmp_path / "c"), "--hosts", "h1.example,10.0.0.2"]) == 0
    assert {p.name for p in (tmp_path / "c").iterdir()} == {
        "ca.pem", "ca.key", "h1.example.pem", "h1.example.key", "10.0.0.2.pem", "10.0.0.2.key",
    }  # fmt: skip
    assert "ca.key stays here" in capsys.readouterr().out


# --- the sockets -----------------------------------------------------------------------


def test_lanes_with_the_pipelines_certificates_talk_over_tls(ours):
    address = url()
    with (
        listen(pynng.Pull0, address, tls_for(ours, "127.0.0.1")) as inbox,
        dial(pynng.Push0, address, tls_for(ours, "127.0.0.2")) as outbox,
    ):
        assert delivered(inbox, outbox)


def _client_config(ca: Path, cert_dir: Path | None, host: str = "127.0.0.1") -> pynng.TLSConfig:
    """A dialer that trusts `ca` and shows the certificate of `cert_dir` (None: no certificate)."""
    own = {}
    if cert_dir is not None:
        cert, key = host_files(cert_dir, host)
        own = {"own_cert_string": cert.read_text(), "own_key_string": key.read_text()}
    return pynng.TLSConfig(
        pynng.TLSConfig.MODE_CLIENT, server_name=host, ca_string=(ca / "ca.pem").read_text(),
        auth_mode=pynng.TLSConfig.AUTH_MODE_REQUIRED, **own,
    )  # fmt: skip


@pytest.mark.parametrize("peer", ["no certificate", "another CA's certificate", "plain tcp"])
def test_a_lanes_listener_refuses_a_peer_that_is_not_a_lane(ours, theirs, peer):
    """The peer trusts our CA (it could check our listener), but cannot show a certificate it signed."""
    address = url()
    if peer == "plain tcp":
        intruder = pynng.Push0()
        target = address.replace("tls+tcp://", "tcp://")
    else:
        intruder = pynng.Push0(tls_config=_client_config(ours, None if peer == "no certificate" else theirs))
        target = address
    with listen(pynng.Pull0, address, tls_for(ours, "127.0.0.1")) as inbox, intruder:
        intruder.dial(target, block=False)
        assert not delivered(inbox, intruder)
        # The control: the same listener takes a lane at once.
        with dial(pynng.Push0, address, tls_for(ours, "127.0.0.2")) as lane:
            assert delivered(inbox, lane)


@pytest.mark.parametrize("listener", ["another CA", "a certificate for another host"])
def test_a_lanes_dialer_refuses_a_listener_that_is_not_the_lane_it_dialed(ours, theirs, listener):
    address = url()  # 127.0.0.1
    impostor = tls_for(theirs, "127.0.0.1") if listener == "another CA" else tls_for(ours, "127.0.0.2")
    with (
        listen(pynng.Pull0, address, impostor) as inbox,
        dial(pynng.Push0, address, tls_for(ours, "127.0.0.1")) as lane,
    ):
        assert not delivered(inbox, lane)


def test_a_client_without_the_pipelines_certificate_gets_no_answer(ours, theirs):
    """The orchestrator's client socket, reduced to a Rep socket that answers every request."""
    address = url()
    rep = listen(pynng.Rep0, address, tls_for(ours, "127.0.0.1"))
    stop = threading.Event()

    def serve() -> None:
        rep.recv_timeout = 100
        while not stop.is_set():
            try:
                rep.recv()
                rep.send(encode(ErrorReply(kind="reached", message="an answer")))
            except pynng.Timeout:
                continue

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with pynng.Req0(tls_config=_client_config(ours, None), recv_timeout=WAIT_MS) as anonymous:
            anonymous.dial(address, block=False)
            anonymous.send_timeout = WAIT_MS
            with pytest.raises(pynng.Timeout):  # no status report: the request never reaches the socket
                anonymous.send(encode(StatusQuery()))
                anonymous.recv()
        with (
            pytest.raises(PipelineError) as caught,
            Client(address, WAIT_MS / 1000, tls_for(theirs, "127.0.0.1")) as c,
        ):
            c.status()
        assert caught.value.kind == "unavailable"
        with pytest.raises(TlsError, match=r"needs tls.ca_file"):  # ours does not even try without files
            Client(address).status()
        with pytest.raises(PipelineError) as caught, Client(address, 5, tls_for(ours, "127.0.0.2")) as c:
            c.status()
        assert caught.value.kind == "reached"  # the control: a lane's certificate gets the answer
    finally:
        stop.set()
        thread.join()
        rep.close()


# --- the files -------------------------------------------------------------------------


def test_a_tls_address_without_usable_files_fails_in_one_line(ours, tmp_path):
    with pytest.raises(TlsError, match=r"needs tls.ca_file, tls.cert_file and tls.key_file"):
        socket_options("tls+tcp://127.0.0.1:1", None, server=True)
    missing = Tls(ca_file=str(tmp_path / "ca.pem"), cert_file="c", key_file="k")
    with pytest.raises(TlsError, match=r"cannot read tls.ca_file .*ca.pem: No such file"):
        socket_options("tls+tcp://127.0.0.1:1", missing, server=False)
    good = tls_for(ours, "127.0.0.1")
    open_key = tmp_path / "open.key"
    open_key.write_bytes(Path(good.key_file).read_bytes())
    open_key.chmod(0o644)
    with pytest.raises(TlsError, match=r"open to other users .*644.*chmod 600"):
        socket_options(
            "tls+tcp://127.0.0.1:1",
            Tls(ca_file=good.ca_file, cert_file=good.cert_file, key_file=str(open_key)),
            server=True,
        )
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(TlsError, match="cannot be used"):
        socket_options(
            "tls+tcp://127.0.0.1:1",
            Tls(ca_file=str(garbage), cert_file=good.cert_file, key_file=good.key_file),
            server=True,
        )


def test_only_tls_addresses_get_a_tls_configuration(ours):
    good = tls_for(ours, "127.0.0.1")
    assert socket_options("ipc:///tmp/x.ipc", good, server=True) == {}
    assert socket_options("tcp://127.0.0.1:1", good, server=False) == {}
    assert set(socket_options("tls+tcp://127.0.0.1:1", good, server=False)) == {"tls_config"}


def test_start_checks_the_files_before_any_lane_runs(ours, tmp_path):
    from pipeline.protocol.config import load_config

    good = tls_for(ours, "127.0.0.1")
    settings = [
        "addresses.verify=tls+tcp://127.0.0.1:7001",
        f"tls.ca_file={good.ca_file}",
        f"tls.cert_file={good.cert_file}",
    ]
    check_files(load_config(None, [*settings, f"tls.key_file={good.key_file}"], environ={}))
    with pytest.raises(TlsError, match=r"cannot read tls.key_file"):
        check_files(load_config(None, [*settings, f"tls.key_file={tmp_path}/absent.key"], environ={}))
    check_files(load_config(None, [], environ={}))  # ipc only: nothing to check


def test_the_cli_refuses_to_connect_over_plain_tcp_off_loopback(capsys):
    from pipeline.cli import main

    assert main(["status", "--connect", "tcp://10.0.0.2:7100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("speclanes: error: --connect = 'tcp://10.0.0.2:7100' is plain tcp://")
    assert err.count("\n") == 1
