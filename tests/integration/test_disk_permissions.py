"""Issue 27, part 3: the disk tier's files are the server's user's alone.

Chunk files hold engines' KV bytes, from which a prompt can be read back. They used to be
0644 in a 0755 directory (the umask's), so any local user could read them, and the server
took a directory another user owned and anyone could write. Now: files 0600 in a 0700
directory whatever the umask; a directory of another user is refused at start; one of
ours that is too open is made private, and files planted in it are deleted.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvdepot.testbed.server_process import free_port
from tests.support.server import small_server
from tests.support.waiting import wait_for_writes

CHUNK = 64
TOKENS = list(range(700, 700 + 3 * CHUNK + 1))
NOBODY = 65534
DISK_SIZE = "64MiB"


@pytest.fixture
def open_parent() -> Iterator[Path]:
    """A directory every user may traverse and list (0755), as /var/lib or /srv are: what
    protects the disk tier must be its own modes, not a private parent like pytest's."""
    path = Path(tempfile.mkdtemp(prefix="kvdepot-disk-"))
    path.chmod(0o755)
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def as_nobody(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["setpriv", "--reuid", str(NOBODY), "--regid", str(NOBODY),
                           "--clear-groups", *command], capture_output=True, text=True,
                          timeout=30)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def process_umask(pid: int) -> int:
    """The umask process `pid` runs under (/proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    raise AssertionError("no Umask line")


def store_three_chunks(engines_at, disk: Path, umask: int | None = None) -> None:
    """Three chunks stored and written behind to `disk`; with `umask`, by a server that
    runs under it. Not forked from the tests' fork server, which keeps its own umask (a
    umask set in pytest never reached the server): started as a subprocess through sh,
    which sets the umask in the server's process alone and execs it (same pid)."""
    server = small_server(chunk_size=CHUNK, extra=(
        "--disk-path", str(disk), "--disk-size", DISK_SIZE))
    if umask is not None:
        server.args = ["sh", "-c", f'umask {umask:03o} && exec "$@"', "sh", *server.args]
    server.start()
    try:
        if umask is not None:
            assert server.pid is not None and process_umask(server.pid) == umask
        engine = engines_at(server.url)
        engine.fill(seed=5)
        engine.store("w", TOKENS, list(range(12)), 0, 3 * CHUNK)
        wait_for_writes(server.url, 3)
    finally:
        server.stop()


def test_chunk_files_are_private_whatever_the_umask(state_dir, open_parent, engines_at):
    """The server runs under umask 0: without modes of its own, its files would be 0666
    and its directory 0777."""
    disk = open_parent / "disk"
    store_three_chunks(engines_at, disk, umask=0)
    files = sorted(disk.iterdir())
    assert len(files) == 3 and all(f.name.endswith(".chunk") for f in files)
    assert mode(disk) == 0o700
    assert {mode(f) for f in files} == {0o600}
    # Another local user reads nothing: not the file (by its full path), not the listing.
    victim = as_nobody("cat", str(files[0]))
    assert victim.returncode != 0 and "Permission denied" in victim.stderr
    assert victim.stdout == ""
    listing = as_nobody("ls", str(disk))
    assert listing.returncode != 0 and "Permission denied" in listing.stderr


def test_the_server_refuses_a_directory_of_another_user(state_dir, open_parent):
    disk = open_parent / "theirs"
    disk.mkdir()
    os.chown(disk, NOBODY, NOBODY)
    disk.chmod(0o777)
    command = [sys.executable, "-m", "kvdepot.cli", "serve", "--port", str(free_port()),
               "--chunk-size", str(CHUNK), "--l1-size", "64MiB", "--disk-path", str(disk),
               "--disk-size", DISK_SIZE]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the server started on a 0777 directory of uid 65534")
    assert result.returncode == 2, result.stderr
    assert f"refusing --disk-path {disk}: it belongs to uid {NOBODY}" in result.stderr
    # It left the directory as it was, and wrote nothing in it.
    assert mode(disk) == 0o777 and list(disk.iterdir()) == []


def test_a_too_open_directory_of_ours_is_made_private(state_dir, open_parent, engines_at):
    disk = open_parent / "ours"
    store_three_chunks(engines_at, disk)
    ours = sorted(disk.iterdir())
    # As an older server (or an operator's cp) left it: open to everyone, and another user
    # planted a file there meanwhile.
    disk.chmod(0o777)
    for f in ours:
        f.chmod(0o644)
    planted = disk / ("ab" * 16 + ".chunk")
    assert as_nobody("sh", "-c", f"echo junk > {planted}").returncode == 0
    assert planted.stat().st_uid == NOBODY

    server = small_server(chunk_size=CHUNK, extra=(
        "--disk-path", str(disk), "--disk-size", DISK_SIZE)).start()
    try:
        assert mode(disk) == 0o700
        assert sorted(disk.iterdir()) == ours  # the planted file is gone, ours are kept
        assert {mode(f) for f in ours} == {0o600}
        # Our chunks are still served (the CPU memory is empty: they come from disk).
        engine = engines_at(server.url)
        assert engine.lookup("after", TOKENS) == 3 * CHUNK
    finally:
        output = server.stop()
    assert "was mode 0777, open to other users; made it 0700" in output
