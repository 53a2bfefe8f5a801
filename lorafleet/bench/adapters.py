"""Random LoRA adapters in the standard PEFT format (adapter_config.json +
adapter_model.safetensors), written directly so that hundreds of them take seconds, not a PEFT
model build each. Same seed, same files; built once and cached next to their base."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from lorafleet.bench.workloads import ALL_MODULES, Workload, adapter_name, adapter_ranks
from lorafleet.model.config import MODULE_BLOCK
from lorafleet.model.config import ModelConfig

WARM_UP_SEED = 7919  # no workload uses it: the warm-up adapter is never one a request names


def write_adapter(base_dir: Path, folder: Path, rank: int, targets=ALL_MODULES, seed: int = 0,
                  alpha: float | None = None, dtype=torch.float32, dora: bool = False, saves_head: bool = False) -> Path:
    """One random adapter with non-zero B (so it really changes the model). `dora`: with a DoRA
    magnitude per module, the row norms of W + scale B A (DoRA's init: the adapter then changes
    the model as the plain one does, and no activation grows). `saves_head`: with its own LM head
    (modules_to_save), the base's moved by 1% noise."""
    cfg = ModelConfig.from_folder(base_dir)
    feats = cfg.linear_features()
    g = torch.Generator().manual_seed(seed)
    alpha = alpha if alpha is not None else 2 * rank
    base = _BaseWeights(base_dir) if dora or saves_head else None
    tensors = {}
    for layer in range(cfg.num_layers):
        for m in targets:
            fin, fout = feats[m]
            key = f"base_model.model.model.layers.{layer}.{MODULE_BLOCK[m]}.{m}"
            a = (torch.randn(rank, fin, generator=g) / fin ** 0.5).to(dtype)
            b = (torch.randn(fout, rank, generator=g) * 0.02).to(dtype)
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
            if dora:
                assert base is not None  # read for DoRA
                w = base.get(f"model.layers.{layer}.{MODULE_BLOCK[m]}.{m}.weight")
                merged = w + (alpha / rank) * b.float() @ a.float()
                tensors[f"{key}.lora_magnitude_vector"] = merged.norm(dim=1).to(dtype)
    if saves_head:
        assert base is not None  # read for a saved head
        head = base.get("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")
        tensors["base_model.model.lm_head.weight"] = (head + 0.01 * head.std() * torch.randn(head.shape, generator=g)
                                                      ).to(dtype)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_dir),
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
        "target_modules": list(targets), "bias": "none", "use_rslora": False, "use_dora": dora,
        "fan_in_fan_out": False, "modules_to_save": ["lm_head"] if saves_head else None, "layers_to_transform": None,
        "rank_pattern": {}, "alpha_pattern": {},
    }
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
    try:
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=1))
        save_file(tensors, tmp / "adapter_model.safetensors")
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(tmp, folder)  # atomic: a crash never leaves half an adapter
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


class _BaseWeights:
    """A base folder's tensors by name, read one at a time from its safetensors files."""

    def __init__(self, base_dir: Path):
        from safetensors import safe_open

        self.files = [safe_open(p, "pt") for p in sorted(Path(base_dir).glob("*.safetensors"))]

    def get(self, name: str) -> torch.Tensor:
        for f in self.files:
            if name in f.keys():
                return f.get_tensor(name).float()
        raise KeyError(f"{name} is in no safetensors file of the base")


def build_adapters(base_dir: Path, n: int, ranks=(8, 16, 32, 64), targets=ALL_MODULES,
                   seed: int = 0, dora_every: int = 0, saves_every: int = 0) -> list[tuple[str, Path]]:
    """n adapters, rank i-th = ranks[i % len(ranks)], cached under base_dir/../adapters-<key>
    (more than 8 ranks, one per adapter as `mix_single` has, go into the key as a digest: a
    folder name has 255 bytes)."""
    spelled = '-'.join(map(str, ranks))
    if len(ranks) > 8:
        spelled = f"{len(ranks)}r{hashlib.sha256(spelled.encode()).hexdigest()[:12]}"
    key = f"{spelled}_{'-'.join(m[0] + m.split('_')[0][-1] for m in targets)}_{seed}"
    if dora_every:
        key += f"_dora{dora_every}"
    if saves_every:
        key += f"_saves{saves_every}"
    root = Path(base_dir).parent / f"{Path(base_dir).name}-adapters-{key}"
    root.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        name = adapter_name(i)
        folder = root / name
        if not (folder / "adapter_model.safetensors").is_file():
            write_adapter(base_dir, folder, ranks[i % len(ranks)], targets, seed=seed * 100003 + i,
                          dora=bool(dora_every) and i % dora_every == 0,
                          saves_head=bool(saves_every) and i % saves_every == 0)
        out.append((name, folder))
    return out


def workload_adapters(base_dir: Path, workload: Workload) -> list[tuple[str, Path]]:
    """The adapters a workload's requests name, built (or reused) next to the base."""
    if workload.num_adapters == 0:
        return []
    if workload.mix_single:  # one per distinct mix, of its summed rank
        ranks = adapter_ranks(workload)
        return build_adapters(base_dir, len(ranks), ranks, workload.targets, workload.seed)
    return build_adapters(base_dir, workload.num_adapters, workload.ranks, workload.targets, workload.seed,
                          workload.dora_every, workload.saves_every)


def stored(base: Path, adapters: list[tuple[str, Path]]) -> tuple[Path, dict[str, tuple[Path, str]]]:
    """The base and the adapters in a store beside the base (pulled once, validated then, as
    `lorafleet pull` does): the base's folder in the store, and name -> (folder, digest) to
    register each adapter with, as the daemon's resolver registers stored adapters."""
    from lorafleet.adapters.layout import LAYOUT_VERSION
    from lorafleet.store.pull import pull
    from lorafleet.store.store import Store

    store = Store(base.parent / f"{base.name}-store-layout{LAYOUT_VERSION}")  # one per layout form: no stale pulls
    if not store.has("models", "base"):
        pull(str(base), name="base", base=True, store=store)
    out = {}
    for name, path in adapters:
        m = store.get("adapters", name) if store.has("adapters", name) else pull(str(path), name=name, store=store)
        out[name] = (store.folder(m), m["digest"])
    return store.folder(store.get("models", "base")), out


def warm_up_adapter(base_dir: Path) -> Path:
    """The adapter the lorafleet systems load (and unload) in their warm-up: rank 8 on every
    projection, built once next to the base, none of any workload's."""
    [(_, path)] = build_adapters(base_dir, 1, ranks=(8,), seed=WARM_UP_SEED)
    return path
