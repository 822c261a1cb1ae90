"""The local-disk tier: one file per chunk under a directory, kept across restarts.

Files are written to a temporary name and renamed, so a crash never leaves a torn
chunk under a real name. Each file is a header (magic, layout fingerprint length,
payload length, tenant length, checksum), the layout fingerprint, the tenant that stored
it and the payload. The checksum is
blake3 over everything else in the file, and every read verifies it before the chunk
counts as found: a flipped bit, a truncated file or a damaged fingerprint is deleted
and counted (`discarded`), never returned, so a lookup never promises it. The
directory is scanned at start-up, so a restarted server finds what the previous one
wrote; files whose length does not match their header are deleted then. Capacity is
enforced by removing the least recently used files; a tenant past its quota (`limits`)
has its own least recently used files removed first.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from blake3 import blake3

from kvdepot.keys import ChunkKey
from kvdepot.log_limiter import LogLimiter
from kvdepot.metrics import Counter
from kvdepot.storage.chunk import UNSCOPED, ChunkScope
from kvdepot.storage.tenant_limits import TenantLimits
from kvdepot.storage.tier import LowerTier, TierListener

log = logging.getLogger(__name__)
damage_log = LogLimiter(log)

TIER_NAME = "disk"
"""How KV events name this tier."""
_MAGIC = b"KVDC3"
_FIELDS = struct.Struct("<5sBQB")  # magic, fingerprint length, payload length, tenant length
_DIGEST_BYTES = 32
_HEADER_BYTES = _FIELDS.size + _DIGEST_BYTES
_SUFFIX = ".chunk"


def _checksum(fields: bytes, fingerprint: bytes, tenant: bytes, payload: memoryview) -> bytes:
    digest = blake3(fields)
    digest.update(fingerprint)
    digest.update(tenant)
    digest.update(payload)
    return digest.digest()


class DiskTier(LowerTier):
    name = TIER_NAME

    def __init__(self, directory: str | Path, capacity: int, discarded: Counter | None = None,
                 limits: TenantLimits | None = None, listener: TierListener | None = None
                 ) -> None:
        """`discarded` counts the chunk files found damaged and deleted; `limits` holds the
        tenants' quotas of this tier (its reserves are not used); `listener` is told
        of every chunk file added and removed."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self.discarded = discarded or Counter()
        self.limits = limits or TenantLimits()
        self.listener = listener
        self._mutex = threading.Lock()
        # key -> (file size, payload size, tenant), least recently used first
        self._files: OrderedDict[ChunkKey, tuple[int, int, str]] = OrderedDict()
        self._by_tenant: dict[str, OrderedDict[ChunkKey, int]] = {}  # key -> file size
        self._tenant_bytes: dict[str, int] = {}
        self.used_bytes = 0
        found = sorted(self.directory.glob(f"*{_SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in found:
            try:
                key = bytes.fromhex(path.name.removesuffix(_SUFFIX))
                size = path.stat().st_size
                with open(path, "rb") as f:
                    magic, fp_len, length, tenant_len = _FIELDS.unpack(f.read(_FIELDS.size))
                    f.seek(_HEADER_BYTES + fp_len)
                    tenant = f.read(tenant_len).decode()
            except (ValueError, OSError, struct.error):
                self._delete_damaged(path, "an unreadable header")
                continue
            if magic != _MAGIC or size != _HEADER_BYTES + fp_len + tenant_len + length:
                self._delete_damaged(path, "a header that does not match its length")
                continue
            self._add(key, size, length, tenant)
        for stale in self.directory.glob("*.tmp"):
            stale.unlink(missing_ok=True)
        if found:
            log.info("disk tier %s: %d chunks from before", self.directory, len(self._files))

    def status(self) -> dict[str, Any]:
        with self._mutex:
            return {"name": "disk", "path": str(self.directory), "capacity_bytes": self.capacity,
                    "used_bytes": self.used_bytes, "chunks": len(self._files)}

    def _path(self, key: ChunkKey) -> Path:
        return self.directory / f"{key.hex()}{_SUFFIX}"

    def __len__(self) -> int:
        return len(self._files)

    def usage(self) -> dict[str, tuple[int, int]]:
        """(chunk files, bytes) per tenant."""
        with self._mutex:
            return {tenant: (len(files), self._tenant_bytes[tenant])
                    for tenant, files in self._by_tenant.items() if files}

    def announce(self) -> None:
        """Tell the listener of every chunk file found at start (its parent and model are
        not kept on disk)."""
        with self._mutex:
            if self.listener is not None:
                for key, (_, _, tenant) in self._files.items():
                    self.listener.stored(TIER_NAME, key, ChunkScope(tenant), None)

    def stored_size(self, key: ChunkKey) -> int | None:
        entry = self._files.get(key)
        return None if entry is None else entry[1]

    def read_into(self, key: ChunkKey, fingerprint_out: bytearray, buffer: memoryview) -> bool:
        try:
            with open(self._path(key), "rb") as f:
                header = f.read(_HEADER_BYTES)
                fields, digest = header[:_FIELDS.size], header[_FIELDS.size:]
                magic, fp_len, length, tenant_len = _FIELDS.unpack(fields)
                if length != len(buffer) and length == self.stored_size(key):
                    return False  # the caller asked for another size: nothing is wrong here
                fingerprint = f.read(fp_len)
                tenant = f.read(tenant_len)
                intact = (magic == _MAGIC and length == len(buffer) and len(fingerprint) == fp_len
                          and len(tenant) == tenant_len
                          and f.readinto(buffer) == length and not f.read(1)
                          and _checksum(fields, fingerprint, tenant, buffer) == digest)
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
            entry = self._files.get(key)
            if entry is not None:
                self._files.move_to_end(key)
                self._by_tenant[entry[2]].move_to_end(key)
        return True

    def write(self, key: ChunkKey, fingerprint: bytes, data: memoryview) -> None:
        self.write_chunk(key, fingerprint, data, UNSCOPED)

    def write_chunk(self, key: ChunkKey, fingerprint: bytes, data: memoryview,
                    scope: ChunkScope, parent: bytes | None = None) -> None:
        tenant = scope.tenant.encode()
        size = _HEADER_BYTES + len(fingerprint) + len(tenant) + len(data)
        quota = self.limits.quota(scope.tenant)
        if key in self._files or size > self.capacity or (quota is not None and size > quota):
            return
        fields = _FIELDS.pack(_MAGIC, len(fingerprint), len(data), len(tenant))
        path = self._path(key)
        tmp = path.with_suffix(f".{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(fields)
            f.write(_checksum(fields, fingerprint, tenant, data))
            f.write(fingerprint)
            f.write(tenant)
            f.write(data)
        os.replace(tmp, path)
        victims: list[tuple[ChunkKey, str]] = []
        with self._mutex:
            self._add(key, size, len(data), scope.tenant)
            if self.listener is not None:
                self.listener.stored(TIER_NAME, key, scope, parent)
            own = self._by_tenant[scope.tenant]
            while quota is not None and self._tenant_bytes[scope.tenant] > quota and own:
                victims.append(self._remove(next(iter(own))))
            while self.used_bytes > self.capacity and self._files:
                victims.append(self._remove(next(iter(self._files))))
            if victims and self.listener is not None:
                self.listener.removed(TIER_NAME, victims)
        for victim, _ in victims:
            self._path(victim).unlink(missing_ok=True)

    # ---- bookkeeping (under the mutex, or before the tier is shared) -----------------------
    def _add(self, key: ChunkKey, size: int, length: int, tenant: str) -> None:
        self._files[key] = (size, length, tenant)
        self._by_tenant.setdefault(tenant, OrderedDict())[key] = size
        self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + size
        self.used_bytes += size

    def _remove(self, key: ChunkKey) -> tuple[ChunkKey, str]:
        size, _, tenant = self._files.pop(key)
        del self._by_tenant[tenant][key]
        self._tenant_bytes[tenant] -= size
        self.used_bytes -= size
        return key, tenant

    def _forget(self, key: ChunkKey) -> None:
        with self._mutex:
            if key in self._files:
                removed = self._remove(key)
                if self.listener is not None:
                    self.listener.removed(TIER_NAME, [removed])

    def _delete_damaged(self, path: Path, what: str) -> None:
        path.unlink(missing_ok=True)
        self.discarded.add()
        damage_log.warning("damaged-chunk", "disk tier: deleted chunk file %s with %s", path.name,
                           what)
