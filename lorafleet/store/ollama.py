"""Models already in a local Ollama store, named as Ollama names them: `ollama:NAME[:TAG]`
(`llama3.2`, `llama3.2:1b`, `me/sql-bot:v2`, `host/ns/name:tag`). Nothing is fetched: the store is
`$OLLAMA_MODELS`, else `~/.ollama/models`, laid out as Ollama lays it out:

- `manifests/<registry>/<namespace>/<name>/<tag>`: a JSON manifest (the registry
  `registry.ollama.ai` and the namespace `library` where the name gives none, the tag `latest`);
- its `layers`, by media type: `application/vnd.ollama.image.model` (the GGUF base),
  `.adapter` (GGUF LoRA adapters), `.params` (JSON sampling options), `.template` (a Go template),
  `.system`, `.license` (these two unread);
- `blobs/sha256-<hex>`, one file per digest.

`resolve` reads a manifest (bounded in size, every name component checked: no component becomes
a path unchecked) and links its blobs, under the names lorafleet's readers recognize
(`<ref>/model.gguf`, `<ref>/adapter-<i>.gguf`), into `$LORAFLEET_HOME/cache/ollama/`: the blobs are
read where Ollama keeps them, never copied. A blob whose size is not the manifest's is refused.

The chat template served is the GGUF's own Jinja `tokenizer.chat_template` where it has one (what
llama.cpp and Hugging Face read); else the template layer, linked beside the GGUF as `model.gotmpl`
and translated to Jinja when the tokenizer is read (`model.go_template.beside`: a template outside
the subset translated leaves the model without one, with a warning naming the construct).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from lorafleet.errors import StoreError, StoreNotFoundError
from lorafleet.model.go_template import SUFFIX

PREFIX = "ollama:"
REGISTRY, NAMESPACE, TAG = "registry.ollama.ai", "library", "latest"
MODEL, ADAPTER, PARAMS, TEMPLATE = ("application/vnd.ollama.image." + k for k in ("model", "adapter", "params",
                                                                                  "template"))
MAX_MANIFEST_BYTES = 1 << 20
MAX_PARAMS_BYTES = 64 << 10
COMPONENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
DIGEST = re.compile(r"sha256:([0-9a-f]{64})")


def is_ref(source: str) -> bool:
    return source.startswith(PREFIX)


def models_dir() -> Path:
    env = os.environ.get("OLLAMA_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".ollama" / "models"


@dataclass
class OllamaModel:
    ref: str                 # as given, less the prefix: "llama3.2:1b"
    name: str                # a name lorafleet can give it: "llama3.2-1b"
    model: Path              # the base, a GGUF file (a link to its blob)
    adapters: list[Path]     # GGUF LoRA adapters (links to their blobs), in the manifest's order
    params: dict             # Ollama's sampling options, as the params layer holds them


def parse(ref: str) -> tuple[str, str, str, str]:
    """NAME[:TAG] -> (registry, namespace, name, tag), each component checked."""
    ref = ref.removeprefix(PREFIX)
    path, tag = ref.rsplit(":", 1) if ":" in ref.rsplit("/", 1)[-1] else (ref, TAG)
    parts = path.split("/")
    if len(parts) > 3 or not all(parts):
        raise StoreError(f"ollama:{ref}: an Ollama model is NAME[:TAG], NAMESPACE/NAME[:TAG] or "
                         "REGISTRY/NAMESPACE/NAME[:TAG]")
    registry, namespace, name = {1: [REGISTRY, NAMESPACE], 2: [REGISTRY], 3: []}[len(parts)] + parts
    for what, value in (("registry", registry), ("namespace", namespace), ("name", name), ("tag", tag)):
        if not COMPONENT.fullmatch(value) or ".." in value:
            raise StoreError(f"ollama:{ref}: {what} {value[:40]!r} is not an Ollama name (letters, digits, . _ -)")
    return registry, namespace, name, tag


def _blob(root: Path, layer: dict, ref: str) -> Path:
    m = DIGEST.fullmatch(str(layer.get("digest", "")))
    if not m:
        raise StoreError(f"ollama:{ref}: a layer's digest {str(layer.get('digest'))[:80]!r} is not sha256:<hex>")
    path = root / "blobs" / f"sha256-{m.group(1)}"
    if not path.is_file():
        raise StoreNotFoundError(f"ollama:{ref}: its blob {path} is missing (run `ollama pull` again)")
    if path.stat().st_size != layer.get("size"):
        raise StoreError(f"ollama:{ref}: {path} holds {path.stat().st_size:,} bytes, its manifest says "
                         f"{layer.get('size')!r}: a partial or changed blob")
    return path


def _link(blob: Path, link: Path) -> Path:
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() and os.readlink(link) == str(blob):
        return link
    tmp = link.with_name(f".{link.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    os.symlink(blob, tmp)
    os.replace(tmp, link)  # atomic: a reader sees the old link or the new one
    return link


def resolve(ref: str) -> OllamaModel:
    """The model `ollama:NAME[:TAG]` names in the local Ollama store; StoreNotFoundError naming
    where it looked when there is none."""
    from lorafleet.paths import home

    registry, namespace, name, tag = parse(ref)
    ref = ref.removeprefix(PREFIX)
    root = models_dir()
    manifest_path = root / "manifests" / registry / namespace / name / tag
    if not manifest_path.is_file():
        raise StoreNotFoundError(f"ollama:{ref}: no such model in the Ollama store ({manifest_path} does not exist; "
                                 "`ollama list` shows what it holds, OLLAMA_MODELS says where it is)")
    if manifest_path.stat().st_size > MAX_MANIFEST_BYTES:
        raise StoreError(f"ollama:{ref}: {manifest_path} is over {MAX_MANIFEST_BYTES >> 20} MiB: not a manifest")
    try:
        manifest = json.loads(manifest_path.read_bytes())
        layers = manifest["layers"]
        if not isinstance(layers, list) or not all(isinstance(layer, dict) for layer in layers):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise StoreError(f"ollama:{ref}: {manifest_path} is not an Ollama manifest (JSON with layers)") from None
    by_type: dict[str, list[dict]] = {}
    for layer in layers:
        by_type.setdefault(str(layer.get("mediaType")), []).append(layer)
    if len(by_type.get(MODEL, [])) != 1:
        raise StoreError(f"ollama:{ref}: its manifest has {len(by_type.get(MODEL, []))} model layers, not one")
    label = f"{name}-{tag}" if tag != TAG else name
    links = home() / "cache" / "ollama" / registry / namespace / name / tag
    model = _link(_blob(root, by_type[MODEL][0], ref), links / "model.gguf")
    adapters = [_link(_blob(root, layer, ref), links / f"adapter-{i}.gguf")
                for i, layer in enumerate(by_type.get(ADAPTER, []))]
    template = model.with_suffix(SUFFIX)  # read (bounded) and translated by the GGUF's tokenizer reader
    if by_type.get(TEMPLATE):
        _link(_blob(root, by_type[TEMPLATE][0], ref), template)
    else:
        template.unlink(missing_ok=True)  # a template an earlier manifest had
    params: dict = {}
    if by_type.get(PARAMS):
        path = _blob(root, by_type[PARAMS][0], ref)
        if path.stat().st_size <= MAX_PARAMS_BYTES:
            try:
                loaded = json.loads(path.read_bytes())
                params = loaded if isinstance(loaded, dict) else {}
            except ValueError:
                params = {}
    return OllamaModel(ref, label, model, adapters, params)
