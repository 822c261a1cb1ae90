"""A malformed credential file is skipped, never handed to the threads that authenticate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvdepot.rpc.auth import read_added_credentials

GOOD = {"name": "bob", "role": "engine", "tenant": "acme", "token_sha256": "a" * 64}


@pytest.mark.parametrize("change", [
    {"token_sha256": 5},
    {"token_sha256": "short"},
    {"curve_public": ["not", "a", "key"]},
    {"tenant": 0},
    {"role": "root"},
    {"name": None},
])
def test_a_malformed_credential_file_is_skipped(tmp_path: Path, change: dict) -> None:
    folder = tmp_path / "credentials"
    folder.mkdir()
    (folder / "good.json").write_text(json.dumps(GOOD))
    (folder / "bad.json").write_text(json.dumps({**GOOD, "name": "eve", **change}))
    assert [entry["name"] for entry in read_added_credentials(tmp_path)] == ["bob"]
