"""The bench's model and PEFT adapters as GGUF files for llama.cpp (`llamacpp.py`), converted
once by the converters `llamacpp_build.py` fetches.

The bench's models have no tokenizer, and a GGUF needs a vocabulary, so the model's
files are staged (symlinks) beside a stand-in tokenizer of the model's vocabulary size: `<unk>`,
`<s>`, `</s>` at ids 0-2 (the bench models' pad/bos/eos), then `▁<id>` for every other id, whole
ASCII pieces, so that every generated token streams as it comes. Prompts go as token ids and
outputs come back as ids: its strings never matter. `convert_hf_to_gguf.py` and
`convert_lora_to_gguf.py`, both `--outtype f32`, write into `<model>-gguf/` beside the base, each
file named by a digest of its inputs (the files' bytes, the converters' sdist, the staging's form)
and written under a temporary name, then renamed. A quantized base (`lorafleet bench llama-cpp
--quantize`, the same model lorafleet quantizes as it loads): int8 is the converter's
`--outtype q8_0` (`model-q8_0-<digest>.gguf`: blocks of 32 with an fp16 scale, where lorafleet's
int8 has one scale per output channel), int4 is `llama-quantize --pure <f32 file> ... Q4_0`
(`model-q4_0-pure-<digest>.gguf`: Q4_0 is lorafleet's int4 block for block; `--pure` makes the
output tensor Q4_0 too, as lorafleet's LM head, where the tool's default mix keeps it in Q6_K).
The adapters stay f32 GGUF LoRA (lorafleet's stay in the compute dtype).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from lorafleet.bench import llamacpp_build as build
from lorafleet.bench.fixtures import SPECIAL_TOKENS

# `--quantize` -> the GGUF type llama-server is given: the converter writes f32 and Q8_0, the
# quantize tool Q4_0 (from the f32 file, --pure: every tensor, the output one too, as lorafleet's int4)
GGUF_TYPES = {None: "f32", "int8": "q8_0", "int4": "q4_0"}
# `bench llama-cpp --quantize TYPE`: both servers given the one file llama-quantize writes in TYPE
FILE_TYPES = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q5_K_S", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q3_K_M",
              "Q2_K")


def bench_gguf(model_dir: Path, quantize: str | None, say: Callable[[str], None] = build.quiet,
               threads: int | None = None) -> Path:
    """The GGUF llama-server is given for `--quantize` (None, a scheme, or one of FILE_TYPES)."""
    if quantize in FILE_TYPES:
        return quantized_gguf(model_dir, quantize, say, threads)
    return convert_model(model_dir, say, quantize, threads)
STAGE_FORM = 1            # the staged tokenizer's form: a new one converts every model again
CONVERT_TIMEOUT_S = 1800


def convert_model(model_dir: Path, say: Callable[[str], None] = build.quiet, quantize: str | None = None,
                  threads: int | None = None) -> Path:
    """The bench model as a GGUF of `GGUF_TYPES[quantize]`, converted once (cached beside it, by
    content): f32 and Q8_0 (`quantize` int8) by the converter, Q4_0 (int4) by the quantize tool
    from the f32 file (`quantize_command`: `--pure`, `threads` of it)."""
    model_dir = Path(model_dir)
    if quantize not in GGUF_TYPES:
        raise ValueError(f"quantize {quantize!r}: one of {', '.join(map(str, GGUF_TYPES))}")
    if quantize == "int4":
        f32 = convert_model(model_dir, say)
        out = f32.with_name(f32.name.replace("model-f32-", "model-q4_0-pure-", 1))
        if not out.is_file():
            binary = build.quantize_binary(say)
            say(f"quantizing {model_dir.name}'s GGUF to Q4_0")
            with tempfile.TemporaryDirectory(prefix=".quantize-", dir=out.parent) as tmp:
                _run(quantize_command(binary, f32, Path(tmp) / "out.gguf", threads),
                     f"quantizing {f32.name} to Q4_0")
                os.replace(Path(tmp) / "out.gguf", out)
        return out
    outtype = GGUF_TYPES[quantize]
    conv = build.converters(say)
    out = _gguf_dir(model_dir) / f"model-{outtype}-{_inputs_digest(_model_files(model_dir))}.gguf"
    if not out.is_file():
        say(f"converting {model_dir.name} to GGUF ({outtype})")
        with tempfile.TemporaryDirectory(prefix=".convert-", dir=out.parent) as tmp:
            stage = _stage(model_dir, Path(tmp) / "model")
            _convert(convert_command(conv, stage, outtype, Path(tmp) / "out.gguf"), f"converting {model_dir} to GGUF")
            os.replace(Path(tmp) / "out.gguf", out)
    return out


def quantized_gguf(model_dir: Path, gguf_type: str, say: Callable[[str], None] = build.quiet,
                   threads: int | None = None) -> Path:
    """The bench model as llama-quantize writes it in `gguf_type` (Q4_K_M, Q6_K, Q4_1...: its own
    choice of type per tensor, as a user runs it), from the f32 conversion; cached beside it."""
    if not gguf_type.replace("_", "").isalnum() or len(gguf_type) > 16:
        raise ValueError(f"GGUF type {gguf_type!r}: a llama-quantize type such as Q4_K_M")
    f32 = convert_model(model_dir, say)
    out = f32.with_name(f32.name.replace("model-f32-", f"model-{gguf_type.lower()}-", 1))
    if not out.is_file():
        binary = build.quantize_binary(say)
        say(f"quantizing {Path(model_dir).name}'s GGUF to {gguf_type}")
        with tempfile.TemporaryDirectory(prefix=".quantize-", dir=out.parent) as tmp:
            _run([binary, f32, Path(tmp) / "out.gguf", gguf_type, *([str(threads)] if threads else [])],
                 f"quantizing {f32.name} to {gguf_type}")
            os.replace(Path(tmp) / "out.gguf", out)
    return out


def convert_command(conv: Path, stage: Path, outtype: str, outfile: Path) -> list:
    """The converter's arguments (after the Python that runs it) for a model staged in `stage`."""
    return [conv / "convert_hf_to_gguf.py", stage, "--outtype", outtype, "--outfile", outfile]


def quantize_command(binary: Path, src: Path, dst: Path, threads: int | None = None) -> list:
    """llama-quantize's command line: `src` (the f32 GGUF) to Q4_0 in `dst`, `--pure` so that
    every tensor is Q4_0, the output (LM head) and token embedding included, where its default
    mix keeps the output in Q6_K: lorafleet's int4 holds its LM head in int4, so this is the
    same model in the same bytes."""
    return [binary, "--pure", src, dst, "Q4_0", *([str(threads)] if threads else [])]


def _run(cmd: list, what: str) -> None:
    try:
        proc = subprocess.run(list(map(str, cmd)), stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=CONVERT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise build.LlamaCppUnavailable(f"{what} took over {CONVERT_TIMEOUT_S} s")
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise build.LlamaCppUnavailable(f"{what} failed (exit {proc.returncode}): {tail}")


def convert_adapter(model_dir: Path, adapter_dir: Path, say: Callable[[str], None] = build.quiet) -> Path:
    """A PEFT adapter of the bench model as an f32 GGUF LoRA adapter (cached beside the base, by content)."""
    model_dir, adapter_dir = Path(model_dir), Path(adapter_dir)
    conv = build.converters(say)
    files = [model_dir / "config.json", adapter_dir / "adapter_config.json", adapter_dir / "adapter_model.safetensors"]
    out = _gguf_dir(model_dir) / f"lora-f32-{_inputs_digest(files)}.gguf"
    if not out.is_file():
        say(f"converting adapter {adapter_dir.name} to GGUF")
        with tempfile.TemporaryDirectory(prefix=".convert-", dir=out.parent) as tmp:
            stage = _stage(model_dir, Path(tmp) / "model")
            _convert([conv / "convert_lora_to_gguf.py", adapter_dir, "--base", stage, "--outtype", "f32",
                      "--outfile", Path(tmp) / "out.gguf"], f"converting adapter {adapter_dir} to GGUF")
            os.replace(Path(tmp) / "out.gguf", out)
    return out


def _model_files(model_dir: Path) -> list[Path]:
    weights = sorted(model_dir.glob("*.safetensors"))
    if not weights:
        from lorafleet.model.loader import RANDOM_WEIGHTS

        made = " (its weights are made in memory as it loads: no files for llama.cpp's converter)" \
            if (model_dir / RANDOM_WEIGHTS).is_file() else ""
        raise build.LlamaCppUnavailable(f"{model_dir} has no *.safetensors to convert{made}")
    return [model_dir / "config.json", *weights]


def _inputs_digest(files: list[Path]) -> str:
    h = hashlib.sha256(f"{build.SDIST_SHA256}/{STAGE_FORM}".encode())
    for f in files:
        h.update(f"\0{f.name}\0".encode())
        build.file_digest(f, h)
    return h.hexdigest()[:16]


def _gguf_dir(model_dir: Path) -> Path:
    folder = model_dir.parent / f"{model_dir.name}-gguf"
    folder.mkdir(exist_ok=True)
    return folder


def _stage(model_dir: Path, stage: Path) -> Path:
    """The model's files (symlinked) and a stand-in tokenizer of its vocabulary size."""
    config = json.loads((model_dir / "config.json").read_text())
    specials = {k: config[k] for k in SPECIAL_TOKENS}
    if specials != SPECIAL_TOKENS:
        raise build.LlamaCppUnavailable(f"{model_dir}: the stand-in tokenizer needs the bench models' special tokens "
                                  f"{SPECIAL_TOKENS}, the config has {specials}")
    stage.mkdir()
    for f in model_dir.iterdir():
        (stage / f.name).symlink_to(f.resolve())
    (stage / "tokenizer.json").write_text(json.dumps(stand_in_tokenizer(config["vocab_size"])))
    (stage / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "pad_token": "<unk>", "bos_token": "<s>",
        "eos_token": "</s>", "add_bos_token": False, "add_eos_token": False}))
    return stage


def stand_in_tokenizer(vocab_size: int) -> dict:
    """A `tokenizers` BPE vocabulary of the Llama kind (byte fallback, a decoder sequence: what
    the converter takes for a Llama tokenizer) with no merges: ids 0-2 special, `▁<id>` after."""
    specials = ["<unk>", "<s>", "</s>"]
    vocab = {**{s: i for i, s in enumerate(specials)}, **{f"\u2581{i}": i for i in range(len(specials), vocab_size)}}
    return {"version": "1.0", "truncation": None, "padding": None, "normalizer": None, "pre_tokenizer": None,
            "post_processor": None,
            "added_tokens": [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": False, "special": True} for i, s in enumerate(specials)],
            "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]},
            "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                      "vocab": vocab, "merges": []}}


def _convert(args: list, what: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}  # the converters' own gguf-py
    try:
        proc = subprocess.run([sys.executable, *map(str, args)], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=CONVERT_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        raise build.LlamaCppUnavailable(f"{what} took over {CONVERT_TIMEOUT_S} s")
    if proc.returncode != 0:
        tail = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise build.LlamaCppUnavailable(f"{what} failed (exit {proc.returncode}): {tail}")
