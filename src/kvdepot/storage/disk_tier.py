"""The local-disk tier: one file per chunk under a directory, kept across restarts.

Files are written to a temporary name and renamed, so a crash never leaves a torn
chunk under a real name. Each file starts with a small header (magic, layout
fingerprint) that is checked on read. The directory is scanned at start-up, so a
restarted server finds what the previous one wrote. Capacity is enforced by removing
the least recently used files.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from collections import OrderedDict
from pathlib import Path

from kvdepot.keys import ChunkKey
from kvdepot.storage.tier import LowerTier

log = logging.getLogger(__name__)

_MAGIC = b"KVDC1"
_HEADER = struct.Struct("<5sBQ")  # magic, fingerprint length, payload length
_SUFFIX = ".chunk"


class DiskTier(LowerTier):
    name = "disk"

    def __init__(self, directory: str | Path, capacity: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self._mutex = threading.Lock()
        # key -> (file size, payload size), least recently used first
        self._files: OrderedDict[ChunkKey, tuple[int, int]] = OrderedDict()
        self.used_bytes = 0
        found = sorted(self.directory.glob(f"*{_SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in found:
            try:
                key = bytes.fromhex(path.name.removesuffix(_SUFFIX))
                with open(path, "rb") as f:
                    magic, _, length = _HEADER.unpack(f.read(_HEADER.size))
            except (ValueError, OSError, struct.error):
                continue
            if magic == _MAGIC:
                size = path.stat().st_size
                self._files[key] = (size, length)
                self.used_bytes += size
        for stale in self.directory.glob("*.tmp"):
            stale.unlink(missing_ok=True)
        if found:
            log.info("disk tier %s: %d chunks from before", self.directory, len(self._files))

    def _path(self, key: ChunkKey) -> Path:
        return self.directory / f"{key.hex()}{_SUFFIX}"

    def __len__(self) -> int:
        return len(self._files)

    def stored_size(self, key: ChunkKey) -> int | None:
        entry = self._files.get(key)
        return None if entry is None else entry[1]

    def read_into(self, key: ChunkKey, fingerprint_out: bytearray, buffer: memoryview) -> bool:
        try:
            with open(self._path(key), "rb") as f:
                magic, fp_len, length = _HEADER.unpack(f.read(_HEADER.size))
                fingerprint = f.read(fp_len)
                if magic != _MAGIC or length != len(buffer):
                    return False
                if f.readinto(buffer) != length:
                    return False
        except (OSError, struct.error):
            self._forget(key)
            return False
        fingerprint_out[:] = fingerprint
        with self._mutex:
            if key in self._files:
                self._files.move_to_end(key)
        return True

    def write(self, key: ChunkKey, fingerprint: bytes, data: memoryview) -> None:
        size = _HEADER.size + len(fingerprint) + len(data)
        if key in self._files or size > self.capacity:
            return
        path = self._path(key)
        tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(_HEADER.pack(_MAGIC, len(fingerprint), len(data)))
            f.write(fingerprint)
            f.write(data)
        os.replace(tmp, path)
        with self._mutex:
            self._files[key] = (size, len(data))
            self.used_bytes += size
            victims = []
            while self.used_bytes > self.capacity and self._files:
                victim, (victim_size, _) = self._files.popitem(last=False)
                self.used_bytes -= victim_size
                victims.append(victim)
        for victim in victims:
            self._path(victim).unlink(missing_ok=True)

    def _forget(self, key: ChunkKey) -> None:
        with self._mutex:
            entry = self._files.pop(key, None)
            if entry is not None:
                self.used_bytes -= entry[0]
