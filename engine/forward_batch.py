"""The tensors one model step runs on: packed tokens, positions, and per-group ring tables.

Only the model runner turns block ids (lists of ints from block_manager) into these tensors;
the models read them, the kernels take them as arguments.
"""

from __future__ import annotations

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
    # tokens whose K/V are written before attention (verification rows: each of their
    # queries is served as a decode reading the row's earlier tokens from the cache; safe
    # by the rings' speculative slack, see block_manager/ring.py)
    early_writes: torch.Tensor | None = None
    # every sequence has exactly one new token after a cached context, and none is written
    # early (known on the host: the decode-only paths check it without a device op)
    decode_only: bool = False
