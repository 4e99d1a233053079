"""GGUF blocks repacked into our quantized layout, without going through float weights.

A GGUF file stores a linear weight [n, k] as n rows of k values, each row cut along k into
blocks of 32 (Q8_0, Q5_0, Q4_0, Q4_1) or 256 values (the K-quants Q4_K, Q6_K) that carry
their own scales. Those blocks map onto `kernels.quant.QuantizedWeight` (read its docstring
for the layout) as follows, `d`, `m`, `dmin` being the block's float16 fields:

    GGUF type  block  ours             values           scale        min
    Q8_0       32     bits 8, group 32 q                d            -
    Q5_0       32     bits 8, group 32 q - 16           d            -
    Q4_0       32     bits 4, group 32 q                d            -8 d
    Q4_1       32     bits 4, group 32 q                d            m
    Q4_K       256    bits 4, group 32 q                d * sc       -(dmin * mn)
    Q6_K       256    bits 8, group 16 q - 32           d * sc       -

Exactness: the integer values always carry over exactly. The scales and mins of Q8_0, Q5_0,
Q4_0 and Q4_1 are the block's own float16 numbers (or -8 times one, exact in float16), so
`kernels.quant.dequantize` of the result equals `gguf.quants.dequantize` of the blocks
exactly (the same float32 numbers, so also the same once rounded to bfloat16). The K-quants'
per-sub-block scales are products of the float16 super-block scale and a 6-bit (Q4_K) or
signed 8-bit (Q6_K) integer: computed exactly in float32, then rounded once (to nearest) to
float16, a relative error of at most 2**-11 on each scale and min.
(Products too small to be float16 normals are exact: they are multiples of 2**-24.)

A scale or min that is not finite in float16 (a product that overflows it, which needs a
super-block scale above about 500, never seen in real files; or a broken file) has no
representation here: `repack` then returns None, as it does for a GGUF type with no layout
here (Q5_1, Q2_K, Q3_K, Q5_K, IQ*, float types) and for Q4_0/Q4_1 rows whose k is not a
multiple of our 4-bit packing chunk (`kernels.quant.INT4_CHUNK`), and the caller quantizes
from float. 4-bit values are packed by `kernels.quant.pack_int4`, so they follow its layout.

`read_linears` reads a model's linears out of a `.gguf` file by their Hugging Face names
(`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`, ...), with gguf-py's tensor name
map, and undoes the q/k row permutation that llama.cpp applies to `llama` files at
conversion (what transformers undoes when it loads the same file; rows permute exactly,
since blocks run along k).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt
import torch

from ringserve.engine.loading.gguf_file import GgufFile, GgufTensor
from ringserve.kernels.quant import INT4_CHUNK, QuantizedWeight, pack_int4

__all__ = ["SUPPORTED_TYPES", "gguf_tensor_names", "layout_bits", "llama_rope_rows",
           "read_linears", "repack", "repacked_bytes"]

Q = gguf.GGMLQuantizationType

_U8 = npt.NDArray[np.uint8]
# (values, scales, mins) of a chunk of rows: int8 [r, k] (bits 8) or uint8 0..15 [r, k]
# (bits 4, packed afterwards by `kernels.quant.pack_int4`); float16 [r, k / group];
# float16 [r, k / group] or None.
_Parts = tuple[npt.NDArray[Any], npt.NDArray[np.float16], npt.NDArray[np.float16] | None]

Reader = gguf.GGUFReader | GgufFile  # gguf-py's, or ours (the same reads)

_CHUNK_VALUES = 1 << 22  # values repacked at a time: bounds the temporaries (~100 MB)


def _f16(fields: _U8) -> npt.NDArray[np.float16]:
    """Two bytes per entry on the last axis (little-endian float16) -> float16 [...]."""
    return np.ascontiguousarray(fields).view("<f2")[..., 0].astype(np.float16)


def _round_f16(products: npt.NDArray[np.float32]) -> npt.NDArray[np.float16]:
    """Round exact float32 products once, to nearest, to float16."""
    return products.astype(np.float16)


def _nibbles(packed: _U8) -> tuple[_U8, _U8]:
    return packed & np.uint8(0x0F), packed >> np.uint8(4)


def _q8_0(blocks: _U8) -> _Parts:
    rows, nb, _ = blocks.shape
    values = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, nb * 32)
    return values, _f16(blocks[..., 0:2]), None


def _q5_0(blocks: _U8) -> _Parts:
    rows, nb, _ = blocks.shape
    high = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")  # bit j: 5th bit of value j
    bits = (high >> np.arange(32, dtype=np.uint32)) & np.uint32(1)  # [rows, nb, 32]
    low, up = _nibbles(blocks[..., 6:22])  # byte i: value i (low), value 16 + i (high)
    fours = np.concatenate([low, up], axis=-1).astype(np.int8)
    values = fours | (bits.astype(np.int8) << np.int8(4))
    values -= np.int8(16)
    return values.reshape(rows, nb * 32), _f16(blocks[..., 0:2]), None


def _q4_32(packed: _U8) -> _U8:
    """[r, nb, 16] Q4_0/Q4_1 value bytes (byte i: value i low, value 16 + i high) -> [r, k]."""
    rows, nb, _ = packed.shape
    return np.concatenate(_nibbles(packed), axis=-1).reshape(rows, nb * 32)


def _q4_0(blocks: _U8) -> _Parts:
    d = _f16(blocks[..., 0:2])
    mins = d * np.float16(-8)  # exact: a power of two (overflow is checked by the caller)
    return _q4_32(blocks[..., 2:]), d, mins


def _q4_1(blocks: _U8) -> _Parts:
    return _q4_32(blocks[..., 4:]), _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])


def _q4_k(blocks: _U8) -> _Parts:
    # Block (144 bytes): d, dmin (float16), 12 bytes of 6-bit scales and mins, 128 bytes of
    # values: bytes 32 c .. 32 c + 31 hold values 64 c + i (low) and 64 c + 32 + i (high).
    rows, nb, _ = blocks.shape
    d = _f16(blocks[..., 0:2]).astype(np.float32)[..., None]
    dmin = _f16(blocks[..., 2:4]).astype(np.float32)[..., None]
    # llama.cpp's get_scale_min_k4: sub-block j < 4 takes the low 6 bits of bytes j and
    # j + 4; j >= 4 takes a nibble of byte j + 4 and the top 2 bits of bytes j - 4 and j.
    head, mid, tail = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
    six = np.uint8(0x3F)
    sc = np.concatenate([head & six, (tail & np.uint8(0x0F)) | ((head >> 6) << 4)], axis=-1)
    mn = np.concatenate([mid & six, (tail >> 4) | ((mid >> 6) << 4)], axis=-1)
    scales = _round_f16(d * sc.astype(np.float32))
    mins = _round_f16(-(dmin * mn.astype(np.float32)))
    values = np.concatenate(_nibbles(blocks[..., 16:].reshape(rows, nb, 4, 1, 32)), axis=-2)
    return values.reshape(rows, nb * 256), scales.reshape(rows, nb * 8), mins.reshape(rows, -1)


def _q6_k(blocks: _U8) -> _Parts:
    # Block (210 bytes): 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales,
    # d (float16). Each half h of 128 values: value 32 t + l (t 0..3, l 0..31) has its low
    # nibble in byte 64 h + 32 (t % 2) + l (low nibble for t < 2, high for t >= 2), its top
    # two bits at bits 2 t of byte 128 + 32 h + l, and scale 16-value sub-block (32 t + l) // 16.
    rows, nb, _ = blocks.shape
    low, high = _nibbles(blocks[..., 0:128].reshape(rows, nb, 2, 1, 2, 32))
    fours = np.concatenate([low, high], axis=-3).reshape(rows, nb, 2, 4, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    twos = (blocks[..., 128:192].reshape(rows, nb, 2, 1, 32) >> shifts) & np.uint8(3)
    values = (fours | (twos << np.uint8(4))).astype(np.int8)
    values -= np.int8(32)
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    d = _f16(blocks[..., 208:210]).astype(np.float32)[..., None]
    scales = _round_f16(d * sc)
    return values.reshape(rows, nb * 256), scales.reshape(rows, nb * 16), None


# GGUF type -> (bits, group, values per block, bytes per block, repacker)
_LAYOUTS: dict[Q, tuple[int, int, int, int, Callable[[_U8], _Parts]]] = {
    Q.Q8_0: (8, 32, 32, 34, _q8_0),
    Q.Q5_0: (8, 32, 32, 22, _q5_0),
    Q.Q4_0: (4, 32, 32, 18, _q4_0),
    Q.Q4_1: (4, 32, 32, 20, _q4_1),
    Q.Q4_K: (4, 32, 256, 144, _q4_k),
    Q.Q6_K: (8, 16, 256, 210, _q6_k),
}

SUPPORTED_TYPES: frozenset[Q] = frozenset(_LAYOUTS)
"""The GGUF types `repack` converts; for any other type it returns None."""


def layout_bits(tensor_type: Q | int) -> int:
    """8 or 4: the bits a value of a supported block type takes in our layout."""
    return _LAYOUTS[Q(tensor_type)][0]


def repacked_bytes(tensor_type: Q | int, count: int) -> int:
    """The bytes ``count`` values of a supported block type take once repacked: the values,
    a float16 scale a group, and a float16 min a group for 4 bits."""
    bits, group = _LAYOUTS[Q(tensor_type)][:2]
    return count * bits // 8 + count // group * (4 if bits == 4 else 2)


def repack(
    tensor_type: Q | int, raw: npt.NDArray[Any], shape: tuple[int, int]
) -> QuantizedWeight | None:
    """Convert the GGUF blocks of one 2-D tensor into a `QuantizedWeight`, never via floats.

    Args:
        tensor_type: the tensor's `gguf.GGMLQuantizationType`.
        raw: its bytes as GGUF stores them (any shape, e.g. the reader's [n, bytes per row]):
            n rows of k values, each row a run of blocks along k.
        shape: (n, k), the weight's shape the PyTorch way (the reverse of what
            `gguf.GGUFReader` reports).

    Returns:
        The weight in our layout (see the module docstring for the mapping; the scales of
        Q4_K and Q6_K are rounded once to float16, all else is exact), or None where the
        type has no layout here, a scale overflows float16, or a 4-bit type's k is not a
        multiple of `kernels.quant.INT4_CHUNK`: the caller then quantizes from float.

    Raises:
        ValueError: ``raw`` does not have the size of ``shape`` in that type.
    """
    layout = _LAYOUTS.get(Q(tensor_type))
    if layout is None:
        return None
    n, k = shape
    per_block, block_bytes = layout[2], layout[3]
    if k % per_block:
        raise ValueError(f"k={k} is not a multiple of {Q(tensor_type).name}'s {per_block}")
    nb = k // per_block
    data = np.asarray(raw)
    if data.dtype != np.uint8 or data.size != n * nb * block_bytes:
        raise ValueError(
            f"{Q(tensor_type).name} [{n}, {k}] needs {n * nb * block_bytes} uint8 bytes, "
            f"got {data.size} of {data.dtype}"
        )
    return repack_rows(tensor_type, [(0, data.reshape(n, nb * block_bytes))], shape)


def repack_rows(
    tensor_type: Q | int, chunks: Iterable[tuple[int, _U8]], shape: tuple[int, int]
) -> QuantizedWeight | None:
    """`repack` from the tensor's rows in chunks (first row, [rows, bytes a row]), e.g. a
    `GgufTensor.row_chunks()`: each chunk goes to its place in the final layout while it
    is in cache, so a tensor is never held twice (the head of a 200k-token vocabulary is
    ~600 MB). The chunks must cover every row once."""
    layout = _LAYOUTS.get(Q(tensor_type))
    if layout is None:
        return None
    bits, group, per_block, block_bytes, convert = layout
    n, k = shape
    if k % per_block:
        raise ValueError(f"k={k} is not a multiple of {Q(tensor_type).name}'s {per_block}")
    if bits == 4 and k % INT4_CHUNK:
        return None  # our 4-bit packing runs in chunks of INT4_CHUNK values along k
    nb = k // per_block
    values = torch.empty((n, k // 2) if bits == 4 else (n, k),
                         dtype=torch.uint8 if bits == 4 else torch.int8)
    scales = torch.empty((n, k // group), dtype=torch.float16)
    mins = torch.empty((n, k // group), dtype=torch.float16) if bits == 4 else None
    step = max(1, _CHUNK_VALUES // k)
    with np.errstate(over="ignore"):  # an overflowing product is caught just below
        for first, rows in chunks:
            blocks = rows.reshape(rows.shape[0], nb, block_bytes)
            if Q(tensor_type) == Q.Q8_0:  # our int8 layout is its own bytes, moved
                count = blocks.shape[0]
                # (gguf-py's reader maps its file read-only; torch wants writable arrays)
                raw8 = torch.from_numpy(blocks if blocks.flags.writeable else blocks.copy())
                values[first:first + count].view(count, nb, 32).copy_(raw8[..., 2:].view(
                    torch.int8))
                scales[first:first + count].view(torch.uint8).view(count, nb, 2).copy_(
                    raw8[..., :2])
                continue
            for start in range(0, blocks.shape[0], step):
                part_values, part_scales, part_mins = convert(blocks[start:start + step])
                at = slice(first + start, first + start + part_scales.shape[0])
                if bits == 4:
                    values[at] = pack_int4(torch.from_numpy(part_values))
                else:
                    values[at] = torch.from_numpy(part_values)
                scales[at] = torch.from_numpy(part_scales)
                if mins is not None and part_mins is not None:
                    mins[at] = torch.from_numpy(part_mins)
    if not torch.isfinite(scales).all() or (mins is not None and not torch.isfinite(mins).all()):
        return None  # an overflowing product (or a broken file): no float16 scale holds it
    return QuantizedWeight(bits, group, values, scales, mins)


def _field(reader: Reader, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise ValueError(f"the GGUF file has no {key!r} field")
    return field.contents()


def gguf_tensor_names(reader: Reader, names: Iterable[str], *,
                      missing_ok: bool = False) -> dict[str, str]:
    """The GGUF tensor name of each Hugging Face parameter name, by gguf-py's name map.

    ``lm_head.weight`` maps to ``token_embd.weight`` where the file has no output tensor
    (tied embeddings, as llama.cpp reads them). With ``missing_ok`` a name that maps to no
    tensor of the file is left out instead.

    Raises:
        KeyError: a name maps to no tensor of the file (unless ``missing_ok``).
        ValueError: gguf-py does not know the file's architecture.
    """
    arch_name = str(_field(reader, "general.architecture"))
    arch = next((a for a, v in gguf.MODEL_ARCH_NAMES.items() if v == arch_name), None)
    if arch is None:
        raise ValueError(f"gguf-py does not know the GGUF architecture {arch_name!r}")
    name_map = gguf.get_tensor_name_map(arch, int(_field(reader, f"{arch_name}.block_count")))
    present = {tensor.name for tensor in reader.tensors}
    found: dict[str, str] = {}
    for name in names:
        mapped = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if (name == "lm_head.weight" or mapped == "output.weight") and mapped not in present:
            mapped = "token_embd.weight"  # tied (gguf-py may know no output tensor at all)
        if mapped is not None and mapped not in present and f"{mapped}.weight" in present:
            mapped += ".weight"  # a parameter with no suffix (gpt-oss's `sinks`)
        if mapped is None or mapped not in present:
            if missing_ok:
                continue
            raise KeyError(f"{name}: no tensor in the GGUF file (mapped to {mapped})")
        found[name] = mapped
    return found


def llama_rope_rows(reader: Reader, gguf_name: str, n: int) -> npt.NDArray[np.intp]:
    """The row order that undoes llama.cpp's q/k permutation (transformers' reverse_permute).

    convert_hf_to_gguf interleaves the two rotary halves of every head: GGUF row
    h * 2 dim + 2 i + a is HF row h * 2 dim + a * dim + i.
    """
    heads = int(_field(reader, "llama.attention.head_count"))
    if ".attn_k." in gguf_name:
        heads = int(_field(reader, "llama.attention.head_count_kv"))
    index: npt.NDArray[np.intp] = np.arange(n).reshape(heads, n // heads // 2, 2)
    return index.swapaxes(1, 2).reshape(n)


def read_linears(
    gguf_file: str | os.PathLike[str] | gguf.GGUFReader | GgufFile, names: Iterable[str]
) -> dict[str, QuantizedWeight]:
    """Read linear (and embedding) weights out of a `.gguf` file in our quantized layout.

    Args:
        gguf_file: the file, or a reader of it: gguf-py's `GGUFReader` (opening one builds
            every metadata field, the tokenizer's included: about 15 s for Gemma 3's 262k
            tokens on two cores) or our `gguf_file.GgufFile` (0.3 s; reads each tensor
            into memory of its own, one at a time).
        names: Hugging Face parameter names of 2-D weights, e.g.
            ``model.layers.0.self_attn.q_proj.weight``, ``model.embed_tokens.weight``,
            ``lm_head.weight`` (the embedding where the file ties them: the same object).

    Returns:
        The weights, by name, equal to what transformers dequantizes from the same file (up
        to the float16 rounding of K-quant scales, see `repack`). Names whose tensor has no
        layout here (a type `repack` returns None for) are left out: the caller quantizes
        those from float.

    Raises:
        KeyError: a name maps to no tensor of the file.
        ValueError: a name's tensor is not 2-D, or the file is not readable as GGUF.
    """
    reader: Reader
    if isinstance(gguf_file, (gguf.GGUFReader, GgufFile)):
        reader = gguf_file
    else:
        reader = GgufFile(gguf_file)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    llama = _field(reader, "general.architecture") == "llama"
    repacked: dict[str, QuantizedWeight | None] = {}  # by GGUF name: tied names share one
    weights: dict[str, QuantizedWeight] = {}
    for name, gguf_name in gguf_tensor_names(reader, names).items():
        if gguf_name not in repacked:
            repacked[gguf_name] = _read_one(reader, tensors[gguf_name], llama=llama)
        packed = repacked[gguf_name]
        if packed is not None:
            weights[name] = packed
    return weights


def _read_one(
    reader: Reader, tensor: gguf.ReaderTensor | GgufTensor, *, llama: bool
) -> QuantizedWeight | None:
    if len(tensor.shape) != 2:
        raise ValueError(f"{tensor.name} is not 2-D: {list(tensor.shape)}")
    k, n = (int(size) for size in tensor.shape)  # GGUF lists dimensions innermost first
    if tensor.tensor_type not in SUPPORTED_TYPES:
        return None
    if llama and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
        raw = np.asarray(tensor.data).reshape(n, -1)[llama_rope_rows(reader, tensor.name, n)]
        return repack(tensor.tensor_type, raw, (n, k))
    if isinstance(tensor, GgufTensor):  # read a few MiB at a time, each moved in cache
        return repack_rows(tensor.tensor_type, tensor.row_chunks(), (n, k))
    return repack(tensor.tensor_type, np.asarray(tensor.data).reshape(n, -1), (n, k))
