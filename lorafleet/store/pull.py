"""`lorafleet pull`: a base or an adapter from a local folder or the Hugging Face Hub into the
store, validated once.

An adapter is validated against a base already in the store with the very checks the engine
applies when it loads one (`adapters.adapter.load_adapter`: config, tensor names, shapes, ranks,
layers, finite values), and its content digest is computed then, once, and its weights are
laid out as the engine's pages hold them (`adapters.layout.save`, stored beside the PEFT files as
`lorafleet-layout.safetensors`, for the pages of the default `block_size`: a load from the store
maps it and copies it, nothing else; an engine with other pages lays it out again: from the saved
rows where its pages hold a multiple of the elements, as with `--lora-dtype`). The
base is the one named with `--for`, else the stored base whose name or Hub id its
`base_model_name_or_path` names, else the base a running daemon serves (stored or a folder: the
manifest then records the folder), else the only base in the store. A `base_model_name_or_path`
naming another model is a warning (an error with `strict_base`): shapes decide what can be
served, the name is a hint. A base is checked as the engine reads it (`model.config.ModelConfig`:
the architecture and features it can serve) and must hold safetensors weights. Only the files
lorafleet reads are stored; pickled weights (`*.bin`, `*.pt`) never are.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from lorafleet.errors import StoreError, StoreNotFoundError
from lorafleet.store import hub
from lorafleet.store.hub import ADAPTER_FILES, ADAPTER_OPTIONAL, MODEL_OPTIONAL  # the files a folder gives, as a repo does
from lorafleet.store.store import Store, check_name


def model_files(folder: Path) -> list[str]:
    weights = sorted(p.name for p in folder.glob("*.safetensors"))
    if not weights:
        raise StoreError(f"{folder}: no *.safetensors weights (pickled weights are never loaded)")
    return ["config.json", *weights, *(f for f in MODEL_OPTIONAL if (folder / f).is_file())]


def _hub_id(manifest: dict) -> str | None:
    source = manifest.get("source", "")
    return source[3:] if source.startswith("hf:") else None


def choose_base(store: Store, adapter_cfg: dict, for_model: str | None,
                served: tuple[str, Path] | None = None) -> dict:
    """The base an adapter is validated against: `--for`'s; else the stored base its
    base_model_name_or_path names; else the base a running daemon serves (`served`: its name and
    folder), stored or not; else the store's only base. A base that is not stored is returned as
    {"name", "snapshot": None, "folder"}."""
    if for_model is not None:
        return store.get("models", for_model)
    bases = store.list("models")
    wanted = adapter_cfg.get("base_model_name_or_path")
    named = [b for b in bases if wanted and wanted in (b["name"], _hub_id(b))]
    if len(named) == 1:
        return named[0]
    if served is not None:
        name, folder = served
        folder = folder.resolve()
        stored = [b for b in bases if store.folder(b).resolve() == folder]
        return stored[0] if stored else {"name": name, "snapshot": None, "folder": str(folder)}
    if len(bases) == 1:
        return bases[0]
    if not bases:
        raise StoreError("the store holds no base model to validate the adapter against, and no daemon "
                         "serves one: pull one first (lorafleet pull SOURCE --base) or start the daemon "
                         "on the base (lorafleet serve MODEL)")
    raise StoreError(f"the store holds {len(bases)} bases and the adapter's base_model_name_or_path names "
                     "none of them: say which with --for MODEL")


def _validate_adapter(store: Store, folder: Path, for_model: str | None, strict_base: bool,
                      warn: Callable[[str], None], layout_file: Path, served: tuple[str, Path] | None) -> dict:
    """Validate the adapter in `folder` (raises on any problem), write its laid-out weights to
    `layout_file`, and return the manifest's adapter fields."""
    from lorafleet.config import EngineConfig
    from lorafleet.adapters.adapter import BaseShapes, load_adapter, read_adapter_config
    from lorafleet.adapters import layout
    from lorafleet.memory.kv import kv_page_elems
    from lorafleet.model.config import ModelConfig

    cfg = read_adapter_config(folder)
    base = choose_base(store, cfg, for_model, served)
    model = _base_config(store, base)
    shapes = BaseShapes.from_model_config(model)
    adapter = load_adapter(folder, shapes)  # AdapterError names what is wrong
    if adapter.vocab_size != shapes.vocab_size:  # its own vocabulary: its tokenizer must come with it
        from lorafleet.adapters.heads import own_tokenizer
        own_tokenizer(folder, adapter.vocab_size, shapes.vocab_size)
    wanted = cfg.get("base_model_name_or_path")
    if wanted and wanted not in (base["name"], _hub_id(base)) and not _same_folder(wanted, store, base):
        which = "the stored base" if base["snapshot"] else "the base the daemon serves,"
        message = (f"the adapter says it was trained on {wanted!r}; validated against {which} "
                   f"{base['name']!r}, whose shapes it fits")
        if strict_base:
            raise StoreError(message + " (refused: --strict-base)")
        warn(message)
    page_elems = kv_page_elems(model.num_layers, EngineConfig().block_size, model.num_kv_heads, model.head_dim)
    layout.save(layout_file, adapter, shapes, page_elems)
    ranks = adapter.ranks
    where = {"snapshot": base["snapshot"]} if base["snapshot"] else {"snapshot": None, "folder": base["folder"]}
    return {"digest": adapter.digest, "base": {"name": base["name"], **where},
            "ranks": ranks, "modules": sorted(ranks), "params": adapter.num_params}


def _base_config(store: Store, base: dict):
    """The ModelConfig of a base `choose_base` chose."""
    from lorafleet.model.config import ModelConfig

    folder_or_file = store.base_folder(base)
    if folder_or_file.suffix.lower() == ".gguf" and folder_or_file.is_file():  # a daemon serving a GGUF file
        from lorafleet.model.gguf import GGUFFile

        return GGUFFile(folder_or_file).model_config
    return ModelConfig.from_folder(folder_or_file)


def _gguf_adapter(store: Store, path: Path, for_model: str | None, served, out: Path) -> Path:
    """A GGUF LoRA adapter as the PEFT folder it came from, in `out` (`adapters/gguf.py`), its
    Q/K rows put back with the head counts of the base it will be validated against."""
    from lorafleet.adapters import gguf as gguf_adapter

    model = _base_config(store, choose_base(store, gguf_adapter.config_hint(path), for_model, served))
    gguf_adapter.convert(path, out, (model.num_heads, model.num_kv_heads))
    return out


def _same_folder(wanted: str, store: Store, base: dict) -> bool:
    """Whether base_model_name_or_path is a path to the very folder (or GGUF file) of `base`, as
    a locally trained adapter names its base: no mismatch to warn of."""
    try:
        return Path(wanted).expanduser().resolve() == store.base_folder(base).resolve()
    except (OSError, ValueError, RuntimeError):
        return False


def _validate_model(folder: Path) -> dict:
    from lorafleet.model.config import ModelConfig

    cfg = ModelConfig.from_folder(folder)  # UnsupportedModelError / ModelLoadError name the problem
    raw = json.loads((folder / "config.json").read_text())
    return {"architecture": (raw.get("architectures") or ["?"])[0], "layers": cfg.num_layers,
            "hidden_size": cfg.hidden_size}


def _quantized(folder: Path, files: list[str], scheme: str, out: Path) -> tuple[Path, list[str]]:
    """`folder`'s base quantized in `scheme` into `out`, with its other files (config, tokenizer)
    linked beside the quantized weights; returns (out, the files to store)."""
    from lorafleet.model.loader import write_quantized

    written = write_quantized(folder, out, scheme)
    kept = [f for f in files if not f.endswith(".safetensors") and f != "model.safetensors.index.json"]
    for f in kept:
        os.symlink(os.path.abspath(folder / f), out / f)
    return out, kept + written


def _gguf(path: Path, base: bool, quantize: str | None, revision: str | None, out: Path) -> Path:
    """A GGUF base file as a model folder in `out` (`model.gguf.write_folder`: config, tokenizer,
    its weights as quantized safetensors, each in its own scheme)."""
    from lorafleet.model.gguf import CONVERTED, QUANT_TYPES, GGUFFile, write_folder

    if not base:
        raise StoreError(f"{path}: a GGUF file is a base model: pull it with --base (adapters are PEFT folders)")
    if revision is not None:
        raise StoreError("--revision is for Hub sources; SOURCE is a local file")
    if quantize is not None:
        types = {t.type.name for t in GGUFFile(path).tensors.values() if t.type in QUANT_TYPES or t.type in CONVERTED}
        if types:
            raise StoreError(f"{path}: the GGUF file is quantized already ({', '.join(sorted(types))}); pull it "
                             "without --quantize")
    write_folder(path, out, quantize)
    return out


def _is_gguf_adapter(path: Path) -> bool:
    from lorafleet.adapters.gguf import is_adapter

    return is_adapter(path)


def _stored_scheme(folder: Path) -> str | None:
    from lorafleet.model.quant import stored_label

    return stored_label(folder)


def default_name(source: str) -> str:
    """A folder's, file's (less .gguf) or repo's last component, with characters a name cannot
    hold replaced by '-'."""
    last = source.rstrip("/").split("/")[-1]
    last = last[:-len(".gguf")] if last.lower().endswith(".gguf") else last
    return re.sub(r"[^A-Za-z0-9._-]", "-", last)[:128]


def pull(source: str, *, name: str | None = None, base: bool = False, quantize: str | None = None,
         revision: str | None = None,
         for_model: str | None = None, strict_base: bool = False, store: Store | None = None,
         progress: bool = True, warn: Callable[[str], None] = lambda m: None,
         served: tuple[str, Path] | None = None) -> dict:
    """Validate and store SOURCE (a folder, or a Hub repo id) as NAME; returns the manifest.
    `served`: the name and folder of the base a running daemon serves (see `choose_base`).
    A refusal raises (StoreError, AdapterError, ModelLoadError...) and leaves the store as it was.

    From the Hub, weight files are downloaded into the store's partial downloads (resumed by the
    next pull if this one dies), claimed until the install has moved them into the store.

    `quantize` (int8 | int4, a base only): the base is stored quantized (`model.loader.
    write_quantized`: its weights quantized once, tensor by tensor; the manifest records the
    scheme as `quantization`).

    SOURCE may be a GGUF file (`*.gguf`): a base (`base`) stored converted (`model.gguf.
    write_folder`), each weight in its scheme, the manifest recording the file's mix, `format: gguf`
    and the file as `source` (`quantize` is refused for a quantized file); or a LoRA adapter,
    stored as the PEFT folder it came from (`adapters/gguf.py`).

    SOURCE may be `ollama:NAME[:TAG]`, a model of the local Ollama store (`store/ollama.py`): its
    base is stored under NAME (NAME-base where it has adapters), its adapters under NAME (NAME-2...),
    validated against that base; the base's manifest is returned, its adapters' under
    `ollama_adapters`."""
    store = store or Store()
    from lorafleet.store import ollama

    if ollama.is_ref(source):
        om = ollama.resolve(source)
        label = check_name(name or om.name)
        base_name = f"{label}-base" if om.adapters else label
        m = pull(str(om.model), name=base_name, base=True, quantize=quantize, store=store, progress=progress,
                 warn=warn)
        m = {**m, "source": source}
        adapters = [pull(str(a), name=label if i == 0 else f"{label}-{i + 1}", for_model=base_name, store=store,
                         progress=progress, warn=warn) for i, a in enumerate(om.adapters)]
        return {**m, "ollama_adapters": adapters} if adapters else m
    if quantize is not None:
        if not base:
            raise StoreError("--quantize is for a base (--base); an adapter stays in full precision")
        if quantize not in ("int8", "int4"):
            raise StoreError(f"--quantize {quantize!r}: choose int8 or int4")
    try:
        return _pull(source, name, base, quantize, revision, for_model, strict_base, store, progress, warn, served)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _no_space(e, store, Path(source).expanduser()) from None
        raise


def _no_space(e: OSError, store: Store, source: Path) -> StoreError:
    """The one line for a disk (or quota) that filled during a pull: where, how much is free, and
    about how much the pull needs (a folder's files, and their laid-out copy for an adapter)."""
    where = Path(e.filename) if e.filename else store.root
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    files = [f for f in source.rglob("*") if f.is_file()] if source.is_dir() else []
    need = f", and this pull needs about {_size(2 * sum(f.stat().st_size for f in files))}" if files else ""
    return StoreError(f"no space left on the device holding {where} ({_size(free)} free{need}); free some "
                      "space (`lorafleet store gc` removes files no item uses) and pull again")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _pull(source: str, name: str | None, base: bool, quantize: str | None, revision: str | None, for_model: str | None,
          strict_base: bool, store: Store, progress: bool, warn: Callable[[str], None],
          served: tuple[str, Path] | None) -> dict:
    kind = "models" if base else "adapters"
    name = check_name(name if name is not None else default_name(source))
    path = Path(source).expanduser()
    origin: dict = {}
    fetched: list[str] | None = None  # from the Hub: exactly the files it verified
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="lorafleet-pull-")))
        take: list[Path] = []
        if path.is_file() and path.suffix.lower() == ".gguf" and not base and _is_gguf_adapter(path):
            origin.update(source=str(path.resolve()), format="gguf")
            path = _gguf_adapter(store, path, for_model, served, tmp / "gguf-adapter")  # then as a PEFT folder
        if path.is_file() and path.suffix.lower() == ".gguf":  # a llama.cpp file, converted to the store's layout
            folder, origin["source"] = _gguf(path, base, quantize, revision, tmp / "gguf"), str(path.resolve())
            record = {**_validate_model(folder), "format": "gguf"}
            if (folder / "lorafleet-quantization.json").is_file():
                record["quantization"] = _stored_scheme(folder)
            files = sorted(f.name for f in folder.iterdir())
            with store.lock():
                return store.install(kind, name, {f: folder / f for f in files}, {**record, **origin})
        if path.is_dir():
            folder = path
            origin.setdefault("source", str(path.resolve()))
            if revision is not None:
                raise StoreError("--revision is for Hub sources; SOURCE is a local folder")
        else:
            if not hub.is_repo_id(source):
                raise StoreNotFoundError(f"{source!r} is neither a folder nor a Hugging Face repo id (org/name), "
                                         "nor a .gguf file")
            partials = stack.enter_context(store.partials())
            _, info = hub.download(source, revision=revision, kind="model" if base else "adapter",
                                   progress=progress, partials=partials, have=store.blob)
            origin.update(source=f"hf:{source}", revision=info["revision"])
            fetched = sorted(info["files"])
            folder = tmp / "files"  # the verified files, wherever each is (Hub cache, partial, store)
            folder.mkdir()
            for f, where in info["paths"].items():
                os.symlink(os.path.abspath(where), folder / f)
            take = list(info["paths"].values())
        if base:
            files, record = fetched or model_files(folder), _validate_model(folder)
            if quantize:
                folder, files = _quantized(folder, files, quantize, tmp / "quantized")
                record["quantization"] = quantize
            elif (folder / "lorafleet-quantization.json").is_file():
                files.append("lorafleet-quantization.json")
                record["quantization"] = _stored_scheme(folder)
            with store.lock():
                return store.install(kind, name, {f: folder / f for f in files}, {**record, **origin}, take=take)
        missing = [f for f in ADAPTER_FILES if not (folder / f).is_file()]
        if missing:
            raise StoreError(f"{folder}: not a PEFT adapter folder (missing {', '.join(missing)}; "
                             "pickled adapter_model.bin files are never loaded)")
        from lorafleet.adapters.layout import LAYOUT_FILE

        laid_out = tmp / LAYOUT_FILE
        record = _validate_adapter(store, folder, for_model, strict_base, warn, laid_out, served)
        with store.lock():
            files = [*ADAPTER_FILES, *(f for f in ADAPTER_OPTIONAL if (folder / f).is_file())]
            return store.install(kind, name, {**{f: folder / f for f in files}, LAYOUT_FILE: laid_out},
                                 {**record, **origin}, take=take)
