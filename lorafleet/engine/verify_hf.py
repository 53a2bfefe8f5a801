"""transformers, and PEFT for adapters, as `lorafleet verify`'s second reference: the model as its
authors' library computes it, where that library is installed (both are optional: imported here
only) and reads the model (a Hugging Face folder of full-precision weights).

Decisions:
- It runs at the engine's dtype and on its device, as a user of transformers would serve the
  same files; the tolerance is the same as against the torch reference.
- A quantized base is not compared: transformers would see the full-precision weights, and the
  difference would be the quantization's, not the kernels'.
- One PEFT model holds every adapter checked (`set_adapter` picks one): the base is loaded once,
  and PEFT's `unload` would keep a saved module's copy in it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lorafleet.errors import ConfigError

if TYPE_CHECKING:
    import peft


def _why_not(folder: Path, engine) -> str | None:
    from lorafleet.model import quant
    from lorafleet.model.loader import RANDOM_WEIGHTS

    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed"
    if not folder.is_dir():
        return "transformers reads Hugging Face folders, not GGUF files"
    if engine.model.quantization or quant.stored_scheme(folder):
        return "the base is quantized: transformers would measure the quantization, not the kernels"
    if (folder / RANDOM_WEIGHTS).is_file() and not any(folder.glob("*.safetensors")):
        return "the folder's weights are made at load (a benchmark's base): transformers has none to read"
    return None


def _short(e: Exception) -> str:
    text = f"{type(e).__name__}: {e}".splitlines()[0]
    return text if len(text) <= 200 else text[:197] + "..."


class HfReference:
    """The transformers model of a folder (`skipped`: why there is none), with the adapters PEFT
    loaded into it."""

    def __init__(self, model=None, device=None, skipped: str | None = None):
        self.model, self.device, self.skipped = model, device, skipped
        self.peft: peft.PeftModel | None = None  # the PeftModel around `model`, once an adapter is loaded
        self.active: str | None = None
        self.names: dict[str, str] = {}  # adapter -> its name in PEFT (attribute names: "double" is a Module's)

    @classmethod
    def open(cls, folder: Path, engine, wanted: bool | None) -> HfReference | None:
        """None where not `wanted`; where `wanted` is None (auto), one that says why it is skipped
        when transformers cannot check this model; where `wanted` is True, a ConfigError then."""
        if wanted is False:
            return None
        why = _why_not(Path(folder), engine)
        if why is None:
            try:
                import transformers

                transformers.logging.set_verbosity_error()  # its progress bars and notices are not this command's
                transformers.logging.disable_progress_bar()
                model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=engine.model.dtype)
                return cls(model.to(engine.device).eval(), engine.device)
            except Exception as e:  # noqa: BLE001 - an architecture or file transformers does not read
                why = f"transformers could not load it ({_short(e)})"
        if wanted:
            raise ConfigError(f"transformers cannot check {folder}: {why}")
        return cls(skipped=why)

    def use(self, name: str | None, path: str | None) -> str | None:
        """Compute with adapter `name` (from `path`) from now on, or the base's (None); returns why
        it cannot, or None."""
        self.active = name
        if name is None:
            return None
        assert path is not None  # an adapter's folder
        if importlib.util.find_spec("peft") is None:
            return "PEFT is not installed"
        import peft

        try:
            with warnings.catch_warnings():  # PEFT's notices about transformers' deprecations
                warnings.simplefilter("ignore", FutureWarning)
                inner = self.names.setdefault(name, f"verify_{len(self.names)}")
                if self.peft is None:
                    self.peft = peft.PeftModel.from_pretrained(self.model, path, adapter_name=inner).eval()
                else:
                    self.peft.load_adapter(path, adapter_name=inner)
                self.peft.set_adapter(inner)
        except Exception as e:  # noqa: BLE001 - a variant this PEFT does not read
            return f"PEFT could not load it ({_short(e)})"
        return None

    def _model(self):
        if self.peft is None:
            return contextlib.nullcontext(self.model)
        if self.active is None:
            return _disabled(self.peft)
        return contextlib.nullcontext(self.peft)

    @torch.inference_mode()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """Every row's fp32 logits of `ids`, on the host."""
        with self._model() as model:
            return model(torch.tensor([ids], device=self.device)).logits[0].float().cpu()

    @torch.inference_mode()
    def greedy(self, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
        """`n` greedy tokens after `ids` (EOS ignored, as the engines are asked) and each step's logits."""
        tokens, steps = [], []
        # the KV cache's name: `cache` in newer transformers, `past_key_values` before
        key = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        extra = self._alora_offsets(ids)
        with self._model() as model:
            out = model(torch.tensor([ids], device=self.device), use_cache=True, **extra)
            for i in range(n):
                logits = out.logits[0, -1].float().cpu()
                tokens.append(int(logits.argmax()))
                steps.append(logits)
                if i + 1 < n:
                    out = model(torch.tensor([[tokens[-1]]], device=self.device), use_cache=True,
                                **{key: getattr(out, key)}, **extra)
        return tokens, steps

    def _alora_offsets(self, ids: list[int]) -> dict:
        """An active aLoRA's offsets of the prompt, passed to every step as PEFT's `generate` does (a
        decode step's forward alone would look for the sequence in its one token); {} for any other."""
        if self.peft is None or self.active is None:
            return {}
        inner = self.names[self.active]
        if not getattr(self.peft.peft_config[inner], "alora_invocation_tokens", None):
            return {}
        from peft.tuners.lora.variants import calculate_alora_offsets

        configs: Any = self.peft.peft_config  # PEFT annotates one config; it reads the dict of them
        return {"alora_offsets": calculate_alora_offsets(configs, inner, torch.tensor([ids]))}


@contextlib.contextmanager
def _disabled(peft_model):
    with peft_model.disable_adapter():
        yield peft_model
