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

The files hold engines' KV (a prompt can be read back from it), so only the server's
user may read or change them: the directory is 0700 and every file in it 0600, whatever
the umask. A directory of another user is refused at start, in any mode (its owner could
plant chunks or read them); one of ours that is too open is made 0700 and its files 0600
(files of other users in it are deleted). Every file is reached through a descriptor of
the directory checked at start (`openat`, no symlink followed), so renaming a directory
on the path later cannot move the tier elsewhere.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
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
_TMP_SUFFIX = ".tmp"
DIRECTORY_MODE = 0o700
FILE_MODE = 0o600
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC


def open_private_directory(directory: Path) -> int:
    """A descriptor of `directory`, created 0700 if missing, after checking that it is the
    server's user's and that nobody else may use it (fixed if ours: made 0700).

    Refused (ValueError, which `kvdepot serve` reports and exits 2 on): a directory of
    another user (its owner could read, plant or delete chunks whatever their modes), and
    anything that is not a directory. The checks run on the open descriptor, so what is
    checked is what is used."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=DIRECTORY_MODE)
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except NotADirectoryError:
        raise ValueError(f"--disk-path {directory} is not a directory") from None
    try:
        info = os.fstat(fd)
        me = os.geteuid()
        if info.st_uid != me:
            raise ValueError(
                f"refusing --disk-path {directory}: it belongs to uid {info.st_uid}, not to the "
                f"server's user (uid {me}), who could read, plant or delete its chunk files; "
                "give a directory of the server's user (it is created 0700 if missing)")
        mode = stat.S_IMODE(info.st_mode)
        if mode != DIRECTORY_MODE:
            os.fchmod(fd, DIRECTORY_MODE)
            if mode & 0o077:
                log.warning("disk tier: %s was mode %04o, open to other users; made it %04o "
                            "(its chunk files are checked next)", directory, mode,
                            DIRECTORY_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


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
        self._dir_fd = open_private_directory(self.directory)
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
        found: list[tuple[float, str]] = []
        with os.scandir(self._dir_fd) as entries:
            for entry in entries:
                if entry.name.endswith(_TMP_SUFFIX):
                    self._unlink(entry.name)  # a write a crash cut short
                elif entry.name.endswith(_SUFFIX):
                    try:
                        found.append((entry.stat(follow_symlinks=False).st_mtime, entry.name))
                    except FileNotFoundError:
                        continue
        for _, name in sorted(found):
            try:
                key = bytes.fromhex(name.removesuffix(_SUFFIX))
                with self._open(name) as f:
                    if not self._own_file(f.fileno(), name):
                        continue
                    size = os.fstat(f.fileno()).st_size
                    magic, fp_len, length, tenant_len = _FIELDS.unpack(f.read(_FIELDS.size))
                    f.seek(_HEADER_BYTES + fp_len)
                    tenant = f.read(tenant_len).decode()
            except (ValueError, OSError, struct.error):
                self._delete_damaged(name, "an unreadable header")
                continue
            if magic != _MAGIC or size != _HEADER_BYTES + fp_len + tenant_len + length:
                self._delete_damaged(name, "a header that does not match its length")
                continue
            self._add(key, size, length, tenant)
        if found:
            log.info("disk tier %s: %d chunks from before", self.directory, len(self._files))

    def status(self) -> dict[str, Any]:
        with self._mutex:
            return {"name": "disk", "path": str(self.directory), "capacity_bytes": self.capacity,
                    "used_bytes": self.used_bytes, "chunks": len(self._files)}

    def __del__(self) -> None:
        # Closed only with the tier itself: a writer thread still holding the tier must
        # never meet the number reused by another directory.
        fd = getattr(self, "_dir_fd", None)
        if fd is not None:
            os.close(fd)

    @staticmethod
    def _name(key: ChunkKey) -> str:
        return f"{key.hex()}{_SUFFIX}"

    def _open(self, name: str) -> Any:
        """Open a file of the directory for reading, never through a symlink."""
        return open(os.open(name, _READ_FLAGS, dir_fd=self._dir_fd), "rb")

    def _unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self._dir_fd)

    def _own_file(self, fd: int, name: str) -> bool:
        """At start: is this file one of ours (made 0600 if it was more open)? A file that
        is not a regular one, or of another user (planted while the directory was open),
        is deleted."""
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            self._delete_damaged(name, f"another owner (uid {info.st_uid}) or type")
            return False
        if stat.S_IMODE(info.st_mode) != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
        return True

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

    def holds_without_io(self, key: ChunkKey) -> bool | None:
        return key in self._files

    def read_into(self, key: ChunkKey, fingerprint_out: bytearray, buffer: memoryview) -> bool:
        try:
            with self._open(self._name(key)) as f:
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
            self._delete_damaged(self._name(key), "a checksum or length that does not match")
            return False
        fingerprint_out[:] = fingerprint
        with self._mutex:
            entry = self._files.get(key)
            if entry is not None:
                self._files.move_to_end(key)
                self._by_tenant[entry[2]].move_to_end(key)
        return True

    # ---- batched forms ------------------------------------------------------------------
    # A promotion asks every lower tier through these. The disk tier answers them here,
    # from its index and file by file, rather than through the interface's per-key
    # defaults: a lookup's walk then goes from the lower tiers down into this module and
    # back, never from the interface up into it (docs/design.md, "The lookup walk").
    def stored_sizes(self, keys: list[ChunkKey]) -> list[int | None]:
        sizes: list[int | None] = []
        for key in keys:
            size = self.stored_size(key)
            sizes.append(size)
            if size is None:
                break
        return sizes + [None] * (len(keys) - len(sizes))

    def stored_sizes_of_each(self, keys: list[ChunkKey]) -> list[int | None]:
        return [self.stored_size(key) for key in keys]

    def read_many(self, reads: list[tuple[ChunkKey, memoryview]]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key, buffer in reads:
            fingerprint = bytearray()
            out.append(bytes(fingerprint) if self.read_into(key, fingerprint, buffer) else None)
        return out

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
        name = self._name(key)
        tmp = f"{key.hex()}.{threading.get_ident()}{_TMP_SUFFIX}"
        # 0600 from its creation (a umask can only remove bits), and again with fchmod in
        # case a file of that name was left with other bits by a crash.
        fd = os.open(tmp, _WRITE_FLAGS, FILE_MODE, dir_fd=self._dir_fd)
        try:
            os.fchmod(fd, FILE_MODE)
            with open(fd, "wb", closefd=False) as f:
                f.write(fields)
                f.write(_checksum(fields, fingerprint, tenant, data))
                f.write(fingerprint)
                f.write(tenant)
                f.write(data)
        except BaseException:
            os.close(fd)
            self._unlink(tmp)
            raise
        os.close(fd)
        os.replace(tmp, name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
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
            self._unlink(self._name(victim))

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

    def _delete_damaged(self, name: str, what: str) -> None:
        self._unlink(name)
        self.discarded.add()
        damage_log.warning("damaged-chunk", "disk tier: deleted chunk file %s with %s", name,
                           what)
