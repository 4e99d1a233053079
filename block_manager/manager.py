"""Per-sequence block tables over one pool shared by every layer group, with admission
against reservations."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from ringserve.block_manager.budget import (
    AdmissionState,
    Capacity,
    KVCacheSpec,
    capacity,
    check_fits_pool,
    sequences_that_fit,
)
from ringserve.block_manager.pool import BlockPool
from ringserve.block_manager.prefix import Hit, PrefixIndex, extend_chain, first_needed
from ringserve.block_manager.ring import overwrites_between, recycles_between, ring_slack
from ringserve.block_manager.table import SKIP_SLOT, BlockTable


class KVCacheError(RuntimeError):
    """The manager was used against its contract (unknown sequence, reservation exceeded)."""


@dataclass(frozen=True)
class KVStats:
    """A snapshot of the pool's counters and gauges; per-group tuples follow `group_names`
    (one entry per window: the groups of one window summed)."""

    blocks_total: int
    blocks_used: int
    blocks_reserved: int
    ring_block_recycles: int
    ring_slot_overwrites: int
    read_misses: int
    num_sequences: int
    group_names: tuple[str, ...]
    blocks_used_per_group: tuple[int, ...]
    blocks_reserved_per_group: tuple[int, ...]
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    blocks_cached: int = 0
    blocks_evicted: int = 0


class _SeqState:
    __slots__ = ("chain", "max_tokens", "promise_start", "promised", "reserved", "tables",
                 "tokens")

    def __init__(self, tables: list[BlockTable], reserved: tuple[int, ...], max_tokens: int):
        self.tables = tables
        self.reserved = reserved
        self.max_tokens = max_tokens
        self.tokens: list[int] = []  # with prefix caching: the tokens known so far
        self.chain: list[bytes] = []  # their full blocks' names
        self.promised: list[bytes] = []  # names of prompt blocks it still has to compute
        self.promise_start = 0  # the block index of promised[0]


class KVCacheManager:
    """Owns the one block pool of every layer group and every sequence's tables
    (docs/design.md §3: why admission is exact, with sharing and drafts).

    A sequence is admitted with the number of tokens it may ever hold (prompt +
    max_tokens); its reservation, the sum over groups of ``min(ceil(n / b), R)`` blocks, is
    set aside in the pool, so the blocks it later takes lazily are always there: no
    preemption, ever. Memory one group does not need serves another.

    With prefix caching every full block gets a chained name; a new sequence starts from
    the longest prompt prefix every group still holds (`block_manager.prefix`), sharing
    those blocks. Admission stays exact: the pool commits

        blocks in use + for every sequence and full group, the blocks it may still take
        + for every sequence and ring group, R less the ring blocks it holds alone

    and admits a request only if that stays within the pool (a ring entry holding a shared
    block takes a fresh one when the ring comes back to it, so a shared ring block still
    counts against each holder's future; a shared full-attention block is counted once).

    Args:
        spec: block size, dtype size and layer groups.
        num_blocks: blocks in the pool (see `budget.plan_num_blocks`).
        max_model_len: the longest sequence served (used in the capacity statement).
        debug: check every cached position a step reads (O(window) per sequence and
            step) instead of only the oldest and newest ones (O(1)). Either way a shadow
            records which (group, contents, position) each slot holds, the contents being
            the name of the block's tokens (or the sequence, for a block not yet full), and
            `check_reads` counts the reads that would find anything else: read misses.
        enable_prefix_caching: share and keep full blocks by their names.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        *,
        max_model_len: int,
        debug: bool = False,
        enable_prefix_caching: bool = False,
        speculative_tokens: int = 0,
    ) -> None:
        self.spec = spec
        self.max_model_len = max_model_len
        self.pool = BlockPool(num_blocks)
        self.ring_blocks = [spec.ring_blocks(i) for i in range(len(spec.groups))]
        self._windows = [g.window for g in spec.groups]
        self.debug = debug
        self.caching = enable_prefix_caching
        caching_slack = ring_slack(spec.block_size, enable_prefix_caching)
        if spec.ring_slack < caching_slack:
            raise ValueError("prefix caching needs rings with a block of slack "
                             f"(ring_slack >= {caching_slack}); see block_manager.ring")
        slack = ring_slack(spec.block_size, enable_prefix_caching, speculative_tokens)
        if spec.ring_slack < slack:
            raise ValueError(f"{speculative_tokens} speculative tokens need rings with "
                             f"{speculative_tokens} tokens of slack beyond prefix caching's "
                             f"(ring_slack >= {slack}); see block_manager.ring")
        self.speculative_tokens = speculative_tokens
        self._reservations: dict[int, tuple[int, ...]] = {}
        self._seqs: dict[Hashable, _SeqState] = {}
        self._reserved_full = 0
        self._reserved_ring = 0
        self._reserved_per_group = [0] * len(spec.groups)
        self._recycles = 0
        self._overwrites = 0
        self._read_misses = 0
        self._shadow: dict[int, tuple[int, Hashable, int]] = {}
        self.prefix = PrefixIndex(spec, self.pool)
        self._stepped: list[Hashable] = []

    # -- admission ---------------------------------------------------------------------

    def reservation(self, prompt_len: int, max_tokens: int) -> tuple[int, ...]:
        """Blocks per group a request of ``prompt_len + max_tokens`` tokens may hold
        (remembered by length: the engine's snapshot asks it of every waiting sequence each
        step)."""
        n = prompt_len + max_tokens
        need = self._reservations.get(n)
        if need is None:
            if len(self._reservations) > 4096:
                self._reservations.clear()
            need = self._reservations[n] = self.spec.blocks_needed(n)
        return need

    def check_request(self, prompt_len: int, max_tokens: int) -> None:
        """Raise `RequestTooLargeError` if the request could never fit the pool."""
        check_fits_pool(self.spec, self.pool.num_blocks, prompt_len, max_tokens,
                        self.reservation(prompt_len, max_tokens))

    def prompt_chain(self, prompt_ids: list[int]) -> list[bytes] | None:
        """The prompt's block names, computed once for a waiting sequence and handed to
        `waits_for_prefix`, `can_admit` and `admit` (None without prefix caching)."""
        return self.prefix.chain(prompt_ids) if self.caching else None

    def can_admit(self, prompt_len: int, max_tokens: int,
                  prompt_ids: list[int] | None = None, *, reuse: bool = True,
                  chain: list[bytes] | None = None) -> bool:
        """True if the request's reservation fits beside every admitted one right now
        (``reuse`` as in `admit`; ``chain``: `prompt_chain`'s answer, if known)."""
        hit = self.prefix.find(prompt_ids, prompt_len if reuse else 1, chain)[1] \
            if self.caching and prompt_ids else None
        return self._fits(self.reservation(prompt_len, max_tokens), hit)

    def cached_prompt_tokens(self, prompt_ids: list[int],
                             chain: list[bytes] | None = None) -> int:
        """Prompt tokens a sequence admitted now would find cached (0 without caching)."""
        if not self.caching:
            return 0
        return self.prefix.find(prompt_ids, len(prompt_ids), chain)[1].num_blocks \
            * self.spec.block_size

    def waits_for_prefix(self, prompt_ids: list[int],
                         chain: list[bytes] | None = None) -> bool:
        """True if a running sequence is computing the prompt's next block after its
        current hit: admitting it after that step reuses the block instead of recomputing
        it (requests that arrive together with one long prefix compute it once)."""
        return self.caching and self.prefix.next_is_promised(prompt_ids, chain)

    def admit(self, seq_id: Hashable, prompt_len: int, max_tokens: int,
              prompt_ids: list[int] | None = None, *, reuse: bool = True,
              chain: list[bytes] | None = None) -> int:
        """Reserve a sequence's blocks; its tables start empty (or at its cached prefix) and
        fill lazily.

        Args:
            prompt_ids: the prompt's tokens; needed with prefix caching.
            reuse: False computes the whole prompt even where it is cached (prompt
                logprobs need every position's logits); its blocks are still named, so
                later prompts find them.

        Returns:
            Prompt tokens found cached: the sequence's tables already hold them.

        Raises:
            RequestTooLargeError: it can never fit.
            KVCacheError: the id is taken, or it does not fit now (call `can_admit`).
        """
        self.check_request(prompt_len, max_tokens)
        if seq_id in self._seqs:
            raise KVCacheError(f"sequence {seq_id!r} is already admitted")
        if self.caching and (prompt_ids is None or len(prompt_ids) != prompt_len):
            raise KVCacheError("prefix caching needs the prompt's token ids")
        need = self.reservation(prompt_len, max_tokens)
        # NOTE: a hit stays under the prompt length passed (see find_hit): 1 finds none
        chain, hit = self.prefix.find(prompt_ids, prompt_len if reuse else 1, chain) \
            if prompt_ids and self.caching else ([], None)
        if not self._fits(need, hit):
            raise KVCacheError(f"sequence {seq_id!r} does not fit now; check can_admit first")
        for i, n in enumerate(need):
            self._reserved_per_group[i] += n
            if self.ring_blocks[i] is None:
                self._reserved_full += n
            else:
                self._reserved_ring += n
        # a next turn that re-templates the answer hits at this prompt's end: each ring
        # holds the blocks such a hit reads when generating moves past them (§9)
        m = prompt_len // self.spec.block_size
        tables = [BlockTable(self.pool, self.spec.block_size, ring, keep_steps=self.caching,
                             hold=range(first_needed(self.spec, g, m), m)
                             if self.caching and ring is not None else range(0))
                  for g, ring in enumerate(self.ring_blocks)]
        state = _SeqState(tables, need, prompt_len + max_tokens)
        self._seqs[seq_id] = state
        if not self.caching:
            return 0
        assert prompt_ids is not None and hit is not None
        state.tokens, state.chain = list(prompt_ids), chain
        for _, block in hit.cached_blocks:
            self.pool.pin(block)
        cached = hit.num_blocks * self.spec.block_size
        for table, row in zip(tables, hit.rows, strict=True):
            table.adopt(cached, row)
        state.promised = chain[hit.num_blocks : prompt_len // self.spec.block_size]
        state.promise_start = hit.num_blocks
        self.prefix.promise(state.promised)
        if reuse:
            self.prefix.queries += prompt_len
            self.prefix.hits += cached
        return cached

    def release(self, seq_id: Hashable) -> None:
        """Free a sequence's blocks and its reservation (finished or aborted)."""
        state = self._state(seq_id)
        for i, table in enumerate(state.tables):
            for block in table.free():
                self._forget_block(block)
            self._reserved_per_group[i] -= state.reserved[i]
            if self.ring_blocks[i] is None:
                self._reserved_full -= state.reserved[i]
            else:
                self._reserved_ring -= state.reserved[i]
        self._drop_promises(state, len(state.promised))
        del self._seqs[seq_id]

    # -- per step ----------------------------------------------------------------------

    def append(self, seq_id: Hashable, num_new: int,
               token_ids: list[int] | None = None, *, drafts: int = 0) -> list[list[int]]:
        """Store ``num_new`` more positions of a sequence; returns slot mappings per group.

        A slot of `SKIP_SLOT` (-1) marks a position the write must skip because a later
        position of the same step takes its slot. With prefix caching, ``token_ids`` are the
        positions' tokens, and the blocks this fills become findable at `commit`.

        ``drafts``: the last so many positions are speculative (their tokens not yet
        verified): they are written, but named and made findable only once `accept` keeps
        them; `accept` must follow before the next append.

        Raises:
            KVCacheError: the sequence would exceed the tokens it was admitted for, or
                drafts more than the rings' slack allows.
        """
        state = self._state(seq_id)
        start = state.tables[0].num_tokens
        end = start + num_new
        if not 0 <= drafts < max(num_new, 1) or drafts > self.speculative_tokens:
            raise KVCacheError(f"{drafts} drafted positions in an append of {num_new}, with "
                               f"{self.speculative_tokens} speculative tokens of slack")
        if end > state.max_tokens:
            raise KVCacheError(
                f"sequence {seq_id!r} would hold {end} tokens, more than the "
                f"{state.max_tokens} it was admitted for"
            )
        if self.caching:
            if token_ids is None or len(token_ids) != num_new:
                raise KVCacheError("prefix caching needs the appended positions' token ids")
            known = len(state.tokens)
            if end - drafts > known:
                state.tokens += token_ids[known - start : num_new - drafts]
                extend_chain(state.chain, state.tokens, self.spec.block_size)
            self._stepped.append(seq_id)
        b = self.spec.block_size
        if num_new == 1 and start % b and end % b:
            return self._append_inside_block(seq_id, state, start)
        mappings = []
        for i, table in enumerate(state.tables):
            # blocks nobody is promised: a long step may park its own blocks in them
            spare = self.pool.num_blocks - self._committed() - self.pool.num_parked
            slots, recycled, overwritten = table.append(num_new, spare)
            self._recycles += recycled
            self._overwrites += overwritten
            self._record(i, seq_id, state, start, slots)
            if self.caching:
                self._filled(i, seq_id, state, table, start, end - drafts)
            mappings.append(slots)
        return mappings

    def accept(self, seq_id: Hashable, num_tokens: int,
               token_ids: list[int] | None = None) -> None:
        """After a step with drafts: keep the sequence's first ``num_tokens`` positions and
        roll back the rest (the rejected drafts stay written, in slots no later query reads:
        the rings' slack, `block_manager.ring`). With prefix caching, ``token_ids`` are the
        kept drafts' tokens; their blocks get their names and become findable now (the
        step's K/V are in).

        Raises:
            KVCacheError: ``num_tokens`` past what was appended, or before the verified part.
        """
        state = self._state(seq_id)
        end = state.tables[0].num_tokens
        verified = len(state.tokens) if self.caching else 0
        if num_tokens > end or (self.caching and num_tokens < verified):
            raise KVCacheError(f"sequence {seq_id!r}: cannot keep {num_tokens} of {end} "
                               f"positions ({verified} verified)")
        for table in state.tables:
            # the rolled-back positions are counted again when they are stored for real
            self._recycles -= recycles_between(num_tokens, end, table.block_size,
                                               table.ring_blocks)
            self._overwrites -= overwrites_between(num_tokens, end, table.capacity)
            table.num_tokens = num_tokens
        if not self.caching or num_tokens == verified:
            return
        if token_ids is None or len(token_ids) != num_tokens - verified:
            raise KVCacheError("prefix caching needs the kept drafts' token ids")
        state.tokens += token_ids
        extend_chain(state.chain, state.tokens, self.spec.block_size)
        for i, table in enumerate(state.tables):
            table.parked = {}
            self._record(i, seq_id, state, verified,
                         [table.slot(p) for p in range(verified, num_tokens)])
            self._filled(i, seq_id, state, table, verified, num_tokens)
        self.prefix.commit()

    def _append_inside_block(self, seq_id: Hashable, state: _SeqState,
                              p: int) -> list[list[int]]:
        """`append` of one position that neither starts nor fills a block (most decode
        steps): no block is taken, swapped or named; the same slots `BlockTable.append`
        gives, without its general path."""
        b = self.spec.block_size
        contents = self._contents(seq_id, state, p // b)
        shadow = self._shadow
        mappings = []
        for i, table in enumerate(state.tables):
            table.parked = {}
            table.num_tokens = p + 1
            slot = table.slot(p)
            self._overwrites += overwrites_between(p, p + 1, table.capacity)
            shadow[slot] = (i, contents, p)
            mappings.append([slot])
        return mappings

    def enable_events(self) -> None:
        """Record KV events from now on (`take_events`)."""
        if self.pool.events is None:
            self.pool.events = []

    def take_events(self) -> list[tuple[Any, ...]]:
        """The cache's events since the last call, oldest first: ``("stored", (group,
        name), (parent, tokens))`` and ``("removed", (group, name))``."""
        events = self.pool.events
        if not events:
            return []
        self.pool.events = []
        return events

    def commit(self) -> None:
        """The step's K/V are written: make the blocks it filled findable by their names."""
        self.prefix.commit()
        b = self.spec.block_size
        for seq_id in self._stepped:
            state = self._seqs.get(seq_id)
            if state is not None and state.promised:
                done = state.tables[0].num_tokens // b  # blocks now computed
                self._drop_promises(state, max(0, done - state.promise_start))
        self._stepped.clear()

    def discard(self) -> None:
        """The step failed: what it wrote is not to be found."""
        self.prefix.discard()
        self._stepped.clear()

    def block_tables(self, seq_id: Hashable) -> list[list[int]]:
        """The sequence's table row per group (a ring row holds at most ``R`` ids)."""
        return [table.blocks for table in self._state(seq_id).tables]

    def row_swaps(self, seq_id: Hashable) -> list[int]:
        """Per group, how many ring entries of the sequence took a fresh block so far: a
        copy of its rows that saw fewer must be rewritten, not only extended."""
        return [table.swaps for table in self._state(seq_id).tables]

    def num_tokens(self, seq_id: Hashable) -> int:
        """Positions stored so far for the sequence."""
        return self._state(seq_id).tables[0].num_tokens

    def check_reads(self, seq_id: Hashable, query_start: int) -> int:
        """Check that the cached positions queries from ``query_start`` on will read
        (``[max(0, query_start - w + 1), query_start)`` per group) still hold their data:
        all of them in debug mode, else the oldest and the newest (the ring's edges, where
        an off-by-one in the ring would show first).

        Returns:
            Read misses found now (also added to the counter).
        """
        misses = 0
        shadow = self._shadow
        state = self._state(seq_id)
        b = self.spec.block_size
        for i, (table, window) in enumerate(zip(state.tables, self._windows, strict=True)):
            lo = 0 if window is None else max(0, query_start - window + 1)
            if lo >= query_start:
                continue
            positions = range(lo, query_start) if self.debug else {lo, query_start - 1}
            for p in positions:
                if shadow.get(table.slot(p)) != (i, self._contents(seq_id, state, p // b), p):
                    misses += 1
        self._read_misses += misses
        return misses

    # -- reporting ---------------------------------------------------------------------

    def stats(self) -> KVStats:
        names = self.spec.names()
        held = [0] * len(self.spec.groups)
        for state in self._seqs.values():
            for i, table in enumerate(state.tables):
                held[i] += len(table.blocks)
        return KVStats(
            blocks_total=self.pool.num_blocks,
            blocks_used=self.pool.num_used,
            blocks_reserved=self._committed(),
            ring_block_recycles=self._recycles,
            ring_slot_overwrites=self._overwrites,
            read_misses=self._read_misses,
            num_sequences=len(self._seqs),
            prefix_cache_queries=self.prefix.queries,
            prefix_cache_hits=self.prefix.hits,
            blocks_cached=self.pool.num_cached,
            blocks_evicted=self.pool.evictions,
            group_names=tuple(names),
            blocks_used_per_group=tuple(sum(held[i] for i in m) for m in names.values()),
            blocks_reserved_per_group=tuple(
                sum(self._reserved_per_group[i] for i in m) for m in names.values()),
        )

    def capacity(self) -> Capacity:
        return capacity(self.spec, self.pool.num_blocks, self.max_model_len)

    def sequences_that_fit(self, tokens: int) -> int:
        """Sequences of ``tokens`` tokens (prompt + max_tokens) the pool holds at once."""
        return sequences_that_fit(self.spec, self.pool.num_blocks, tokens)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    # -- internals ---------------------------------------------------------------------

    def _state(self, seq_id: Hashable) -> _SeqState:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KVCacheError(f"unknown sequence {seq_id!r}") from None

    @property
    def committed(self) -> int:
        """Blocks promised to admitted sequences: in use, plus what they may still take."""
        return self._committed()

    def admission_state(self, waiting: Sequence[tuple[int, int]], running: int,
                        max_running: int, stats: KVStats | None = None) -> AdmissionState:
        """What `budget.admission` answers from, now: ``waiting`` the (prompt, max_tokens)
        of each waiting sequence in queue order, ``running`` the sequences admitted;
        ``stats`` this moment's `stats()`, if the caller has it already."""
        stats = self.stats() if stats is None else stats
        return AdmissionState(
            num_blocks=self.pool.num_blocks, committed=self._committed(),
            waiting=tuple(sum(self.reservation(p, m)) for p, m in waiting),
            running=running, max_running=max_running,
            reserved_per_group=dict(zip(stats.group_names, stats.blocks_reserved_per_group,
                                        strict=True)),
            used_per_group=dict(zip(stats.group_names, stats.blocks_used_per_group,
                                    strict=True)))

    def _committed(self) -> int:
        """Blocks the pool has promised: in use, plus what admitted sequences may still take."""
        pool = self.pool
        return (pool.num_used + self._reserved_full - pool.full_refs
                + self._reserved_ring - pool.ring_exclusive)

    def _fits(self, need: tuple[int, ...], hit: Hit | None) -> bool:
        extra = sum(need)
        for g, block in [] if hit is None else hit.cached_blocks:
            ref = self.pool.ref(block)
            if self.ring_blocks[g] is None:
                extra += (ref == 0) - 1  # in use once more, and one block fewer to take
            else:
                extra += ref == 1  # its holder no longer holds it alone
        return self._committed() + extra <= self.pool.num_blocks

    def _drop_promises(self, state: _SeqState, count: int) -> None:
        count = min(count, len(state.promised))
        state.promise_start += count
        self.prefix.fulfil(state.promised[:count])
        del state.promised[:count]

    def _contents(self, seq_id: Hashable, state: _SeqState, k: int) -> Hashable:
        """What block ``k`` of a sequence holds: its name once its tokens fill it."""
        return state.chain[k] if k < len(state.chain) else seq_id

    def _record(self, group: int, seq_id: Hashable, state: _SeqState, start: int,
                slots: list[int]) -> None:
        shadow = self._shadow
        b = self.spec.block_size
        for offset, slot in enumerate(slots):
            if slot != SKIP_SLOT:
                p = start + offset
                shadow[slot] = (group, self._contents(seq_id, state, p // b), p)

    def _filled(self, group: int, seq_id: Hashable, state: _SeqState, table: BlockTable,
                start: int, end: int) -> None:
        """Blocks this append completed: name them in the shadow, and queue them for the
        cache."""
        b = self.spec.block_size
        for k in range(start // b, end // b):
            if table.lost(k * b, end):  # overwritten in place by this very step
                continue
            block = table.block_of(k)
            name = state.chain[k]
            for p in range(k * b, start):  # written before the block had a name
                self._shadow[block * b + p % b] = (group, name, p)
            meta = None
            if self.pool.events is not None:  # KV events: the parent's name, the tokens
                meta = (state.chain[k - 1] if k else None, state.tokens[k * b : (k + 1) * b])
            self.prefix.queue(block, group, name, meta)

    def _forget_block(self, block: int) -> None:
        b = self.spec.block_size
        shadow = self._shadow
        for slot in range(block * b, (block + 1) * b):
            shadow.pop(slot, None)
