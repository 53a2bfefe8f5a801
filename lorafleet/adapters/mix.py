"""A mix: one request on several adapters at once, each with its scale, batched with every other
request (no merged copy is ever built).

The delta of a mix is the sum of its adapters' deltas, each times its scale: for every module,
sum_j scale_j * B_j A_j x. It equals PEFT's `add_weighted_adapter(..., combination_type="cat")`
with the same weights, which stacks the adapters' rank rows into one adapter; the LoRA op does
that stacking per step, reading each adapter from the pool where it lies (`kernels/reference.py`:
a mix is a run of segments over the same rows, summed in fp32 and rounded once).

Bounds, checked before anything else touches a mix (a client's input is bounded first): at most
`MAX_ADAPTERS` adapters, distinct names, each scale a finite number in [-MAX_SCALE, MAX_SCALE].
A mix is kept in a canonical order (by name), so that the same adapters at the same scales are
one mix wherever they come from: one segment group in a step, one key in the prefix cache.

Torch-free: `lorafleet chat` parses its `--adapter NAME[:SCALE]` options with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lorafleet.errors import InvalidRequestError, shown

MAX_ADAPTERS = 16    # adapters in one mix: its segments are one task list per module
MAX_SCALE = 4.0      # |scale|: beyond, a delta dwarfs the base (and fp16 pools overflow)
FIELD = "adapters"   # the request body's field


def _bad(message: str, param: str = FIELD) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


@dataclass(frozen=True)
class Mix:
    """(name, scale) pairs, sorted by name: build with `Mix.of` (checked), never directly."""

    members: tuple[tuple[str, float], ...]

    @classmethod
    def of(cls, pairs: Mapping[str, float] | Sequence[tuple[str, float]], where: str = FIELD) -> Mix:
        """A checked mix of (name, scale) pairs (or a name -> scale mapping); InvalidRequestError
        naming `where` and the entry at fault."""
        items = list(pairs.items()) if isinstance(pairs, Mapping) else list(pairs)
        if not items:
            raise _bad(f"{where} must name at least one adapter")
        if len(items) > MAX_ADAPTERS:
            raise _bad(f"{where} names {len(items)} adapters; a request mixes at most {MAX_ADAPTERS}")
        seen: set[str] = set()
        out = []
        for i, item in enumerate(items):
            at = f"{where}[{i}]"
            if not (isinstance(item, (tuple, list)) and len(item) == 2):
                raise _bad(f"{at} must be a (name, scale) pair, got {shown(item)}")
            name, scale = item
            if not isinstance(name, str) or not name or len(name) > 128:
                raise _bad(f"{at}.name must be an adapter's name (1-128 characters), got {shown(name)}")
            if name in seen:
                raise _bad(f"{at}.name: adapter {shown(name)} appears twice; each adapter of a mix is named once")
            seen.add(name)
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
                    or abs(scale) > MAX_SCALE:
                raise _bad(f"{at}.scale must be a finite number in [-{MAX_SCALE:g}, {MAX_SCALE:g}], got {shown(scale)}")
            out.append((name, float(scale)))
        return cls(tuple(sorted(out)))

    @classmethod
    def from_json(cls, value: object, where: str = FIELD) -> Mix:
        """The request body's `adapters`: [{"name": "sql", "scale": 1.0}, ...] ("scale" defaults
        to 1.0; no other key)."""
        if not isinstance(value, list):
            raise _bad(f"{where} must be a list of {{\"name\": ..., \"scale\": ...}} objects, got "
                       f"{type(value).__name__}")
        if len(value) > MAX_ADAPTERS:  # before looking at any entry
            raise _bad(f"{where} names {len(value)} adapters; a request mixes at most {MAX_ADAPTERS}")
        pairs = []
        for i, entry in enumerate(value):
            if not isinstance(entry, dict):
                raise _bad(f"{where}[{i}] must be an object {{\"name\": ..., \"scale\": ...}}, got {shown(entry)}")
            extra = sorted(set(entry) - {"name", "scale"})
            if extra:
                raise _bad(f"{where}[{i}] has unknown field(s) {', '.join(map(repr, extra))}: only name and scale")
            if "name" not in entry:
                raise _bad(f"{where}[{i}] has no name")
            pairs.append((entry["name"], entry.get("scale", 1.0)))
        return cls.of(pairs, where)

    @classmethod
    def parse_option(cls, options: Sequence[str], where: str = "--adapter") -> Mix:
        """`NAME` or `NAME:SCALE` per option (the part after the last ':' is a scale when it reads
        as a number; a name that ends in ':<number>' is given with its scale: `v:2:1`)."""
        pairs = []
        for opt in options:
            name, sep, tail = opt.rpartition(":")
            try:
                scale = float(tail) if sep else None
            except ValueError:
                scale = None
            pairs.append((name, scale) if scale is not None else (opt, 1.0))
        return cls.of(pairs, where)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.members)

    @property
    def scales(self) -> tuple[float, ...]:
        return tuple(s for _, s in self.members)

    @property
    def label(self) -> str:
        """How stats and queues name it: `a+b*0.5` (scale 1 unwritten; '+' and '*' are in no
        adapter name)."""
        return "+".join(n if s == 1.0 else f"{n}*{s:g}" for n, s in self.members)

    def to_json(self) -> list[dict]:
        return [{"name": n, "scale": s} for n, s in self.members]

    def __str__(self) -> str:
        return self.label
