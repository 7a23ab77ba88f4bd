"""A private CA for one mesh and a certificate per role (`vmesh certs`, and `vmesh serve` for each run),
and server certificates for the public port. Keys are ECDSA P-256; files are PEM."""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from vmesh.services.common.tls import role_dns_name
from vmesh.services.common.types import ROLES

VALID_DAYS = 825


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "vmesh"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _validity(builder: x509.CertificateBuilder) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return builder.not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(
        now + datetime.timedelta(days=VALID_DAYS))


def make_ca() -> tuple[bytes, bytes]:
    """(certificate, key) of a new CA, PEM."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name("vmesh mesh CA")
    cert = (_validity(x509.CertificateBuilder()).subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def issue(ca_cert_pem: bytes, ca_key_pem: bytes, common_name: str, dns_names: list[str],
          ip_addresses: Sequence[str] = (), client: bool = True) -> tuple[bytes, bytes]:
    """(certificate, key) signed by the CA: a server certificate, and a client one too unless
    `client` is False. Key identifiers are included: strict verifiers (Python >= 3.13's
    default context) refuse certificates without them."""
    ca_cert = x509.load_pem_x509_certificate(ca_cert_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    ca_public_key = ca_cert.public_key()
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey) or not isinstance(ca_public_key, ec.EllipticCurvePublicKey):
        raise ValueError("the CA's key is not an elliptic-curve key, as `vmesh certs` makes them")
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns_names]
    names += [x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses]
    cert = (_validity(x509.CertificateBuilder()).subject_name(_name(common_name)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]
                                                 + ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])),
                           critical=False)
            .add_extension(x509.KeyUsage(digital_signature=True, key_agreement=True, key_cert_sign=False,
                                         crl_sign=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_public_key), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def issue_role(ca_cert_pem: bytes, ca_key_pem: bytes, role: str) -> tuple[bytes, bytes]:
    return issue(ca_cert_pem, ca_key_pem, role, [role_dns_name(role)])


def _write(path: Path, data: bytes, mode: int) -> None:
    """Created with its final mode (a key is never readable by others, even for an instant),
    and never through a file or link someone else left there."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)  # the umask may have narrowed it


def write_mesh_certificates(directory: Path, roles: tuple[str, ...] = ROLES, public_hosts: Sequence[str] = (),
                            key_mode: int = 0o600) -> Path:
    """ca.crt and <role>.crt/.key for each role (the CA's key is not kept: the mesh is fixed);
    public.crt/.key for `public_hosts` (DNS names or IP addresses) when given. Returns `directory`.
    `key_mode`: 0o640 where a group (a container's runtime user) must read the keys."""
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    ca_cert, ca_key = make_ca()
    _write(directory / "ca.crt", ca_cert, 0o644)
    for role in roles:
        cert, key = issue_role(ca_cert, ca_key, role)
        _write(directory / f"{role}.crt", cert, 0o644)
        _write(directory / f"{role}.key", key, key_mode)
    if public_hosts:
        if set(public_hosts) & set(ROLES):
            raise ValueError(f"a public host may not be named like a role ({', '.join(ROLES)})")
        ips = [h for h in public_hosts if _is_ip(h)]
        # server-only: the public key may end up on a load balancer; it must not be a client of the mesh
        cert, key = issue(ca_cert, ca_key, public_hosts[0], [h for h in public_hosts if not _is_ip(h)], ips,
                          client=False)
        _write(directory / "public.crt", cert, 0o644)
        _write(directory / "public.key", key, key_mode)
    return directory


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
