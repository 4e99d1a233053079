"""Honest inputs for the attention kernel tests, and an independent float64 oracle.

`make_case` simulates each sequence's history: every position's K/V is written into its
ring (or full table) in position order, so the slots of expired positions hold *older*
positions' data, exactly as in a served sequence. With `poison` set, every cache slot that no
query of the step may read (expired positions, positions outside the window of every query,
unused blocks, the blocks that padding table entries point to, unwritten slots) is then
overwritten with the poison value.

`dense_attention` rebuilds the answer from the unpaged K/V in float64 with a mask written
out position by position, sharing no code with `kernels.reference`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass
class Case:
    """One call's inputs plus the unpaged history the oracle needs."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    context_lens: torch.Tensor
    scale: float
    sliding_window: int | None
    ring_blocks: int | None
    softcap: float | None
    sinks: torch.Tensor | None = None  # [num_heads] float32 sink logits
    full_k: list[torch.Tensor] = field(default_factory=list)  # per seq [ctx + n, kvh, d]
    full_v: list[torch.Tensor] = field(default_factory=list)

    def kwargs(self) -> dict[str, object]:
        """Keyword arguments of `paged_attention`."""
        return {
            "scale": self.scale,
            "sliding_window": self.sliding_window,
            "ring_blocks": self.ring_blocks,
            "softcap": self.softcap,
            **({} if self.sinks is None else {"sinks": self.sinks}),
        }

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Positional arguments of `paged_attention`."""
        return (
            self.query, self.key, self.value, self.key_cache, self.value_cache,
            self.block_tables, self.query_start_loc, self.context_lens,
        )  # fmt: skip


def _blocks_held(ctx: int, block_size: int, ring: int | None) -> int:
    used = -(-ctx // block_size)
    return used if ring is None else min(used, ring)


def make_case(
    seqs: list[tuple[int, int]],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 4,
    window: int | None = 8,
    ring: bool = True,
    extra_ring_blocks: int = 0,
    softcap: float | None = None,
    sinks: bool = False,
    dtype: torch.dtype = torch.float32,
    poison: float | None = float("nan"),
    spare_blocks: int = 3,
    seed: int = 0,
) -> Case:
    """Build a packed batch of `seqs` = [(context_len, new_tokens), ...] with honest caches.

    Args:
        ring: ring tables of R = ceil(window / b) + extra_ring_blocks ids, else full tables.
        sinks: give every head a random sink logit (about as large as the scores).
        poison: value written into every slot that must not be read (None: leave stale data).
        spare_blocks: unused physical blocks (poisoned, and targets of padding entries).
        seed: seeds everything random (values, block permutation).
    """
    gen = torch.Generator().manual_seed(seed)
    ring_blocks = None
    if ring:
        assert window is not None
        ring_blocks = -(-window // block_size) + extra_ring_blocks
    held = [_blocks_held(ctx, block_size, ring_blocks) for ctx, _ in seqs]
    num_blocks = sum(held) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    spare = perm[sum(held) :]
    # Full tables get at least one padding column.
    width = ring_blocks if ring_blocks is not None else max([*held, 1]) + 1
    # Padding entries point at spare (poisoned) blocks: reading one shows up as NaN.
    pad_ids = spare[torch.randint(len(spare), (len(seqs), width), generator=gen)]
    tables = pad_ids.clone()
    first = 0
    for s, h in enumerate(held):
        tables[s, :h] = perm[first : first + h]
        first += h

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache, value_cache = rand(*cache_shape), rand(*cache_shape)
    readable = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    full_k, full_v = [], []
    for s, (ctx, n) in enumerate(seqs):
        full_k.append(rand(ctx + n, num_kv_heads, head_dim))
        full_v.append(rand(ctx + n, num_kv_heads, head_dim))
        for p in range(ctx):  # position order: later positions overwrite expired ones
            col = p // block_size if ring_blocks is None else (p // block_size) % ring_blocks
            blk = int(tables[s, col])
            key_cache[blk, p % block_size] = full_k[s][p]
            value_cache[blk, p % block_size] = full_v[s][p]
        lo = 0 if window is None else max(0, ctx - window + 1)
        for p in range(lo, ctx):  # the window of the step's first (earliest) query
            col = p // block_size if ring_blocks is None else (p // block_size) % ring_blocks
            readable[int(tables[s, col]), p % block_size] = True
    if poison is not None:
        key_cache[~readable] = poison
        value_cache[~readable] = poison

    counts = torch.tensor([n for _, n in seqs])
    qsl = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(counts, 0)
    num_tokens = int(qsl[-1])
    none = torch.zeros(0, num_kv_heads, head_dim, dtype=dtype)
    key = torch.cat([none] + [k[ctx:] for k, (ctx, _) in zip(full_k, seqs, strict=True)])
    value = torch.cat([none] + [v[ctx:] for v, (ctx, _) in zip(full_v, seqs, strict=True)])
    scale = 1.0 / math.sqrt(head_dim) if softcap is None else 4.0 / math.sqrt(head_dim)
    sink_logits = torch.randn(num_heads, generator=gen) * 1.5 if sinks else None
    return Case(
        query=rand(num_tokens, num_heads, head_dim),
        key=key.reshape(num_tokens, num_kv_heads, head_dim),
        value=value.reshape(num_tokens, num_kv_heads, head_dim),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=tables.to(torch.int32),
        query_start_loc=qsl,
        context_lens=torch.tensor([c for c, _ in seqs], dtype=torch.int32),
        scale=scale,
        sliding_window=window,
        ring_blocks=ring_blocks,
        softcap=softcap,
        sinks=sink_logits,
        full_k=full_k,
        full_v=full_v,
    )


def dense_attention(case: Case) -> torch.Tensor:
    """float64 attention of every new token over its sequence's unpaged history.

    Returns:
        [num_tokens, num_heads, head_dim] float64.
    """
    num_tokens, num_heads, head_dim = case.query.shape
    group = num_heads // case.key.shape[1]
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float64)
    w = case.sliding_window
    starts = case.query_start_loc.tolist()
    for s, ctx in enumerate(case.context_lens.tolist()):
        keys = case.full_k[s].double()
        values = case.full_v[s].double()
        for t in range(starts[s + 1] - starts[s]):
            i = ctx + t  # the query's absolute position
            seen = [j for j in range(i + 1) if w is None or j > i - w]
            for h in range(num_heads):
                q = case.query[starts[s] + t, h].double()
                k = keys[seen, h // group]
                logits = (k @ q) * case.scale
                if case.softcap is not None:
                    logits = case.softcap * torch.tanh(logits / case.softcap)
                if case.sinks is None:
                    probs = torch.softmax(logits, 0)
                else:  # the sink's exp joins the denominator, and weighs no value
                    with_sink = torch.cat([logits, case.sinks[h : h + 1].double()])
                    probs = torch.softmax(with_sink, 0)[:-1]
                out[starts[s] + t, h] = probs @ values[seen, h // group]
    return out


TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """Compare with a dtype-aware tolerance; NaN anywhere fails."""
    assert not torch.isnan(actual).any(), "output holds NaN: a poisoned slot was read"
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol, rtol=tol)


# (id, seqs = [(context_len, new_tokens), ...], make_case keyword arguments)
CASES: list[tuple[str, list[tuple[int, int]], dict[str, object]]] = [
    ("decode_one_empty_context", [(0, 1)], {}),
    ("mixed_decode_prefill_wrapped", [(5, 1), (13, 1), (0, 3), (22, 7), (3, 0), (40, 1)], {}),
    ("chunk_longer_than_ring", [(30, 20), (1, 1)], {"window": 6, "block_size": 2}),
    ("first_chunk_longer_than_ring", [(0, 19)], {"window": 5, "block_size": 2}),
    ("block_size_1", [(12, 3), (4, 1), (9, 0)], {"window": 5, "block_size": 1}),
    ("window_below_block", [(21, 4), (9, 1)], {"window": 3, "block_size": 8}),
    ("window_1", [(10, 3), (0, 2), (5, 1)], {"window": 1}),
    ("window_beyond_context", [(5, 4), (2, 1), (0, 2)], {"window": 64}),
    ("extra_ring_block", [(37, 5), (11, 1)],
     {"window": 7, "block_size": 2, "extra_ring_blocks": 1}),
    ("full_attention", [(9, 4), (20, 1), (0, 5)], {"window": None, "ring": False}),
    ("window_on_full_table", [(25, 3), (13, 1)], {"window": 6, "ring": False}),
    ("decode_ragged_full", [(300, 1), (10, 1), (140, 1), (70, 1), (1, 1)],
     {"window": None, "ring": False, "block_size": 8}),
    ("decode_ragged_window", [(200, 1), (3, 1), (90, 1), (0, 1)], {"window": 150}),
    ("empty_rows_around", [(3, 0), (7, 2), (0, 0), (12, 1), (4, 0)], {}),
    ("gqa_3", [(14, 5), (3, 1)], {"num_heads": 6, "num_kv_heads": 2}),
    ("gqa_7", [(14, 5), (9, 1)], {"num_heads": 7, "num_kv_heads": 1}),
    ("gqa_32", [(6, 1), (17, 1)], {"num_heads": 32, "num_kv_heads": 1, "head_dim": 8}),
    ("mha", [(14, 5), (3, 1)], {"num_heads": 3, "num_kv_heads": 3}),
    ("head_dim_80", [(11, 3), (6, 1)], {"head_dim": 80, "num_heads": 2, "num_kv_heads": 1}),
    ("head_dim_96", [(11, 3), (6, 1)], {"head_dim": 96, "num_heads": 2, "num_kv_heads": 1}),
    ("head_dim_64", [(11, 3)], {"head_dim": 64}),
    ("head_dim_128", [(11, 2)], {"head_dim": 128, "num_heads": 2, "num_kv_heads": 1}),
    ("head_dim_256", [(9, 2)], {"head_dim": 256, "num_heads": 2, "num_kv_heads": 1}),
    ("block_size_128", [(300, 3), (50, 1)], {"window": 130, "block_size": 128}),
    ("softcap", [(17, 5), (2, 1)], {"softcap": 2.0}),
    ("softcap_full", [(17, 5), (2, 1)], {"softcap": 3.0, "window": None, "ring": False}),
    ("sinks", [(17, 5), (2, 1), (30, 1)], {"sinks": True}),
    ("sinks_full_gqa", [(17, 5), (9, 1)], {"sinks": True, "window": None, "ring": False,
                                           "num_heads": 8, "num_kv_heads": 2}),
    ("bf16_sinks", [(23, 6), (8, 1), (40, 1)], {"dtype": torch.bfloat16, "sinks": True}),
    ("fp16", [(17, 5), (2, 1), (30, 1)], {"dtype": torch.float16}),
    ("bf16", [(17, 5), (2, 1), (30, 1)], {"dtype": torch.bfloat16}),
    ("bf16_softcap_gqa", [(23, 6), (8, 1)], {"dtype": torch.bfloat16, "softcap": 2.0,
                                              "num_heads": 6, "num_kv_heads": 2}),
    ("poison_huge", [(19, 4), (33, 1)], {"poison": 1e30}),
    ("stale_not_poisoned", [(19, 4), (33, 1), (45, 9)], {"poison": None}),
]
CASE_IDS = [c[0] for c in CASES]


def case_seed(name: str) -> int:
    """A stable per-case seed (Python's str hash is salted per process)."""
    return sum((i + 1) * ord(ch) for i, ch in enumerate(name))


def random_case_args(seed: int) -> tuple[list[tuple[int, int]], dict[str, object]]:
    """A random small configuration: ragged mixed batch, random block size / window / GQA."""
    gen = torch.Generator().manual_seed(10_000 + seed)

    def pick(options: list[object]) -> object:
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    block_size = int(pick([1, 2, 3, 4, 8, 16]))
    window = pick([None, 1, 2, 5, 8, 13, 40])
    kv = int(pick([1, 2]))
    seqs = []
    for _ in range(int(torch.randint(1, 5, (1,), generator=gen))):
        ctx = int(torch.randint(0, 45, (1,), generator=gen))
        new = int(pick([0, 1, 1, 2, 7, 17]))
        seqs.append((ctx, new))
    kwargs: dict[str, object] = {
        "block_size": block_size,
        "window": window,
        "ring": window is not None and bool(pick([True, True, False])),
        "num_kv_heads": kv,
        "num_heads": kv * int(pick([1, 2, 3, 4])),
        "head_dim": int(pick([8, 16, 24])),
        "softcap": pick([None, None, 3.0]),
        "dtype": pick([torch.float32, torch.float32, torch.float16]),
        "seed": seed,
    }
    return seqs, kwargs
