"""A self-signed certificate for 127.0.0.1, made with the openssl command."""

from __future__ import annotations

import subprocess
from pathlib import Path


def self_signed_certificate(directory: Path) -> tuple[str, str]:
    """(certificate, key) PEM files in `directory`, valid one day for IP 127.0.0.1."""
    cert, key = str(directory / "cert.pem"), str(directory / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", key, "-out", cert], check=True, capture_output=True)
    return cert, key
