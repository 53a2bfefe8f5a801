"""lorafleet: one base model, many LoRA adapters.

`Engine` and `SamplingParams` are imported lazily so that `import lorafleet` (and the CLI) stays
free of torch.
"""

__version__ = "0.1.0"
__all__ = ["Engine", "SamplingParams", "RequestOutput", "Mix", "__version__"]


def __getattr__(name):
    if name == "Engine":
        from lorafleet.engine.engine import Engine
        return Engine
    if name == "Mix":  # torch-free
        from lorafleet.adapters.mix import Mix
        return Mix
    if name in ("SamplingParams", "RequestOutput"):
        from lorafleet.engine import request
        return getattr(request, name)
    raise AttributeError(f"module 'lorafleet' has no attribute {name!r}")
