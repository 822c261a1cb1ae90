"""The local-disk tier: one file per chunk under a directory, kept across restarts.

Files are written to a temporary name and renamed, so a crash never leaves a torn
chunk under a real name. Each file is a header (magic, layout fingerprint length,
payload length, checksum), the layout fingerprint and the payload. The checksum is
blake3 over everything else in the file, and every read verifies it before the chunk
counts as found: a flipped bit, a truncated file or a damaged fingerprint is deleted
and counted (`discarded`), never returned, so a lookup never promises it. The
directory is scanned at start-up, so a restarted server finds what the previous one
wrote; files whose length does not match their header are deleted then. Capacity is
enforced by removing the least recently used files.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from collections import OrderedDict
from pathlib import Path

from blake3 import blake3

from kvdepot.keys import ChunkKey
from kvdepot.log_limiter import LogLimiter
from kvdepot.metrics import Counter
from kvdepot.storage.tier import LowerTier

log = logging.getLogger(__name__)
damage_log = LogLimiter(log)

_MAGIC = b"KVDC2"
_FIELDS = struct.Struct("<5sBQ")  # magic, fingerprint length, payload length
_DIGEST_BYTES = 32
_HEADER_BYTES = _FIELDS.size + _DIGEST_BYTES
_SUFFIX = ".chunk"


def _checksum(fields: bytes, fingerprint: bytes, payload: memoryview) -> bytes:
    digest = blake3(fields)
    digest.update(fingerprint)
    digest.update(payload)
    return digest.digest()


class DiskTier(LowerTier):
    def __init__(self, directory: str | Path, capacity: int, discarded: Counter | None = None
                 ) -> None:
        """`discarded` counts the chunk files found damaged and deleted."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self.discarded = discarded or Counter()
        self._mutex = threading.Lock()
        # key -> (file size, payload size), least recently used first
        self._files: OrderedDict[ChunkKey, tuple[int, int]] = OrderedDict()
        self.used_bytes = 0
        found = sorted(self.directory.glob(f"*{_SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in found:
            try:
                key = bytes.fromhex(path.name.removesuffix(_SUFFIX))
                size = path.stat().st_size
                with open(path, "rb") as f:
                    magic, fp_len, length = _FIELDS.unpack(f.read(_FIELDS.size))
            except (ValueError, OSError, struct.error):
                self._delete_damaged(path, "an unreadable header")
                continue
            if magic != _MAGIC or size != _HEADER_BYTES + fp_len + length:
                self._delete_damaged(path, "a header that does not match its length")
                continue
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
                header = f.read(_HEADER_BYTES)
                fields, digest = header[:_FIELDS.size], header[_FIELDS.size:]
                magic, fp_len, length = _FIELDS.unpack(fields)
                if length != len(buffer) and length == self.stored_size(key):
                    return False  # the caller asked for another size: nothing is wrong here
                fingerprint = f.read(fp_len)
                intact = (magic == _MAGIC and length == len(buffer) and len(fingerprint) == fp_len
                          and f.readinto(buffer) == length and not f.read(1)
                          and _checksum(fields, fingerprint, buffer) == digest)
        except FileNotFoundError:
            self._forget(key)  # evicted meanwhile
            return False
        except (OSError, struct.error):
            intact = False
        if not intact:
            self._forget(key)
            self._delete_damaged(self._path(key), "a checksum or length that does not match")
            return False
        fingerprint_out[:] = fingerprint
        with self._mutex:
            if key in self._files:
                self._files.move_to_end(key)
        return True

    def write(self, key: ChunkKey, fingerprint: bytes, data: memoryview) -> None:
        size = _HEADER_BYTES + len(fingerprint) + len(data)
        if key in self._files or size > self.capacity:
            return
        fields = _FIELDS.pack(_MAGIC, len(fingerprint), len(data))
        path = self._path(key)
        tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(fields)
            f.write(_checksum(fields, fingerprint, data))
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

    def _delete_damaged(self, path: Path, what: str) -> None:
        path.unlink(missing_ok=True)
        self.discarded.add()
        damage_log.warning("damaged-chunk", "disk tier: deleted chunk file %s with %s", path.name,
                           what)
