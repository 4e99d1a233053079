"""A GGUF file's weights under transformers' names, read from the file as they are stored.

Serving a `.gguf` file never converts it into a folder of weights first (docs/design.md
§12): `convert.resolve_model` keeps only its config, tokenizer and chat template (from the
metadata) in the cache, and the loader reads the tensors from the file itself, one at a
time (`gguf_file.GgufFile`), each to its final form:

- F32, F16 and BF16 tensors in their stored type, read straight into their parameter where
  nothing is undone (no norm shift, no row permutation);
- the linears (and embedding) in a block type `gguf_blocks` has a layout for (Q8_0, Q5_0,
  Q4_0, Q4_1, Q4_K, Q6_K) as those blocks, repacked in place of the stored bytes, under
  ``--quantization gguf`` (`blocks_for`); their modules are never given a float weight
  (`PendingLinear` stands in for them until the blocks arrive);
- gpt-oss's MXFP4 experts as transformers' MXFP4 pair of tensors (``X_blocks``,
  ``X_scales``): the same bytes, nibbles reordered (`mxfp4_pair`), which the CPU serves as
  stored (`engine.models.packed_linear.Mxfp4Linear`);
- everything else dequantized by gguf-py, one tensor at a time.

What llama.cpp's converter did to a tensor is undone here, as transformers undoes it when it
reads the same file: Gemma's norms hold ``1 + w`` (we subtract 1), a `llama` file's q/k
rows are interleaved per head (we put them back), gpt-oss's experts were split and
transposed (`gguf_archs`).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from torch import nn

from ringserve.engine.loading.errors import ModelLoadError
from ringserve.engine.loading.gguf_archs import ARCHS
from ringserve.engine.loading.gguf_blocks import (
    SUPPORTED_TYPES,
    gguf_tensor_names,
    layout_bits,
    llama_rope_rows,
    read_linears,
)
from ringserve.engine.loading.gguf_file import GgufFile, GgufTensor
from ringserve.kernels.quant import INT4_CHUNK, QuantizedWeight

__all__ = ["PARAMETERS_FILE", "GgufWeights", "PendingLinear", "expected_parameters", "mxfp4_pair",
           "saved_parameters"]

Q = gguf.GGMLQuantizationType
_STORED = {Q.F32: ("F32", torch.float32), Q.F16: ("F16", torch.float16),
           Q.BF16: ("BF16", torch.bfloat16)}
# what transformers' GGUF reader undoes for the architectures it reads itself (its
# `TENSOR_PROCESSORS`); ours are in `gguf_archs.ARCHS`
_NORM_SHIFT = {"gemma3": 1.0}
_EXPERTS = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


PARAMETERS_FILE = "parameters.json"
"""A GGUF's model folder keeps `expected_parameters` here (building transformers' model on
the meta device to learn them imports its modeling code: ~3 s of every start)."""


def expected_parameters(config: Any) -> dict[str, tuple[int, ...]]:
    """transformers' parameter names and shapes for ``config`` (a tied head left out)."""
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    return expected


def saved_parameters(folder: Path) -> dict[str, tuple[int, ...]] | None:
    """What `PARAMETERS_FILE` in ``folder`` holds, or None."""
    path = folder / PARAMETERS_FILE
    if not path.is_file():
        return None
    return {name: tuple(shape) for name, shape in
            json.loads(path.read_text(encoding="utf-8")).items()}


class PendingLinear(nn.Module):
    """A linear whose weight will be the GGUF file's blocks: only its bias is a parameter
    (loaded with the float tensors) until `quantize.quantize_model` puts the quantized
    layer in its place. Never run."""

    def __init__(self, out_features: int, in_features: int, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features
        self.bias = bias

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def forward(self, _x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a GGUF linear was never given its blocks")


def mxfp4_pair(parts: list[GgufTensor], split: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF MXFP4 expert tensors [E, out, in] -> (blocks [E, rows, G, 16] uint8, scales
    [E, rows, G] uint8) in transformers' pair's shapes, rows interleaved where there are two
    parts (gpt-oss's gate and up: row 2i of the first, 2i + 1 of the second).

    A GGUF block is 17 bytes: the E8M0 exponent, then 16 bytes whose low nibbles are values
    0-15 and high nibbles values 16-31. With ``split`` the 16 bytes are kept as they are
    (the CPU kernel reads that order: `Mxfp4Linear(split=True)`): two strided copies.
    Without, they are reordered into transformers' order (values 2i and 2i + 1 in byte i's
    low and high nibble), which a model without the CPU kernels widens
    (`mxfp4.merge_mxfp4`): ~0.4 s a tensor of 141 MB. The same codes and exponents either
    way, so the same numbers, exactly.
    """
    experts, rows, k = parts[0].hf_shape
    groups = k // 32
    blocks = torch.empty((experts, rows * len(parts), groups, 16), dtype=torch.uint8)
    scales = torch.empty((experts, rows * len(parts), groups), dtype=torch.uint8)
    for index, part in enumerate(parts):
        if part.hf_shape != (experts, rows, k) or part.tensor_type != Q.MXFP4:
            raise ModelLoadError(f"{part.name}: MXFP4 parts of one projection differ")
        # a few experts' rows at a time, each moved to its place while in cache
        for first, chunk in part.row_chunks(multiple=rows):
            raw = torch.from_numpy(chunk).view(-1, rows, groups, 17)  # whole experts
            at = slice(first // rows, first // rows + raw.shape[0])
            out_blocks = blocks[at, index::len(parts)]
            scales[at, index::len(parts)] = raw[..., 0]
            if split:
                out_blocks.copy_(raw[..., 1:])
                continue
            # byte 2i's low nibble and byte 2i + 1's are values 2i and 2i + 1
            # (transformers' byte i); their high nibbles 16 + 2i and 17 + 2i (its 8 + i)
            codes = raw[..., 1:].numpy()
            even, odd = codes[..., 0::2], codes[..., 1::2]
            target = out_blocks.numpy()
            np.bitwise_or(even & 0x0F, odd << 4, out=target[..., :8])
            np.bitwise_or(even >> 4, odd & 0xF0, out=target[..., 8:])
    return blocks, scales


@dataclass(frozen=True)
class _Source:
    """Where one of transformers' tensors comes from."""

    tensor: GgufTensor | None  # None: an architecture's special tensor
    shape: tuple[int, ...]
    kind: str  # "F32" / "F16" / "BF16", a GGML block type's name, or "U8" (MXFP4 pairs)


class GgufWeights:
    """The weights of one GGUF file under transformers' names for ``config``.

    Raises:
        ModelLoadError: a parameter the file has no tensor for.
    """

    def __init__(self, file: GgufFile, config: Any,
                 expected: dict[str, tuple[int, ...]] | None = None) -> None:
        self.file = file
        self.arch_name = file.architecture
        self.arch = ARCHS.get(self.arch_name)
        expected = expected if expected is not None else expected_parameters(config)
        self.mapped = gguf_tensor_names(file, expected, missing_ok=True)
        tensors = file.by_name
        self.sources: dict[str, _Source] = {}
        self.mxfp4: dict[str, list[GgufTensor]] = {}
        for name, shape in expected.items():
            parts = self._mxfp4_parts(name)
            if parts is not None:
                self.mxfp4[name] = parts
                experts, rows, k = parts[0].hf_shape
                full = (experts, rows * len(parts), k // 32)
                self.sources[f"{name}_blocks"] = _Source(None, (*full, 16), "U8")
                self.sources[f"{name}_scales"] = _Source(None, full, "U8")
                continue
            if self.arch is not None and self._special(name):  # before the name map
                self.sources[name] = _Source(None, shape, "F32")
                continue
            gguf_name = self.mapped.get(name)
            if gguf_name is None:
                raise ModelLoadError(f"the GGUF file has no tensor for {name}")
            tensor = tensors[gguf_name]
            kind = _STORED[tensor.tensor_type][0] if tensor.tensor_type in _STORED \
                else tensor.tensor_type.name
            self.sources[name] = _Source(tensor, shape, kind)

    def _mxfp4_parts(self, name: str) -> list[GgufTensor] | None:
        if not name.endswith(_EXPERTS):
            return None
        block = name.split(".")[2]
        kinds = ("gate", "up") if name.endswith("gate_up_proj") else ("down",)
        parts = [self.file.by_name.get(f"blk.{block}.ffn_{k}_exps.weight") for k in kinds]
        if any(p is None or p.tensor_type != Q.MXFP4 for p in parts):
            return None
        return [p for p in parts if p is not None]

    def _special(self, name: str) -> bool:
        """Whether the architecture has its own reading of ``name`` (read to find out; the
        hooks answer None at once for every name but their few)."""
        assert self.arch is not None
        return self.arch.special(self.file.by_name, name) is not None  # type: ignore[arg-type]

    def stored(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Every tensor's (kind, transformers shape), as `checkpoint.stored_tensors` gives
        a folder's: kinds are "F32" / "F16" / "BF16", "U8" for an MXFP4 pair, or a GGML
        block type's name ("Q4_K", ...)."""
        return {name: (source.kind, source.shape) for name, source in self.sources.items()}

    def servable_blocks(self, names: Collection[str]) -> set[str]:
        """Of ``names`` (2-D weights of linears or the embedding), those whose blocks have a
        layout here: what ``--quantization gguf`` serves as stored."""
        out = set()
        for name in names:
            source = self.sources.get(name)
            if source is None or source.tensor is None or len(source.shape) != 2:
                continue
            kind = source.tensor.tensor_type
            if kind in SUPPORTED_TYPES and (layout_bits(kind) == 8
                                            or source.shape[1] % INT4_CHUNK == 0):
                out.add(name)
        return out

    def blocks_for(self, names: Collection[str]) -> dict[str, QuantizedWeight]:
        """The weights of ``names`` (from `servable_blocks`) in our quantized layout, read and
        repacked one tensor at a time; tied names share one object."""
        return read_linears(self.file, names)

    def iter_weights(self, *, skip: Collection[str] = (),
                     into: Mapping[str, torch.Tensor] | None = None,
                     mxfp4_split: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor but those in ``skip`` (served as blocks), in the file's order of
        the model (layer by layer): stored floats as stored (read into ``into``'s tensor of
        that name where its dtype and shape are the stored ones and nothing is undone),
        MXFP4 experts as transformers' pairs (their nibbles in GGUF's order with
        ``mxfp4_split``, see `mxfp4_pair`), other block types dequantized to float32."""
        into = into or {}
        for name, source in self.sources.items():
            if name in skip:
                continue
            if name.endswith("_blocks") and name[:-7] in self.mxfp4:
                blocks, scales = mxfp4_pair(self.mxfp4[name[:-7]], mxfp4_split)
                yield name, blocks
                yield f"{name[:-7]}_scales", scales
                continue
            if name.endswith("_scales") and name[:-7] in self.mxfp4:
                continue
            yield name, self._read(name, source, into.get(name))

    def _read(self, name: str, source: _Source, target: torch.Tensor | None) -> torch.Tensor:
        if source.tensor is None:
            assert self.arch is not None
            value = self.arch.special(self.file.by_name, name)  # type: ignore[arg-type]
            assert value is not None
            return value
        tensor = source.tensor
        shift = self.arch.norm_shift if self.arch is not None else _NORM_SHIFT.get(
            self.arch_name, 0.0)
        shift = shift if name.endswith("norm.weight") else 0.0
        permute = self.arch_name == "llama" and (".attn_q." in tensor.name
                                                 or ".attn_k." in tensor.name)
        stored = _STORED.get(tensor.tensor_type)
        if stored is not None:
            dtype = stored[1]
            plain = not shift and not permute
            if plain and target is not None and target.dtype == dtype and \
                    target.device.type == "cpu" and tuple(target.shape) == source.shape \
                    and target.is_contiguous():
                # the bytes land in the parameter itself
                tensor.read(into=target.view(-1).view(torch.uint8).numpy())
                return target
            value = torch.from_numpy(tensor.read()).view(dtype)
        else:
            value = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type))
        value = value.reshape(tensor.hf_shape or (1,))
        if permute:
            value = value[torch.from_numpy(llama_rope_rows(self.file, tensor.name,
                                                           value.shape[0]))]
        if shift:
            value = (value.float() - shift).to(value.dtype)
        if value.numel() == 1:
            value = value.reshape(source.shape)
        if tuple(value.shape) != source.shape:
            raise ModelLoadError(f"{name}: the GGUF tensor is {list(value.shape)}, the config "
                                 f"wants {list(source.shape)}")
        return value
