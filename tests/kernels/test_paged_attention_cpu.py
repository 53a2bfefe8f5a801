"""The CPU paged-decode kernel computes what the gather + SDPA reference computes."""

from __future__ import annotations

import pytest
import torch

from lorafleet import Engine, SamplingParams
from lorafleet.engine.request import Request
from lorafleet.engine.scheduler import Chunk
from lorafleet.kernels import paged_attention_cpu
from lorafleet.kernels import reference

# with LORAFLEET_REQUIRE_CPU_KERNELS=1 (CI), load() raises instead: a broken build fails, never skips
# a string, read as each test starts: collecting the tree builds nothing (a session of unit tests builds no kernel)
pytestmark = pytest.mark.skipif("paged_attention_cpu.load() is None", reason="the kernel does not build here")


def scattered_case(seed: int, heads: int, kv_heads: int, dim: int, block: int, lens: list[int],
                   dtype: torch.dtype = torch.float32):
    """q [B, heads, dim], one layer's strided view of a pool (as the model passes it) whose pages
    the sequences hold in random order, their tables (page 0 past a context's last page) and
    lengths, in `dtype`."""
    g = torch.Generator().manual_seed(seed)
    pages, layers = 40, 3
    kv = torch.randn(pages, layers, 2, block, kv_heads, dim, generator=g).to(dtype)[:, 1]
    perm = torch.randperm(pages, generator=g).tolist()
    width = max(-(-n // block) for n in lens)
    tables, at = [], 0
    for n in lens:
        nb = -(-n // block)
        tables.append(perm[at:at + nb] + [0] * (width - nb))
        at += nb
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    return q, kv, torch.tensor(tables), torch.tensor(lens)


@pytest.mark.parametrize("heads, kv_heads, dim, block", [(4, 2, 16, 16), (9, 3, 64, 16), (8, 8, 8, 4), (6, 1, 24, 8)])
def test_kernel_matches_the_reference_on_scattered_pages(heads, kv_heads, dim, block, variant):
    q, kv, tables, lens = scattered_case(heads * 100 + dim, heads, kv_heads, dim, block,
                                         [1, block, block + 1, 3 * block - 2, 5])
    ref = reference.paged_decode(q, kv, tables, lens, dim ** -0.5)
    got = paged_attention_cpu.paged_decode(q, kv, tables, lens, dim ** -0.5)
    assert (got - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("op", ["reference", "cpu"])
def test_slots_past_a_sequences_end_never_reach_its_output_even_as_nan(op):
    # a page reused for KV keeps its former bytes (another sequence's KV, an adapter's row table,
    # whose int64 -1 reads as NaN) in the slots the sequence has not written
    heads, kv_heads, dim, block = 4, 2, 16, 16
    q, kv, tables, lens = scattered_case(3, heads, kv_heads, dim, block, [1, block + 1, 5])
    fn = reference.paged_decode if op == "reference" else paged_attention_cpu.paged_decode
    clean = fn(q, kv, tables, lens, dim ** -0.5)
    dirty = kv.clone()
    for b, n in enumerate(lens.tolist()):
        for t in range(n, -(-n // block) * block):  # the rest of its last page
            dirty[tables[b, t // block], :, t % block] = float("nan")
    assert torch.equal(fn(q, dirty, tables, lens, dim ** -0.5), clean)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q_is_read_in_place_from_the_qkv_rows(dtype, variant):
    """The decode driver hands the kernel q as the qkv projection leaves it: [B, H, D] cut from
    [B, H + 2 KVH, D], rows strided, no copy; it gives what a contiguous q gives. A q whose heads
    are not side by side is refused by name (the Python wrapper copies such a q first)."""
    heads, kv_heads, dim, block = 8, 4, 32, 16
    q, kv, tables, lens = scattered_case(7, heads, kv_heads, dim, block, [1, block + 1, 40], dtype)
    qkv = torch.randn(3, heads + 2 * kv_heads, dim).to(dtype)
    qkv[:, :heads] = q
    view = qkv[:, :heads]
    assert not view.is_contiguous()
    out = torch.empty(q.shape, dtype=dtype)
    paged_attention_cpu.load().paged_decode(view, kv, tables, lens, dim ** -0.5, out)
    assert torch.equal(out, paged_attention_cpu.paged_decode(q, kv, tables, lens, dim ** -0.5))
    swapped = q.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, heads not contiguous
    with pytest.raises(RuntimeError, match="paged_decode: q"):
        paged_attention_cpu.load().paged_decode(swapped, kv, tables, lens, dim ** -0.5, out)
    assert torch.equal(paged_attention_cpu.paged_decode(swapped, kv, tables, lens, dim ** -0.5), out)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("batch", [1, 2, 3])
@pytest.mark.parametrize("heads, kv_heads", [(8, 4), (16, 8), (6, 2), (6, 3)])
def test_a_small_batch_splits_its_kv_heads_between_tasks(batch, heads, kv_heads, variant, two_threads):
    """Below two sequences a thread, a task takes only some of a sequence's kv heads (halved
    while even: 4 -> 2 -> 1 for one sequence on 2 threads); every split gives the reference."""
    block, dim = 8, 16
    q, kv, tables, lens = scattered_case(batch * 10 + kv_heads, heads, kv_heads, dim, block,
                                         [3 * block + 1, block, 5][:batch])
    ref = reference.paged_decode(q, kv, tables, lens, dim ** -0.5)
    got = paged_attention_cpu.paged_decode(q, kv, tables, lens, dim ** -0.5)
    assert (got - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 4, 64), (6, 3, 24), (4, 4, 8)])
def test_bf16_pages_give_the_fp32_reference_rounded_once(heads, kv_heads, dim, variant):
    """bf16 q and pages, fp32 scores, softmax and sums: each output element is the fp32 reference
    on the same values, rounded once to bf16 (half a bf16 step, 2^-9 relative; 2^-8 allowed)."""
    block = 16
    q, kv, tables, lens = scattered_case(dim, heads, kv_heads, dim, block, [1, 2 * block + 3, 70], torch.bfloat16)
    got = paged_attention_cpu.paged_decode(q, kv, tables, lens, dim ** -0.5)
    assert got.dtype == torch.bfloat16
    ref = reference.paged_decode(q.float(), kv.float(), tables, lens, dim ** -0.5)
    assert ((got.float() - ref).abs() <= 2 ** -8 * ref.abs() + 1e-6).all()


def test_a_bf16_engine_decodes_on_the_kernel(llama_dir, monkeypatch):
    """A bf16 engine's decode rows go to the kernel (the torch path's gather + SDPA before): a
    prefill, then two decode steps of two sequences, the logits the torch path's within bf16 noise."""
    logits = {}
    for kernels in ("cpu", "torch"):
        monkeypatch.setenv("LORAFLEET_KERNELS", kernels)
        engine = Engine(llama_dir, pool_bytes=4 << 20, dtype="bfloat16")
        assert (engine.model.kernels.decode is paged_attention_cpu.paged_decode) == (kernels == "cpu")
        reqs = [Request(f"r{i}", list(range(5 + i, 30 + 3 * i)), SamplingParams()) for i in range(2)]
        for req in reqs:
            engine.kv.grow(req.request_id, req.num_tokens)
            engine.runner.execute([Chunk(req, req.num_tokens)])
            req.num_computed = req.num_tokens
        steps = []
        for token in (7, 11):
            for req in reqs:
                req.output_token_ids.append(token)
                engine.kv.grow(req.request_id, req.num_tokens)
            steps.append(engine.runner.execute([Chunk(req, 1) for req in reqs]).float())
            for req in reqs:
                req.num_computed = req.num_tokens
        logits[kernels] = torch.stack(steps)
    assert (logits["cpu"] - logits["torch"]).abs().max().item() < 0.1  # 0.03 here; a wrong context moves them ~1
