"""The manager: layer groups over one pool, admission, reservations, read checks, budget."""

from __future__ import annotations

import pytest

from ringserve.block_manager import (
    SKIP_SLOT,
    KVCacheError,
    KVCacheManager,
    KVCacheSpec,
    LayerGroup,
    RequestTooLargeError,
    capacity,
    group_layers,
    layers_per_group,
    parse_size,
    plan_num_blocks,
    sequences_that_fit,
)


def gemma_like_spec(block_size: int = 2, window: int = 3) -> KVCacheSpec:
    # Four sliding layers then two full ones: groups of two layers, two sliding, one full.
    windows = [window] * 4 + [None] * 2
    return KVCacheSpec(
        block_size=block_size,
        dtype_bytes=4,
        groups=group_layers(windows, num_kv_heads=1, head_dim=8),
    )


def test_group_layers_splits_windows_into_equal_groups() -> None:
    groups = group_layers([4, 4, None, 4, 8, None, 4, 8], num_kv_heads=2, head_dim=16)
    assert [(g.name, g.window, g.layer_ids) for g in groups] == [
        ("sliding_4", 4, (0, 1)),
        ("sliding_4", 4, (3, 6)),
        ("full", None, (2, 5)),
        ("sliding_8", 8, (4, 7)),
    ]


@pytest.mark.parametrize(
    ("counts", "size"),
    [([15, 3], 3), ([22, 4], 2), ([29, 5], 5), ([26], 26), ([13, 13], 13), ([5, 1], 1),
     ([7, 5], 1)],
)
def test_layers_per_group_pads_at_most_a_sixteenth(counts: list[int], size: int) -> None:
    # gemma-3-270m, gemma-3-1b, gemma-3-4b, a sliding-only model, gemma-2, ...
    assert layers_per_group(counts) == size
    slots = sum(-(-n // size) * size for n in counts)
    assert slots - sum(counts) <= slots / 16


def test_the_shared_pool_narrated() -> None:
    # b=2; sliding w=3 -> R=2, C=4; two sliding groups and one full group take their blocks
    # from one pool of 16, in group order, oldest-freed first.
    kv = KVCacheManager(gemma_like_spec(), 16, max_model_len=16)
    kv.admit("a", prompt_len=5, max_tokens=3)  # 8 tokens: 2 + 2 sliding, 4 full
    assert kv.reservation(5, 3) == (2, 2, 4)
    assert kv.stats().blocks_reserved == 8
    g0, g1, full = kv.append("a", 5)
    # Sliding rings: p0 is overwritten by p4 inside this chunk, so it is skipped.
    assert g0 == [SKIP_SLOT, 1, 2, 3, 0]
    assert g1 == [SKIP_SLOT, 5, 6, 7, 4]
    assert full == [8, 9, 10, 11, 12]
    assert kv.block_tables("a") == [[0, 1], [2, 3], [4, 5, 6]]
    assert kv.append("a", 1) == [[1], [5], [13]]
    assert kv.append("a", 2) == [[2, 3], [6, 7], [14, 15]]
    assert kv.block_tables("a") == [[0, 1], [2, 3], [4, 5, 6, 7]]
    st = kv.stats()
    assert st.group_names == ("sliding_3", "full")
    assert st.blocks_used_per_group == (4, 4) == st.blocks_reserved_per_group
    assert st.blocks_used == 8 == st.blocks_reserved
    assert st.ring_block_recycles == 4  # logical blocks 2 and 3 of each sliding group
    assert st.ring_slot_overwrites == 8  # positions 4..7 in each sliding group
    with pytest.raises(KVCacheError, match="more than the 8"):
        kv.append("a", 1)
    kv.release("a")
    st = kv.stats()
    assert (st.blocks_used, st.blocks_reserved, st.num_sequences) == (0, 0, 0)
    assert kv.pool.num_free == 16


def test_memory_a_group_does_not_need_serves_another() -> None:
    # b=2, w=3: a 2-token request takes 1 block per group (3); a 16-token one takes 2 + 2
    # ring blocks and 8 full ones (12). One pool of 12 holds four short or one long.
    kv = KVCacheManager(gemma_like_spec(), 12, max_model_len=16)
    for i in range(4):
        kv.admit(i, 1, 1)
    assert not kv.can_admit(1, 1)
    for i in range(4):
        kv.append(i, 2)
    assert kv.pool.num_free == 0
    for i in range(4):
        kv.release(i)
    kv.admit("long", 1, 15)
    assert not kv.can_admit(1, 1)
    kv.append("long", 16)
    assert [len(row) for row in kv.block_tables("long")] == [2, 2, 8]


def test_admission_waits_for_room_and_refuses_what_never_fits() -> None:
    spec = KVCacheSpec(
        block_size=4,
        dtype_bytes=2,
        groups=(LayerGroup(name="s", window=8, layer_ids=(0,), num_kv_heads=1, head_dim=4),),
    )
    kv = KVCacheManager(spec, 5, max_model_len=100)  # R = 2: two rings fit, not three
    assert kv.reservation(3, 1000) == (2,)  # capped at the ring however long it runs
    assert kv.reservation(3, 1) == (1,)  # short requests reserve only what they need
    kv.admit(1, 3, 1000)
    kv.admit(2, 3, 1000)
    assert not kv.can_admit(3, 1000)
    assert kv.can_admit(3, 1)  # the fifth block is still free for a short one
    with pytest.raises(KVCacheError, match="does not fit now"):
        kv.admit(3, 3, 1000)
    kv.release(1)
    assert kv.can_admit(3, 1000)


def test_request_larger_than_the_whole_pool_is_refused_with_the_numbers() -> None:
    kv = KVCacheManager(gemma_like_spec(), 12, max_model_len=16)
    with pytest.raises(RequestTooLargeError) as err:
        kv.admit("big", prompt_len=10, max_tokens=10)
    message = str(err.value)
    for words in ("needs 14 KV blocks", "all layer groups", "holds 12", "never be admitted",
                  "20 tokens"):
        assert words in message
    assert "big" not in kv and kv.stats().blocks_reserved == 0


def test_unknown_and_duplicate_sequences_are_errors() -> None:
    kv = KVCacheManager(gemma_like_spec(), 12, max_model_len=16)
    with pytest.raises(KVCacheError, match="unknown sequence"):
        kv.append("x", 1)
    kv.admit("x", 1, 1)
    with pytest.raises(KVCacheError, match="already admitted"):
        kv.admit("x", 1, 1)


def test_read_check_counts_a_slot_that_lost_its_position() -> None:
    kv = KVCacheManager(gemma_like_spec(block_size=2, window=3), 28, max_model_len=32,
                        debug=True)
    kv.admit("a", 2, 10)
    kv.admit("b", 2, 10)
    for _ in range(9):
        kv.append("a", 1)
        kv.append("b", 1)
        assert kv.check_reads("a", kv.num_tokens("a")) == 0
    # Break the invariant on purpose: point a's ring at b's blocks. The check must see it.
    kv.block_tables("a")[0][:] = kv.block_tables("b")[0]
    assert kv.check_reads("a", kv.num_tokens("a")) > 0
    assert kv.stats().read_misses > 0


def test_the_read_check_sees_one_group_reading_another_groups_block() -> None:
    # The same sequence, the same positions, but another group's block: still a miss.
    kv = KVCacheManager(gemma_like_spec(block_size=2, window=3), 14, max_model_len=32,
                        debug=True)
    kv.admit("a", 2, 10)
    kv.append("a", 6)
    assert kv.check_reads("a", 6) == 0
    kv.block_tables("a")[0][:] = kv.block_tables("a")[1]
    assert kv.check_reads("a", 6) == 2  # cached positions 4 and 5 (the query at 6 is new)


def test_the_always_on_edge_check_sees_a_broken_ring() -> None:
    kv = KVCacheManager(gemma_like_spec(block_size=2, window=3), 28, max_model_len=32)
    assert not kv.debug
    kv.admit("a", 2, 10)
    kv.admit("b", 2, 10)
    for _ in range(9):
        kv.append("a", 1)
        kv.append("b", 1)
        assert kv.check_reads("a", kv.num_tokens("a")) == 0
    kv.block_tables("a")[0][:] = kv.block_tables("b")[0]
    assert kv.check_reads("a", kv.num_tokens("a")) == 2  # the oldest and the newest
    assert kv.stats().read_misses == 2


def test_block_bytes_and_pool_plan() -> None:
    spec = gemma_like_spec(block_size=16, window=512)
    # 2 (K and V) * 16 tokens * 1 head * 8 dims * 4 bytes * 2 layers per block
    assert spec.layers_per_block == 2
    assert spec.block_bytes == 2 * 16 * 1 * 8 * 4 * 2
    memory = 10 * 2**20 + 5
    blocks = plan_num_blocks(spec, memory)
    assert blocks * spec.block_bytes <= memory < (blocks + 1) * spec.block_bytes


def test_capacity_in_words_for_a_bounded_model() -> None:
    spec = KVCacheSpec(
        block_size=16,
        dtype_bytes=2,
        groups=group_layers([4096] * 4, num_kv_heads=8, head_dim=128),
    )
    cap = capacity(spec, 4096, max_model_len=32768)
    assert cap.max_sequences == 16 and cap.sequence_tokens is None
    assert cap.by_tokens == {256: 256, 4096: 16, 32768: 16}
    assert "KV pool: 4096 blocks of 16 tokens x 4 layers" in cap.description
    assert "group sliding_4096 (4 layers): 1 ring of 256 blocks" in cap.description
    assert "16 of unbounded length" in cap.description


GEMMA_270M = [512] * 5 + [None]  # its layer pattern, three times over


@pytest.mark.parametrize(("tokens", "expected"),
                         [(256, 455), (512, 227), (4096, 105), (8192, 65), (32768, 19)])
def test_gemma_270m_in_2_gib_holds_what_the_bytes_allow(tokens: int, expected: int) -> None:
    # 18 layers x 1 KV head x 256 dims x 2 (K, V) x 2 bytes: 1 KiB per token and layer;
    # a sliding layer holds at most 512 tokens. Counted here without the block manager.
    spec = KVCacheSpec(block_size=16, dtype_bytes=2,
                       groups=group_layers(GEMMA_270M * 3, num_kv_heads=1, head_dim=256))
    blocks = plan_num_blocks(spec, 2 * 2**30)
    cap = capacity(spec, blocks, max_model_len=32768)
    kib_per_sequence = 15 * min(tokens, 512) + 3 * tokens
    allowed = 2 * 2**20 // kib_per_sequence
    assert sequences_that_fit(spec, blocks, tokens) == expected
    assert allowed - 1 <= expected <= allowed  # blocks round each group up by < one block
    assert cap.max_sequences == 19 and cap.sequence_tokens == 32768
    assert cap.by_tokens == {256: 455, 512: 227, 32768: 19}


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1GiB", 2**30), ("512MiB", 512 * 2**20), ("2G", 2 * 10**9), ("1024", 1024),
     ("1.5 GiB", 3 * 2**29), (77, 77)],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "one gig", "1XB", "-5"])
def test_parse_size_rejects_nonsense(text: str) -> None:
    with pytest.raises(ValueError, match="not a memory size"):
        parse_size(text)


def test_a_ring_reaching_a_shared_block_takes_a_fresh_one_narrated() -> None:
    # b=2, w=4, prefix caching: R = ceil((4 + 1) / 2) = 3 (one token of slack), C = 6.
    spec = KVCacheSpec(block_size=2, dtype_bytes=2, ring_slack=1, groups=(
        LayerGroup(name="s", window=4, layer_ids=(0,), num_kv_heads=1, head_dim=4),))
    kv = KVCacheManager(spec, 12, max_model_len=32, debug=True, enable_prefix_caching=True)
    assert kv.ring_blocks == [3]
    prompt = [5, 6, 7, 8, 9, 10, 11]
    assert kv.admit("A", 7, 4, prompt) == 0  # nothing cached yet
    # One chunk of 7 > C. p6 starts logical block 3 at entry 0, whose block 0 this very
    # step wrote: the entry takes fresh block 3 and block 0 is parked, so every position is
    # written (without caching, or without a spare block, p0 would be skipped and
    # overwritten by p6 in place).
    assert kv.append("A", 7, prompt) == [[0, 1, 2, 3, 4, 5, 6]]
    assert kv.block_tables("A") == [[3, 1, 2]]
    assert kv.pool.num_parked == 1
    kv.commit()  # the K/V are in: blocks 0, 1, 2 are named; block 0 waits as evictable
    assert kv.pool.num_cached == 3 and kv.pool.num_parked == 0
    assert kv.pool.num_free == 9  # 12 less the 3 A holds; block 0 counts as free
    # B, same prompt: a query at 6 reads p3..p5, so blocks 1 and 2 serve a hit of 6 tokens;
    # the entry of logical block 0 holds only expired positions and gets a fresh block, 4.
    assert kv.admit("B", 7, 4, prompt) == 6
    assert kv.block_tables("B") == [[4, 1, 2]]
    assert [kv.pool.ref(b) for b in (1, 2)] == [2, 2]  # shared by A and B
    assert kv.append("B", 1, [11]) == [[8]]  # p6 -> entry 0: B's own block 4
    assert kv.append("B", 1, [1]) == [[9]]
    kv.commit()
    # p8 starts logical block 4 -> entry 1, which holds shared block 1: not overwritten,
    # the entry takes fresh block 5; p2, p3 had expired for B (the query at 8 sees p5..p8).
    assert kv.append("B", 1, [2]) == [[10]]
    assert kv.block_tables("B") == [[4, 5, 2]]
    assert kv.block_tables("A") == [[3, 1, 2]]  # A still reads its p2, p3 intact
    assert [kv.pool.ref(b) for b in range(6)] == [0, 1, 2, 1, 1, 1]
    assert kv.check_reads("A", 7) == 0 and kv.check_reads("B", 9) == 0
    kv.release("A")
    kv.release("B")
    # Nothing is held; the named blocks wait, still findable, among the free ones.
    assert kv.stats().blocks_used == 0 and kv.pool.num_free == 12
    assert kv.pool.num_cached == 4  # A's blocks 0, 1, 2 and B's block 4 ([11, 1])
