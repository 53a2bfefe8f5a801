"""`lorafleet verify`: does the served fast path compute what the model means, for the base and for
each adapter? Two engines in this process on the same files: the one `serve` would build (its
kernels: `kernels.backend.select`'s choice) and one on the torch reference kernels
(`kernels="torch"`, the oracle of every op); and, where installed, transformers (and PEFT for
adapters) on a Hugging Face folder (`verify_hf.py`).

On a few fixed probe prompts, per target (the base, then each adapter):
- the largest prefill logit difference of the fast path from each reference, against the
  tolerance of `selfcheck.tolerance` (relative to the logits' scale, looser at lower precision);
- whether greedy decoding gives the same tokens over `tokens` steps. Where two paths part on a
  near tie (the reference's top two within the tolerance of each other) they agree as far as
  arithmetic can: counted as such, and said;
- for an adapter: how far it moves the reference's logits from the base's (an adapter below the
  tolerance changes nothing: a warning, as a zero-initialised B that was never trained gives),
  and whether every tensor of its file is served (`LoraAdapter.used`: a tensor the loader reads
  and leaves, such as a PEFT `original_module` copy, is a warning).
An activated LoRA (`adapters/alora.py`) is probed with its invocation sequence ending each probe
that lacks it (a prompt without it is refused), and measured against the base on those prompts.
A disagreement or an adapter the loader refuses is a problem (the CLI's exit 1), naming the
kernels and the difference.

Memory: the second engine holds a second copy of the weights, and transformers a third; each
engine's pool is sized for the probes and the largest adapter only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lorafleet.engine.engine import Engine
from lorafleet.engine.request import Request, SamplingParams
from lorafleet.engine.scheduler import Chunk
from lorafleet.engine.selfcheck import probe_ids, tolerance
from lorafleet.errors import ConfigError, LorafleetError
from lorafleet.adapters.alora import activation, request_activation
from lorafleet.adapters.peft_config import WEIGHTS_NAME

# fixed probes: text where the model has a tokenizer (prose, code, a list, a question), else token ids
PROBES = ("The capital of France is", "def fibonacci(n):\n    if n < 2:\n", "Translate to German: good morning, how are you?",
          "1, 1, 2, 3, 5, 8, 13,", "Once upon a time, in a small village by the sea,", "SELECT name, email FROM users WHERE",
          "Q: What is 12 times 7?\nA:", "The quick brown fox jumps over the lazy dog.")
# transformers below float32: its roundings and the kernels' are independent (the torch reference
# rounds where the kernels do), so the tolerance against it is this many times looser
INDEPENDENT = 2.0
POOL_BYTES = 256 << 20  # each engine's pool: the probes' KV, plus room for the largest adapter (`_pool_bytes`)


def probes(engine: Engine, n: int, tokens: int) -> list[list[int]]:
    """`n` fixed prompts as token ids: PROBES through the model's tokenizer, then (or without one)
    seeded ids of growing lengths; each cut to leave room for `tokens` more in the context."""
    room = engine.max_model_len - tokens - 1
    if room < 1:
        raise ConfigError(f"{tokens} tokens leave no room for a prompt in the model's context of "
                          f"{engine.max_model_len} tokens")
    out = [engine.tokenizer.encode(text) for text in PROBES[:n]] if engine.tokenizer else []
    out += [probe_ids(engine.model.cfg.vocab_size, 6 + 5 * i, seed=i) for i in range(len(out), n)]
    return [ids[:room] for ids in out]


def prefill_logits(engine: Engine, ids: list[int], adapter: str | None = None) -> torch.Tensor:
    """Every row's fp32 logits of `ids` prefilled on `engine` (with `adapter`, loaded), on the host."""
    loras = engine.adapters.acquire_all([adapter]) if adapter else ()
    req = Request("verify", ids, SamplingParams(), adapter, loras=loras, scales=(1.0,) * len(loras),
                  activation=request_activation([(e, 1.0) for e in loras], ids))
    engine.kv.grow(req.request_id, len(ids))
    try:
        chunks = [Chunk(req, len(ids))]
        return engine.runner.execute(chunks, engine.runner.lora_batch(chunks), all_logits=True).float().cpu()
    finally:
        engine.kv.free(req.request_id)
        for entry in loras:
            engine.adapters.release(entry)


def invoked(engine: Engine, prompts: list[list[int]], adapter: str | None) -> list[list[int]]:
    """The probes for `adapter`: an aLoRA's each end with its invocation sequence where it lacks it
    (cut to keep the room `probes` left); the probes themselves for any other."""
    inv = engine.adapters.get(adapter).invocation if adapter else None
    if inv is None:
        return prompts
    return [ids if activation(ids, inv) is not None else (ids[:max(1, len(ids) - len(inv))] + list(inv))
            for ids in prompts]


def greedy(engine: Engine, prompts: list[list[int]], tokens: int, adapter: str | None, logprobs: int | None = None):
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    return engine.generate(prompts, params, adapters=[adapter] * len(prompts))


def compare_tokens(ours: list[list[int]], theirs: list[list[int]], gaps, tol: float) -> dict:
    """Greedy tokens of the fast path (`ours`) against a reference's, prompt by prompt:
    `gaps(prompt, step, token)` is how far below the reference's choice at that step `token`'s
    logit lies (None: unknown). Returns agree (prompts whose tokens agree, near ties included),
    prompts, near_ties and differ ([{prompt, token}]: where they part for real)."""
    agree, near, differ = 0, 0, []
    for p, (a, b) in enumerate(zip(ours, theirs)):
        step = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if step is None:
            agree += 1
            continue
        gap = gaps(p, step, a[step])
        if gap is not None and gap <= tol:
            agree, near = agree + 1, near + 1
        else:
            differ.append({"prompt": p, "token": step})
    return {"agree": agree, "prompts": len(ours), "near_ties": near, "differ": differ}


def _pool_bytes(adapters: dict[str, Path]) -> int:
    """POOL_BYTES and four times the largest adapter file (laid out in fp32: twice a bf16 file's bytes)."""
    sizes = [(Path(p) / WEIGHTS_NAME).stat().st_size for p in adapters.values() if (Path(p) / WEIGHTS_NAME).is_file()]
    return POOL_BYTES + 4 * max(sizes, default=0)


class Verifier:
    """The engines (and transformers) of one model, and the base's reference logits each adapter is
    measured against. `verify()` runs it all."""

    def __init__(self, model: str | Path, adapters: dict[str, Path], prompts: int, tokens: int, options: dict,
                 transformers: bool | None):
        opts = {**options, "pool_bytes": _pool_bytes(adapters)}
        self.fast = self.ref = Engine(model, **opts)
        self.hf = None
        try:
            if self.fast.model.kernels.name != "torch":  # else the fast path is the reference
                self.ref = Engine(model, **{**opts, "kernels": "torch"})
            self.label = self.fast.model.kernels.label
            self.model, self.tokens = Path(model), tokens
            self.prompts = probes(self.fast, prompts, tokens)
            m = self.fast.model
            self.tol_of = lambda ref: tolerance(m.numerics, m.quantization, ref)
            self.hf_factor = 1.0 if m.dtype == torch.float32 else INDEPENDENT
            self.base_ref: list[torch.Tensor] = []
            from lorafleet.engine.verify_hf import HfReference

            self.hf = HfReference.open(self.model, self.fast, transformers)
        except BaseException:
            self.close()
            raise

    @property
    def engines(self) -> list[Engine]:
        return [self.fast] if self.ref is self.fast else [self.fast, self.ref]

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
        self.hf = None

    def target(self, name: str | None, path: Path | None) -> dict:
        out: dict = {"name": name or "base", "adapter": str(path) if path else None, "problems": [], "warnings": []}
        if name is not None:
            assert path is not None  # an adapter's folder
            try:
                used, keys = self._load(name, path)
            except LorafleetError as e:
                self._unload(name)
                out["problems"].append(f"{name}: refused: {e}")
                out["error"] = str(e)
                return out
            unused = sorted(keys - used)
            out["tensors"] = {"in_file": len(keys), "used": len(keys & used), "unused": unused}
            if unused:
                shown = ", ".join(unused[:3]) + (f" and {len(unused) - 3} more" if len(unused) > 3 else "")
                out["warnings"].append(f"{name}: {len(unused)} of the {len(keys)} tensors in its file are not used: {shown}")
        try:
            self._compare(name, out)
        finally:
            self._unload(name)
        return out

    def _unload(self, name: str | None) -> None:
        for engine in self.engines:
            if name is not None and name in engine.adapters:
                engine.unload_adapter(name)

    def _load(self, name: str, path: Path) -> tuple[set[str], set[str]]:
        """Load the adapter into both engines; the keys its file holds and those the loader serves."""
        from safetensors import safe_open

        from lorafleet.adapters.adapter import BaseShapes, load_adapter

        adapter = load_adapter(path, BaseShapes.from_model_config(self.fast.model.cfg))  # AdapterError: refused
        with safe_open(str(Path(path) / WEIGHTS_NAME), framework="pt") as f:
            keys = set(f.keys())
        for engine in self.engines:
            engine.load_adapter(name, path)
        return set(adapter.used), keys

    def _compare(self, name: str | None, out: dict) -> None:
        prompts = invoked(self.fast, self.prompts, name)
        fast = [prefill_logits(self.fast, ids, name) for ids in prompts]
        ref = [prefill_logits(self.ref, ids, name) for ids in prompts] if self.ref is not self.fast else fast
        tol = max(self.tol_of(r) for r in ref)
        ours = greedy(self.fast, prompts, self.tokens, name)
        tokens = [o.token_ids for o in ours]
        who = name or "base"
        if self.ref is self.fast:
            out["torch"] = {"skipped": "the served kernels are the torch reference"}
        else:
            theirs = greedy(self.ref, prompts, self.tokens, name, logprobs=2)

            def gaps(p, step, token):
                lp = theirs[p].logprobs[step]
                return None if token not in lp else lp[theirs[p].token_ids[step]] - lp[token]
            out["torch"] = self._judge(who, "the torch reference", fast, ref, tol, tokens,
                                       [o.token_ids for o in theirs], gaps)
        if name is None:
            self.base_ref = ref
        else:
            base_ref = self.base_ref if prompts is self.prompts else [prefill_logits(self.ref, ids) for ids in prompts]
            width = min(ref[0].shape[1], base_ref[0].shape[1])  # an adapter's own vocabulary: the base's ids
            effect = max(float((r[:, :width] - b[:, :width]).abs().max()) for r, b in zip(ref, base_ref))
            out["effect"], out["changes_nothing"] = effect, effect <= tol
            if effect <= tol:
                out["warnings"].append(f"{name}: changes nothing: it moves the logits at most {effect:.3g} from the "
                                       f"base's (tolerance {tol:.3g}); an untrained adapter (B = 0) does that")
        if self.hf is None or self.hf.skipped:
            out["transformers"] = {"skipped": self.hf.skipped if self.hf else "not asked for"}
            return
        why = self.hf.use(name, out["adapter"])
        if why:
            out["transformers"] = {"skipped": why}
            return
        hf = [self.hf.logits(ids) for ids in prompts]
        runs = [self.hf.greedy(ids, self.tokens) for ids in prompts]

        def hf_gaps(p, step, token):
            logits = runs[p][1][step]
            return float(logits[runs[p][0][step]] - logits[token])
        out["transformers"] = self._judge(who, "transformers" + (" + PEFT" if name else ""), fast, hf,
                                          max(self.tol_of(h) for h in hf) * self.hf_factor, tokens,
                                          [r[0] for r in runs], hf_gaps)

    def _judge(self, who: str, against: str, fast, ref, tol: float, ours, theirs, gaps) -> dict:
        diff = max(float((f - r).abs().max()) if f.shape == r.shape else float("inf") for f, r in zip(fast, ref))
        tokens = compare_tokens(ours, theirs, gaps, tol)
        found = {"max_logit_diff": diff, "tolerance": tol, "greedy": tokens,
                 "ok": diff <= tol and not tokens["differ"]}
        problems = []
        if not diff <= tol:
            problems.append(f"{who}: the {self.label} kernels' prefill logits differ from {against} by up to "
                            f"{diff:.3g} (tolerance {tol:.3g})")
        if tokens["differ"]:
            first = tokens["differ"][0]
            problems.append(f"{who}: the {self.label} kernels' greedy tokens differ from {against} on "
                            f"{len(tokens['differ'])} of {tokens['prompts']} prompts (first: prompt {first['prompt']}, "
                            f"token {first['token']})")
        found["problems"] = problems
        return found


def verify(model: str | Path, adapters: dict[str, Path] | None = None, prompts: int = 4, tokens: int = 16,
           transformers: bool | None = None, progress=lambda line: None, **options) -> dict:
    """Verify `model` and `adapters` (name -> PEFT folder) as the module doc says; `options` are the
    engine's (device, dtype, quantize, kernels: as `serve` would build it). `transformers`: compare
    with transformers/PEFT too (None: where installed and the model is a Hugging Face folder).
    `progress(line)` hears each target as it starts. Returns the report: what was served (model,
    device, dtype, quantization, kernels), prompts, tokens, `targets` (one dict a target: per
    reference, `torch` and `transformers`, its max_logit_diff, tolerance, greedy and ok, or why it
    was skipped; for adapters effect, changes_nothing, tensors; problems, warnings), and `ok`,
    `problems`, `warnings` over them all."""
    adapters = {name: Path(p) for name, p in (adapters or {}).items()}
    progress(f"loading {model}")
    v = Verifier(model, adapters, prompts, tokens, options, transformers)
    m = v.fast.model
    report: dict[str, Any]
    report = {"model": str(model), "device": str(v.fast.device), "dtype": str(m.dtype).removeprefix("torch."),
              "quantization": m.quantization, "kernels": v.label, "prompts": len(v.prompts), "tokens": tokens,
              "targets": []}
    try:
        for name, path in [(None, None), *adapters.items()]:
            progress(f"checking {name or 'the base'}")
            report["targets"].append(v.target(name, path))
    finally:
        v.close()
    for t in report["targets"]:
        t["problems"] += [p for ref in ("torch", "transformers") for p in t.get(ref, {}).pop("problems", [])]
        t["problems"], t["warnings"] = t.pop("problems"), t.pop("warnings")  # last, after what they sum up
        t["ok"] = not t["problems"]
    report["problems"] = [p for t in report["targets"] for p in t["problems"]]
    report["warnings"] = [w for t in report["targets"] for w in t["warnings"]]
    report["ok"] = not report["problems"]
    return report
