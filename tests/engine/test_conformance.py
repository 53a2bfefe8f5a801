"""The conformance matrix: real models' configs (tests/engine/conformance.py) at 2 layers with
random weights, on every CPU kernel variant this CPU runs (`variant`) and the torch path, in fp32,
bf16, int8 and int4, against `transformers` (and PEFT for adapters) on the same weights in fp32,
dequantized where the base is quantized.

Each case checks, in one batch of base requests and a plain LoRA, a DoRA and a saved-LM-head adapter:
- the base's prefill logits within TOLERANCE[case] of the reference's largest logit;
- every greedy token of 16 is the reference's argmax given the same prefix (teacher-forced), but
  where the reference's top two are closer than that tolerance (a tie at the dtype's precision):
  in fp32 and on quantized bases (fp32 activations), that is token for token transformers' greedy
  decoding; each chosen token's logprob within the tolerance of the reference's.
The default tier runs FAST (every property at least once) in fp32 on this CPU's own variant, and
two of them in bf16 and SmolLM2 quantized; the heavy tier every config on every variant and on torch.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from lorafleet import Engine, SamplingParams
from lorafleet.kernels import cpu_module
from lorafleet.store.pull import pull
from lorafleet.store.store import Store
from tests.engine.conformance import ADAPTERS, CONFIGS, FAST, build, shrink
from tests.engine.test_parity import engine_prefill_logits
from tests.engine.test_quantized import dequantized_
from tests.fixtures import build_adapter, force_kernels, load_hf, load_peft

CASES = ("fp32", "bf16", "int8", "int4")
# relative to the reference's largest logit: fp32 sums in another order; bf16 rounds the weights
# and every activation; int8/int4 compute in fp32 on the dequantized weights (AMX: fp32 x in two bf16 halves)
TOLERANCE = {"fp32": 1e-4, "bf16": 4e-2, "int8": 1e-4, "int4": 1e-4}
ORDER = [None, "plain", "dora", "head", None]
LENGTHS = [5, 12, 23, 9, 17]
TOKENS = 16
FAST_QUANTIZED = ("SmolLM2-135M",)  # quantized bases in the default tier (tied, odd heads, GQA 3)
# bf16 in the default tier: the kernels' bf16 paths do not depend on the family, whose properties
# (biases, q/k norms, GQA 3, tied heads) FAST covers in fp32
FAST_BF16 = ("SmolLM2-135M", "Llama-3.2-1B")


def _cases():
    """(config, case, kernels): every config in every case on every CPU variant this CPU runs, and
    on the torch path for FAST's configs in fp32 and bf16 (elsewhere its parity is
    tests/engine/test_parity.py's and tests/engine/test_quantized.py's).
    The default tier: FAST in fp32, FAST_BF16 in bf16, FAST_QUANTIZED quantized, on this CPU's variant."""
    host = cpu_module.host_variant()
    out = []
    for n in CONFIGS:
        for c in CASES:
            for k in (*cpu_module.runnable(), *(("torch",) if n in FAST and not c.startswith("int") else ())):
                fast = k == host and n in {"fp32": FAST, "bf16": FAST_BF16}.get(c, FAST_QUANTIZED)
                out.append(pytest.param(n, c, k, marks=() if fast else pytest.mark.heavy))
    return out


class Reference:
    """One config's base, adapters and what transformers (and PEFT) compute on them, each computed
    once for every kernel path: the reference models by (case, adapter) (fp32 for fp32 and bf16;
    dequantized for int8 and int4), their greedy continuations with their logits, and the bases
    stored quantized (`pull --quantize`: quantized once, served as stored)."""

    def __init__(self, name: str, root):
        self.name, self.root = name, root
        self.base = build(name, root / "base")
        self.config = shrink(CONFIGS[name][1])
        self.adapters = {a: build_adapter(self.base, root / a, seed=i + 1, b_std=0.05, **kw)
                         for i, (a, kw) in enumerate(ADAPTERS.items())}
        self._models: dict = {}
        self._greedy: dict = {}
        self._stored: dict = {}

    def folder(self, case: str):
        """The base folder an engine serves for `case` (quantized bases as `pull --quantize` stores them)."""
        if not case.startswith("int"):
            return self.base
        if case not in self._stored:
            store = Store(self.root / "store")
            pull(str(self.base), name=case, base=True, quantize=case, store=store, progress=False)
            self._stored[case] = store.folder(store.get("models", case))
        return self._stored[case]

    def model(self, case: str, adapter: str | None):
        """transformers on the base (fp32, or dequantized for int8/int4: its folder saved once),
        with PEFT's adapter merged into it (`merge_and_unload`: the adapter's own arithmetic, DoRA's
        included, without PEFT's per-call overhead)."""
        key = (case if case.startswith("int") else "fp32", adapter)
        if key not in self._models:
            folder = self.base
            if case.startswith("int"):
                folder = self.root / f"dequantized-{case}"
                if not folder.is_dir():
                    dequantized_(load_hf(self.base), case).save_pretrained(folder, safe_serialization=True)
            self._models[key] = (load_peft(folder, self.adapters[adapter]).merge_and_unload().eval() if adapter
                                 else load_hf(folder))
        return self._models[key]

    def logits(self, case: str, adapter: str | None, ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.model(case, adapter)(torch.tensor([ids])).logits[0].float()

    def greedy(self, case: str, adapter: str | None, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
        """The reference's greedy tokens after `prompt` and the logits each was picked from [TOKENS, V]."""
        key = (case if case.startswith("int") else "fp32", adapter, tuple(prompt))
        if key not in self._greedy:
            model, seq, rows = self.model(case, adapter), torch.tensor([prompt]), []
            with torch.no_grad():
                out = model(seq, use_cache=True)
                for _ in range(TOKENS):
                    rows.append(out.logits[0, -1].float())
                    nxt = rows[-1].argmax().view(1, 1)
                    seq = torch.cat([seq, nxt], dim=1)
                    out = model(nxt, past_key_values=out.past_key_values, use_cache=True)
            self._greedy[key] = (seq[0, len(prompt):].tolist(), torch.stack(rows))
        return self._greedy[key]


_last: list[Reference] = []  # the config of the tests before (they run config by config, in _cases' order)


@pytest.fixture
def model(request, tmp_path_factory):
    """The config's `Reference`, built once for all its cases and kernel paths (an indirect
    parameter is a test's own: the cache here keeps it across them, one config at a time)."""
    if not _last or _last[0].name != request.param:
        _last[:] = [Reference(request.param, tmp_path_factory.mktemp(request.param))]
    return _last[0]


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture
def kernels(request, monkeypatch):
    """A CPU kernel variant or torch, forced for the test (`force_kernels`)."""
    return force_kernels(monkeypatch, request.param)


@pytest.mark.parametrize("model, case, kernels", _cases(), indirect=["model", "kernels"])
def test_a_real_config_serves_transformers_tokens_and_logits(model, case, kernels):
    options = {"fp32": dict(dtype="float32"), "bf16": dict(dtype="bfloat16")}.get(case, {})
    cfg = model.config
    head = cfg["vocab_size"] * cfg["hidden_size"] * (2 if case == "bf16" else 4)  # the saved LM head's pages
    engine = Engine(model.folder(case), pool_bytes=head + (24 << 20), max_model_len=256, **options)
    assert engine.model.kernels.label == ("torch" if kernels == "torch" else f"cpu/{kernels}")
    assert engine.model.quantization == (case if case.startswith("int") else None)
    for a, path in model.adapters.items():
        engine.load_adapter(a, path)
    tol = TOLERANCE[case]
    prompts = _prompts(engine.model.cfg.vocab_size)

    ours = engine_prefill_logits(engine, prompts[2]).float()
    want = model.logits(case, None, prompts[2])
    scale = want.abs().max().item()
    assert ours.shape == want.shape
    found = {"config": model.name, "case": case, "kernels": kernels, "scale": scale,
             "prefill": (ours - want).abs().max().item(), "logprob": 0.0, "tokens": 0, "same": 0}
    assert found["prefill"] <= tol * scale, found

    outs = engine.generate(prompts, SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=0),
                           adapters=ORDER)
    for prompt, adapter, out in zip(prompts, ORDER, outs):
        tokens, logits = model.greedy(case, adapter, prompt)
        if out.token_ids != tokens:  # parted from the reference's greedy tokens: its logits on our prefix
            logits = model.logits(case, adapter, prompt + out.token_ids[:-1])[len(prompt) - 1:]
        logp = logits.log_softmax(-1)
        top = logits.max(-1).values
        found["tokens"] += TOKENS
        found["same"] += sum(a == b for a, b in zip(out.token_ids, tokens))  # transformers' own greedy tokens
        for j, tok in enumerate(out.token_ids):
            gap = (top[j] - logits[j, tok]).item()
            assert gap <= tol * scale, (model.name, case, adapter, j, gap)  # the argmax, or a tie at the dtype's precision
            off = abs(out.logprobs[j][tok] - logp[j, tok].item())
            found["logprob"] = max(found["logprob"], off)
            assert off <= 2 * tol * scale, (model.name, case, adapter, j)
    if os.environ.get("LORAFLEET_CONFORMANCE_REPORT"):  # a JSON line per case, for the figures of docs/testing.md
        with open(os.environ["LORAFLEET_CONFORMANCE_REPORT"], "a") as f:
            f.write(json.dumps(found) + "\n")
