"""`hf-fedtask flower credentials`: the CA and the SuperLink certificate form a chain a TLS client
accepts for every name given (and no other), the SuperNode keys are OpenSSH P-384 pairs flwr loads,
private keys are 0600, and a non-empty folder is refused with nothing changed."""

from __future__ import annotations

import ipaddress
import os
import socket
import ssl
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_pem_private_key, load_ssh_private_key, load_ssh_public_key
from cryptography.x509.oid import ExtendedKeyUsageOID
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from hf_fedtask.cli import main
from hf_fedtask.engine.flower import credentials
from hf_fedtask.engine.flower.credentials import write_credentials
from hf_fedtask.errors import ConfigError

HOSTS = ["superlink.example.org", "10.0.0.5", "[2001:db8::7]"]


@pytest.fixture(scope="module")
def creds(tmp_path_factory):
    return write_credentials(tmp_path_factory.mktemp("c") / "creds", 2, HOSTS, days=30)


def _certs(creds):
    return (x509.load_pem_x509_certificate(creds.ca_cert.read_bytes()),
            x509.load_pem_x509_certificate(creds.superlink_cert.read_bytes()))


def test_the_superlink_certificate_verifies_against_the_ca_for_each_name_and_no_other(creds):
    ca, leaf = _certs(creds)
    leaf.verify_directly_issued_by(ca)
    store = Store([ca])
    names = [x509.DNSName("superlink.example.org"), x509.IPAddress(ipaddress.ip_address("10.0.0.5")),
             x509.IPAddress(ipaddress.ip_address("2001:db8::7")), x509.DNSName("localhost"),
             x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.IPAddress(ipaddress.ip_address("::1"))]
    for name in names:  # a TLS server validation: chain, validity, key usage, names
        PolicyBuilder().store(store).build_server_verifier(name).verify(leaf, [])
    with pytest.raises(VerificationError):
        PolicyBuilder().store(store).build_server_verifier(x509.DNSName("other.example.org")).verify(leaf, [])
    other_ca, _ = _certs(write_credentials(creds.folder.parent / "other", 1))
    with pytest.raises(VerificationError):
        PolicyBuilder().store(Store([other_ca])).build_server_verifier(names[0]).verify(leaf, [])


def test_names_key_usage_and_validity_are_as_given(creds):
    ca, leaf = _certs(creds)
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["superlink.example.org", "localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address(a) for a in ("10.0.0.5", "2001:db8::7",
                                                                                          "127.0.0.1", "::1")]
    assert leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    usage = leaf.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.digital_signature and not usage.key_cert_sign
    assert list(leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert ca.extensions.get_extension_for_class(x509.KeyUsage).value.key_cert_sign
    assert ca.subject == ca.issuer == leaf.issuer
    days = (leaf.not_valid_after_utc - leaf.not_valid_before_utc).total_seconds() / 86400
    assert 30 < days < 30.01
    link_key = load_pem_private_key(creds.superlink_key.read_bytes(), None)
    assert link_key.public_key().public_numbers() == leaf.public_key().public_numbers()


def test_python_tls_completes_a_handshake_with_the_certificate(creds):
    """What the SuperLink (uvicorn) and its clients (httpx) do: ssl contexts from these files."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(creds.superlink_cert, creds.superlink_key)
    client = ssl.create_default_context(cafile=str(creds.ca_cert))
    for host in ("127.0.0.1", "superlink.example.org"):
        a, b = socket.socketpair()
        with a, b:
            done = threading.Thread(target=lambda: server.wrap_socket(a, server_side=True).close())
            done.start()
            with client.wrap_socket(b, server_hostname=host) as tls:
                assert tls.version() in ("TLSv1.2", "TLSv1.3")
            done.join(timeout=10)
    a, b = socket.socketpair()
    with a, b:
        threading.Thread(target=lambda: _quietly(server.wrap_socket, a, server_side=True), daemon=True).start()
        with pytest.raises(ssl.SSLCertVerificationError):
            client.wrap_socket(b, server_hostname="elsewhere.example.org")


def _quietly(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs).close()
    except (ssl.SSLError, OSError):
        pass


def test_node_keys_are_openssh_p384_pairs_flwr_accepts(creds):
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.supercore.primitives.asymmetric import public_key_to_bytes

    for k in range(2):
        assert creds.node_key(k).read_bytes().startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----")
        private = load_ssh_private_key(creds.node_key(k).read_bytes(), None)  # as flower-supernode loads it
        public = load_ssh_public_key(creds.node_pub(k).read_bytes())
        assert isinstance(private, ec.EllipticCurvePrivateKey) and isinstance(private.curve, ec.SECP384R1)
        assert public.public_numbers() == private.public_key().public_numbers()
        assert creds.node_pub(k).read_text().startswith("ecdsa-sha2-nistp384 ")
        # `flwr supernode register` reads the .pub into the bytes the SuperLink matches the node's own against
        assert try_load_public_key(creds.node_pub(k)) == public_key_to_bytes(private.public_key())
    assert load_ssh_public_key(creds.node_pub(0).read_bytes()) != load_ssh_public_key(creds.node_pub(1).read_bytes())


def test_private_keys_are_0600_and_the_folder_0700(creds):
    def mode(p):
        return stat.S_IMODE(p.stat().st_mode)

    for p in (creds.ca_key, creds.superlink_key, creds.node_key(0), creds.node_key(1)):
        assert mode(p) == 0o600, p.name
    for p in (creds.ca_cert, creds.superlink_cert, creds.node_pub(0)):
        assert mode(p) & 0o022 == 0 and mode(p) & 0o444 == 0o444, p.name
    assert mode(creds.folder) == 0o700
    assert sorted(p.name for p in creds.folder.iterdir()) == [
        "ca.crt", "ca.key", "superlink.crt", "superlink.key", "supernode-0.key", "supernode-0.pub",
        "supernode-1.key", "supernode-1.pub"]


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def test_the_cli_writes_the_folder_and_refuses_a_non_empty_one_with_nothing_changed(tmp_path, capsys):
    folder = tmp_path / "creds"
    assert main(["flower", "credentials", str(folder), "--nodes", "2", "--host", "10.1.2.3"]) == 0
    out = capsys.readouterr().out
    assert "SuperLink machine:" in out and f"{folder / 'superlink.key'}" in out
    assert "SuperNode 1 machine:" in out and f"{folder / 'supernode-1.key'}" in out
    assert "kept offline" in out and str(folder / "ca.key") in out
    before = _snapshot(folder)
    assert main(["flower", "credentials", str(folder), "--nodes", "3"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (f"hf-fedtask: error: credentials folder {str(folder)!r} is not empty; pass --overwrite to replace "
                    "its credentials (the SuperLink and every SuperNode then need the new files)")
    assert _snapshot(folder) == before
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert main(["flower", "credentials", str(tmp_path / "other"), "--nodes", "1"]) == 2
    assert [p.name for p in (tmp_path / "other").iterdir()] == ["notes.txt"]


def test_overwrite_replaces_every_credential_and_drops_stale_node_keys(tmp_path):
    folder = tmp_path / "creds"
    write_credentials(folder, 3)
    (folder / "notes.txt").write_text("mine")
    before = _snapshot(folder)
    write_credentials(folder, 2, overwrite=True)
    after = _snapshot(folder)
    assert sorted(after) == ["ca.crt", "ca.key", "notes.txt", "superlink.crt", "superlink.key", "supernode-0.key",
                             "supernode-0.pub", "supernode-1.key", "supernode-1.pub"]
    assert after["notes.txt"] == before["notes.txt"]
    assert all(after[name][0] != before[name][0] for name in after if name != "notes.txt")
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temporary file left


@pytest.mark.parametrize("argv,message", [
    (["--nodes", "0"], "--nodes 0: expected a positive number of SuperNodes"),
    (["--nodes", "1", "--days", "0"], "--days 0: expected a positive number of days"),
    (["--nodes", "1", "--host", "bad host"], "--host 'bad host': not a host name or an IP address"),
    (["--nodes", "1", "--host", "x..org"], "--host 'x..org': not a host name or an IP address"),
])
def test_bad_flags_are_one_line_and_write_nothing(argv, message, tmp_path, capsys):
    assert main(["flower", "credentials", str(tmp_path / "creds"), *argv]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"hf-fedtask: error: {message}")
    assert not (tmp_path / "creds").exists()


def test_a_failure_while_writing_leaves_no_folder_and_no_half_written_file(tmp_path, monkeypatch):
    real, calls = credentials._write_file, []

    def failing(path, data, mode):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("disk full")
        real(path, data, mode)

    monkeypatch.setattr(credentials, "_write_file", failing)
    with pytest.raises(OSError, match="disk full"):
        write_credentials(tmp_path / "creds", 2)
    assert len(calls) == 3 and list(tmp_path.iterdir()) == []


def test_the_module_loads_neither_torch_nor_flwr():
    code = ("import sys, hf_fedtask.engine.flower.credentials as c; "
            "assert not {'torch', 'flwr', 'transformers'} & set(sys.modules), sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ})


def test_hosts_are_checked_and_normalized():
    assert credentials.subject_alt_names(["[::1]", "LocalHost", "10.0.0.5", "10.0.0.5"]) == (
        "::1", "localhost", "10.0.0.5", "127.0.0.1")
    with pytest.raises(ConfigError, match="--host 'a_b.org'"):
        credentials.subject_alt_names(["a_b.org"])
