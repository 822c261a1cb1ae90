"""`kvdepot credentials add` records a credential only once its file is written: a
credential nobody holds would be accepted by every server and revoked by no one."""

from __future__ import annotations

from pathlib import Path

from kvdepot.cli import main
from kvdepot.rpc.auth import read_added_credentials


def test_a_credential_whose_file_cannot_be_written_is_not_recorded(tmp_path, capsys):
    state = tmp_path / "state"
    missing_dir = tmp_path / "no-such-dir" / "bob.json"
    assert main(["credentials", "--state-dir", str(state), "add", "bob",
                 "--out", str(missing_dir)]) == 2
    assert "kvdepot credentials:" in capsys.readouterr().err
    assert read_added_credentials(state) == []


def test_an_existing_out_file_is_neither_overwritten_nor_recorded(tmp_path):
    state = tmp_path / "state"
    out = tmp_path / "bob.json"
    out.write_text("someone else's file")
    assert main(["credentials", "--state-dir", str(state), "add", "bob",
                 "--out", str(out)]) == 2
    assert out.read_text() == "someone else's file"
    assert read_added_credentials(state) == []


def test_a_refused_credential_leaves_no_out_file(tmp_path):
    state = tmp_path / "state"
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    assert main(["credentials", "--state-dir", str(state), "add", "bob",
                 "--out", str(first)]) == 0
    assert main(["credentials", "--state-dir", str(state), "add", "bob",
                 "--out", str(second)]) == 2  # the name is taken
    assert not Path(second).exists()
    assert [e["name"] for e in read_added_credentials(state)] == ["bob"]
