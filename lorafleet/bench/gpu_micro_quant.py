"""The quantized projections on a GPU, `python -m lorafleet.bench.gpu_micro --quant`
(`run_quant`): on each shape's qkv, o, gate_up and down ([N, K]: Llama-3-8B's [6144, 4096], [4096, 4096],
[28672, 4096], [4096, 14336]) at T = 1, 8 and 64 rows, bf16 `F.linear` on the full weight,
`quant_triton.linear` on int8 (a scale per channel) and int4 (groups of 32) codes, and torchao's
int8 and int4 weight-only kernels where torchao imports on a GPU (a line says why not
otherwise): each as GB/s of the bytes it must read (the weight as stored, its scales, x; y
written) against the copy bandwidth measured in the same run (`of_copy`) and a same-size read
(`of_read`), with its error against `reference.linear` (torchao's: against bf16 `F.linear`, its
own quantization being another one). Each timed call reads another copy of the weight (copies
enough to be twice the L2), so no figure is an L2 hit. Then, as the deadline allows, every
configuration of `quant_triton.CANDIDATES` (decides `quant_triton.CONFIG`) and torchao's int8
under `torch.compile` (its eager int8 converts the whole weight each call). JSON:
`gpu_micro_quant.json`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from lorafleet.kernels import reference
from lorafleet.bench.gpu_micro import CALLS_PER_GRAPH, ModelShape, SHAPES, copy_bandwidth, read_rate, timed

QUANT_ROWS = (1, 8, 64)
L2_BYTES = 50 << 20  # an H100's L2 (an H200's too): each timed call reads weights outside it


def projections(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """A layer's fused projections as the model holds them, [N, K]."""
    h, kv, i = shape.hidden, shape.kv_heads * shape.head_dim, shape.intermediate
    return {"qkv": (h + 2 * kv, h), "o": (h, h), "gate_up": (2 * i, h), "down": (h, i)}


def torchao_weights(w: torch.Tensor, scheme: str):
    """torchao's weight-only `scheme` of w [N, K] (bf16, on the GPU), as an nn.Linear to call; or
    the reason it cannot serve here (a string)."""
    try:
        import torchao
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
    except Exception as e:  # noqa: BLE001 (not installed, or built for another torch)
        return f"torchao does not import: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if w.device.type != "cuda":
        return f"torchao {torchao.__version__}: its weight-only kernels are measured on a GPU only"
    layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    layer.weight.data.copy_(w)
    try:
        if scheme == "int8":  # a scale per output channel, as lorafleet's int8
            quantize_(layer, Int8WeightOnlyConfig(set_inductor_config=False))
        else:  # groups of 32, as lorafleet's int4; tinygemm's layout (plain needs the mslk package)
            quantize_(layer, Int4WeightOnlyConfig(group_size=32, int4_packing_format="tile_packed_to_4d",
                                                  set_inductor_config=False))
    except Exception as e:  # noqa: BLE001
        return f"torchao {torchao.__version__} {scheme}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return layer


def _stored_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _torchao_bytes(layer) -> int:
    """The bytes a torchao weight holds (its tensor subclass's inner tensors)."""
    w = layer.weight
    names, _ = w.__tensor_flatten__() if hasattr(w, "__tensor_flatten__") else ([], None)
    return sum(_stored_bytes(getattr(w, n)) for n in names) or _stored_bytes(w)


@dataclass
class QuantCase:
    """One projection at T rows: the weights of each form in `copies` copies (each timed call
    reads the next), x, and per form the bytes a call must read and write."""

    name: str
    rows: int
    x: torch.Tensor
    forms: dict[str, list | str]    # form -> copies of its weight (a tensor, (codes, scales), a layer), or why not
    moved: dict[str, int]
    full: torch.Tensor              # the bf16 weight (torchao's parity)


def make_quant_case(proj: str, n: int, k: int, rows: int, dtype, device, budget: int = 2 * L2_BYTES) -> QuantCase:
    from lorafleet.model import quant
    g = torch.Generator(device="cpu").manual_seed(n * 7 + k)
    w = (torch.randn(n, k, generator=g) * 0.02).to(device, dtype)
    x = torch.randn(rows, k, generator=g).to(device, dtype)
    io = (rows * k + rows * n) * x.element_size()
    forms = {"full": w, "int8": quant.quantize(w, "int8"), "int4": quant.quantize(w, "int4")}
    for scheme in ("int8", "int4"):
        forms[f"torchao {scheme}"] = torchao_weights(w, scheme)
    made: dict[str, list | str] = {}
    moved: dict[str, int] = {}
    for form, one in forms.items():
        if isinstance(one, str):  # torchao's reason
            made[form] = one
            continue
        size = _torchao_bytes(one) if isinstance(one, torch.nn.Module) else _stored_bytes(*(
            one if isinstance(one, tuple) else (one,)))
        copies = max(1, min(CALLS_PER_GRAPH, -(-budget // size))) if device.type == "cuda" else 1
        made[form] = [one] + [_copy(one) for _ in range(copies - 1)]
        moved[form] = size + io
    return QuantCase(proj, rows, x, made, moved, w)


def _copy(one):
    if isinstance(one, torch.nn.Module):
        import copy
        return copy.deepcopy(one)
    if isinstance(one, tuple):
        return tuple(t.clone() for t in one)
    return one.clone()


def quant_call(case: QuantCase, form: str, linear):
    """A call of `form` that reads the next copy of its weight each time it is made."""
    copies, at = case.forms[form], [0]

    def call():
        one = copies[at[0] % len(copies)]
        at[0] += 1
        if isinstance(one, torch.nn.Module):
            return one(case.x)
        if isinstance(one, tuple):
            return linear(case.x, one[0], None, one[1])
        return linear(case.x, one)
    return call


class _QuantRun:
    """One run of `run_quant`: its report, saved to `out`/gpu_micro_quant.json with each line it
    prints, the copy bandwidth its figures are read against, and its deadline."""

    def __init__(self, report: dict[str, Any], out: Path, dev: torch.device, copy: float, t_start: float,
                 deadline_s: float):
        self.report, self.out, self.dev, self.copy = report, out, dev, copy
        self.t_start, self.deadline_s = t_start, deadline_s

    def save(self, message: str) -> None:
        print(message, flush=True)
        (self.out / "gpu_micro_quant.json").write_text(json.dumps(self.report, indent=1))

    def late(self) -> bool:
        if time.monotonic() - self.t_start > self.deadline_s:
            self.save(f"deadline ({self.deadline_s:.0f} s) passed: stopping")
            return True
        return False

    def measure(self, rows: list, case: QuantCase, label: str, call, moved: int, want: torch.Tensor) -> None:
        """One form of `case` timed and checked against `want`: a row of `rows`, or a line of "skipped"."""
        dev, copy, report = self.dev, self.copy, self.report
        try:
            got = call().float()
            s = timed(call, dev)
        except Exception as e:  # noqa: BLE001 (a library's kernel that cannot run or be captured here)
            report["skipped"].append(f"{case.name} T={case.rows} {label}: {type(e).__name__}: {e}"[:300])
            self.save(report["skipped"][-1])
            return
        ceiling = read_rate(dev, moved)
        rows.append({"case": case.name, "rows": case.rows, "form": label, "us": s * 1e6, "bytes": moved,
                     "GB/s": moved / s / 1e9, "of_copy": moved / s / copy, "of_read": moved / s / ceiling,
                     "error": float((got - want).abs().max() / want.abs().max())})
        r = rows[-1]
        self.save(f"{case.name} T={case.rows} [{label}]: {r['us']:.1f} us, {r['GB/s']:.0f} GB/s = {r['of_copy']:.0%} "
                  f"of copy, {r['of_read']:.0%} of a {moved / 1e6:.1f} MB read, error {r['error']:.1e}")


def run_quant(shapes: list[str], out: Path, deadline_s: float = 270.0, device: str | None = None) -> dict:
    """The quantized projections' figures (the module doc), into `out`/gpu_micro_quant.json."""
    t_start = time.monotonic()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    on_gpu = dev.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    from lorafleet.kernels import backend
    kernels = backend.select(dev, dtype)
    copy = copy_bandwidth(dev, 1 << 30 if on_gpu else 1 << 24)
    report: dict[str, Any]
    report = {"device": torch.cuda.get_device_name(dev) if on_gpu else "cpu", "dtype": str(dtype),
              "torch": torch.__version__, "kernels": kernels.name, "copy_GB/s": copy / 1e9, "skipped": [],
              "shapes": {}}
    out.mkdir(parents=True, exist_ok=True)
    run = _QuantRun(report, out, dev, copy, t_start, deadline_s)
    run.save(f"{report['device']}: copy {copy / 1e9:.0f} GB/s, kernels {kernels.name}")
    cases = _measure_projections(run, shapes, dtype, kernels)
    if cases is None:
        return report
    # as the deadline allows: quant_triton's candidates, then torchao's int8 compiled
    if on_gpu and not (_measure_candidates(run, cases) and _measure_torchao_compiled(run, cases)):
        return report
    report["seconds"] = time.monotonic() - t_start
    run.save(f"done in {report['seconds']:.0f} s")
    return report


def _measure_projections(run: _QuantRun, shapes: list[str], dtype, kernels) -> list[tuple] | None:
    """Every projection of each shape at each of QUANT_ROWS, in each form that can be made: the cases
    measured, (rows, case, the bf16 answer) each; None if the deadline passed."""
    on_gpu, report, cases = run.dev.type == "cuda", run.report, []
    for name in shapes:
        rows = report["shapes"].setdefault(name, [])
        for proj, (n, k) in projections(SHAPES[name]).items():
            for t in QUANT_ROWS:
                if run.late():
                    return None
                case = make_quant_case(proj, n, k, t, dtype, run.dev)
                for form in ("torchao int8", "torchao int4"):
                    reason = case.forms[form]
                    if isinstance(reason, str) and reason not in report["skipped"]:
                        report["skipped"].append(reason)
                        run.save(f"skipped: {reason}")
                full = reference.linear(case.x, case.full).float()
                for form in ("full", "int8", "int4", "torchao int8", "torchao int4"):
                    if isinstance(case.forms[form], str):
                        continue
                    if run.late():
                        return None
                    label = {"full": f"{str(dtype).removeprefix('torch.')} F.linear"}.get(form, form)
                    want = _quant_want(case, form, full)
                    run.measure(rows, case, label, quant_call(case, form, kernels.linear), case.moved[form], want)
                cases.append((rows, case, full))
                if on_gpu:
                    torch.cuda.empty_cache()
    return cases


def _measure_candidates(run: _QuantRun, cases: list[tuple]) -> bool:
    """lorafleet's int8 and int4 under each other configuration of `quant_triton.CANDIDATES`; False
    if the deadline passed."""
    from lorafleet.kernels import quant_triton
    run.report["configs"] = {f"{i}: {c}": asdict(c) for i, c in enumerate(quant_triton.CANDIDATES)}
    for i, cfg in enumerate(quant_triton.CANDIDATES[1:], 1):
        for rows, case, full in cases:
            for form in ("int8", "int4"):
                if run.late():
                    return False
                call = quant_call(case, form, lambda x, q, b, s, c=cfg: quant_triton.linear(x, q, b, s, config=c))
                run.measure(rows, case, f"{form} config {i}", call, case.moved[form], _quant_want(case, form, full))
    return True


def _measure_torchao_compiled(run: _QuantRun, cases: list[tuple]) -> bool:
    """torchao's int8 under `torch.compile`, where torchao serves; False if the deadline passed."""
    for rows, case, full in cases:
        if isinstance(case.forms["torchao int8"], str):
            break
        if run.late():
            return False
        # the weight an input of the compiled graph (not a module it guards on): one compile for
        # every copy
        compiled = torch.compile(lambda x, w: torch.nn.functional.linear(x, w), dynamic=False)
        weights, at = [layer.weight for layer in case.forms["torchao int8"]], [0]

        def call(weights=weights, at=at, compiled=compiled, x=case.x):
            at[0] += 1
            return compiled(x, weights[at[0] % len(weights)])
        run.measure(rows, case, "torchao int8 compiled", call, case.moved["torchao int8"], full)
    return True


def _quant_want(case: QuantCase, form: str, full: torch.Tensor) -> torch.Tensor:
    """What `form` is checked against: lorafleet's codes, `reference.linear` on them; the full
    weight's and torchao's (its own quantization), bf16 `F.linear` on the full weight."""
    if form in ("int8", "int4"):
        copies = case.forms[form]
        assert not isinstance(copies, str)  # lorafleet's own forms are always made
        q, scales = copies[0]
        return reference.linear(case.x, q, None, scales).float()
    return full
