"""The tensors one model step runs on: packed tokens, positions, and per-group ring tables.

Only this module and the model runner turn block ids (lists of ints from block_manager) into
tensors; the models read them, the kernels take them as arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupTables:
    """One layer group's view of a step: its block tables and where new K/V go."""

    block_tables: torch.Tensor  # [num_seqs, width] int32; ring rows hold <= R ids
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = skip the write
    window: int | None
    ring_blocks: int | None


@dataclass(frozen=True)
class ForwardBatch:
    """A packed step: sequence ``s`` owns tokens ``query_start_loc[s]:query_start_loc[s+1]``."""

    positions: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    context_lens: torch.Tensor  # [num_seqs] int32: positions cached before this step
    groups: tuple[GroupTables, ...]
    logits_indices: torch.Tensor  # [num_outputs] int64: rows whose logits are sampled
    max_position: int = 0  # 1 + the largest position, known on the host (no device sync)


@dataclass(frozen=True)
class SeqStep:
    """What the runner knows about one sequence in a step (host side, plain Python)."""

    context_len: int
    num_new: int
    block_tables: Sequence[Sequence[int]]  # per group
    slot_mappings: Sequence[Sequence[int]]  # per group, num_new entries each
    wants_logits: bool = True


def build_forward_batch(
    steps: Sequence[SeqStep],
    windows: Sequence[int | None],
    ring_blocks: Sequence[int | None],
    device: torch.device | str = "cpu",
) -> ForwardBatch:
    """Pack the host-side description of a step into the tensors a forward pass reads.

    Args:
        steps: one entry per scheduled sequence, in batch order.
        windows: per layer group, its sliding window (None = full attention).
        ring_blocks: per layer group, its ring length R (None = full attention).
        device: where the tensors go.

    Returns:
        The `ForwardBatch`; logits rows are the last new token of each sequence that wants
        logits (a prefill chunk that does not end the prompt samples nothing).
    """
    num_new = [s.num_new for s in steps]
    starts = [0]
    for n in num_new:
        starts.append(starts[-1] + n)
    positions = torch.cat(
        [torch.arange(s.context_len, s.context_len + s.num_new) for s in steps]
    ) if steps else torch.zeros(0, dtype=torch.int64)
    groups = []
    for g, (window, ring) in enumerate(zip(windows, ring_blocks, strict=True)):
        # NOTE: ring rows are padded to R columns (a short sequence holds fewer blocks);
        # padding is never read, since every cached position maps into a held entry.
        width = max([len(s.block_tables[g]) for s in steps] + [ring or 1])
        table = torch.zeros((len(steps), width), dtype=torch.int32)
        for i, s in enumerate(steps):
            row = s.block_tables[g]
            if row:
                table[i, : len(row)] = torch.tensor(row, dtype=torch.int32)
        slots = [slot for s in steps for slot in s.slot_mappings[g]]
        groups.append(
            GroupTables(
                block_tables=table.to(device),
                slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
                window=window,
                ring_blocks=ring,
            )
        )
    logits_rows = [starts[i + 1] - 1 for i, s in enumerate(steps) if s.wants_logits and s.num_new]
    return ForwardBatch(
        positions=positions.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        context_lens=torch.tensor([s.context_len for s in steps], dtype=torch.int32,
                                  device=device),
        groups=tuple(groups),
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=device),
        max_position=max((s.context_len + s.num_new for s in steps), default=0),
    )
