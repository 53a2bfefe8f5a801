"""Per-step LoRA metadata: which flat-batch rows use which resident adapter, as contiguous
segments (the runner orders rows by adapter so each adapter of the step is one segment per
phase), handed to the kernels' LoRA op for every projection group.

Projection groups share an input:
  qkv -> (q_proj, k_proj, v_proj), o -> (o_proj,), gate_up -> (gate_proj, up_proj), down -> (down_proj,)

One path for every segment, decode or prefill: the op reads each adapter's weights from the
pool's pages through the adapter's row table, which lives in its own pages (`kernels/reference.py`
states the contract, `adapters/layout.py` builds it). So a step's metadata is small: per segment
its first row, its end, where its adapter's row table starts, its scale and its place in a mix,
`seg` [S, SEG_FIELDS], built once on the host and copied once (by `to_device`, or into a captured
step's buffer by `engine/graphs.py`).

A request on several adapters (a mix) is one segment per adapter over the same rows, each with
its scale; the op sums their deltas in fp32 and adds them once. Its rank bound (`max_rank`) is
the sum of its members' ranks: the op treats it as one adapter of their rank rows side by side.

An adapter's own embedding, LM head and norms (`adapters/heads.py`: a LoRA on the first two, or full
copies) are applied here in torch, per segment (`embed`, `norm`, `logits`), reading them from the pool
(`HeadParts`): outside the per-layer op, once a step, and a step with them runs eagerly (not
in a captured graph nor the CPU's one-call decode), as their shapes follow the adapters.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from lorafleet.kernels.reference import GROUPS, SEG_FIELDS, lora_entry, scale_bits
from lorafleet.model.upload import Upload
from lorafleet.adapters.heads import NORM_PARTS

GROUP_INDEX = {g: i for i, g in enumerate(GROUPS)}
GROUP_NAMES = list(GROUPS)  # a group's index -> its name
MODULE_SLOTS = max(len(m) for m in GROUPS.values())  # module slots per group in a row table


OUT_ALIGN_MAX = 64  # elements: more than any kernel's widest vector


def group_shapes(features: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """Each group's widest module output (a bound of the LoRA op's grid) and its column
    alignment: the largest power of two, up to OUT_ALIGN_MAX, dividing every module's width and
    first column in the group's fused output (the GPU op then reads and writes out's rows as
    vectors), from the base's (in, out) features per module."""
    shapes = {}
    for g, modules in GROUPS.items():
        col, align = 0, OUT_ALIGN_MAX
        for m in modules:
            align = math.gcd(align, col, features[m][1])
            col += features[m][1]
        shapes[g] = (max(features[m][1] for m in modules), align)
    return shapes


PAD_LOGIT = torch.finfo(torch.float32).min  # a token outside a row's vocabulary: finite, never sampled


class HeadParts:
    """One adapter's embedding, LM head and norm matrices where they lie in the pool
    (`layout.Part`): built when its pages are known, read by `LoraBatch.embed`, `.norm` and `.logits`."""

    def __init__(self, parts: dict, pages, page_elems: int, device):
        self.page_elems = page_elems
        self.host_pages = {name: [int(pages[j]) for j in p.pages(page_elems)] for name, p in parts.items()}
        self.parts = {name: (p, torch.tensor(self.host_pages[name], dtype=torch.long, device=device))
                      for name, p in parts.items()}
        # a part whose pages are consecutive in the pool (the usual case: an adapter takes the
        # highest free pages) is read in place, without the gather's copy: its first page
        self.run_start = {name: on[0] for name, on in self.host_pages.items()
                          if on == list(range(on[0], on[0] + len(on)))}

    def __contains__(self, name: str) -> bool:
        return name in self.parts

    def matrix(self, pool: torch.Tensor, name: str) -> torch.Tensor:
        """The part [rows, width]: its whole pages gathered (one copy)."""
        p, pages = self.parts[name]
        whole = pool.index_select(0, pages)[:, :p.per * p.stride]
        return whole.reshape(-1, p.stride)[:p.rows, :p.width]

    def row(self, pool: torch.Tensor, name: str, i: int) -> torch.Tensor:
        """Row i of the part, a view of the pool (a saved norm's weight for layer i)."""
        p, _ = self.parts[name]
        at = self.host_pages[name][i // p.per] * self.page_elems + (i % p.per) * p.stride
        return pool.view(-1)[at:at + p.width]

    def project(self, pool: torch.Tensor, name: str, x: torch.Tensor) -> torch.Tensor:
        """x [n, width] @ part^T: [n, rows]. In place over consecutive pages (a batched matmul
        over a strided view: [pages, per, width]), else on the gathered matrix (widened to x's
        dtype where the pool holds adapters narrower: `PagePool.adapter_dtype`)."""
        p, pages = self.parts[name]
        start = self.run_start.get(name)
        if start is None or pool.dtype != x.dtype:
            return x @ self.matrix(pool, name).to(x.dtype).t()
        view = pool[start:start + len(pages), :p.per * p.stride].unflatten(1, (p.per, p.stride))[..., :p.width]
        return torch.matmul(view, x.t()).flatten(0, 1)[:p.rows].t()

    def lookup(self, pool: torch.Tensor, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the part [len(ids), width]."""
        p, pages = self.parts[name]
        at = pages[ids // p.per] * self.page_elems + (ids % p.per) * p.stride
        return pool.view(-1)[at[:, None] + torch.arange(p.width, device=ids.device)]


class LoraBatch:
    def __init__(self, kernels, pool_tensor: torch.Tensor, shapes: dict[str, tuple[int, int]]):
        """`kernels`: the model's `kernels.backend.Kernels`; `pool_tensor` [pages, page_elems], the pool
        as its adapters are held (`PagePool.adapter_tensor`);
        `shapes`: `group_shapes` of the base."""
        self.kernels = kernels
        self.weights = pool_tensor.view(-1)
        self.shapes = shapes
        self.host = np.zeros((0, SEG_FIELDS), dtype=np.int64)  # [S, 5] (start, end, row table, scale, mix)
        self.seg: torch.Tensor | None = None           # the same on the pool's device, once copied
        self._seg_at = -1                               # `host`'s column in the step's Upload (`stage`)
        self.max_rows = self.max_rank = 0
        self._rows: list[tuple[int, int, int, int, int]] = []
        self._split: dict[int, np.ndarray] = {}
        self.pool = pool_tensor
        self.heads: list[tuple[int, int, list[tuple[HeadParts, float]]]] = []  # (start, end, its adapters')
        self.norms: set[str] = set()  # the saved norms' parts some segment reads ("in_norm", "post_norm", "final_norm")

    @classmethod
    def fixed(cls, kernels, pool_tensor: torch.Tensor, shapes: dict[str, tuple[int, int]], seg: torch.Tensor,
              max_rows: int, max_rank: int) -> LoraBatch:
        """A batch over a fixed buffer with static bounds (a captured decode step: `engine/graphs.py`)."""
        batch = cls(kernels, pool_tensor, shapes)
        batch.seg, batch.max_rows, batch.max_rank = seg, max_rows, max_rank
        return batch

    def add_rows(self, start: int, end: int, tables: list[tuple[int, float]], max_rank: int) -> None:
        """Rows [start, end) use the adapters whose row tables start at these int64 indices of the
        pool, each delta times its scale ((table, 1.0): one adapter; several: a mix, summed);
        `max_rank`: the sum of their largest ranks."""
        n = len(tables)
        for j, (table, scale) in enumerate(tables):
            self._rows.append((start, end, table, scale_bits(scale), n if j == 0 else -j))
        self.max_rank = max(self.max_rank, max_rank)

    def add_heads(self, start: int, end: int, members: list[tuple[HeadParts, float]]) -> None:
        """Rows [start, end) read these adapters' own embedding / LM head / norm parts, each at its scale."""
        self.heads.append((start, end, members))
        self.norms |= {part for m, _ in members for part in NORM_PARTS.values() if part in m}

    def norm(self, layer: int, part: str, x: torch.Tensor, h: torch.Tensor, rms_norm, eps: float) -> None:
        """h (`part`, a layer's norm, of the residual stream x [T, H]): the rows of each segment whose
        adapter saved that norm computed again with its own weight (PEFT's modules_to_save)."""
        for start, end, members in self.heads:
            for m, _ in members:
                if part in m:
                    h[start:end] = rms_norm(x[start:end], m.row(self.pool, part, layer).to(x.dtype), eps)

    def final_norm(self, pre: torch.Tensor, rows: torch.Tensor, h: torch.Tensor, rms_norm, eps: float) -> None:
        """h (the final norm of `pre` [S, H], flat rows `rows`): each segment's rows whose adapter
        saved the final norm computed again with its own weight."""
        for start, end, members in self.heads:
            for m, _ in members:
                if "final_norm" in m:
                    sel = torch.nonzero((rows >= start) & (rows < end)).flatten()
                    if len(sel):
                        h[sel] = rms_norm(pre[sel], m.row(self.pool, "final_norm", 0).to(pre.dtype), eps)

    def embed(self, ids: torch.Tensor, x: torch.Tensor) -> None:
        """x [T, H] (the base's embedding of `ids`): each head segment's rows replaced by its
        adapter's own embedding, then its embedding LoRA added (PEFT's base_layer + delta)."""
        for start, end, members in self.heads:
            seg = ids[start:end]
            for h, _ in members:
                if "embed" in h:
                    x[start:end] = h.lookup(self.pool, "embed", seg)
            for h, scale in members:
                if "embed_a" in h:
                    delta = h.lookup(self.pool, "embed_a", seg).float() @ h.matrix(self.pool, "embed_b").float()
                    x[start:end] += (delta * scale).to(x.dtype)

    def logits(self, h: torch.Tensor, rows: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [S, V] (fp32, the base's head on the final hidden states `h` [S, H] of flat
        rows `rows`) with each head segment's rows from its adapter's own LM head and LM-head
        LoRA. An adapter with its own vocabulary has as many logits as it has tokens: the result
        is as wide as the widest, a row's tokens past its own vocabulary at PAD_LOGIT."""
        done = []
        for start, end, members in self.heads:
            sel = torch.nonzero((rows >= start) & (rows < end)).flatten()
            if not len(sel) or not any("lm_head" in m or "lm_head_a" in m for m, _ in members):
                continue
            hs = h[sel]
            out = next((m.project(self.pool, "lm_head", hs).float() for m, _ in members if "lm_head" in m), None)
            out = logits[sel] if out is None else out
            for m, scale in members:
                if "lm_head_a" in m:
                    down = hs.float() @ m.matrix(self.pool, "lm_head_a").float().t()
                    out = out + scale * (down @ m.matrix(self.pool, "lm_head_b").float().t())
            done.append((sel, out))
        width = max([logits.shape[1]] + [out.shape[1] for _, out in done])
        if width > logits.shape[1]:
            logits = torch.cat([logits, logits.new_full((logits.shape[0], width - logits.shape[1]), PAD_LOGIT)], 1)
        for sel, out in done:
            if out.shape[1] < width:
                out = torch.cat([out, out.new_full((out.shape[0], width - out.shape[1]), PAD_LOGIT)], 1)
            logits[sel] = out
        return logits

    def finish(self) -> LoraBatch:
        """The step's segments, on the host."""
        self.host = np.array(self._rows, dtype=np.int64).reshape(-1, SEG_FIELDS)
        self.max_rows = int((self.host[:, 1] - self.host[:, 0]).max(initial=0))
        return self

    def split(self, rows: int) -> np.ndarray:
        """The segments cut into runs of at most `rows` rows: [S', SEG_FIELDS] (a captured step's
        grid has one row block of `rows` per segment). A mix is cut as one: each run of its rows
        is a mix again (its lead, then its followers), so the runs of a mix stay together."""
        if rows not in self._split:
            self._split[rows] = self._cut(rows)
        return self._split[rows]

    def _cut(self, rows: int) -> np.ndarray:
        """Array operations, no loop per segment (a captured step runs this every step): mix g of
        n[g] segments and p[g] runs gives n[g] * p[g] rows, run q's members j in order."""
        h = self.host
        lead = np.flatnonzero(h[:, 4] >= 1)
        n, lo, hi = h[lead, 4], h[lead, 0], h[lead, 1]
        count = n * (-(-(hi - lo) // rows))                       # an empty mix: no run
        g = np.repeat(np.arange(len(lead)), count)
        local = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
        q, j = local // n[g], local % n[g]
        out = h[lead[g] + j]                                     # a copy (fancy indexing)
        out[:, 0] = lo[g] + q * rows
        out[:, 1] = np.minimum(out[:, 0] + rows, hi[g])
        return out

    def stage(self, up: Upload) -> None:
        """Adds the host's [S, SEG_FIELDS] to `up` (a step's one copy), which `landed` reads once sent."""
        self._seg_at = up.add(self.host)

    def landed(self, up: Upload) -> LoraBatch:
        """`seg` for the kernels: the staged column on the pool's device, from `up` once sent."""
        self.seg = up.sent[self._seg_at]
        return self

    def to_device(self) -> LoraBatch:
        """`stage` and `landed` in a copy of its own (none on the CPU), for a batch used alone."""
        up = Upload()
        self.stage(up)
        up.send(self.weights.device)
        return self.landed(up)

    def apply(self, layer: int, group: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += each row's adapter delta for `group` of `layer` (rows in no segment untouched)."""
        entry = lora_entry(layer, GROUP_INDEX[group], len(GROUPS), MODULE_SLOTS)
        width, align = self.shapes[group]
        self.kernels.lora(x, out, self.weights, self.seg, entry, len(GROUPS[group]), self.max_rows, self.max_rank,
                          width, align)
