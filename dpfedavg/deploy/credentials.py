"""TLS certificates and SuperNode authentication keys for a deployment.

Writes, under one folder:

* ``certificates/ca.crt`` and ``ca.key``: a self-signed certificate authority;
* ``certificates/server.pem`` and ``server.key``: the SuperLink's certificate,
  signed by that CA, valid for the given host names and IP addresses (its
  subject alternative names: every address SuperNodes and the ``flwr`` CLI use
  to reach the SuperLink must be listed) and always for the loopback names
  ``127.0.0.1``, ``localhost`` and ``::1``: the SuperLink's own SuperExec dials
  its Runtime API there over TLS (``--host 0.0.0.0`` becomes ``127.0.0.1``) and
  exits if the certificate does not name it;
* ``keys/supernode_I`` and ``keys/supernode_I.pub`` for I = 0..N-1: one
  elliptic-curve (NIST P-384) key pair per SuperNode in OpenSSH format, the
  format ``flower-supernode --auth-supernode-private-key`` reads and
  ``flwr supernode register`` sends.

``renew_server_certificate`` signs a new SuperLink certificate with the
existing CA, leaving the CA and the SuperNode keys alone (nothing has to be
copied to the SuperNodes again). Private keys are written with mode 0600. For production, an organisation's
own PKI and key handling replace this; the generated files are what a small
federation (or the loopback test) needs.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "LOOPBACK_NAMES",
    "Credentials",
    "generate_credentials",
    "generate_supernode_key",
    "missing_server_names",
    "renew_server_certificate",
]

#: ``x509.KeyUsage``'s flags other than those a CA certificate sets (all off).
_KEY_USAGES = ("content_commitment", "key_encipherment", "data_encipherment", "key_agreement", "encipher_only",
               "decipher_only")  # fmt: skip
#: Names the SuperLink's own processes use to reach it: always in its certificate.
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class Credentials:
    """Paths of the generated files."""

    root: Path
    ca_cert: Path
    server_cert: Path
    server_key: Path
    supernode_keys: tuple[Path, ...]  # private keys; the public key is ``<path>.pub``

    def public_key(self, index: int) -> Path:
        return self.supernode_keys[index].with_name(self.supernode_keys[index].name + ".pub")


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def _general_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host.lower())


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    """``hosts`` then the loopback names, each once, as the certificate's subject alternative names."""
    names: list[x509.GeneralName] = []
    for host in [*hosts, *LOOPBACK_NAMES]:
        name = _general_name(host)
        if name not in names:
            names.append(name)
    return x509.SubjectAlternativeName(names)


def missing_server_names(server_cert: Path | x509.Certificate, hosts: list[str] | tuple[str, ...]) -> list[str]:
    """The names among ``hosts`` and the loopback names that ``server_cert`` (a PEM file or a certificate) lacks."""
    cert = server_cert
    if not isinstance(cert, x509.Certificate):
        cert = x509.load_pem_x509_certificate(Path(server_cert).read_bytes())
    try:
        sans = list(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value)
    except x509.ExtensionNotFound:
        sans = []
    wanted = dict.fromkeys([*hosts, *LOOPBACK_NAMES])
    return [host for host in wanted if _general_name(host) not in sans]


def generate_supernode_key(path: Path) -> Path:
    """One SuperNode key pair: ``path`` (OpenSSH private key, 0600) and ``path.pub``; returns ``path``."""
    key = ec.generate_private_key(ec.SECP384R1())
    _write_private(
        path,
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        ),
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    path.with_name(path.name + ".pub").write_bytes(public + b"\n")
    return path


def _certificate_authority(now: dt.datetime, until: dt.datetime) -> tuple[Any, x509.Name, x509.Certificate]:
    """The federation's own CA: a key, its name and its self-signed certificate."""
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "dpfedavg federation CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(until)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(**dict.fromkeys(_KEY_USAGES, False), digital_signature=True, key_cert_sign=True,
                          crl_sign=True),  # fmt: skip
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return ca_key, ca_name, ca_cert


def _server_certificate(
    hosts: list[str], ca_key: Any, ca_name: x509.Name, now: dt.datetime, until: dt.datetime
) -> tuple[Any, x509.Certificate]:
    """The SuperLink's key and its certificate for ``hosts``, signed by the CA."""
    server_key = ec.generate_private_key(ec.SECP384R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(until)
        .add_extension(_san(hosts), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return server_key, server_cert


def _check_hosts(hosts: list[str], valid_days: int) -> None:
    if not hosts:
        raise ValueError("give at least one host name or IP address for the SuperLink certificate")
    if valid_days < 1:
        raise ValueError(f"valid_days must be >= 1, got {valid_days}")


def _write_server(certs: Path, server_key: Any, server_cert: x509.Certificate) -> None:
    pem = serialization.Encoding.PEM
    (certs / "server.pem").write_bytes(server_cert.public_bytes(pem))
    _write_private(
        certs / "server.key",
        server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )


def renew_server_certificate(out: Path, hosts: list[str], *, valid_days: int = 365) -> Path:
    """A new SuperLink key and certificate for ``hosts`` (and the loopback names), signed by the existing CA.

    The CA and the SuperNode keys are left alone, so the SuperNodes (which hold ``ca.crt``) and the
    registered public keys stay valid: only ``server.pem`` and ``server.key`` go to the SuperLink again.
    Returns the certificate's path. Raises ``FileNotFoundError`` without ``certificates/ca.key`` in ``out``.
    """
    _check_hosts(hosts, valid_days)
    certs = Path(out) / "certificates"
    if not (certs / "ca.key").exists() or not (certs / "ca.crt").exists():
        raise FileNotFoundError(f"{certs / 'ca.key'} or {certs / 'ca.crt'} is missing: no CA to sign a certificate")
    ca_cert = x509.load_pem_x509_certificate((certs / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((certs / "ca.key").read_bytes(), password=None)
    now = dt.datetime.now(dt.UTC)
    until = min(now + dt.timedelta(days=valid_days), ca_cert.not_valid_after_utc)
    server_key, server_cert = _server_certificate(hosts, ca_key, ca_cert.subject, now, until)
    _write_server(certs, server_key, server_cert)
    return certs / "server.pem"


def generate_credentials(
    out: Path, hosts: list[str], num_supernodes: int, *, valid_days: int = 365, overwrite: bool = False
) -> Credentials:
    """Generate a CA, a SuperLink certificate for ``hosts`` and ``num_supernodes`` SuperNode key pairs.

    The certificate is also valid for ``LOOPBACK_NAMES``, whatever ``hosts`` says.

    Raises ``ValueError`` for no hosts, ``num_supernodes < 0`` or ``valid_days < 1``, and
    ``FileExistsError`` if ``out`` already holds credentials and ``overwrite`` is false.
    """
    _check_hosts(hosts, valid_days)
    if num_supernodes < 0:
        raise ValueError(f"num_supernodes must be >= 0, got {num_supernodes}")
    out = Path(out)
    certs, keys = out / "certificates", out / "keys"
    if (certs / "ca.crt").exists() and not overwrite:
        raise FileExistsError(f"{certs / 'ca.crt'} exists; pass overwrite=True (--overwrite) to replace it")
    certs.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    until = now + dt.timedelta(days=valid_days)

    ca_key, ca_name, ca_cert = _certificate_authority(now, until)
    server_key, server_cert = _server_certificate(hosts, ca_key, ca_name, now, until)
    pem = serialization.Encoding.PEM
    pkcs8 = serialization.PrivateFormat.PKCS8
    (certs / "ca.crt").write_bytes(ca_cert.public_bytes(pem))
    _write_private(certs / "ca.key", ca_key.private_bytes(pem, pkcs8, serialization.NoEncryption()))
    _write_server(certs, server_key, server_cert)
    supernode_keys = tuple(generate_supernode_key(keys / f"supernode_{i}") for i in range(num_supernodes))
    return Credentials(
        root=out,
        ca_cert=certs / "ca.crt",
        server_cert=certs / "server.pem",
        server_key=certs / "server.key",
        supernode_keys=supernode_keys,
    )
