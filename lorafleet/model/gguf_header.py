"""A GGUF file's header walked with every count and length bounded (`check`), before
`gguf.GGUFReader` reads it.

The reader believes what the file declares: an array's count is looped over whatever bytes are
left (past the end of the file, reading nothing), and each item becomes a numpy array of its own,
so one declared count decides its time and memory. Here each count and length is checked, before
anything is read on its behalf, against the bytes left in the file and against what a served
model needs (`MAX_*`), and each string is checked to be UTF-8; a file past a bound is refused
with a `ModelLoadError` naming the file, the key (or tensor), what it declares and the bound. The
tensors' data is checked to lie within the file. The walk reads the header only (memory-mapped),
copying one string at a time.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

import gguf

from lorafleet.errors import ModelLoadError

V = gguf.GGUFValueType
SCALARS: dict[int, str]  # by the value type (an int in the file)
SCALARS = {V.UINT8: "B", V.INT8: "b", V.UINT16: "H", V.INT16: "h", V.UINT32: "I", V.INT32: "i",
           V.FLOAT32: "f", V.BOOL: "?", V.UINT64: "Q", V.INT64: "q", V.FLOAT64: "d"}
VERSIONS = (2, 3)  # gguf.GGUFReader's

# What a served model needs, with room: a file past one is not a model lorafleet serves, and the
# reader's cost grows with each (one numpy array per array item).
MAX_KEYS = 1 << 16          # metadata keys: a model file holds tens
MAX_TENSORS = 1 << 16       # tensors: a dense model holds about ten a layer (`config.MAX_LAYERS`)
MAX_NAME = 1 << 16          # a key's or tensor name's bytes: the GGUF specification's bound on keys
MAX_DIMS = 4                # a tensor's dimensions: ggml's GGML_MAX_DIMS
MAX_STRING = 1 << 24        # a string value's bytes: chat templates, the longest, are kilobytes
MAX_ARRAY = 1 << 20         # items of any other array: the per-layer values, a charsmap's bytes
MAX_ITEMS = 1 << 22         # items of all arrays together: a tokenizer's tokens, types, scores, merges
MAX_TOKENS = 1 << 19        # a vocabulary: twice the largest published one
MAX_MERGES = 1 << 20        # byte-level BPE merges: several times the largest published list
MAX_TOKEN_BYTES = 1 << 10   # one token's text: real tokens, added ones included, are far shorter
MAX_VOCAB_BYTES = 1 << 23   # all tokens' text: a SentencePiece vocabulary's merges are searched in it
                            # (`gguf_tokenizer._merges_by_score`), so its time is bounded by this
TOKEN_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
MERGES_KEY = "tokenizer.ggml.merges"
# key -> (its items' bound, one item's bytes' bound, what the bound stands for)
ARRAY_BOUNDS = {**{k: (MAX_TOKENS, MAX_TOKEN_BYTES, "tokens a vocabulary holds") for k in TOKEN_KEYS},
                MERGES_KEY: (MAX_MERGES, 2 * MAX_TOKEN_BYTES + 1, "merges a tokenizer holds")}


class _Walk:
    """The header's bytes (`buf`, `size` of them) and the reader's position (`pos`)."""

    def __init__(self, path: Path, buf, order: str):
        self.path, self.buf, self.size, self.order, self.pos = path, buf, len(buf), order, 0
        self.items = 0          # array items so far, all arrays
        self.vocab_bytes = 0    # tokens' text so far

    def refuse(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: {what}; refused before reading it (a damaged or hostile GGUF file)")

    def take(self, fmt: str, what: str):
        n = struct.calcsize(fmt)
        if self.pos + n > self.size:
            raise self.refuse(f"{what} runs past the end of the file ({self.size} bytes)")
        value = struct.unpack_from(self.order + fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def string(self, what: str, bound: int) -> str:
        n = self.take("Q", what)
        if n > bound:
            raise self.refuse(f"{what} is {n} bytes long, over the bound of {bound}")
        if n > self.size - self.pos:
            raise self.refuse(f"{what} declares {n} bytes, only {self.size - self.pos} are left in the file")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.refuse(f"{what} is not UTF-8 (byte {e.start})") from None

    def value(self, key: str, vtype: int):
        what = f"metadata {key}"
        if vtype == V.STRING:
            return self.string(what, MAX_STRING)
        if vtype in SCALARS:
            return self.take(SCALARS[vtype], what)
        if vtype != V.ARRAY:
            raise self.refuse(f"{what} has unknown value type {vtype}")
        itype, count = self.take("I", what), self.take("Q", what)
        bound, item_bytes, meaning = ARRAY_BOUNDS.get(key, (MAX_ARRAY, MAX_STRING, "items a model's array holds"))
        if itype == V.ARRAY:  # llama.cpp refuses arrays of arrays too
            raise self.refuse(f"{what} is an array of arrays, which GGUF models do not hold")
        if itype != V.STRING and itype not in SCALARS:
            raise self.refuse(f"{what} is an array of unknown value type {itype}")
        least = 8 if itype == V.STRING else struct.calcsize(SCALARS[itype])  # an item's fewest bytes
        if count > bound:
            raise self.refuse(f"{what} declares {count} items, over the bound of {bound} ({meaning})")
        if count * least > self.size - self.pos:
            raise self.refuse(f"{what} declares {count} items of {least} bytes or more, only "
                              f"{self.size - self.pos} bytes are left in the file")
        self.items += count
        if self.items > MAX_ITEMS:
            raise self.refuse(f"{what} brings the metadata's array items to {self.items}, over the bound of "
                              f"{MAX_ITEMS}")
        if itype != V.STRING:
            self.pos += count * least
            return None
        for i in range(count):
            start = self.pos
            self.string(f"{what}[{i}]", item_bytes)
            if key == TOKEN_KEYS[0]:
                self.vocab_bytes += self.pos - start - 8  # its length's own bytes not counted
                if self.vocab_bytes > MAX_VOCAB_BYTES:
                    raise self.refuse(f"{what}: the tokens' text passes the bound of {MAX_VOCAB_BYTES} bytes at "
                                      f"token {i}")
        return None


def check(path: str | Path) -> None:
    """Walk the GGUF header of `path` with every count and length bounded (see the module's
    docstring); raises `ModelLoadError` naming the first one out of bounds."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            if fh.seek(0, 2) < 24:  # magic, version, the two counts
                raise ModelLoadError(f"{path}: too short for a GGUF file")
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                _check(path, buf)
    except OSError as e:
        raise ModelLoadError(f"{path}: unreadable GGUF file ({e.strerror or e})") from None


def _check(path: Path, buf) -> None:
    if buf[:4] != b"GGUF":
        raise ModelLoadError(f"{path}: not a GGUF file (its first bytes are not GGUF's magic)")
    order = "<"
    version = struct.unpack_from("<I", buf, 4)[0]
    if version & 0xFFFF == 0:  # written on a machine of the other byte order, as the reader reads it
        order, version = ">", struct.unpack_from(">I", buf, 4)[0]
    if version not in VERSIONS:
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported (versions {VERSIONS})")
    w = _Walk(path, buf, order)
    w.pos = 8
    n_tensors, n_keys = w.take("Q", "the tensor count"), w.take("Q", "the key count")
    for n, what, bound in ((n_keys, "keys", MAX_KEYS), (n_tensors, "tensors", MAX_TENSORS)):
        if n > bound:
            raise w.refuse(f"the header declares {n} {what}, over the bound of {bound}")
    alignment = gguf.GGUF_DEFAULT_ALIGNMENT
    for i in range(n_keys):
        key = w.string(f"metadata key {i}", MAX_NAME)
        value = w.value(key, w.take("I", f"metadata {key}"))
        if key == "general.alignment":
            if not isinstance(value, int) or value < 1 or value & (value - 1):
                raise w.refuse(f"metadata general.alignment is {value!r}, not a power of two")
            alignment = value
    spans = []
    for i in range(n_tensors):
        name = w.string(f"tensor {i}'s name", MAX_NAME)
        n_dims = w.take("I", f"tensor {name}")
        if n_dims > MAX_DIMS:
            raise w.refuse(f"tensor {name} declares {n_dims} dimensions, over the bound of {MAX_DIMS}")
        dims = [w.take("Q", f"tensor {name}") for _ in range(n_dims)]
        raw_type = w.take("I", f"tensor {name}")
        try:
            block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(raw_type)]
        except (ValueError, KeyError):
            raise w.refuse(f"tensor {name} has unknown GGUF type {raw_type}") from None
        elements = 1
        for d in dims:
            elements *= d
        if dims and dims[0] % block:
            raise w.refuse(f"tensor {name}'s rows ({dims[0]}) are not whole blocks of {block}")
        spans.append((name, w.take("Q", f"tensor {name}"), elements // block * type_bytes))
    start = -(-w.pos // alignment) * alignment
    for name, offset, nbytes in spans:
        if start + offset + nbytes > w.size:
            raise w.refuse(f"tensor {name}'s data ({nbytes} bytes at offset {offset}) runs past the end of the "
                           f"file ({w.size} bytes)")
