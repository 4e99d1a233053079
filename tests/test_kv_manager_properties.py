"""Property tests: random interleavings of many sequences against a shadow of the cache.

Every layer group takes its blocks from one pool. The shadow records, for every physical
slot, which (group, sequence, position) last wrote it, using the slots the manager handed
out. After every operation every position inside every live window must be found, through
the sequence's current table and the ring rule written out here independently, in a slot
whose last writer is that very position of that very group; every block of the pool is
free or in exactly one table row.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from ringserve import kernels
from ringserve.block_manager import (
    SKIP_SLOT,
    KVCacheManager,
    KVCacheSpec,
    LayerGroup,
    RequestTooLargeError,
    group_layers,
)
from ringserve.block_manager.prefix import extend_chain
from ringserve.engine.kv_cache import allocate_kv_caches

windows = st.one_of(st.none(), st.integers(1, 20))
# a layer: its window and its head size (Gemma 4: full layers with larger heads), so one
# pool serves groups whose K/V per token differ (fewer layers a block where they are larger)
layers = st.tuples(windows, st.sampled_from([4, 8, 12]))


def mixed_groups(model_layers: list[tuple[int | None, int]]) -> tuple[LayerGroup, ...]:
    return group_layers([w for w, _ in model_layers], num_kv_heads=1,
                        head_dim=[d for _, d in model_layers])


def expected_slot(row: list[int], position: int, b: int, window: int | None) -> int:
    ring = None if window is None else -(-window // b)
    entry = position // b if ring is None else (position // b) % ring
    return row[entry] * b + position % b


def release_all(machine: RuleBasedStateMachine) -> None:
    """A machine's end: every live sequence released, every block back, nothing reserved."""
    kv = getattr(machine, "kv", None)
    if kv is None:
        return
    for sid in list(machine.length):  # type: ignore[attr-defined]
        kv.release(sid)
    stats = kv.stats()
    assert stats.blocks_used == 0 and stats.blocks_reserved == 0
    assert kv.pool.num_free == kv.pool.num_blocks


def _codes(sid: int, positions: range, layer: int) -> torch.Tensor:
    """A value naming (sequence, position, layer) exactly in float32."""
    return ((sid * 128 + torch.tensor(list(positions), dtype=torch.float32)) * 16 + layer + 1)


class RingMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    @initialize(
        block_size=st.integers(1, 8),
        layer_windows=st.lists(layers, min_size=1, max_size=8),
        pool_blocks=st.integers(0, 120),
    )
    def setup(self, block_size: int, layer_windows: list[tuple[int | None, int]],
              pool_blocks: int) -> None:
        self.b = block_size
        self.spec = KVCacheSpec(
            block_size=block_size,
            dtype_bytes=2,
            groups=mixed_groups(layer_windows),
        )
        self.windows = [g.window for g in self.spec.groups]
        self.kv = KVCacheManager(self.spec, pool_blocks, max_model_len=64, debug=True)
        # the real cache tensors: every layer's views of the one K and V slab per block
        self.caches = allocate_kv_caches(self.spec, pool_blocks, len(layer_windows),
                                         torch.float32, "cpu")
        self.shadow: dict[int, tuple[int, int, int]] = {}
        self.limit: dict[int, int] = {}
        self.length: dict[int, int] = {}
        self.next_id = 0

    @rule(target=seqs, prompt=st.integers(1, 40), max_tokens=st.integers(1, 40))
    def add(self, prompt: int, max_tokens: int) -> int:
        sid = self.next_id
        self.next_id += 1
        need = sum(self.kv.reservation(prompt, max_tokens))
        total = self.kv.pool.num_blocks
        try:
            self.kv.check_request(prompt, max_tokens)
        except RequestTooLargeError:
            assert need > total
            return sid  # never admitted; later rules on it are no-ops
        assert need <= total
        fits = self.kv.stats().blocks_reserved + need <= total
        assert self.kv.can_admit(prompt, max_tokens) == fits
        if fits:
            self.kv.admit(sid, prompt, max_tokens)
            self.limit[sid] = prompt + max_tokens
            self.length[sid] = 0
        return sid

    def _append(self, sid: int, n: int) -> None:
        if sid not in self.limit:
            return
        n = min(n, self.limit[sid] - self.length[sid])
        if n <= 0:
            return
        start = self.length[sid]
        assert self.kv.check_reads(sid, start) == 0
        mappings = self.kv.append(sid, n)
        for g, slots in enumerate(mappings):
            assert len(slots) == n
            written = [s for s in slots if s != SKIP_SLOT]
            assert len(written) == len(set(written)), "two positions of one step share a slot"
            for offset, slot in enumerate(slots):
                if slot != SKIP_SLOT:
                    self.shadow[slot] = (g, sid, start + offset)
            for layer in self.spec.groups[g].layer_ids:  # what each layer's K/V would be
                group = self.spec.groups[g]
                rows = _codes(sid, range(start, start + n), layer)[:, None, None].expand(
                    n, group.num_kv_heads, group.head_dim)
                kernels.write_kv(rows, -rows, *self.caches[layer],
                                 torch.tensor(slots, dtype=torch.int64))
        self.length[sid] = start + n

    @rule(sid=seqs, n=st.integers(1, 50))
    def prefill_chunk(self, sid: int, n: int) -> None:
        self._append(sid, n)

    @rule(sid=seqs)
    def decode_one(self, sid: int) -> None:
        self._append(sid, 1)

    @rule(sid=consumes(seqs))
    def finish_or_abort(self, sid: int) -> None:
        if sid in self.limit:
            self.kv.release(sid)
            del self.limit[sid], self.length[sid]

    @invariant()
    def windows_are_intact(self) -> None:
        if not hasattr(self, "kv"):
            return
        for sid, length in self.length.items():
            rows = self.kv.block_tables(sid)
            for g, window in enumerate(self.windows):
                lo = 0 if window is None else max(0, length - window)
                slots = []
                for p in range(lo, length):
                    slot = expected_slot(rows[g], p, self.b, window)
                    assert self.shadow.get(slot) == (g, sid, p), (sid, g, p)
                    slots.append(slot)
                index = torch.tensor(slots, dtype=torch.int64)
                for layer in self.spec.groups[g].layer_ids:  # no other group's write hit it
                    k, v = self.caches[layer]
                    want = _codes(sid, range(lo, length), layer)[:, None, None]
                    got_k = k[torch.div(index, self.b, rounding_mode="floor"), index % self.b]
                    got_v = v[torch.div(index, self.b, rounding_mode="floor"), index % self.b]
                    assert bool((got_k == want).all() and (got_v == -want).all()), (sid, layer)

    @invariant()
    def blocks_are_accounted(self) -> None:
        if not hasattr(self, "kv"):
            return
        stats = self.kv.stats()
        pool = self.kv.pool
        assert pool.num_free + pool.num_used == pool.num_blocks == stats.blocks_total
        held: list[int] = []
        reserved = 0
        for sid, length in self.length.items():
            rows = self.kv.block_tables(sid)
            need = self.kv.reservation(self.limit[sid], 0)
            for g, window in enumerate(self.windows):
                ring = None if window is None else -(-window // self.b)
                expect = -(-length // self.b) if ring is None else min(-(-length // self.b), ring)
                assert len(rows[g]) == expect <= need[g]
                held += rows[g]
            reserved += sum(need)
        assert len(held) == len(set(held)) == pool.num_used == stats.blocks_used
        assert all(pool.is_used(b) for b in held)
        assert stats.blocks_reserved == reserved <= pool.num_blocks
        assert sum(stats.blocks_reserved_per_group) == reserved
        assert sum(stats.blocks_used_per_group) == stats.blocks_used
        assert stats.read_misses == 0

    def teardown(self) -> None:
        release_all(self)


RingMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                         deadline=None)
TestRing = RingMachine.TestCase


def test_predicted_reservation_equals_what_the_tables_take() -> None:
    """The predictor (`reservation`) and the allocator agree at every final length."""
    for b in (1, 2, 3, 4, 16):
        for w in (None, 1, 2, 5, 16, 17, 100):
            spec = KVCacheSpec(block_size=b, dtype_bytes=2,
                               groups=group_layers([w], num_kv_heads=1, head_dim=4))
            kv = KVCacheManager(spec, 1000, max_model_len=400)
            for total in (1, 2, 7, 16, 33, 250):
                kv.admit("s", total - 1, 1)
                chunk = 1
                while kv.num_tokens("s") < total:
                    kv.append("s", min(chunk, total - kv.num_tokens("s")))
                    chunk = chunk * 2 + 1
                assert (len(kv.block_tables("s")[0]),) == kv.reservation(total - 1, 1)
                kv.release("s")


class PrefixRingMachine(RuleBasedStateMachine):
    """The same ring with prefix caching: prompts drawn from a few shared stems over a tiny
    vocabulary, so sequences hit, share, swap and evict each other's blocks. The shadow here
    names a slot's contents by the exact tokens it was computed from (group, tokens up to
    the position), not by the manager's hashes: a hit must hand over exactly the K/V a fresh
    computation would write, and a failed step's writes must never be found."""

    seqs = Bundle("seqs")

    @initialize(
        block_size=st.integers(1, 4),
        layer_windows=st.lists(layers, min_size=1, max_size=6),
        pool_blocks=st.integers(8, 80),
        stems=st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=24), min_size=1,
                       max_size=3),
        k=st.integers(0, 3),
    )
    def setup(self, block_size: int, layer_windows: list[tuple[int | None, int]],
              pool_blocks: int,
              stems: list[list[int]], k: int) -> None:
        self.b, self.k = block_size, k
        self.spec = KVCacheSpec(
            block_size=block_size, dtype_bytes=2, ring_slack=block_size - 1 + k,
            groups=mixed_groups(layer_windows),
        )
        self.windows = [g.window for g in self.spec.groups]
        self.kv = KVCacheManager(self.spec, pool_blocks, max_model_len=80, debug=True,
                                 enable_prefix_caching=True, speculative_tokens=k)
        self.kv.enable_events()
        self.cached: set[object] = set()  # the cache as its KV events tell it
        self.stems = stems
        self.prompt_len: dict[int, int] = {}
        self.shadow: dict[int, tuple[object, ...]] = {}
        self.tokens: dict[int, list[int]] = {}  # every token the sequence will hold
        self.length: dict[int, int] = {}
        self.next_id = 0

    def _window(self, g: int, length: int) -> range:
        window = self.windows[g]
        return range(0 if window is None else max(0, length - window + 1), length)

    def _slot(self, row: list[int], p: int, g: int) -> int:
        window = self.windows[g]
        ring = None if window is None else -(-(window + self.b - 1 + self.k) // self.b)
        entry = p // self.b if ring is None else (p // self.b) % ring
        return row[entry] * self.b + p % self.b

    @rule(target=seqs, stem=st.integers(0, 2), tail=st.lists(st.integers(0, 2), max_size=10),
          extra=st.lists(st.integers(0, 2), min_size=1, max_size=20),
          reuse=st.sampled_from([True, True, True, False]))
    def add(self, stem: int, tail: list[int], extra: list[int], reuse: bool) -> int:
        """``reuse=False``: a prompt computed whole though cached (prompt logprobs)."""
        sid = self.next_id
        self.next_id += 1
        prompt = self.stems[stem % len(self.stems)] + tail
        if not prompt:
            return sid
        need = sum(self.kv.reservation(len(prompt), len(extra)))
        if need > self.kv.pool.num_blocks:
            with pytest.raises(RequestTooLargeError):
                self.kv.check_request(len(prompt), len(extra))
            return sid
        if not self.kv.can_admit(len(prompt), len(extra), prompt, reuse=reuse):
            return sid
        cached = self.kv.admit(sid, len(prompt), len(extra), prompt, reuse=reuse)
        assert cached % self.b == 0 and 0 <= cached < len(prompt)
        assert reuse or cached == 0
        assert self.kv.num_tokens(sid) == cached
        self.tokens[sid] = prompt + extra
        self.prompt_len[sid] = len(prompt)
        self.length[sid] = cached
        rows = self.kv.block_tables(sid)
        for g in range(len(self.windows)):  # the hit holds exactly what computing would
            for p in self._window(g, cached):
                slot = self._slot(rows[g], p, g)
                assert self.shadow.get(slot) == (g, tuple(prompt[: p + 1])), (g, p)
        return sid

    def _append(self, sid: int, n: int, fail: bool = False) -> None:
        if sid not in self.length:
            return
        start = self.length[sid]
        n = min(n, len(self.tokens[sid]) - start)
        if n <= 0:
            return
        assert self.kv.check_reads(sid, start) == 0
        tokens = self.tokens[sid][start : start + n]
        for g, slots in enumerate(self.kv.append(sid, n, tokens)):
            written = [s for s in slots if s != SKIP_SLOT]
            assert len(written) == len(set(written)), "two positions of one step share a slot"
            for offset, slot in enumerate(slots):
                if slot != SKIP_SLOT:
                    p = start + offset
                    self.shadow[slot] = ("garbage",) if fail else \
                        (g, tuple(self.tokens[sid][: p + 1]))
        self.length[sid] = start + n
        if fail:  # the step raised: nothing it wrote may be found, its sequences end
            self.kv.discard()
            self.kv.release(sid)
            del self.length[sid], self.tokens[sid]
        else:
            self.kv.commit()

    @rule(sid=seqs, n=st.integers(1, 30))
    def prefill_chunk(self, sid: int, n: int) -> None:
        self._append(sid, n)

    @rule(sid=seqs)
    def decode_one(self, sid: int) -> None:
        self._append(sid, 1)

    @rule(sid=seqs, drafts=st.lists(st.integers(0, 2), min_size=1, max_size=3),
          kept=st.integers(0, 3))
    def speculate(self, sid: int, drafts: list[int], kept: int) -> None:
        """A verification step: the last token and up to k drafts; the first ``kept`` drafts
        are the sequence's real next tokens and are kept, the others (whatever their
        tokens) are rejected and rolled back."""
        if sid not in self.length or self.k == 0:
            return
        start, tokens = self.length[sid], self.tokens[sid]
        d = min(len(drafts), self.k, len(tokens) - start - 1)
        if start < self.prompt_len[sid] or d <= 0:  # only decodes speculate
            return
        kept = min(kept, d)
        drafts = tokens[start + 1 : start + 1 + kept] + drafts[kept:d]
        assert self.kv.check_reads(sid, start) == 0
        fed = [tokens[start], *drafts]
        for g, slots in enumerate(self.kv.append(sid, 1 + d, fed, drafts=d)):
            for offset, slot in enumerate(slots):
                if slot != SKIP_SLOT:  # a draft's K/V: of the drafted tokens
                    self.shadow[slot] = (g, tuple(tokens[:start] + fed[: offset + 1]))
        self.kv.commit()
        self.kv.accept(sid, start + 1 + kept, drafts[:kept])
        self.length[sid] = start + 1 + kept

    @rule(sid=consumes(seqs), n=st.integers(1, 10))
    def failed_step(self, sid: int, n: int) -> None:
        self._append(sid, n, fail=True)

    @rule(sid=consumes(seqs))
    def finish_or_abort(self, sid: int) -> None:
        if sid in self.length:
            self.kv.release(sid)
            del self.length[sid], self.tokens[sid]

    @invariant()
    def windows_are_intact(self) -> None:
        if not hasattr(self, "kv"):
            return
        for sid, length in self.length.items():
            rows = self.kv.block_tables(sid)
            for g in range(len(self.windows)):
                for p in self._window(g, length):
                    slot = self._slot(rows[g], p, g)
                    assert self.shadow.get(slot) == (g, tuple(self.tokens[sid][: p + 1]))

    @invariant()
    def blocks_are_accounted(self) -> None:
        if not hasattr(self, "kv"):
            return
        pool, stats = self.kv.pool, self.kv.stats()
        holders: dict[int, int] = {}
        for sid in self.length:
            rows = self.kv.block_tables(sid)
            need = self.kv.reservation(len(self.tokens[sid]), 0)
            for g, row in enumerate(rows):
                assert len(row) == len(set(row)) <= need[g]
                for blk in row:
                    holders[blk] = holders.get(blk, 0) + 1
        assert all(pool.ref(blk) == n for blk, n in holders.items()), "a leaked reference"
        assert pool.num_used == len(holders) == stats.blocks_used
        assert pool.num_free + pool.num_used == pool.num_blocks
        assert stats.blocks_used <= stats.blocks_reserved <= pool.num_blocks
        assert pool.num_parked == 0  # between steps nothing is parked
        assert stats.read_misses == 0
        # a block waits held (behind the LRU) only for a sequence that still runs, and
        # holds something findable
        holding = {blk for sid in self.length for t in self.kv._seqs[sid].tables
                   for blk in t.held}
        assert set(pool._held) <= holding
        assert all(pool.ref(blk) == 0 and pool.keeps(blk) for blk in pool._held)

    @invariant()
    def events_tell_the_cache(self) -> None:
        """KV events replayed (stored, removed) give the cache: a name is stored once until
        removed, removed only once stored, and each stored block's name is the chain of its
        parent and its tokens."""
        if not hasattr(self, "kv"):
            return
        for event in self.kv.take_events():
            if event[0] == "stored":
                assert event[1] not in self.cached
                parent, tokens = event[2]
                chain = [] if parent is None else [parent]
                extend_chain(chain, [0] * (self.b * len(chain)) + tokens, self.b)
                assert chain[-1] == event[1][1] and len(tokens) == self.b
                self.cached.add(event[1])
            else:
                self.cached.remove(event[1])
        assert len(self.cached) == self.kv.pool.num_cached == self.kv.stats().blocks_cached

    def teardown(self) -> None:
        release_all(self)


PrefixRingMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50,
                                               deadline=None)
TestPrefixRing = PrefixRingMachine.TestCase


def test_every_chunking_of_every_prompt_names_only_intact_blocks() -> None:
    """Prefix caching over every prompt length and chunk size (b=4, w=6: R=3 with slack):
    a second sequence with the same prompt hits, and every position it reads holds what it
    should (the manager's shadow, in debug mode). A chunk longer than the ring overwrites
    its own early blocks: those must never be named for the cache."""
    b = 4
    spec = KVCacheSpec(block_size=b, dtype_bytes=2, ring_slack=b - 1,
                       groups=group_layers([6, 6, None], num_kv_heads=1, head_dim=4))
    for length in range(1, 30):
        for chunk in (1, 3, 5, 8, 12, 13, 16):
            kv = KVCacheManager(spec, 400, max_model_len=100, debug=True,
                                enable_prefix_caching=True)
            tokens = [(7 * i + length) % 11 for i in range(length + 8)]
            for sid in ("first", "second"):
                n = kv.admit(sid, length, 8, tokens[:length])
                assert sid == "first" or n == (length - 1) // b * b
                while n < length + 8:
                    step = min(chunk, length - n) if n < length else 1
                    assert kv.check_reads(sid, n) == 0, (length, chunk, sid, n)
                    kv.append(sid, step, tokens[n : n + step])
                    kv.commit()
                    n += step
