"""Per-sequence block tables over one pool shared by every layer group, with admission
against reservations."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from block_manager.budget import Capacity, KVCacheSpec, capacity, sequences_that_fit
from block_manager.pool import BlockPool
from block_manager.table import SKIP_SLOT, BlockTable


class RequestTooLargeError(ValueError):
    """A request needs more blocks than a whole pool holds: it can never be admitted."""


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


class _SeqState:
    __slots__ = ("max_tokens", "reserved", "tables")

    def __init__(self, tables: list[BlockTable], reserved: tuple[int, ...], max_tokens: int):
        self.tables = tables
        self.reserved = reserved
        self.max_tokens = max_tokens


class KVCacheManager:
    """Owns the one block pool of every layer group and every sequence's tables.

    A sequence is admitted with the number of tokens it may ever hold (prompt +
    max_tokens); its reservation, the sum over groups of ``min(ceil(n / b), R)`` blocks, is
    set aside in the pool, so the blocks it later takes lazily are always there: no
    preemption, ever. Memory one group does not need serves another.

    Args:
        spec: block size, dtype size and layer groups.
        num_blocks: blocks in the pool (see `budget.plan_num_blocks`).
        max_model_len: the longest sequence served (used in the capacity statement).
        debug: check every cached position a step reads (O(window) per sequence and
            step) instead of only the oldest and newest ones (O(1)). Either way a shadow
            records which (group, sequence, position) each slot holds, and `check_reads`
            counts the reads that would find another owner: read misses.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        num_blocks: int,
        *,
        max_model_len: int,
        debug: bool = False,
    ) -> None:
        self.spec = spec
        self.max_model_len = max_model_len
        self.pool = BlockPool(num_blocks)
        self.ring_blocks = [spec.ring_blocks(i) for i in range(len(spec.groups))]
        self.debug = debug
        self._seqs: dict[Hashable, _SeqState] = {}
        self._reserved = 0
        self._reserved_per_group = [0] * len(spec.groups)
        self._recycles = 0
        self._overwrites = 0
        self._read_misses = 0
        self._shadow: dict[int, tuple[int, Hashable, int]] = {}

    # -- admission ---------------------------------------------------------------------

    def reservation(self, prompt_len: int, max_tokens: int) -> tuple[int, ...]:
        """Blocks per group a request of ``prompt_len + max_tokens`` tokens may take."""
        return self.spec.blocks_needed(prompt_len + max_tokens)

    def check_request(self, prompt_len: int, max_tokens: int) -> None:
        """Raise `RequestTooLargeError` if the request could never fit the pool."""
        n = sum(self.reservation(prompt_len, max_tokens))
        if n > self.pool.num_blocks:
            raise RequestTooLargeError(
                f"request needs {n} KV blocks of {self.spec.block_size} tokens over all "
                f"layer groups (prompt {prompt_len} + max_tokens {max_tokens} = "
                f"{prompt_len + max_tokens} tokens) but the whole pool holds "
                f"{self.pool.num_blocks}; it can never be admitted"
            )

    def can_admit(self, prompt_len: int, max_tokens: int) -> bool:
        """True if the request's reservation fits beside every admitted one right now."""
        need = sum(self.reservation(prompt_len, max_tokens))
        return self._reserved + need <= self.pool.num_blocks

    def admit(self, seq_id: Hashable, prompt_len: int, max_tokens: int) -> None:
        """Reserve a sequence's blocks; its tables start empty and fill lazily.

        Raises:
            RequestTooLargeError: it can never fit.
            KVCacheError: the id is taken, or it does not fit now (call `can_admit`).
        """
        self.check_request(prompt_len, max_tokens)
        if seq_id in self._seqs:
            raise KVCacheError(f"sequence {seq_id!r} is already admitted")
        if not self.can_admit(prompt_len, max_tokens):
            raise KVCacheError(f"sequence {seq_id!r} does not fit now; check can_admit first")
        need = self.reservation(prompt_len, max_tokens)
        self._reserved += sum(need)
        for i, n in enumerate(need):
            self._reserved_per_group[i] += n
        tables = [BlockTable(self.pool, self.spec.block_size, ring) for ring in self.ring_blocks]
        self._seqs[seq_id] = _SeqState(tables, need, prompt_len + max_tokens)

    def release(self, seq_id: Hashable) -> None:
        """Free a sequence's blocks and its reservation (finished or aborted)."""
        state = self._state(seq_id)
        for i, table in enumerate(state.tables):
            for block in table.blocks:
                self._forget_block(block)
            table.free()
            self._reserved_per_group[i] -= state.reserved[i]
        self._reserved -= sum(state.reserved)
        del self._seqs[seq_id]

    # -- per step ----------------------------------------------------------------------

    def append(self, seq_id: Hashable, num_new: int) -> list[list[int]]:
        """Store ``num_new`` more positions of a sequence; returns slot mappings per group.

        A slot of `SKIP_SLOT` (-1) marks a position the write must skip because a later
        position of the same step takes its slot.

        Raises:
            KVCacheError: the sequence would exceed the tokens it was admitted for.
        """
        state = self._state(seq_id)
        start = state.tables[0].num_tokens
        if start + num_new > state.max_tokens:
            raise KVCacheError(
                f"sequence {seq_id!r} would hold {start + num_new} tokens, more than the "
                f"{state.max_tokens} it was admitted for"
            )
        mappings = []
        for i, table in enumerate(state.tables):
            slots, recycled, overwritten = table.append(num_new)
            self._recycles += recycled
            self._overwrites += overwritten
            self._record(i, seq_id, start, slots)
            mappings.append(slots)
        return mappings

    def block_tables(self, seq_id: Hashable) -> list[list[int]]:
        """The sequence's table row per group (a ring row holds at most ``R`` ids)."""
        return [table.blocks for table in self._state(seq_id).tables]

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
        for i, table in enumerate(self._state(seq_id).tables):
            window = self.spec.groups[i].window
            lo = 0 if window is None else max(0, query_start - window + 1)
            if lo >= query_start:
                continue
            positions = range(lo, query_start) if self.debug else {lo, query_start - 1}
            for p in positions:
                if shadow.get(table.slot(p)) != (i, seq_id, p):
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
            blocks_reserved=self._reserved,
            ring_block_recycles=self._recycles,
            ring_slot_overwrites=self._overwrites,
            read_misses=self._read_misses,
            num_sequences=len(self._seqs),
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

    def _record(self, group: int, seq_id: Hashable, start: int, slots: list[int]) -> None:
        shadow = self._shadow
        for offset, slot in enumerate(slots):
            if slot != SKIP_SLOT:
                shadow[slot] = (group, seq_id, start + offset)

    def _forget_block(self, block: int) -> None:
        b = self.spec.block_size
        shadow = self._shadow
        for slot in range(block * b, (block + 1) * b):
            shadow.pop(slot, None)
