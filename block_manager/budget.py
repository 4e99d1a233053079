"""KV memory arithmetic: layer groups, bytes per block, pool sizing, capacity in words.

Everything a request will ever need is known when it arrives (DESIGN.md §3), so the one
pool all layer groups share is sized once and admission is exact.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from block_manager.ring import blocks_for_tokens, ring_length


@dataclass(frozen=True, kw_only=True)
class LayerGroup:
    """Layers that share a window and one block table per sequence.

    A model's layers of one window are split into groups of the same number of layers
    (`group_layers`), so every group's block is the same size and all of them share one
    pool: a block id addresses the same slot of the cache tensor that the j-th layer of
    every group uses.

    Args:
        name: the window's label for logs and metrics ("sliding_512", "full"); the groups
            of one window share it.
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
    """The shape of a model's KV cache: one pool of equal blocks shared by its layer groups.

    A block holds ``block_size`` tokens of K and V for ``layers_per_block`` layers (the
    largest group; a smaller group leaves its block's other layer slots unused).
    """

    block_size: int
    dtype_bytes: int
    groups: tuple[LayerGroup, ...]
    ring_slack: int = 0  # tokens a ring holds beyond its window (`ring.ring_length`)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.dtype_bytes < 1:
            raise ValueError(f"dtype_bytes must be >= 1, got {self.dtype_bytes}")
        if not self.groups:
            raise ValueError("a KV cache needs at least one layer group")
        if len({(g.num_kv_heads, g.head_dim) for g in self.groups}) > 1:
            raise ValueError("one pool needs every layer group to have the same KV heads "
                             "and head size")

    @property
    def layers_per_block(self) -> int:
        return max(len(g.layer_ids) for g in self.groups)

    @property
    def block_bytes(self) -> int:
        """``2 * b * num_kv_heads * head_dim * dtype_bytes * layers_per_block`` (K and V)."""
        g = self.groups[0]
        return (2 * self.block_size * g.num_kv_heads * g.head_dim * self.dtype_bytes
                * self.layers_per_block)

    def ring_blocks(self, group: int) -> int | None:
        """Ring length ``R`` of group ``group`` (None for a full-attention group)."""
        return ring_length(self.groups[group].window, self.block_size, self.ring_slack)

    def blocks_needed(self, num_tokens: int) -> tuple[int, ...]:
        """Blocks per group that a sequence of ``num_tokens`` tokens holds at most."""
        return tuple(
            blocks_for_tokens(num_tokens, self.block_size, self.ring_blocks(i))
            for i in range(len(self.groups))
        )

    def pool_blocks_needed(self, num_tokens: int) -> int:
        """Blocks of the pool a sequence of ``num_tokens`` tokens holds at most (all groups)."""
        return sum(self.blocks_needed(num_tokens))

    def names(self) -> dict[str, list[int]]:
        """Each window's label and the indices of its groups, in order of appearance."""
        out: dict[str, list[int]] = {}
        for i, g in enumerate(self.groups):
            out.setdefault(g.name, []).append(i)
        return out

    @property
    def is_bounded(self) -> bool:
        """True when every group slides: a sequence's KV is bounded however long it runs."""
        return all(g.window is not None for g in self.groups)


MAX_PADDING = 1 / 16
"""The share of the pool `group_layers` may leave unused to keep the number of groups low."""


def layers_per_group(counts: Sequence[int], max_padding: float = MAX_PADDING) -> int:
    """Layers per group for windows holding ``counts`` layers each.

    The largest size up to the smallest count whose padding (the unused layer slots of each
    window's last, partial group) stays within ``max_padding`` of the pool. Any common
    divisor of the counts pads nothing, so the answer is at least their gcd: gemma-3-270m
    (15 sliding, 3 full) gets 3; gemma-3-4b (29, 5) gets 5 (1 slot of 35 unused) rather
    than 34 groups of one layer.
    """
    if not counts or min(counts) < 1:
        raise ValueError("every window needs at least one layer")
    for size in range(min(counts), 0, -1):
        slots = sum(-(-n // size) * size for n in counts)
        if slots - sum(counts) <= max_padding * slots:
            return size
    raise AssertionError("size 1 pads nothing")  # pragma: no cover


def group_layers(
    windows: Sequence[int | None], *, num_kv_heads: int, head_dim: int
) -> tuple[LayerGroup, ...]:
    """Group a model's layers by window, then split each window into equal groups.

    Args:
        windows: per layer, its sliding window or None for full attention.
        num_kv_heads: KV heads per layer.
        head_dim: size of one head.

    Returns:
        `LayerGroup` s of `layers_per_group` layers (a window's last group may have
        fewer), windows in order of first appearance, each window's layers in order.
    """
    order: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        order.setdefault(window, []).append(layer)
    size = layers_per_group([len(ids) for ids in order.values()])
    return tuple(
        LayerGroup(
            name="full" if w is None else f"sliding_{w}",
            window=w,
            layer_ids=tuple(ids[i : i + size]),
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
        for w, ids in order.items()
        for i in range(0, len(ids), size)
    )


def plan_num_blocks(spec: KVCacheSpec, memory_bytes: int) -> int:
    """Blocks of the one pool that fit ``memory_bytes``."""
    if memory_bytes < 0:
        raise ValueError("memory_bytes must be >= 0")
    return memory_bytes // spec.block_bytes


SHORT_REQUEST = 256
"""Tokens of the "short request" the capacity statement counts (a chat turn)."""


@dataclass(frozen=True, kw_only=True)
class Capacity:
    """How many sequences the pool holds at once, by request length, and that in words.

    ``by_tokens`` maps a request length (prompt + max_tokens) to the sequences of that
    length that fit together: a short one, one per window, and ``max_model_len``.
    ``max_sequences`` is the worst case: for ``max_model_len`` tokens, which for a model
    whose every layer slides is also the count for sequences of unbounded length.
    """

    max_sequences: int
    sequence_tokens: int | None
    by_tokens: dict[int, int]
    description: str


def capacity_lengths(spec: KVCacheSpec, max_model_len: int) -> list[int]:
    """The request lengths the capacity statement counts, ascending."""
    lengths = {min(SHORT_REQUEST, max_model_len), max_model_len}
    lengths |= {g.window for g in spec.groups if g.window is not None and
                g.window < max_model_len}
    return sorted(lengths)


def sequences_that_fit(spec: KVCacheSpec, num_blocks: int, tokens: int) -> int:
    """Sequences of ``tokens`` tokens (prompt + max_tokens) a pool of ``num_blocks`` holds."""
    return num_blocks // spec.pool_blocks_needed(tokens)


def capacity(spec: KVCacheSpec, num_blocks: int, max_model_len: int) -> Capacity:
    """Concurrent sequences that fit the pool, in numbers and words."""
    by_tokens = {n: sequences_that_fit(spec, num_blocks, n)
                 for n in capacity_lengths(spec, max_model_len)}
    parts = [f"KV pool: {num_blocks} blocks of {spec.block_size} tokens x "
             f"{spec.layers_per_block} layers ({spec.block_bytes / 2**10:g} KiB each)"]
    for name, members in spec.names().items():
        layers = sum(len(spec.groups[i].layer_ids) for i in members)
        ring = spec.ring_blocks(members[0])
        k = len(members)
        share = (f"{k} ring{'s' * (k > 1)} of {ring} blocks" if ring is not None
                 else f"{k} growing row{'s' * (k > 1)}")
        parts.append(f"group {name} ({layers} layers): {share}")
    fits = ", ".join(f"{k} of {n} tokens" for n, k in by_tokens.items())
    worst = by_tokens[max_model_len]
    if spec.is_bounded and max_model_len >= max(g.window or 0 for g in spec.groups):
        fits += f" (and {worst} of unbounded length: every layer slides)"
    parts.append(f"sequences that fit at once: {fits}")
    return Capacity(
        max_sequences=worst,
        sequence_tokens=None if spec.is_bounded else max_model_len,
        by_tokens=by_tokens,
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
