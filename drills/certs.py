"""Throwaway certificates for TLS tests, made with the openssl command line: a CA, a
server certificate for localhost / 127.0.0.1, client certificates by common name, and a
client certificate from a CA nobody trusts."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def available() -> bool:
    return shutil.which("openssl") is not None


def _run(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _authority(folder: Path, name: str) -> tuple[Path, Path]:
    key, cert = folder / f"{name}.key", folder / f"{name}.pem"
    _run("req", "-x509", *_EC, "-keyout", str(key), "-out", str(cert), "-days", "2",
         "-subj", f"/CN={name}")
    return cert, key


def _issue(folder: Path, ca: tuple[Path, Path], name: str, extensions: str) -> tuple[Path, Path]:
    key, request, cert = folder / f"{name}.key", folder / f"{name}.csr", folder / f"{name}.pem"
    ext = folder / f"{name}.ext"
    ext.write_text(extensions)
    _run("req", *_EC, "-keyout", str(key), "-out", str(request), "-subj", f"/CN={name}")
    _run("x509", "-req", "-in", str(request), "-CA", str(ca[0]), "-CAkey", str(ca[1]),
         "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext))
    return cert, key


@dataclass(frozen=True)
class Certs:
    ca: Path
    server: tuple[Path, Path]  # (certificate, key)
    clients: dict[str, tuple[Path, Path]]  # by common name, signed by `ca`
    stranger: tuple[Path, Path]  # CN=acme-worker, but signed by another CA


def make(folder: Path, client_names: tuple[str, ...]) -> Certs:
    folder.mkdir(parents=True, exist_ok=True)
    ca = _authority(folder, "tiercache-test-ca")
    server = _issue(folder, ca, "localhost", "subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    clients = {name: _issue(folder, ca, name, "extendedKeyUsage=clientAuth\n")
               for name in client_names}
    other = _authority(folder, "other-ca")
    stranger_dir = folder / "stranger"
    stranger_dir.mkdir(exist_ok=True)
    stranger = _issue(stranger_dir, other, "acme-worker", "extendedKeyUsage=clientAuth\n")
    return Certs(ca[0], server, clients, stranger)
