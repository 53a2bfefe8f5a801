"""Numbers and adapter records as the CLI's verbs and `lorafleet top` print them. A leaf: both
front ends import it, neither the other (tests/test_import_boundaries.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def ranks_text(info: Mapping[str, Any]) -> str:
    """An adapter's ranks (its `ranks`: module -> rank) as one rank or a range, '-' for none."""
    ranks = sorted(set((info.get("ranks") or {}).values()))
    if not ranks:
        return "-"
    return str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (powers of 1024, up to GiB)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def duration(seconds: float) -> str:
    """3725 -> '1h 2m 5s'."""
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return " ".join(f"{v}{u}" for v, u in ((d, "d"), (h, "h"), (m, "m"), (s, "s")) if v) or "0s"
