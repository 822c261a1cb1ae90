"""How long the control loop spends decoding the largest REPORT_BLOCK_ALLOCATION the
protocol's bounds allow (README, "Bounds"). Run: python scripts/measure_report_decode.py"""

from __future__ import annotations

import statistics
import time

from kvdepot.protocol import (
    ENCODER,
    MAX_BLOCK_REPORT_BYTES,
    MAX_BLOCK_REPORT_RECORDS,
    MAX_ID_CHARS,
    MAX_NAME_CHARS,
    REQUEST_DECODERS,
    BlockAllocation,
    ReportBlockAllocation,
    RequestType,
)


def largest(kind: str) -> bytes:
    """Records up to the count bound, filled with ids or arrays up to the byte bound."""
    room = (MAX_BLOCK_REPORT_BYTES - MAX_NAME_CHARS - 64) // MAX_BLOCK_REPORT_RECORDS - 16
    if kind == "long ids":
        id_chars = min(MAX_ID_CHARS, room)
        records = [BlockAllocation(f"{i:06d}".ljust(id_chars, "r"), b"", b"")
                   for i in range(MAX_BLOCK_REPORT_RECORDS)]
    else:
        half = room // 2 // 4 * 4
        records = [BlockAllocation(str(i), b"\1" * half, b"\2" * half)
                   for i in range(MAX_BLOCK_REPORT_RECORDS)]
    body = ENCODER.encode(ReportBlockAllocation(1, "m" * MAX_NAME_CHARS, records))
    assert len(body) <= MAX_BLOCK_REPORT_BYTES
    return body


def main() -> None:
    decoder = REQUEST_DECODERS[RequestType.REPORT_BLOCK_ALLOCATION]
    for kind in ("long ids", "packed arrays"):
        body = largest(kind)
        times = []
        for _ in range(500):
            start = time.perf_counter()
            decoder.decode(body)
            times.append(time.perf_counter() - start)
        print(f"{kind}: {len(body)} bytes, {MAX_BLOCK_REPORT_RECORDS} records: decode "
              f"median {statistics.median(times) * 1e3:.3f} ms, min {min(times) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
