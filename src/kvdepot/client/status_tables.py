"""`GET /v1/status` as terminal tables: `kvdepot status` prints one, `kvdepot top` redraws
one with rates computed between two readings."""

from __future__ import annotations

from typing import Any

from kvdepot.sizes import format_size


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        return "  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
    return [line(header), *(line(r) for r in rows)]


def _share(used: int, capacity: int | None) -> str:
    if not capacity:
        return ""
    return f"{100 * used / capacity:.1f}%"


def hit_rate(counters: dict[str, float]) -> float | None:
    """Tokens found over tokens asked for, None before any lookup."""
    asked = counters.get("lookup_requested_tokens", 0)
    return counters.get("hit_tokens", 0) / asked if asked else None


def render(status: dict[str, Any], previous: dict[str, Any] | None = None,
           seconds: float = 0.0) -> str:
    """The tables; with a `previous` status taken `seconds` earlier, rates per second."""
    counters = status["counters"]
    rate = hit_rate(counters)
    lines = [f"kvdepot {status['version']} at {status['url']}  up {status['uptime_seconds']:.0f} s"
             f"  chunk size {status['chunk_size']}"
             f"{'  DRAINING' if status.get('draining') else ''}",
             f"lookups {counters['lookups']}  hit rate "
             f"{'-' if rate is None else f'{100 * rate:.1f}%'}  sessions "
             f"{status['sessions']['lookup_jobs']} on {status['sessions']['connections']} "
             f"connections  locked {status['locks']['locked_keys']} keys "
             f"({format_size(status['locks']['locked_bytes'])})"]
    if previous is not None and seconds > 0:
        before = previous["counters"]

        def per_second(name: str) -> float:
            return (counters.get(name, 0) - before.get(name, 0)) / seconds
        lines.append(f"per second: lookups {per_second('lookups'):.1f}  stored "
                     f"{format_size(int(per_second('stored_bytes')))}  retrieved "
                     f"{format_size(int(per_second('retrieved_bytes')))}  evicted "
                     f"{per_second('evictions'):.1f} chunks")
    lines.append("")
    lines += _table(["tier", "used", "capacity", "use", "chunks"],
                    [[t["name"], format_size(t["used_bytes"]) if "used_bytes" in t else "",
                      format_size(t["capacity_bytes"]) if "capacity_bytes" in t else "",
                      _share(t.get("used_bytes", 0), t.get("capacity_bytes")),
                      str(t.get("chunks", ""))] for t in status["tiers"]])
    tenants = status.get("tenants") or {}
    if tenants:
        lines.append("")
        lines += _table(["tenant", "cpu", "chunks", "quota"],
                        [[name or "-", format_size(t.get("cpu_bytes", 0)), str(t.get("chunks", 0)),
                          "" if t.get("quota_cpu_bytes") is None
                          else format_size(t["quota_cpu_bytes"])]
                         for name, t in tenants.items()])
    lines.append("")
    if status["engines"]:
        lines += _table(["engine", "model", "rank", "tenant", "memory", "layers", "block",
                         "blocks", "chunk", "per token by group"],
                        [[f"#{e['engine']}", e["model"][:40], f"{e['rank']}/{e['world_size']}",
                          e["tenant"] or "-", e["memory"], str(e["layout"]["layers"]),
                          str(e["layout"]["block_size"]), str(e["layout"]["num_blocks"]),
                          format_size(e["chunk_bytes"]), _per_token(e["layout"])]
                         for e in status["engines"]])
    else:
        lines.append("no engines registered")
    return "\n".join(lines)


def _per_token(layout: dict[str, Any]) -> str:
    """Each KV cache group's bytes per token ("4.0 KiB + 4.0 KiB" for a sliding-window
    group beside a full one), a recurrent group's per state ("256.0 KiB per state");
    servers before issue 44 did not report them."""
    return " + ".join(f"{format_size(g['bytes_per_state'])} per state" if "bytes_per_state" in g
                      else format_size(g["bytes_per_token"]) for g in layout.get("groups", ()))
