"""KV memory arithmetic: layer groups, bytes per block, pool sizing, capacity in words.

Everything a request will ever need is known when it arrives (DESIGN.md §3), so the pool is
sized once and admission is exact.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from block_manager.ring import blocks_for_tokens, ring_length


@dataclass(frozen=True, kw_only=True)
class LayerGroup:
    """Layers that share a window, and so one KV cache and one block table per sequence.

    Args:
        name: a short label for logs and metrics ("sliding_512", "full").
        window: the sliding window ``w`` in tokens, or None for full attention.
        layer_ids: the model's layer indices in this group.
        num_kv_heads: KV heads per layer.
        head_dim: size of one head.
    """

    name: str
    window: int | None
    layer_ids: tuple[int, ...]
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.window is not None and self.window < 1:
            raise ValueError(f"window must be >= 1 or None, got {self.window}")
        if not self.layer_ids:
            raise ValueError(f"layer group {self.name!r} has no layers")
        if self.num_kv_heads < 1 or self.head_dim < 1:
            raise ValueError("num_kv_heads and head_dim must be >= 1")


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """The shape of a model's KV cache: block size, dtype size and its layer groups."""

    block_size: int
    dtype_bytes: int
    groups: tuple[LayerGroup, ...]

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.dtype_bytes < 1:
            raise ValueError(f"dtype_bytes must be >= 1, got {self.dtype_bytes}")
        if not self.groups:
            raise ValueError("a KV cache needs at least one layer group")

    def ring_blocks(self, group: int) -> int | None:
        """Ring length ``R`` of group ``group`` (None for a full-attention group)."""
        return ring_length(self.groups[group].window, self.block_size)

    def bytes_per_block(self, group: int) -> int:
        """``2 * b * num_kv_heads * head_dim * dtype_bytes * layers_in_group`` (K and V)."""
        g = self.groups[group]
        return 2 * self.block_size * g.num_kv_heads * g.head_dim * self.dtype_bytes * len(
            g.layer_ids
        )

    def blocks_needed(self, num_tokens: int) -> tuple[int, ...]:
        """Blocks per group that a sequence of ``num_tokens`` tokens holds at most."""
        return tuple(
            blocks_for_tokens(num_tokens, self.block_size, self.ring_blocks(i))
            for i in range(len(self.groups))
        )

    @property
    def is_bounded(self) -> bool:
        """True when every group slides: a sequence's KV is bounded however long it runs."""
        return all(g.window is not None for g in self.groups)


def group_layers(
    windows: Sequence[int | None], *, num_kv_heads: int, head_dim: int
) -> tuple[LayerGroup, ...]:
    """Group a model's layers by window, in order of first appearance.

    Args:
        windows: per layer, its sliding window or None for full attention.
        num_kv_heads: KV heads per layer.
        head_dim: size of one head.

    Returns:
        One `LayerGroup` per distinct window.
    """
    order: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        order.setdefault(window, []).append(layer)
    return tuple(
        LayerGroup(
            name="full" if w is None else f"sliding_{w}",
            window=w,
            layer_ids=tuple(ids),
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
        for w, ids in order.items()
    )


def plan_num_blocks(spec: KVCacheSpec, memory_bytes: int, max_model_len: int) -> tuple[int, ...]:
    """Split a memory budget into per-group pools.

    Each group gets blocks in proportion to what one sequence of ``max_model_len`` tokens
    needs in it, so the pools run out together for sequences of that length. For a model
    whose groups all slide and ``max_model_len >= every window``, this is just "as many
    whole rings as fit".

    Returns:
        Blocks per group; their bytes add up to at most ``memory_bytes``.
    """
    if memory_bytes < 0 or max_model_len < 1:
        raise ValueError("memory_bytes must be >= 0 and max_model_len >= 1")
    need = spec.blocks_needed(max_model_len)
    per_sequence = sum(n * spec.bytes_per_block(i) for i, n in enumerate(need))
    return tuple(memory_bytes * n // per_sequence for n in need)


@dataclass(frozen=True, kw_only=True)
class Capacity:
    """How many sequences the pools hold at once, and that statement in words."""

    max_sequences: int
    sequence_tokens: int | None
    description: str


def capacity(spec: KVCacheSpec, num_blocks: Sequence[int], max_model_len: int) -> Capacity:
    """Concurrent sequences that fit the pools, in numbers and words.

    For a model whose every group slides, a sequence of any length holds at most ``R``
    blocks per group, so the count is for sequences of unbounded length; otherwise it is
    for sequences of ``max_model_len`` tokens.
    """
    bounded = spec.is_bounded
    need = spec.blocks_needed(2**62 if bounded else max_model_len)
    fits = min(n // k if k else n for n, k in zip(num_blocks, need, strict=True))
    parts = []
    for i, g in enumerate(spec.groups):
        ring = spec.ring_blocks(i)
        taken = (
            f"a sequence under window {g.window} takes at most {ring} blocks"
            if ring is not None
            else f"a sequence of {max_model_len} tokens takes {need[i]} blocks"
        )
        parts.append(
            f"group {g.name} ({len(g.layer_ids)} layers): {num_blocks[i]} blocks of "
            f"{spec.block_size} tokens; {taken}"
        )
    length = "unbounded length" if bounded else f"{max_model_len} tokens"
    parts.append(f"{fits} sequences of {length} fit")
    return Capacity(
        max_sequences=fits,
        sequence_tokens=None if bounded else max_model_len,
        description="; ".join(parts),
    )


_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes in a size such as ``"1GiB"``, ``"512MiB"``, ``"2G"`` or ``1024``.

    Raises:
        ValueError: the text is not a size.
    """
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if m is None:
        raise ValueError(f"not a memory size: {text!r} (examples: '1GiB', '512MiB', '2G')")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])
