"""Credential files for the tests' clients, added to a test's own state directory (the
`state_dir` fixture)."""

from __future__ import annotations

from pathlib import Path

from kvdepot.rpc.auth import add_credential


def credential_file(state_dir: Path, name: str, role: str, tenant: str) -> str:
    """Add credential `name` (`role`, of `tenant`) to every server of `state_dir`, as
    `kvdepot credentials add` does, and write it where a client can be pointed at it,
    STATE_DIR/NAME.cred; that file's path."""
    path = state_dir / f"{name}.cred"
    path.write_text(add_credential(state_dir, name, role, tenant).to_json())
    return str(path)
