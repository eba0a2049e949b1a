"""A GGUF file's metadata and tensor table, parsed in one pass over the mapped header.

The gguf package's GGUFReader builds a numpy view for every part of every field: a 49,152-token
vocabulary and its merges are ~600,000 of them, ~3-4 s a parse on a 2-core Zen 4, and preparing a
file took four such parses (12 s of a 25 s first start). Here arrays of strings are walked, not
kept (a count stands for them, as transformers' fast reader does), and a tensor whose data would
run past the end of the file, a truncated download, is refused as GGUFReader refuses it.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

from gguf.constants import GGML_QUANT_SIZES

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32  # llama.cpp's, where general.alignment is absent
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q"}
_SCALARS |= {11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class FileTensor:
    offset: int  # of its data, from the file's start
    qtype: int  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # torch's order: [rows, weights per row] for a matrix

    def nbytes(self) -> int:
        per, size = GGML_QUANT_SIZES[self.qtype]
        count = 1
        for n in self.shape:
            count *= n
        return count // per * size


@dataclass(frozen=True)
class GgufHeader:
    metadata: dict[str, Any]  # arrays of strings as their length
    tensors: dict[str, FileTensor]

    @property
    def arch(self) -> str:
        return self.metadata["general.architecture"]


def read_header(path: str) -> GgufHeader:
    """The file's header; ValueError (naming what is wrong) for anything not a whole GGUF file."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        try:
            return _parse(blob)
        except (struct.error, KeyError, UnicodeDecodeError) as e:  # bytes cut short or damaged
            raise ValueError(f"its header does not parse ({type(e).__name__}: {e})") from None


def _parse(blob: mmap.mmap) -> GgufHeader:
    if blob[:4] != GGUF_MAGIC:
        raise ValueError("it does not start with GGUF's magic bytes")
    version, tensor_count, field_count = struct.unpack_from("<IQQ", blob, 4)
    if version not in (2, 3):
        raise ValueError(f"it is GGUF version {version} (2 and 3 are read)")
    pos, metadata = 24, {}
    for _ in range(field_count):
        key, pos = _string(blob, pos)
        (kind,) = struct.unpack_from("<I", blob, pos)
        metadata[key], pos = _value(blob, pos + 4, kind)
    if "general.architecture" not in metadata:
        raise ValueError("its metadata has no general.architecture")
    entries, pos = _tensor_table(blob, tensor_count, pos)
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    data_start = (pos + align - 1) // align * align
    tensors = {name: FileTensor(data_start + off, qt, shape) for name, shape, qt, off in entries}
    for name, t in tensors.items():
        if t.offset + t.nbytes() > len(blob):
            raise ValueError(f"tensor {name}'s data runs past the end of the file (truncated?)")
    return GgufHeader(metadata, tensors)


def _string(blob: mmap.mmap, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", blob, pos)
    if pos + 8 + n > len(blob):
        raise ValueError("a string runs past the end of the file (truncated?)")
    return blob[pos + 8 : pos + 8 + n].decode("utf-8"), pos + 8 + n


def _value(blob: mmap.mmap, pos: int, kind: int) -> tuple[Any, int]:
    if kind == _STRING:
        return _string(blob, pos)
    if kind != _ARRAY:
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    item, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if item == _STRING:  # a vocabulary: walked past, its length kept
        for _ in range(count):
            pos += 8 + struct.unpack_from("<Q", blob, pos)[0]
        return count, pos
    if item == _ARRAY:
        raise ValueError("it has an array of arrays in its metadata")
    fmt = _SCALARS[item]
    width = struct.calcsize(fmt)
    return list(struct.unpack_from(f"<{count}{fmt[1]}", blob, pos)), pos + count * width


def _tensor_table(blob: mmap.mmap, count: int, pos: int) -> tuple[list[tuple], int]:
    entries = []
    for _ in range(count):
        name, pos = _string(blob, pos)
        (dims,) = struct.unpack_from("<I", blob, pos)
        shape = struct.unpack_from(f"<{dims}Q", blob, pos + 4)
        pos += 4 + 8 * dims
        qtype, offset = struct.unpack_from("<IQ", blob, pos)
        entries.append((name, tuple(reversed(shape)), qtype, offset))
        pos += 12
    return entries, pos
