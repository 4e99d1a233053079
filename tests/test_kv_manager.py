"""The manager: layer groups side by side, admission, reservations, read checks, budget."""

from __future__ import annotations

import pytest

from block_manager import (
    SKIP_SLOT,
    KVCacheError,
    KVCacheManager,
    KVCacheSpec,
    LayerGroup,
    RequestTooLargeError,
    capacity,
    group_layers,
    parse_size,
    plan_num_blocks,
)


def gemma_like_spec(block_size: int = 2, window: int = 3) -> KVCacheSpec:
    # Five sliding layers then one full layer, as in Gemma-3.
    windows = [window] * 5 + [None]
    return KVCacheSpec(
        block_size=block_size,
        dtype_bytes=4,
        groups=group_layers(windows, num_kv_heads=1, head_dim=8),
    )


def test_group_layers_follows_first_appearance() -> None:
    groups = group_layers([4, 4, None, 4, 8, None], num_kv_heads=2, head_dim=16)
    assert [(g.name, g.window, g.layer_ids) for g in groups] == [
        ("sliding_4", 4, (0, 1, 3)),
        ("full", None, (2, 5)),
        ("sliding_8", 8, (4,)),
    ]


def test_two_groups_per_sequence_narrated() -> None:
    # b=2; sliding group w=3 -> R=2, C=4; full group grows. Pools of 4 and 8 blocks.
    kv = KVCacheManager(gemma_like_spec(), [4, 8], max_model_len=16)
    kv.admit("a", prompt_len=5, max_tokens=3)  # 8 tokens: sliding min(4, 2)=2, full 4
    assert kv.stats().blocks_reserved_per_group == (2, 4)
    sliding, full = kv.append("a", 5)
    # Sliding ring: p0 is overwritten by p4 inside this chunk, so it is skipped.
    assert sliding == [SKIP_SLOT, 1, 2, 3, 0]
    assert full == [0, 1, 2, 3, 4]
    assert kv.block_tables("a") == [[0, 1], [0, 1, 2]]
    assert kv.append("a", 1) == [[1], [5]]
    assert kv.append("a", 2) == [[2, 3], [6, 7]]
    assert kv.block_tables("a") == [[0, 1], [0, 1, 2, 3]]
    st = kv.stats()
    assert st.blocks_used_per_group == (2, 4) == st.blocks_reserved_per_group
    assert st.ring_block_recycles == 2  # logical blocks 2 and 3 of the sliding group
    assert st.ring_slot_overwrites == 4  # positions 4..7
    with pytest.raises(KVCacheError, match="more than the 8"):
        kv.append("a", 1)
    kv.release("a")
    st = kv.stats()
    assert (st.blocks_used, st.blocks_reserved, st.num_sequences) == (0, 0, 0)


def test_admission_waits_for_room_and_refuses_what_never_fits() -> None:
    spec = KVCacheSpec(
        block_size=4,
        dtype_bytes=2,
        groups=(LayerGroup(name="s", window=8, layer_ids=(0,), num_kv_heads=1, head_dim=4),),
    )
    kv = KVCacheManager(spec, [5], max_model_len=100)  # R = 2: two rings fit, not three
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
    kv = KVCacheManager(gemma_like_spec(), [4, 8], max_model_len=16)
    with pytest.raises(RequestTooLargeError) as err:
        kv.admit("big", prompt_len=10, max_tokens=10)
    message = str(err.value)
    for words in ("needs 10 blocks", "group full", "holds 8", "never be admitted", "20 tokens"):
        assert words in message
    assert "big" not in kv and kv.stats().blocks_reserved == 0


def test_unknown_and_duplicate_sequences_are_errors() -> None:
    kv = KVCacheManager(gemma_like_spec(), [4, 8], max_model_len=16)
    with pytest.raises(KVCacheError, match="unknown sequence"):
        kv.append("x", 1)
    kv.admit("x", 1, 1)
    with pytest.raises(KVCacheError, match="already admitted"):
        kv.admit("x", 1, 1)


def test_read_check_counts_a_slot_that_lost_its_position() -> None:
    kv = KVCacheManager(gemma_like_spec(block_size=2, window=3), [6, 16], max_model_len=32,
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


def test_the_always_on_edge_check_sees_a_broken_ring() -> None:
    kv = KVCacheManager(gemma_like_spec(block_size=2, window=3), [6, 16], max_model_len=32)
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


def test_bytes_per_block_and_pool_plan() -> None:
    spec = gemma_like_spec(block_size=16, window=512)
    # 2 (K and V) * 16 tokens * 1 head * 8 dims * 4 bytes * 5 layers
    assert spec.bytes_per_block(0) == 2 * 16 * 1 * 8 * 4 * 5
    assert spec.bytes_per_block(1) == 2 * 16 * 1 * 8 * 4 * 1
    memory = 10 * 2**20
    blocks = plan_num_blocks(spec, memory, max_model_len=2048)
    used = sum(n * spec.bytes_per_block(i) for i, n in enumerate(blocks))
    assert used <= memory and memory - used < spec.bytes_per_block(0) + spec.bytes_per_block(1)
    # pools are in proportion to one 2048-token sequence's need: 32 ring blocks, 128 full
    assert abs(blocks[1] / blocks[0] - 128 / 32) < 0.01


def test_capacity_in_words_for_a_bounded_model() -> None:
    spec = KVCacheSpec(
        block_size=16,
        dtype_bytes=2,
        groups=group_layers([4096] * 4, num_kv_heads=8, head_dim=128),
    )
    cap = capacity(spec, [4096], max_model_len=32768)
    assert cap.max_sequences == 16 and cap.sequence_tokens is None
    assert "4096 blocks of 16 tokens" in cap.description
    assert "a sequence under window 4096 takes at most 256 blocks" in cap.description
    assert "16 sequences of unbounded length fit" in cap.description


def test_capacity_with_a_full_group_is_per_max_model_len() -> None:
    spec = gemma_like_spec(block_size=16, window=512)
    cap = capacity(spec, [320, 1280], max_model_len=2048)
    assert cap.max_sequences == 10 and cap.sequence_tokens == 2048
    assert "10 sequences of 2048 tokens fit" in cap.description


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
