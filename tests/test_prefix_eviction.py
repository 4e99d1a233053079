"""What the prefix cache's LRU takes first under pressure (issue 26): blocks no later prompt
can use before blocks a waiting or later turn will hit.

A ring group's blocks older than its window at a hit's end cannot serve that hit, and a
full group's chain serves only from block 0; the pool evicts the least recently used
evictable block. These tests fill a pool with two sessions' cached turns, take blocks from
it, and ask what each session's next turn still finds.
"""

from __future__ import annotations

from ringserve.block_manager import KVCacheManager, KVCacheSpec, LayerGroup
from ringserve.block_manager.prefix import find_hit


def _spec(window: int | None) -> KVCacheSpec:
    groups = (LayerGroup(name="full", window=None, layer_ids=(0,), num_kv_heads=1, head_dim=4),)
    if window is not None:
        groups = (LayerGroup(name="s", window=window, layer_ids=(1,), num_kv_heads=1,
                             head_dim=4), *groups)
    return KVCacheSpec(block_size=2, dtype_bytes=2, ring_slack=1, groups=groups)


def _turn(kv: KVCacheManager, name: str, prompt: list[int]) -> None:
    """A turn computed, cached and finished: its prompt prefilled in one step, released."""
    kv.admit(name, len(prompt), 1, prompt)
    kv.append(name, len(prompt), prompt)
    kv.commit()
    kv.release(name)


def _take_truly_free(kv: KVCacheManager) -> list[int]:
    """Every block that holds nothing cached: what follows must evict."""
    return [kv.pool.allocate() for _ in range(kv.pool.num_free - kv.pool.num_cached)]


def test_a_waiting_prompts_dead_ring_blocks_go_before_another_sessions_live_ones() -> None:
    kv = KVCacheManager(_spec(window=4), 40, max_model_len=64, enable_prefix_caching=True)
    a = list(range(100, 112))  # 12 tokens: a query at 10 reads p7..p10 of the ring
    b = list(range(200, 212))
    _turn(kv, "A", a)
    _turn(kv, "B", b)
    a_next, b_next = [*a, 1, 2, 3, 4], [*b, 5, 6, 7, 8]
    full_hit = 12  # every full block of the turn: the next prompt's tokens 0..11
    assert kv.cached_prompt_tokens(b_next) == kv.cached_prompt_tokens(a_next) == full_hit
    # A's next turn waits (an admission check looks its prefix up); B's is yet to come.
    assert kv.can_admit(len(a_next), 1, a_next)
    _take_truly_free(kv)
    # Each session's ring holds blocks 0-5 (p0..p11) cached, but a hit of 12 tokens reads
    # only p9..p11 (blocks 4, 5): blocks 0-3 of both rings are dead. Taking 8 blocks must
    # take those 8, not B's live blocks (B's turn ended after A's, yet A's check refreshed
    # only what A's hit uses).
    for _ in range(8):
        kv.pool.allocate()
    assert kv.cached_prompt_tokens(b_next) == full_hit
    assert kv.cached_prompt_tokens(a_next) == full_hit


def test_a_full_chain_is_evicted_from_its_tail() -> None:
    """Full attention only: a turn's chain goes back deepest block first, so taking one
    block from the pool shortens the next turn's hit by one block instead of ending it."""
    kv = KVCacheManager(_spec(window=None), 12, max_model_len=64, enable_prefix_caching=True)
    a = list(range(100, 110))  # 5 full blocks
    _turn(kv, "A", a)
    _take_truly_free(kv)
    kv.pool.allocate()
    assert kv.cached_prompt_tokens([*a, 1, 2]) == 8


def test_an_admitted_hit_keeps_its_blocks_and_exact_outputs_follow() -> None:
    """The hit a waiting prompt was promised is the one it gets: after the evictions above,
    admitting A's next turn pins the blocks `cached_prompt_tokens` counted."""
    kv = KVCacheManager(_spec(window=4), 40, max_model_len=64, enable_prefix_caching=True)
    a = list(range(100, 112))
    _turn(kv, "A", a)
    a_next = [*a, 1, 2, 3, 4]
    assert kv.can_admit(len(a_next), 1, a_next)
    _take_truly_free(kv)
    for _ in range(3):
        kv.pool.allocate()
    assert kv.admit("A2", len(a_next), 1, a_next) == 12
    assert kv.check_reads("A2", 12) == 0


def test_a_session_that_ended_first_is_evicted_first() -> None:
    """A next turn that re-templates the answer hits at the previous prompt's end and reads
    the ring blocks covering the window before it; generating moves the ring past the
    oldest of them while the sequence still runs. Those go back to the LRU with the rest of
    the session's blocks when it ends, not when the ring moves on, so the session that
    ended first is evicted first. (Under a plain LRU, B's blocks let go mid-generation went
    before A's, and B lost its whole hit to two evictions while A kept all of its.)"""
    kv = KVCacheManager(_spec(window=4), 40, max_model_len=64, enable_prefix_caching=True)
    a = list(range(100, 112))  # 12 tokens: a hit at 12 reads p9..p11 (blocks 4, 5)
    b = list(range(200, 212))
    kv.admit("A", len(a), 1, a)
    kv.admit("B", len(b), 6, b)
    kv.append("A", len(a), a)
    kv.append("B", len(b), b)
    kv.commit()
    for t in range(6):  # B's ring (3 blocks of 2) moves past blocks 4 and 5 of its prompt
        kv.append("B", 1, [300 + t])
        kv.commit()
    kv.append("A", 1, [400])
    kv.commit()
    kv.release("A")  # A ends first, then B
    kv.release("B")
    a_next, b_next = [*a, 1, 2, 3, 4], [*b, 5, 6, 7, 8]
    assert _found(kv, a_next) == _found(kv, b_next) == 12
    _take_truly_free(kv)
    while _found(kv, a_next) == 12:  # evict until A's hit breaks (looking, not touching)
        kv.pool.allocate()
    assert _found(kv, b_next) == 12


def _found(kv: KVCacheManager, prompt: list[int]) -> int:
    """Prompt tokens a prompt would find cached, leaving the LRU's order alone (an
    admission check marks the blocks its hit reads recently used)."""
    hit = find_hit(kv.spec, kv.prefix.chain(prompt), len(prompt),
                   lambda g, name: kv.pool.peek((g, name)))
    return hit.num_blocks * kv.spec.block_size


def test_multi_turn_sessions_keep_hitting_under_pressure() -> None:
    """`benchmarks/multiturn.py`'s workload (8 sessions x 5 turns, gemma-3-270m's layers, a
    64 MiB pool: 1,365 blocks for a working set of 1,600-1,760) through the real scheduler
    and pool, without a model (`benchmarks/multiturn_sim.py`): with lpm, at least 5 of the 8
    sessions find their previous prompt cached at every turn from 2 on. (A ring that let
    go of its prompt's window as it generated left 2 a turn.)"""
    from benchmarks.multiturn_sim import parse_args, run

    args = parse_args(["--kv-cache-memory", "64MiB"])
    turns = run("lpm", True, args)
    assert min(t.hits for t in turns[2:]) >= 5, [t.hits for t in turns]
    assert all(t.hit_rate > 0.4 for t in turns[2:])
