"""Per-step LoRA metadata: which flat-batch rows use which resident adapter, as contiguous
segments (the runner orders rows by adapter so each adapter of the step is one segment per
phase), handed to the shrink/expand op for every projection group.

Projection groups share an input, so their shrinks fuse into one matmul:
  qkv -> (q_proj, k_proj, v_proj), o -> (o_proj,), gate_up -> (gate_proj, up_proj), down -> (down_proj,)
"""

from __future__ import annotations

from lorafleet.kernels.reference import LoraSegment, lora_shrink_expand

GROUPS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


class LoraBatch:
    """segments[layer][group] -> list of LoraSegment, built once per step."""

    def __init__(self, num_layers: int):
        self.segments = [{g: [] for g in GROUPS} for _ in range(num_layers)]
        self.adapters: set[str] = set()

    def add_rows(self, start: int, end: int, adapter_views) -> None:
        """Rows [start, end) use the adapter whose per-(layer, group) views are given
        (see `residency.ResidentAdapter.views`)."""
        for layer, groups in enumerate(adapter_views):
            for group, view in groups.items():
                a, bs = view
                self.segments[layer][group].append(LoraSegment(start, end, a, bs))

    def apply(self, layer: int, group: str, x, outs) -> None:
        segs = self.segments[layer][group]
        if segs:
            lora_shrink_expand(x, outs, segs)
