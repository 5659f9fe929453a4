"""Credentials for a secured Flower deployment: TLS and SuperNode authentication.

`hf-fedtask flower credentials DIR --nodes N` writes, with the `cryptography` library (no hand-rolled
crypto), what Flower's guides make with openssl and ssh-keygen
(https://flower.ai/docs/framework/how-to-enable-tls-connections.html,
https://flower.ai/docs/framework/how-to-authenticate-supernodes.html):

    ca.crt, ca.key                  a CA (self-signed, P-384): the operator keeps ca.key offline
    superlink.crt, superlink.key    the SuperLink's TLS certificate, signed by the CA, with a subject
                                    alternative name for every host SuperNodes and the flwr CLI dial
    supernode-K.key, supernode-K.pub  one P-384 key pair per SuperNode, both in OpenSSH format
                                    (`flower-supernode --auth-supernode-private-key`,
                                    `flwr supernode register supernode-K.pub`)

Private keys are mode 0600. Every key and certificate is made in memory first; the files then go
to disk atomically (a new folder is renamed into place whole; files in an existing folder are each
written to a temporary name and renamed), so a failure leaves no half-written file. No torch import.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hf_fedtask.errors import ConfigError

CA_CERT, CA_KEY = "ca.crt", "ca.key"
SUPERLINK_CERT, SUPERLINK_KEY = "superlink.crt", "superlink.key"
# the SuperLink's own ServerApp process (its SuperExec) dials the SuperLink on loopback when it listens
# on 0.0.0.0 or ::, so these names are always in the certificate
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
DEFAULT_DAYS = 365
# RFC 1123 host names (ASCII labels of letters, digits and inner hyphens): checked here so that a
# typo is one line naming the flag, not an x509 error later
_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def node_key_name(k: int) -> str:
    return f"supernode-{k}.key"


def node_pub_name(k: int) -> str:
    return f"supernode-{k}.pub"


@dataclass(frozen=True)
class Credentials:
    """The files of one credentials folder."""

    folder: Path
    nodes: int
    hosts: tuple[str, ...]

    @property
    def ca_cert(self) -> Path:
        return self.folder / CA_CERT

    @property
    def ca_key(self) -> Path:
        return self.folder / CA_KEY

    @property
    def superlink_cert(self) -> Path:
        return self.folder / SUPERLINK_CERT

    @property
    def superlink_key(self) -> Path:
        return self.folder / SUPERLINK_KEY

    def node_key(self, k: int) -> Path:
        return self.folder / node_key_name(k)

    def node_pub(self, k: int) -> Path:
        return self.folder / node_pub_name(k)


def subject_alt_names(hosts: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """The SuperLink certificate's names: `hosts` (checked, brackets of IPv6 literals dropped, IP
    addresses normalized) followed by the loopback names, each once."""
    names: list[str] = []
    for host in [*(hosts or ()), *LOOPBACK_HOSTS]:
        name = host.strip()
        if name.startswith("[") and name.endswith("]"):
            name = name[1:-1]
        try:
            name = str(ipaddress.ip_address(name))
        except ValueError:
            labels = name.rstrip(".").split(".")
            if not name or len(name) > 253 or not all(_LABEL.match(label) for label in labels):
                raise ConfigError(f"--host {host!r}: not a host name or an IP address (a SuperLink certificate "
                                  "names the hosts SuperNodes dial, e.g. superlink.example.org or 10.0.0.5)") from None
            name = name.rstrip(".").lower()
        if name not in names:
            names.append(name)
    return tuple(names)


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _make(nodes: int, hosts: tuple[str, ...], days: int) -> dict[str, tuple[bytes, int]]:
    """{file name: (contents, mode)} of a credentials folder."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)  # 5 min: clock skew
    ca_key, link_key = ec.generate_private_key(ec.SECP384R1()), ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "hf-fedtask federation"),
                         x509.NameAttribute(NameOID.COMMON_NAME, "hf-fedtask federation CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
               .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(start).not_valid_after(end)
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                            content_commitment=False, key_encipherment=False,
                                            data_encipherment=False, key_agreement=False, encipher_only=False,
                                            decipher_only=False), critical=True)
               .add_extension(ca_ski, critical=False)
               .sign(ca_key, hashes.SHA384()))
    sans = [x509.IPAddress(ipaddress.ip_address(h)) if _is_ip(h) else x509.DNSName(h) for h in hosts]
    link_name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "hf-fedtask federation"),
                           x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])])
    link_cert = (x509.CertificateBuilder().subject_name(link_name).issuer_name(ca_name)
                 .public_key(link_key.public_key()).serial_number(x509.random_serial_number())
                 .not_valid_before(start).not_valid_after(end)
                 .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                 .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                              content_commitment=False, key_encipherment=False,
                                              data_encipherment=False, key_agreement=False, encipher_only=False,
                                              decipher_only=False), critical=True)
                 .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
                 .add_extension(x509.SubjectAlternativeName(sans), critical=False)
                 .add_extension(x509.SubjectKeyIdentifier.from_public_key(link_key.public_key()), critical=False)
                 .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                                critical=False)
                 .sign(ca_key, hashes.SHA384()))
    pem = serialization.Encoding.PEM
    files = {CA_KEY: (_key_pem(ca_key), 0o600), CA_CERT: (ca_cert.public_bytes(pem), 0o644),
             SUPERLINK_KEY: (_key_pem(link_key), 0o600), SUPERLINK_CERT: (link_cert.public_bytes(pem), 0o644)}
    for k in range(nodes):  # what `ssh-keygen -t ecdsa -b 384` writes, as flwr loads it (load_ssh_private_key)
        key = ec.generate_private_key(ec.SECP384R1())
        private = key.private_bytes(pem, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption())
        public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        files[node_key_name(k)] = (private, 0o600)
        files[node_pub_name(k)] = (public + f" hf-fedtask-supernode-{k}\n".encode(), 0o644)
    return files


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _write_file(path: Path, data: bytes, mode: int) -> None:
    """Write `data` to a temporary file beside `path` (created with `mode`), then rename it into place."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_credentials(folder: str | Path, nodes: int, hosts: list[str] | tuple[str, ...] | None = None, *,
                      days: int = DEFAULT_DAYS, overwrite: bool = False) -> Credentials:
    """Write a CA, a SuperLink certificate for `hosts` (plus the loopback names) and `nodes` SuperNode
    key pairs into `folder`; a `ConfigError` (nothing written) when `folder` is a non-empty folder and
    `overwrite` is False. With `overwrite`, the folder's credentials are replaced (older
    supernode-K.key/.pub beyond `nodes` removed); other files are left alone."""
    folder = Path(folder).expanduser()
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ConfigError(f"--nodes {nodes!r}: expected a positive number of SuperNodes")
    if isinstance(days, bool) or not isinstance(days, int) or days < 1:
        raise ConfigError(f"--days {days!r}: expected a positive number of days")
    names = subject_alt_names(hosts)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"credentials folder {str(folder)!r} is a file")
    if folder.is_dir() and any(folder.iterdir()) and not overwrite:
        raise ConfigError(f"credentials folder {str(folder)!r} is not empty; pass --overwrite to replace "
                          "its credentials (the SuperLink and every SuperNode then need the new files)")
    files = _make(nodes, names, days)
    if not folder.exists():  # a new folder appears whole, or not at all
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        try:
            for name, (data, mode) in files.items():
                _write_file(staging / name, data, mode)
            staging.chmod(0o700)
            os.rename(staging, folder)
        except BaseException:
            for p in staging.glob("*"):
                p.unlink()
            staging.rmdir()
            raise
    else:
        for name, (data, mode) in files.items():
            _write_file(folder / name, data, mode)
        stale = re.compile(r"^supernode-(\d+)\.(key|pub)$")
        for p in folder.iterdir():
            if (m := stale.match(p.name)) and int(m.group(1)) >= nodes:
                p.unlink()
    return Credentials(folder, nodes, names)


def placement(creds: Credentials) -> str:
    """Which file goes to which machine, as `hf-fedtask flower credentials` prints it."""
    d = creds.folder
    last = creds.nodes - 1
    pubs = str(creds.node_pub(0)) + (f" .. {creds.node_pub(last).name}" if last else "")
    rows = [("operator only, kept offline:", f"{d / CA_KEY} (signs new SuperLink certificates)"),
            ("SuperLink machine:", f"{d / CA_CERT} {d / SUPERLINK_CERT} {d / SUPERLINK_KEY}"),
            ("flwr CLI (operator):", f"{d / CA_CERT} (root-certificates in $FLWR_HOME/config.toml), "
                                     f"{pubs} (flwr supernode register)"),
            *((f"SuperNode {k} machine:", f"{d / CA_CERT} {creds.node_key(k)}") for k in range(creds.nodes))]
    width = max(len(label) for label, _ in rows) + 1
    head = (f"wrote a CA, a SuperLink certificate for {', '.join(creds.hosts)} and {creds.nodes} SuperNode key "
            f"pair{'s' if creds.nodes > 1 else ''} to {d}")
    return "\n".join([head, *(f"  {label.ljust(width)} {files}" for label, files in rows)])


def main(args) -> int:
    """`hf-fedtask flower credentials` (its flags: hf_fedtask/cli.py): write the folder and say which file
    goes to which machine."""
    creds = write_credentials(args.folder, args.nodes, args.host, days=args.days, overwrite=args.overwrite)
    print(placement(creds))
    return 0
