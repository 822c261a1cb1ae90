"""Mapping a handed-over memfd populates exactly the pages its owner wrote (issue 27, part 4):
real memfds, real mappings, the kernel's own accounting."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator

import pytest

from kvdepot.transfer.sealed_memory import create_sealable, seal_size
from kvdepot.transfer.shm_mapping import map_shared_fd, populate_written

MIB = 1 << 20


def file_bytes(fd: int) -> int:
    """What tmpfs holds for the file (its pages), whoever faulted them in."""
    return os.fstat(fd).st_blocks * 512


@pytest.fixture
def memfd() -> Iterator[int]:
    fd = create_sealable("populate-test", 64 * MIB)
    seal_size(fd)
    yield fd
    os.close(fd)


def test_a_file_never_written_stays_empty(memfd):
    mapping, view = map_shared_fd(memfd, 64 * MIB)
    assert file_bytes(memfd) == 0  # MAP_POPULATE allocated all 64 MiB here
    del view
    mapping.close()


def test_only_written_runs_are_populated(memfd):
    os.pwrite(memfd, b"a" * (3 * MIB), 5 * MIB)
    os.pwrite(memfd, b"b" * mmap.PAGESIZE, 40 * MIB)
    held = file_bytes(memfd)
    mapping = mmap.mmap(memfd, 64 * MIB, flags=mmap.MAP_SHARED)
    assert populate_written(mapping, memfd, 64 * MIB) == 3 * MIB + mmap.PAGESIZE
    assert file_bytes(memfd) == held
    mapping.close()


def test_a_file_written_whole_is_populated_whole(memfd):
    os.pwrite(memfd, b"c" * (64 * MIB), 0)
    mapping = mmap.mmap(memfd, 64 * MIB, flags=mmap.MAP_SHARED)
    assert populate_written(mapping, memfd, 64 * MIB) == 64 * MIB
    mapping.close()
