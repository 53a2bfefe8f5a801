"""How an adapter is laid out as one flat buffer, in host memory and in pool pages, and the row
table the kernels read it through.

Per layer and projection group (see `adapters/batch.py`): the A matrices of the group's targeted
modules, then each module's Bt = (scale * B)^T, [r, out], and, for a module with an epilogue
(DoRA, lora_bias: `adapters/adapter.py`), its two rows g and c of [out] after its Bt. Offsets are
logical (from the buffer's start): in the pool the buffer is cut into pages of `page_elems` that
may lie anywhere. Every rank row (a row of A over `in`, a row of Bt over `out`) starts at a
multiple of `ROW_ALIGN` elements and never crosses a page: a row that would is moved to the next
page's start. So once the pages are known, each row is one contiguous run of the pool, and the
kernels read it through one pointer (the row table, `kernels/reference.py`'s contract), as
vectors, never element by element through a page table. The padding costs at most one row per
page boundary.

The row table follows the weights in the same pages: per (layer, group, module slot) the fields
(r, n_out, col, a_rows, b_rows, g_row, c_row), then for each targeted module its r pointers to
A's rows and r to Bt's (each list, and the fields, inside one page). It is built when the pages
are assigned (`row_table`), and rebuilt only when they change (an adapter evicted and loaded
again gets new pages and a new table).

The store keeps each adapter's weights laid out once, at pull (`save` / `read_saved`: the file
`LAYOUT_FILE` beside the PEFT files, a safetensors file of one float32 tensor, the page size and
the ranks in its metadata). Loading a stored adapter is then a memory map and one copy into pages:
no tensor is parsed, checked, hashed, scaled or transposed again (a DoRA adapter's g alone is
computed at each load, from the base it serves on: `finish_dora`). The buffer is float32 whatever
the pool's dtype (the copy into a bf16 or fp16 pool rounds once, as a checked load does:
`memory.host_cache`); a file of another `LAYOUT_VERSION`, or laid out for a page size that does
not divide the engine's, is not read (the adapter then loads as any folder does). One that divides
it (adapters held in 16 bits: twice the elements a page) is laid out again from the saved rows.
"""

from __future__ import annotations

import json
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from lorafleet.errors import AdapterError
from lorafleet.kernels.reference import ROW_ALIGN, TABLE_FIELDS, lora_entry
from lorafleet.adapters.adapter import BaseShapes, LoraAdapter
from lorafleet.adapters.batch import GROUP_INDEX, GROUP_NAMES, GROUPS, MODULE_SLOTS
from lorafleet.adapters.heads import COPY_PARTS, HEAD_MODULES, IN_NORM, NORM_PARTS, PARTS, POST_NORM, matrices

LAYOUT_FILE = "lorafleet-layout.safetensors"
LAYOUT_VERSION = "4"  # bump when the buffer's arrangement or this file's form changes


def _align(n: int) -> int:
    return -(-n // ROW_ALIGN) * ROW_ALIGN


def place_rows(o: int, length: int, count: int, page_elems: int) -> tuple[np.ndarray, int]:
    """Logical offsets of `count` rows of `length` elements from offset `o` on: each at a multiple
    of ROW_ALIGN, none crossing a page (one that would starts the next page). Returns (offsets,
    the offset past the last row)."""
    stride = _align(length)
    if stride > page_elems:
        raise AdapterError(f"a rank row or row pointer list of {length} elements does not fit in a page of "
                           f"{page_elems} (the rank is too large for this base's pages: raise block_size)")
    o = _align(o)
    first = min(count, (page_elems - o % page_elems) // stride)       # rows left in this page
    out = o + np.arange(first, dtype=np.int64) * stride
    if first == count:
        return out, o + first * stride
    per = page_elems // stride                                         # rows in a whole page
    i = np.arange(count - first, dtype=np.int64)
    rest = (o // page_elems + 1 + i // per) * page_elems + (i % per) * stride
    return np.concatenate([out, rest]), int(rest[-1]) + stride


def pieces(pages, page_elems: int, o: int, n: int) -> list[tuple[int, int, int]]:
    """Where the adapter's logical elements [o, o + n) lie in the pool (logical page j is pool page
    pages[j]): (pool element offset, offset in the range, length) per run, consecutive pages
    merged into one run."""
    out: list[list[int]] = []
    done = 0
    while done < n:
        j, lo = divmod(o + done, page_elems)
        take = min(n - done, page_elems - lo)
        at = int(pages[j]) * page_elems + lo
        if out and out[-1][0] + out[-1][2] == at:
            out[-1][2] += take
        else:
            out.append([at, done, take])
        done += take
    return [(p[0], p[1], p[2]) for p in out]


def page_problem(base: BaseShapes, page_elems: int, itemsize: int) -> str | None:
    """Why pages of `page_elems` elements of `itemsize` bytes cannot hold this base's adapters
    (a rank row, or a row table's fields, larger than a page; pages not ROW_ALIGN-aligned), or None."""
    widest = max(_align(max(features)) for features in base.features.values())
    fields = base.num_layers * len(GROUPS) * MODULE_SLOTS * TABLE_FIELDS * (8 // itemsize)
    if page_elems % ROW_ALIGN:
        return f"a page of {page_elems} elements is not a multiple of {ROW_ALIGN}"
    if max(widest, fields) > page_elems:
        return (f"a page holds {page_elems} elements, but an adapter's rank row or row table needs "
                f"{max(widest, fields)}: raise block_size")
    return None


@dataclass(frozen=True)
class Module:
    """One targeted module of one layer: where its rows are (logical offsets)."""

    layer: int
    group: int          # index into GROUPS
    slot: int           # the module's place in its group
    col: int            # its first column in the group's fused output
    fan_in: int
    n_out: int
    a_rows: np.ndarray  # [r] int64: A's rows, [fan_in] each
    b_rows: np.ndarray  # [r] int64: Bt's rows, [n_out] each
    post: str | None = None               # its epilogue: "dora", "bias" or None
    post_rows: np.ndarray | None = None   # [2] int64: the epilogue's rows g and c, [n_out] each

    @property
    def r(self) -> int:
        return len(self.a_rows)

    def __eq__(self, other) -> bool:
        return (isinstance(other, Module) and (self.layer, self.group, self.slot, self.col, self.fan_in, self.n_out,
                                               self.post)
                == (other.layer, other.group, other.slot, other.col, other.fan_in, other.n_out, other.post)
                and np.array_equal(self.a_rows, other.a_rows) and np.array_equal(self.b_rows, other.b_rows)
                and np.array_equal(self.post_rows, other.post_rows))  # type: ignore[arg-type]  # None equals None


@dataclass(frozen=True)
class Part:
    """One matrix of the embedding's or LM head's (`adapters/heads.py`): `rows` rows of `width`,
    from `first` (a page's start) on, `per` rows a page at a stride of `stride`: row i is at
    first + (i // per) * page + (i % per) * stride (what `place_rows` gives from a page's start),
    so the whole matrix is whole pages, gathered at once, and a row is found without a table."""

    first: int
    rows: int
    width: int
    stride: int
    per: int

    def pages(self, page_elems: int) -> range:
        """The logical pages it lies in."""
        return range(self.first // page_elems, self.first // page_elems + -(-self.rows // self.per))

    def offsets(self, page_elems: int) -> np.ndarray:
        i = np.arange(self.rows, dtype=np.int64)
        return self.first + (i // self.per) * page_elems + (i % self.per) * self.stride


@dataclass
class Layout:
    """Where each rank row sits in the flat buffer of `numel` elements (the weights; the row
    table follows them once the pool's element size is known: `paged_numel`, `row_table`)."""

    modules: list[Module]
    numel: int
    page_elems: int
    num_layers: int
    parts: dict[str, Part] = field(default_factory=dict)  # the embedding's and LM head's matrices, after the modules' rows
    modules_numel: int = 0  # where the modules' rows end (the parts start at the next page)

    @classmethod
    def plan(cls, ranks: dict[tuple[int, str], int], base: BaseShapes, page_elems: int,
             posts: dict[tuple[int, str], str] | None = None,
             heads: dict[str, tuple[int, int]] | None = None) -> Layout:
        """The layout of an adapter whose (layer, module) pairs have these ranks (0 or absent:
        not targeted) and these epilogues ("dora" or "bias"), and whose embedding and LM head
        parts have these (rows, width), for pages of `page_elems`."""
        posts = posts or {}
        modules, off = [], 0
        for layer in range(base.num_layers):
            for group, names in GROUPS.items():
                present = [(j, m, ranks[(layer, m)]) for j, m in enumerate(names) if ranks.get((layer, m), 0) > 0]
                cols = np.concatenate([[0], np.cumsum([base.features[m][1] for m in names])]).tolist()
                a_rows = []
                for j, m, r in present:
                    rows, off = place_rows(off, base.features[m][0], r, page_elems)
                    a_rows.append(rows)
                for (j, m, r), a in zip(present, a_rows):
                    fan_in, n_out = base.features[m]
                    b, off = place_rows(off, n_out, r, page_elems)
                    post, post_rows = posts.get((layer, m)), None
                    if post is not None:
                        post_rows, off = place_rows(off, n_out, 2, page_elems)
                    modules.append(Module(layer, GROUP_INDEX[group], j, cols[j], fan_in, n_out, a, b, post, post_rows))
        parts, end = _place_parts(off, heads or {}, page_elems)
        return cls(modules, end, page_elems, base.num_layers, parts, off)

    def without(self, names) -> Layout:
        """The same modules with the parts `names` left out (the others placed again after them)."""
        parts, end = _place_parts(self.modules_numel, {n: h for n, h in self.heads.items() if n not in names},
                                  self.page_elems)
        return Layout(self.modules, end, self.page_elems, self.num_layers, parts, self.modules_numel)

    @classmethod
    def of(cls, adapter: LoraAdapter, base: BaseShapes, page_elems: int) -> Layout:
        heads = {name: (m.shape[0], m.shape[1]) for name, m in matrices(adapter.heads).items()}
        return cls.plan({key: w.rank for key, w in adapter.weights.items()}, base, page_elems, adapter.posts, heads)

    @property
    def saved(self) -> tuple[str, ...]:
        """The modules the adapter holds its own copy of ("embed_tokens", "lm_head", the norms)."""
        return tuple(m for part, m in SAVED_PARTS.items() if part in self.parts)

    @property
    def heads(self) -> dict[str, tuple[int, int]]:
        """Part -> (rows, width): what `plan` takes."""
        return {name: (p.rows, p.width) for name, p in self.parts.items()}

    @property
    def ranks(self) -> dict[tuple[int, str], int]:
        return {(m.layer, GROUPS[GROUP_NAMES[m.group]][m.slot]): m.r for m in self.modules}

    @property
    def posts(self) -> dict[tuple[int, str], str]:
        return {(m.layer, GROUPS[GROUP_NAMES[m.group]][m.slot]): m.post for m in self.modules if m.post}

    def fill(self, buf: torch.Tensor, adapter: LoraAdapter) -> None:
        """Write the adapter's tensors into `buf` (flat, zeroed) at their rows, B scaled and
        transposed: one copy per run of rows that lie back to back."""
        for m in self.modules:
            w = adapter.weights[(m.layer, GROUPS[GROUP_NAMES[m.group]][m.slot])]
            for k0, k1, o in _runs(m.a_rows, m.fan_in):
                buf[o:o + (k1 - k0) * m.fan_in].copy_(w.a[k0:k1].reshape(-1))
            for k0, k1, o in _runs(m.b_rows, m.n_out):
                torch.mul(w.b[:, k0:k1].t(), w.scale, out=buf[o:o + (k1 - k0) * m.n_out].view(k1 - k0, m.n_out))
            if m.post == "bias":    # g = 1, c = scale * b_B
                assert m.post_rows is not None and w.bias is not None  # a bias epilogue's
                g, c = (int(o) for o in m.post_rows)
                buf[g:g + m.n_out].fill_(1.0)
                torch.mul(w.bias, w.scale, out=buf[c:c + m.n_out])
            elif m.post == "dora":  # m itself: g = m / ||W + scale B A|| once the base is known (`finish_dora`)
                assert m.post_rows is not None and w.magnitude is not None  # a DoRA epilogue's
                g = int(m.post_rows[0])
                buf[g:g + m.n_out].copy_(w.magnitude)
        for name, mat in matrices(adapter.heads).items():  # a page's rows at a time
            p = self.parts[name]
            for k, page in enumerate(p.pages(self.page_elems)):
                rows = mat[k * p.per:(k + 1) * p.per]
                o = p.first + k * self.page_elems
                buf[o:o + len(rows) * p.stride].view(len(rows), p.stride)[:, :p.width].copy_(rows)

    def targets(self) -> set[tuple[int, str]]:
        """The (layer, module) pairs the adapter has weights for; its own embedding (a LoRA or a
        copy) counts as (0, "embed_tokens"), its LM head as (last layer, "lm_head"): what the
        prefix cache keys by (`memory.kv.kv_salt`); saved layer norms count in every layer, the
        final norm as the LM head."""
        out = set(self.ranks)
        if self.parts.keys() & {"embed", "embed_a"}:
            out.add((0, "embed_tokens"))
        if self.parts.keys() & {"lm_head", "lm_head_a", "final_norm"}:
            out.add((self.num_layers - 1, "lm_head"))
        for kind in (IN_NORM, POST_NORM):  # the kind is the module's name in each layer
            if NORM_PARTS[kind] in self.parts:
                out |= {(layer, kind) for layer in range(self.num_layers)}
        return out

    # -- the row table ---------------------------------------------------------------------------
    def _table_plan(self, itemsize: int) -> tuple[int, list[tuple[int, int]], int]:
        """(the fields' logical offset, each module's two pointer lists', the end), in elements of
        `itemsize` bytes: the fields [layers, groups, slots, TABLE_FIELDS] int64 first, then the
        lists, each inside one page."""
        per = 8 // itemsize  # elements an int64 takes
        fields = self.num_layers * len(GROUPS) * MODULE_SLOTS * TABLE_FIELDS * per
        (start,), off = place_rows(self.numel, fields, 1, self.page_elems)
        lists = []
        for m in self.modules:
            ab, off = place_rows(off, m.r * per, 2, self.page_elems)
            lists.append((int(ab[0]), int(ab[1])))
        return int(start), lists, off

    def paged_numel(self, itemsize: int) -> int:
        """Elements (of `itemsize` bytes) the adapter takes in pages: its weights and row table."""
        return self._table_plan(itemsize)[2]

    def table_index(self, pages, itemsize: int) -> int:
        """The int64 index in the pool at which the row table's fields start (`row_table`'s last)."""
        start = self._table_plan(itemsize)[0]
        return (pages[start // self.page_elems] * self.page_elems + start % self.page_elems) // (8 // itemsize)

    def row_table(self, pages, itemsize: int) -> tuple[int, np.ndarray, int]:
        """The row table for the adapter in `pages` (logical page j is pool page pages[j]), with
        the pool's element size: (its logical offset, the int64 words from there to its end, with
        zeros in the gaps, to copy into the pages at that offset; the int64 index in the pool at
        which its fields start: the `table` of a segment using this adapter)."""
        pages = np.asarray(pages, dtype=np.int64)
        E, per = self.page_elems, 8 // itemsize

        def pool(o):  # logical element offsets -> pool element offsets
            return pages[o // E] * E + o % E

        start, lists, end = self._table_plan(itemsize)
        words = np.zeros((end - start) // per, dtype=np.int64)
        for m, (a_at, b_at) in zip(self.modules, lists):
            f = lora_entry(m.layer, m.group, len(GROUPS), MODULE_SLOTS) + m.slot * TABLE_FIELDS
            g_row, c_row = pool(m.post_rows).tolist() if m.post else (-1, -1)
            words[f:f + TABLE_FIELDS] = (m.r, m.n_out, m.col, pool(a_at) // per, pool(b_at) // per, g_row, c_row)
            words[(a_at - start) // per:][:m.r] = pool(m.a_rows)
            words[(b_at - start) // per:][:m.r] = pool(m.b_rows)
        return start, words, int(pool(start)) // per


def _place_parts(off: int, heads: dict[str, tuple[int, int]], page_elems: int) -> tuple[dict[str, Part], int]:
    """Each part (rows, width), in PARTS' order, from the first page start at or after `off`;
    returns them and the offset past the last."""
    parts = {}
    for name in PARTS:
        if name not in heads:
            continue
        rows, width = heads[name]
        first = -(-off // page_elems) * page_elems
        (_, off) = place_rows(first, width, rows, page_elems) if rows else (None, first)
        stride = _align(width)
        parts[name] = Part(first, rows, width, stride, page_elems // stride)
    return parts, off


# a saved copy's part -> the module's name as users write it (`AdapterEntry.saved`)
SAVED_PARTS = {part: HEAD_MODULES[kind] for kind, part in COPY_PARTS.items()}


def _runs(rows: np.ndarray, length: int):
    """(first row, row past the last, offset) of each run of rows lying back to back."""
    breaks = np.flatnonzero(np.diff(rows) != length) + 1
    bounds = [0, *breaks.tolist(), len(rows)]
    return [(k0, k1, int(rows[k0])) for k0, k1 in zip(bounds, bounds[1:])]


def save(path: Path, adapter: LoraAdapter, base: BaseShapes, page_elems: int) -> None:
    """Write `adapter` (validated: `load_adapter`) laid out for pages of `page_elems`, float32, as
    the file `path`."""
    layout = Layout.of(adapter, base, page_elems)
    buf = torch.zeros(layout.numel, dtype=torch.float32)
    layout.fill(buf, adapter)
    module_ranks = sorted([layer, module, r] for (layer, module), r in layout.ranks.items())
    posts = sorted([layer, module, kind] for (layer, module), kind in layout.posts.items())
    meta = {"format": "lorafleet-layout", "version": LAYOUT_VERSION, "digest": adapter.digest,
            "page_elems": str(page_elems), "module_ranks": json.dumps(module_ranks, separators=(",", ":")),
            "posts": json.dumps(posts, separators=(",", ":")),
            "heads": json.dumps(layout.heads, sort_keys=True, separators=(",", ":")),
            "ranks": json.dumps(adapter.ranks, sort_keys=True)}
    header = json.dumps({"__metadata__": meta, "layout": {"dtype": "F32", "shape": [layout.numel],
                                                          "data_offsets": [0, 4 * layout.numel]}},
                        sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)  # safetensors' alignment of the data
    # Written here rather than by safetensors' save_file, whose header order varies from call to
    # call: the same adapter must give the same bytes (one blob, one snapshot in the store).
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        buf.numpy().tofile(f)


def read_saved(path: Path, digest: str, base: BaseShapes,
               page_elems: int) -> tuple[Layout, torch.Tensor, dict[str, int]] | None:
    """The layout, the float32 buffer (a read-only view of the memory-mapped file: nothing is
    read until it is copied) and the ranks saved at `path` for the adapter of `digest`; None
    when there is no such file, or it was written by another layout version, for other weights
    or for a page size that does not divide `page_elems`. A divisor (pages of adapters held in 16
    bits, `--lora-dtype`, hold twice the elements) gives the layout as saved, which the caller lays
    out again (`finish.relaid`). The file is the store's (written by `save` at pull, read-only
    since): trusted."""
    try:
        mapped = np.memmap(path, mode="r")
    except (FileNotFoundError, ValueError):  # ValueError: an empty file
        return None
    (n,) = struct.unpack("<Q", mapped[:8].tobytes())
    header = json.loads(mapped[8:8 + n].tobytes())
    meta = header.get("__metadata__", {})
    saved_elems = int(meta.get("page_elems", "0")) if str(meta.get("page_elems", "")).isdigit() else 0
    if (meta.get("version") != LAYOUT_VERSION or meta.get("digest") != digest
            or saved_elems <= 0 or page_elems % saved_elems):
        return None
    start, end = header["layout"]["data_offsets"]
    with warnings.catch_warnings():  # read-only memory: the buffer is only copied from
        warnings.simplefilter("ignore", UserWarning)
        buf = torch.from_numpy(mapped[8 + n + start: 8 + n + end]).view(torch.float32)
    ranks = {(layer, module): r for layer, module, r in json.loads(meta["module_ranks"])}
    posts = {(layer, module): kind for layer, module, kind in json.loads(meta["posts"])}
    heads = {name: tuple(shape) for name, shape in json.loads(meta["heads"]).items()}
    layout = Layout.plan(ranks, base, saved_elems, posts, heads)
    assert layout.numel == buf.numel(), f"{path}: the saved layout disagrees with its plan"
    return layout, buf, json.loads(meta["ranks"])
