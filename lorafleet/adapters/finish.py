"""What a load finishes against the base it serves on, on the load worker, once per load
(`memory.host_cache.build_host_adapter`): DoRA's epilogue, dropping the saved copies of the
embedding or LM head that equal the base's weights, and a stored layout laid out again for the
engine's pages (`relaid`).

`base_rows(layer, group, start, end)` -> (rows [start, end) of a weight, fp32; their bias or
None): the base's weights as the engine serves them (dequantized, unpacked: `LlamaModel.base_rows`).
`group` is a projection group (qkv, o, gate_up, down), whose rows a module's start at its column
in the group's output (`Module.col`), or "embed" / "lm_head" (`layer` unused).
"""

from __future__ import annotations

import torch

from lorafleet.adapters.adapter import BaseShapes
from lorafleet.adapters.batch import GROUP_NAMES
from lorafleet.adapters.layout import Layout

ROWS = 1024  # base weight rows read at a time (bounded memory for any base)


def finish_dora(layout: Layout, buf: torch.Tensor, base_rows) -> None:
    """DoRA's epilogue from its magnitude m (in the g row, as `Layout.fill` leaves it) and the
    base: g = m / ||W + Bt^T A|| per output row (Bt already scale * B^T: the delta's own weight),
    in fp32, and c = (1 - g) * bias, the base bias the epilogue keeps (zero without one). `buf`
    is float32."""
    for m in layout.modules:
        if m.post != "dora":
            continue
        a = torch.stack([buf[o:o + m.fan_in] for o in m.a_rows.tolist()])      # [r, in]
        bt = torch.stack([buf[o:o + m.n_out] for o in m.b_rows.tolist()])     # [r, out]
        assert m.post_rows is not None  # an epilogue's rows
        g_at, c_at = (int(o) for o in m.post_rows)
        for lo in range(0, m.n_out, ROWS):
            hi = min(m.n_out, lo + ROWS)
            w, bias = base_rows(m.layer, GROUP_NAMES[m.group], m.col + lo, m.col + hi)
            norm = (w.float() + bt[:, lo:hi].t() @ a).norm(dim=1)
            g = buf[g_at + lo:g_at + hi] / norm
            buf[g_at + lo:g_at + hi] = g
            if bias is not None:
                buf[c_at + lo:c_at + hi] = (1 - g) * bias.float()


def drop_base_copies(layout: Layout, buf: torch.Tensor, base_rows, vocab: int) -> tuple[Layout, torch.Tensor]:
    """The layout and buffer without the saved embedding / LM head copies that equal the base's
    weights as served, bit for bit (fp32). Why: PEFT saves both whole beside any LoRA on the
    embedding (`save_embedding_layers`), usually unchanged, and each is vocab x hidden elements
    of pages; serving the base's instead gives the same outputs. A copy of another vocabulary,
    or that differs anywhere (a trained one, or one against a quantized base), is kept. `buf`
    (float32, read only: it may be the store's mapping) is copied only when a part is dropped."""
    same = [part for part in ("embed", "lm_head")
            if part in layout.parts and layout.parts[part].rows == vocab and _equal(layout, buf, part, base_rows)]
    if not same:
        return layout, buf
    kept = layout.without(same)
    out = torch.zeros(kept.numel, dtype=torch.float32)
    out[:layout.modules_numel] = buf[:layout.modules_numel]
    for name, p in kept.parts.items():  # each kept part's run, moved as it is (rows keep their place in a page)
        old = layout.parts[name]
        n = int(old.offsets(layout.page_elems)[-1]) + old.stride - old.first
        out[p.first:p.first + n] = buf[old.first:old.first + n]
    return kept, out


def _equal(layout: Layout, buf: torch.Tensor, part: str, base_rows) -> bool:
    """Whether the part (a copy of "embed" or "lm_head") equals the base's weight, ROWS rows at a time."""
    p = layout.parts[part]
    at, cols = torch.from_numpy(p.offsets(layout.page_elems)), torch.arange(p.width)
    return all(torch.equal(buf[at[lo:lo + ROWS, None] + cols], base_rows(0, part, lo, min(p.rows, lo + ROWS))[0])
               for lo in range(0, p.rows, ROWS))


def relaid(old: Layout, buf: torch.Tensor, page_elems: int, base: BaseShapes) -> tuple[Layout, torch.Tensor]:
    """`buf` (laid out by `old`, as the store saved it) laid out for pages of `page_elems`: the same
    modules and parts, each row copied to its new place, the gaps zero as saved (a stored adapter
    served with other pages than the store's: adapters held in 16 bits). Nothing is recomputed, so
    the result is the checked load's layout and bits."""
    new = Layout.plan(old.ranks, base, page_elems, old.posts, old.heads)
    out = torch.zeros(new.numel, dtype=buf.dtype)
    rows = [(a.a_rows, b.a_rows, a.fan_in) for a, b in zip(old.modules, new.modules)]
    rows += [(a.b_rows, b.b_rows, a.n_out) for a, b in zip(old.modules, new.modules)]
    rows += [(a.post_rows, b.post_rows, a.n_out) for a, b in zip(old.modules, new.modules)
             if a.post_rows is not None and b.post_rows is not None]
    rows += [(p.offsets(old.page_elems), new.parts[name].offsets(page_elems), p.width) for name, p in old.parts.items()]
    for src, dst, width in rows:
        cols = torch.arange(width)
        for i in range(0, len(src), ROWS):  # bounded index memory for an embedding's rows
            s, d = torch.from_numpy(src[i:i + ROWS]), torch.from_numpy(dst[i:i + ROWS])
            out[d[:, None] + cols] = buf[s[:, None] + cols]
    return new, out
