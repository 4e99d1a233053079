"""KV memory arithmetic: layer groups, bytes per block, pool sizing, capacity in words.

Everything a request will ever need is known when it arrives (docs/design.md §3), so the one
pool all layer groups share is sized once and admission is exact.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ringserve.block_manager.ring import blocks_for_tokens, ring_length


@dataclass(frozen=True, kw_only=True)
class LayerGroup:
    """Layers that share a window and one block table per sequence.

    A model's layers of one window and one KV shape are split into groups (`group_layers`)
    whose K and V for a block take (nearly) the same bytes, so all of them share one pool
    of equal blocks: a block id addresses one slab of the cache, which the group holding it
    divides among its layers. A group of larger layers (Gemma 4's full layers: 512-dim
    heads) holds fewer layers per block than a group of smaller ones.

    Args:
        name: the window's label for logs and metrics ("sliding_512", "full"); the groups
            of one window share it.
        window: the sliding window ``w`` in tokens, or None for full attention.
        layer_ids: the model's layer indices in this group.
        num_kv_heads: KV heads of each of its layers.
        head_dim: size of one head of its layers.
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

    @property
    def row(self) -> int:
        """Elements of one token of one layer's K (or V): ``num_kv_heads * head_dim``."""
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """The shape of a model's KV cache: one pool of equal blocks shared by its layer groups.

    A block is a slab of ``block_size`` tokens of K and V, ``slab_row`` elements a token
    each, for whichever group holds it: the group's layers one after another, ``row``
    elements a token each (`LayerGroup.row`); a group that needs less leaves the rest of
    the slab unused (`padding`).
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

    @property
    def slab_row(self) -> int:
        """K elements per token of a block (and as many of V): the largest group's need."""
        return max(len(g.layer_ids) * g.row for g in self.groups)

    @property
    def uniform(self) -> bool:
        """Every group's layers have the same KV heads and head size."""
        return len({(g.num_kv_heads, g.head_dim) for g in self.groups}) == 1

    @property
    def layers_per_block(self) -> int:
        """The most layers one block holds (every group's, for a uniform model)."""
        return max(len(g.layer_ids) for g in self.groups)

    @property
    def block_bytes(self) -> int:
        """``2 * b * slab_row * dtype_bytes`` (K and V)."""
        return 2 * self.block_size * self.slab_row * self.dtype_bytes

    def padding(self, group: int) -> float:
        """The share of a block that group ``group`` leaves unused."""
        g = self.groups[group]
        return 1 - len(g.layer_ids) * g.row / self.slab_row

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
    """Layers per group for windows holding ``counts`` layers each, all of one KV shape.

    The largest size up to the smallest count whose padding (the unused layer slots of each
    window's last, partial group) stays within ``max_padding`` of the pool. Any common
    divisor of the counts pads nothing, so the answer is at least their gcd: gemma-3-270m
    (15 sliding, 3 full) gets 3; gemma-3-4b (29, 5) gets 5 (1 slot of 35 unused) rather
    than 34 groups of one layer.
    """
    return slab_layers(counts, [1] * len(counts), max_padding)[0]


def slab_layers(counts: Sequence[int], rows: Sequence[int],
                max_padding: float = MAX_PADDING) -> list[int]:
    """Layers per group for classes of ``counts[c]`` layers of ``rows[c]`` KV elements a
    token each, so that every group's block takes one slab of the same size.

    The slab (elements a token) is the largest group's need; the largest one up to the
    smallest class's whole size whose padding (slab space the groups leave unused) stays
    within ``max_padding`` of the pool wins, and where none does, the one that pads least.
    Gemma 4's 12 sliding layers of 256 and 3 full layers of 512 get slabs of 1536: two
    groups of 6 sliding layers and one of 3 full ones, nothing unused.
    """
    if not counts or len(counts) != len(rows) or min(counts) < 1 or min(rows) < 1:
        raise ValueError("every class needs at least one layer of a positive row")
    classes = list(zip(counts, rows, strict=True))
    top = max(max(rows), min(n * r for n, r in classes))
    candidates = sorted({k * r for n, r in classes for k in range(1, n + 1)
                         if max(rows) <= k * r <= top}, reverse=True)
    best: tuple[float, list[int]] | None = None
    for target in candidates:
        sizes = [min(n, target // r) for n, r in classes]
        slab = max(k * r for k, (_n, r) in zip(sizes, classes, strict=True))
        total = sum(-(-n // k) for k, (n, _r) in zip(sizes, classes, strict=True)) * slab
        pad = 1 - sum(n * r for n, r in classes) / total
        if pad <= max_padding:
            return sizes
        if best is None or pad < best[0]:
            best = (pad, sizes)
    assert best is not None
    return best[1]


def group_layers(
    windows: Sequence[int | None], *, num_kv_heads: int | Sequence[int],
    head_dim: int | Sequence[int], layer_ids: Sequence[int] | None = None,
) -> tuple[LayerGroup, ...]:
    """Group a model's layers by window and KV shape, then split each class into groups
    that fill one slab each (`slab_layers`).

    Args:
        windows: per layer, its sliding window or None for full attention.
        num_kv_heads: KV heads, one for every layer or per layer.
        head_dim: size of one head, one for every layer or per layer.
        layer_ids: the model's index of each entry (default 0, 1, ...): the layers that
            keep KV of their own, where some read another layer's (Gemma 4).

    Returns:
        `LayerGroup` s, classes in order of first appearance, each class's layers in order
        (a class's last group may have fewer).
    """
    n = len(windows)
    heads = [num_kv_heads] * n if isinstance(num_kv_heads, int) else list(num_kv_heads)
    dims = [head_dim] * n if isinstance(head_dim, int) else list(head_dim)
    ids = list(range(n)) if layer_ids is None else list(layer_ids)
    if not len(heads) == len(dims) == len(ids) == n:
        raise ValueError("windows, num_kv_heads, head_dim and layer_ids differ in length")
    order: dict[tuple[int | None, int, int], list[int]] = {}
    for layer, window, h, d in zip(ids, windows, heads, dims, strict=True):
        order.setdefault((window, h, d), []).append(layer)
    sizes = slab_layers([len(v) for v in order.values()], [h * d for _w, h, d in order])
    return tuple(
        LayerGroup(
            name="full" if w is None else f"sliding_{w}",
            window=w,
            layer_ids=tuple(members[i : i + size]),
            num_kv_heads=h,
            head_dim=d,
        )
        for ((w, h, d), members), size in zip(order.items(), sizes, strict=True)
        for i in range(0, len(members), size)
    )


class RequestTooLargeError(ValueError):
    """A request needs more blocks than a whole pool holds: it can never be admitted."""


def check_fits_pool(spec: KVCacheSpec, num_blocks: int, prompt_len: int, max_tokens: int,
                    need: Sequence[int] | None = None) -> None:
    """Raise `RequestTooLargeError` if a request could never fit a pool of ``num_blocks``
    (``need``: its blocks per group, when known)."""
    n = sum(need if need is not None else spec.blocks_needed(prompt_len + max_tokens))
    if n > num_blocks:
        raise RequestTooLargeError(
            f"request needs {n} KV blocks of {spec.block_size} tokens over all "
            f"layer groups (prompt {prompt_len} + max_tokens {max_tokens} = "
            f"{prompt_len + max_tokens} tokens) but the whole pool holds "
            f"{num_blocks}; it can never be admitted")


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
    held = (f"{spec.layers_per_block} layers" if spec.uniform else
            f"{spec.slab_row} K and V elements a token")
    parts = [f"KV pool: {num_blocks} blocks of {spec.block_size} tokens x "
             f"{held} ({spec.block_bytes / 2**10:g} KiB each)"]
    for name, members in spec.names().items():
        for shape in dict.fromkeys((spec.groups[i].num_kv_heads, spec.groups[i].head_dim)
                                   for i in members):
            same = [i for i in members
                    if (spec.groups[i].num_kv_heads, spec.groups[i].head_dim) == shape]
            layers = sum(len(spec.groups[i].layer_ids) for i in same)
            ring = spec.ring_blocks(same[0])
            k = len(same)
            share = (f"{k} ring{'s' * (k > 1)} of {ring} blocks" if ring is not None
                     else f"{k} growing row{'s' * (k > 1)}")
            heads = "" if spec.uniform else f" of {shape[0]}x{shape[1]}"
            parts.append(f"group {name} ({layers} layers{heads}): {share}")
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


@dataclass(frozen=True, kw_only=True)
class AdmissionState:
    """What admission depends on, as of one moment (published in the engine's snapshot).

    Args:
        num_blocks: blocks in the pool.
        committed: blocks promised to admitted sequences (in use plus what they may still
            take; `KVCacheManager` counts it).
        waiting: the reservation (blocks, all groups) of each waiting sequence, queue order.
        running: sequences admitted.
        max_running: the most the scheduler runs at once (``max_num_seqs``).
        reserved_per_group, used_per_group: by window name, for the answer's detail.
    """

    num_blocks: int
    committed: int
    waiting: tuple[int, ...]
    running: int
    max_running: int
    reserved_per_group: dict[str, int]
    used_per_group: dict[str, int]


@dataclass(frozen=True, kw_only=True)
class Admission:
    """The answer for requests of one shape (prompt + max_tokens tokens), no prefix hit.

    ``admit_now``: one sent now is admitted as soon as the scheduler next looks (nothing
    waits before it, a running slot is free, its blocks fit). ``fit_now``: how many such
    requests would be admitted beside what runs, after what waits (first come, first
    served). ``fit_empty``: how many an idle server holds at once. A prefix hit only lowers
    a request's need, so with one these are lower bounds.
    """

    prompt_tokens: int
    max_tokens: int
    admit_now: bool
    fit_now: int
    fit_empty: int
    blocks_per_request: dict[str, int]
    blocks_free: int
    waiting: int
    running: int

    def body(self, state: AdmissionState) -> dict[str, object]:
        """The JSON answer of ``GET /v1/admission``."""
        return {
            "prompt_tokens": self.prompt_tokens, "max_tokens": self.max_tokens,
            "admit_now": self.admit_now, "fit_now": self.fit_now, "fit_empty": self.fit_empty,
            "blocks_free": self.blocks_free, "blocks_total": state.num_blocks,
            "sequences_running": self.running, "sequences_waiting": self.waiting,
            "max_num_seqs": state.max_running,
            "groups": [{"group": name, "blocks_per_request": need,
                        "blocks_reserved": state.reserved_per_group.get(name, 0),
                        "blocks_used": state.used_per_group.get(name, 0)}
                       for name, need in self.blocks_per_request.items()],
        }


def admission(spec: KVCacheSpec, state: AdmissionState, prompt_tokens: int,
              max_tokens: int) -> Admission:
    """How requests of ``prompt_tokens + max_tokens`` tokens would be admitted now.

    The scheduler admits the head of the queue while a running slot is free and the
    head's reservation fits beside everything admitted (``committed``); admitting it
    commits exactly its reservation (no blocks are used yet), so the count is a division.
    """
    if prompt_tokens < 1 or max_tokens < 1:
        raise ValueError("prompt_tokens and max_tokens must be >= 1")
    per_group = spec.blocks_needed(prompt_tokens + max_tokens)
    need = sum(per_group)
    free = state.num_blocks - state.committed
    slots = state.max_running - state.running
    blocked = False
    for wait in state.waiting:  # first come, first served: they go first
        if slots < 1 or wait > free:
            blocked = True
            break
        free -= wait
        slots -= 1
    fit_now = 0 if blocked else max(0, min(free // need, slots))
    by_name: dict[str, int] = {}
    for g, n in zip(spec.groups, per_group, strict=True):
        by_name[g.name] = by_name.get(g.name, 0) + n
    return Admission(
        prompt_tokens=prompt_tokens, max_tokens=max_tokens,
        admit_now=not state.waiting and fit_now >= 1, fit_now=fit_now,
        fit_empty=min(state.num_blocks // need, state.max_running),
        blocks_per_request=by_name, blocks_free=state.num_blocks - state.committed,
        waiting=len(state.waiting), running=state.running)
