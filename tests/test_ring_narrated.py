"""Narrated ring tables with tiny numbers: exact block ids and slots, step by step."""

from __future__ import annotations

from ringserve.block_manager import SKIP_SLOT, BlockPool, BlockTable, ring_length


def decode(table: BlockTable, n: int) -> list[int]:
    """Append ``n`` positions one at a time, returning each one's slot."""
    return [table.append(1)[0][0] for _ in range(n)]


def test_b2_w5_two_sequences_interleaved_wrap_around() -> None:
    # b=2, w=5 -> R=3 blocks, C=6 slots. Two sequences take blocks from one pool in turn, so
    # their ids interleave: A gets 0, 2, 4 and B gets 1, 3, 5.
    assert ring_length(5, 2) == 3
    pool = BlockPool(8)
    a, b = BlockTable(pool, 2, 3), BlockTable(pool, 2, 3)
    assert a.append(1)[0] == [0]  # A p0 -> block 0, slot 0
    assert b.append(1)[0] == [2]  # B p0 -> block 1, slot 2
    assert a.append(2)[0] == [1, 4]  # A p1 in block 0; p2 opens block 2 (slots 4, 5)
    assert b.append(2)[0] == [3, 6]  # B p1 in block 1; p2 opens block 3
    assert a.append(3)[0] == [5, 8, 9]  # A p3; p4, p5 open block 4
    assert b.append(3)[0] == [7, 10, 11]
    assert (a.blocks, b.blocks) == ([0, 2, 4], [1, 3, 5])
    assert pool.num_used == 6  # each ring is full: 3 blocks, never more

    # A p6: logical block 3 -> entry 3 % 3 = 0 -> block 0 recycled in place; p6 overwrites p0.
    slots, recycled, overwritten = a.append(1)
    assert (slots, recycled, overwritten) == ([0], 1, 1)
    # p7 overwrites p1 (same block, no new recycle); p8 opens logical block 4 -> entry 1.
    assert a.append(1) == ([1], 0, 1)
    assert a.append(1) == ([4], 1, 1)
    assert decode(a, 5) == [5, 8, 9, 0, 1]  # p9..p13: blocks 2, 4, 4, then 0 again
    assert a.blocks == [0, 2, 4] and pool.num_used == 6
    assert a.slot(13) == 1 and a.slot(8) == 4  # what a kernel reading p8 would compute


def test_b4_w4_single_block_ring() -> None:
    # w == b: R = 1; every position p >= 4 reuses the only block, slot p % 4.
    pool = BlockPool(3)
    pool.allocate()  # someone else holds block 0
    t = BlockTable(pool, 4, ring_length(4, 4))
    assert t.ring_blocks == 1
    assert decode(t, 4) == [4, 5, 6, 7]
    assert t.blocks == [1]
    slots, recycled, overwritten = t.append(1)
    assert (slots, recycled, overwritten) == ([4], 1, 1)  # p4 recycles block 1, overwrites p0
    assert decode(t, 7) == [5, 6, 7, 4, 5, 6, 7]
    assert t.blocks == [1] and pool.num_used == 2


def test_window_smaller_than_block() -> None:
    # w=3 < b=4: R = 1 and C = 4 >= w, so the one block still holds every visible key.
    t = BlockTable(BlockPool(2), 4, ring_length(3, 4))
    assert t.ring_blocks == 1
    assert decode(t, 6) == [0, 1, 2, 3, 0, 1]
    assert t.blocks == [0]


def test_window_one() -> None:
    # w=1, b=2: R=1, C=2. A query sees only itself; the ring still keeps two slots.
    t = BlockTable(BlockPool(1), 2, ring_length(1, 2))
    results = [t.append(1) for _ in range(5)]
    assert [r[0][0] for r in results] == [0, 1, 0, 1, 0]
    assert [r[1] for r in results] == [0, 0, 1, 0, 1]  # recycles at p2 and p4
    assert [r[2] for r in results] == [0, 0, 1, 1, 1]  # overwrites from p2 on


def test_chunk_longer_than_ring_skips_positions_overwritten_in_the_same_step() -> None:
    # b=2, w=5 (R=3, C=6); one prefill chunk of 10 positions. Positions 0..3 would be
    # overwritten by 6..9 within the same write, so they are skipped (-1): no query after
    # this step can see them, and two writes to one slot would race in a parallel kernel.
    t = BlockTable(BlockPool(4), 2, 3)
    slots, recycled, overwritten = t.append(10)
    s = SKIP_SLOT
    assert slots == [s, s, s, s, 4, 5, 0, 1, 2, 3]
    assert t.blocks == [0, 1, 2]
    assert recycled == 2  # logical blocks 3 and 4 reuse entries 0 and 1
    assert overwritten == 4  # positions 6..9 displace 0..3
    # Then decode continues the ring where the chunk left it: p10 -> entry 5 % 3 = 2.
    assert decode(t, 3) == [4, 5, 0]


def test_full_attention_grows_one_block_per_b_tokens() -> None:
    pool = BlockPool(4)
    t = BlockTable(pool, 2, None)
    assert t.append(3) == ([0, 1, 2], 0, 0)
    assert t.blocks == [0, 1]
    assert decode(t, 3) == [3, 4, 5]
    assert t.blocks == [0, 1, 2]
    t.free()
    assert pool.num_free == 4 and t.blocks == []
