"""A GGUF file's header, parsed once, and its tensors read one at a time.

gguf-py's `GGUFReader` maps the whole file and builds a numpy view per metadata array
entry: opening a file with a 262k-token vocabulary takes ~15 s on two cores, and every
tensor page it touches counts in the process's resident memory for as long as the mapping
lives. Serving a GGUF needs neither: this reader parses the header (the metadata and the
tensor table) in one pass, then reads each tensor's bytes into memory of its own when it
is asked for (`file_read.read_at`, like `checkpoint.iter_weights` for safetensors), so a loader
that moves each tensor to its final layout before the next holds at most one tensor beyond
the model, and the file's pages stay page cache (docs/design.md §12).

`GgufFile` answers the parts of `GGUFReader`'s interface the loaders use (``fields[key]
.contents()``, ``tensors`` with ``name``, ``shape`` (innermost first), ``tensor_type``,
``n_bytes`` and ``data``), so `gguf_blocks.read_linears`, `gguf_model.hf_config` and the
architectures' hooks take either.

The format (GGUF v2/v3, little-endian): magic ``GGUF``, version, tensor count, metadata
count; each metadata entry a string key, a type and a value (arrays: element type, count,
elements); each tensor a name, its dimensions (innermost first), its type and its offset
from the data section, which starts at the next multiple of ``general.alignment``
(default 32) after the table.
"""

from __future__ import annotations

import functools
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt

from ringserve.engine.loading.errors import ModelLoadError
from ringserve.engine.loading.file_read import read_at

__all__ = ["GgufField", "GgufFile", "GgufTensor", "open_gguf"]

_SCALARS: dict[int, tuple[str, int]] = {  # GGUF value type -> (struct code, size)
    0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4),
    6: ("f", 4), 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8),
}
_NUMPY: dict[int, str] = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4",
                          6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_CHUNK_BYTES = 8 << 20  # `GgufTensor.row_chunks`: a few MiB, read and moved while in cache
_FLOATS = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}


@dataclass(frozen=True)
class GgufField:
    """One metadata entry; ``contents()`` as gguf-py's `ReaderField` answers it."""

    value: Any

    def contents(self) -> Any:
        if isinstance(self.value, _Strings):
            return self.value.decode()
        return self.value


class _Strings:
    """An array of strings kept as its bytes until asked for: a vocabulary of 200k tokens
    is decoded only by the code that reads it (a serving start reads the tokenizer from the
    metadata folder written at the first start, never from here), so opening a file walks
    the lengths alone (~0.1 s against ~1.2 s to decode every token on two cores)."""

    __slots__ = ("_count", "_decoded", "_raw")

    def __init__(self, raw: bytes, count: int) -> None:
        self._raw, self._count = raw, count
        self._decoded: list[str] | None = None

    def decode(self) -> list[str]:
        if self._decoded is None:
            raw, at, items = self._raw, 0, []
            for _ in range(self._count):
                (length,) = struct.unpack_from("<Q", raw, at)
                items.append(raw[at + 8:at + 8 + length].decode("utf-8", errors="replace"))
                at += 8 + length
            self._decoded = items
        return self._decoded


class GgufTensor:
    """One tensor of the table: where its bytes are, read on demand (never kept)."""

    def __init__(self, file: GgufFile, name: str, dims: tuple[int, ...],
                 kind: gguf.GGMLQuantizationType, offset: int) -> None:
        self._file = file
        self.name = name
        self.shape = np.array(dims, dtype=np.uint64)  # innermost first, as gguf-py
        self.tensor_type = kind
        self.data_offset = offset  # from the start of the file
        block, size = gguf.GGML_QUANT_SIZES[kind]
        self.n_elements = int(np.prod(dims)) if dims else 1
        if dims and dims[0] % block:
            raise ModelLoadError(f"{file.path.name}: tensor {name!r} has {dims[0]} values a "
                                 f"row, not a multiple of {kind.name}'s {block}")
        self.n_bytes = self.n_elements // block * size

    @property
    def hf_shape(self) -> tuple[int, ...]:
        """The shape the PyTorch way (outermost first)."""
        return tuple(int(d) for d in reversed(self.shape))

    def read(self, into: npt.NDArray[np.uint8] | None = None) -> npt.NDArray[np.uint8]:
        """The tensor's bytes, read into memory of their own (or into ``into``)."""
        return self._file.read_bytes(self.data_offset, self.n_bytes, self.name, into)

    def row_chunks(self, chunk_bytes: int | None = None,
                   multiple: int = 1) -> Iterator[tuple[int, npt.NDArray[np.uint8]]]:
        """The tensor's rows (every dimension but the innermost flattened: [rows, bytes a
        row]) as (first row, bytes of some rows), read a few MiB at a time into one buffer
        that the next chunk overwrites: a loader that moves each chunk to its final layout
        touches the tensor's bytes once, in cache, and never holds a copy of the whole.
        Each chunk holds a multiple of ``multiple`` rows (e.g. an expert's)."""
        rows = self.n_elements // int(self.shape[0]) if len(self.shape) else 1
        row_bytes = self.n_bytes // rows
        chunk_bytes = _CHUNK_BYTES if chunk_bytes is None else chunk_bytes
        step = max(1, chunk_bytes // max(row_bytes * multiple, 1)) * multiple
        buffer = np.empty(min(step, rows) * row_bytes, np.uint8)
        for start in range(0, rows, step):
            count = min(step, rows - start)
            out = buffer[:count * row_bytes]
            self._file.read_bytes(self.data_offset + start * row_bytes, out.size, self.name, out)
            yield start, out.reshape(count, row_bytes)

    @property
    def data(self) -> npt.NDArray[Any]:
        """As gguf-py's `ReaderTensor.data`: F32 / F16 as their numbers [outermost first],
        every other type as bytes [rows..., bytes a row]. Read anew at each access."""
        raw = self.read()
        dims = self.hf_shape or (1,)
        if self.tensor_type in _FLOATS:
            return raw.view(_FLOATS[self.tensor_type]).reshape(dims)
        return raw.reshape(*dims[:-1], -1)


class GgufFile:
    """A GGUF file's metadata and tensor table.

    Raises:
        ModelLoadError: not a GGUF file, an unknown value or tensor type, a header that ends
            early, or a tensor that lies past the end of the file (a truncated download).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.size = self.path.stat().st_size
        with self.path.open("rb") as handle:
            try:
                view = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as err:  # an empty file
                raise ModelLoadError(f"{self.path.name} is not a GGUF file (empty)") from err
            try:
                self._parse(view)
            except (struct.error, IndexError, ValueError) as err:
                raise ModelLoadError(f"{self.path.name}: unreadable GGUF header ({err})") from err
            finally:
                view.close()
        for tensor in self.tensors:
            if tensor.data_offset + tensor.n_bytes > self.size:
                raise ModelLoadError(
                    f"{self.path.name} is truncated: tensor {tensor.name!r} ends at byte "
                    f"{tensor.data_offset + tensor.n_bytes}, the file has {self.size}")

    def _parse(self, buf: mmap.mmap) -> None:
        if buf[:4] != b"GGUF":
            raise ModelLoadError(f"{self.path.name} is not a GGUF file (no GGUF magic)")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ModelLoadError(f"{self.path.name}: GGUF version {version} is not read here")
        pos = 24

        def string(at: int) -> tuple[str, int]:
            (length,) = struct.unpack_from("<Q", buf, at)
            return buf[at + 8:at + 8 + length].decode("utf-8", errors="replace"), at + 8 + length

        def value(kind: int, at: int) -> tuple[Any, int]:
            if kind == _STRING:
                return string(at)
            if kind in _SCALARS:
                code, size = _SCALARS[kind]
                return struct.unpack_from("<" + code, buf, at)[0], at + size
            if kind == _ARRAY:
                item, count = struct.unpack_from("<IQ", buf, at)
                at += 12
                if item in _NUMPY:
                    size = _SCALARS[item][1] * count
                    return np.frombuffer(buf, _NUMPY[item], count, at).tolist(), at + size
                if item == _STRING:  # walk the lengths; the strings decode when read
                    begin, unpack = at, struct.Struct("<Q").unpack_from
                    for _ in range(count):
                        at += 8 + unpack(buf, at)[0]
                    if at > len(buf):
                        raise ValueError("a string array runs past the end of the file")
                    return _Strings(buf[begin:at], count), at
                items = []
                for _ in range(count):
                    entry, at = value(item, at)
                    items.append(entry)
                return items, at
            raise ValueError(f"unknown GGUF value type {kind}")

        self.fields: dict[str, GgufField] = {}
        for _ in range(n_fields):
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", buf, pos)
            entry, pos = value(kind, pos + 4)
            self.fields[key] = GgufField(entry)
        table = []
        for _ in range(n_tensors):
            name, pos = string(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            table.append((name, dims, kind, offset))
        alignment = int(self.field("general.alignment", 32))
        start = -(-pos // alignment) * alignment
        self.tensors: list[GgufTensor] = []
        for name, dims, kind, offset in table:
            try:
                qtype = gguf.GGMLQuantizationType(kind)
            except ValueError:
                raise ModelLoadError(f"{self.path.name}: tensor {name!r} has GGML type {kind}, "
                                     "which this gguf package does not know") from None
            self.tensors.append(GgufTensor(self, name, dims, qtype, start + offset))
        self.by_name = {t.name: t for t in self.tensors}

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value, or ``default`` where the file has no such key."""
        found = self.fields.get(key)
        return default if found is None else found.contents()

    @property
    def architecture(self) -> str:
        return str(self.field("general.architecture", ""))

    def read_bytes(self, offset: int, size: int, what: str,
                   out: npt.NDArray[np.uint8] | None = None) -> npt.NDArray[np.uint8]:
        """``size`` bytes at ``offset``, into ``out`` or a fresh array (copied from a small
        mapping of the file: `file_read.read_at`)."""
        if out is None:
            out = np.empty(size, np.uint8)
        elif out.nbytes != size or out.dtype != np.uint8:
            raise ValueError(f"{what}: {size} bytes do not fit {out.nbytes}")
        with self.path.open("rb", buffering=0) as handle:
            if not read_at(handle.fileno(), offset, out):
                raise ModelLoadError(f"{self.path.name}: short read of tensor {what!r}")
        return out

    def __iter__(self) -> Iterator[GgufTensor]:
        return iter(self.tensors)


def open_gguf(path: str | os.PathLike[str]) -> GgufFile:
    """The parsed header of ``path``, parsed once while the file stays the same (its size
    and modification time): a start asks for it three times (the method, the plan's
    estimate, the load). A `GgufFile` holds no open file, so sharing one is safe."""
    stat = Path(path).stat()
    return _cached(os.fspath(Path(path).resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _cached(path: str, _size: int, _mtime_ns: int) -> GgufFile:
    return GgufFile(path)
