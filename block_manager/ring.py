"""The ring rule, written once: where a position lives and how many blocks a sequence holds
(docs/design.md §2; its slack for prefix caching and speculation: §9, §10).

For a layer group with window ``w`` and block size ``b`` the ring has ``R = ceil(w / b)``
blocks, ``C = R * b >= w`` token slots. Position ``p`` lives in logical block ``p // b``,
which sits in entry ``(p // b) % R`` of the sequence's table row::

    b = 2, w = 5  ->  R = 3, C = 6
    position   0 1 | 2 3 | 4 5 | 6 7 | 8 9 | ...
    entry      0   |  1  |  2  |  0  |  1  | ...   (entries 0, 1 recycled from position 6 on)

Writing ``p`` overwrites ``p - C``; since ``C >= w`` no present or future query (which sees
``i - w < j <= i``) can still need it. A full-attention group is the case ``R = None``: the
row grows one entry per ``b`` tokens.

Slack: a ring that must be able to replace a whole block when it comes back to its entry
(prefix caching: the block is shared or cached, so it is not overwritten in place) needs
that block's every position expired at that moment. Starting block ``k`` at position
``k * b``, the entry held block ``k - R``, whose last position ``(k - R + 1) * b - 1`` is
visible to the query at ``k * b`` unless ``R * b >= w + b - 1``. So such a ring has
``R = ceil((w + b - 1) / b)`` blocks: ``slack = b - 1`` tokens beyond the window::

    b = 4, w = 8:  R = 2 in place (position 8 overwrites 0; 5..7 stay until 9..11 come)
                   R = 3 with slack 3 (block 2 takes a fresh block: 0..3 all expired at 8)

Speculative decoding adds ``k`` more. A verification step feeds the last token ``L`` and
``k`` drafts, writing positions up to ``L + k``, and a draft rejected there has already
overwritten the slot of ``L + k - C``. After the rollback the sequence may hold only
``L + 1`` positions, and the next query (at ``L + 1``) reads back to ``L + 2 - w``; the
step's own first query at ``L`` reads back to ``L - w + 1``. So a rejected draft is harmless
iff ``L + k - C < L - w + 1``: ``C >= w + k``, slack ``k``. With prefix caching both hold at
once: the block a draft starts may take a fresh block, and the old one must have expired
for every query from ``L`` on, so the slacks add up, ``b - 1 + k``::

    b = 2, w = 4, k = 2:  R = 2 (C = 4): the sequence holds 0..5; a step feeds 6 and drafts
                          7, 8; draft 8 lands on position 4's slot; both drafts are
                          rejected, and the next query, at 7, reads 4..6: position 4 is gone
                          R = 3 (C = 6): draft 8 lands on position 2's slot, read by no
                          query from 6 on (tests/test_spec_decode.py narrates both)
"""

from __future__ import annotations


def ring_slack(block_size: int, prefix_caching: bool, speculative_tokens: int = 0) -> int:
    """Tokens a ring holds beyond its window (see the module's note): ``b - 1`` with prefix
    caching, plus ``k`` with ``k`` speculative tokens."""
    if speculative_tokens < 0:
        raise ValueError(f"speculative tokens must be >= 0, got {speculative_tokens}")
    return (block_size - 1 if prefix_caching else 0) + speculative_tokens


def ring_length(window: int | None, block_size: int, slack: int = 0) -> int | None:
    """Blocks in a ring for ``window`` tokens: ``ceil((window + slack) / block_size)``, None
    for full attention (see the module's note on slack)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if window is None:
        return None
    if window < 1:
        raise ValueError(f"sliding window must be >= 1 or None, got {window}")
    if slack < 0:
        raise ValueError(f"ring slack must be >= 0, got {slack}")
    return -(-(window + slack) // block_size)


def blocks_for_tokens(num_tokens: int, block_size: int, ring_blocks: int | None) -> int:
    """Blocks a sequence of ``num_tokens`` tokens holds: ``min(ceil(n / b), R)``.

    This one function both predicts a request's reservation and decides when a table takes
    a new block, so the two cannot disagree.
    """
    needed = -(-num_tokens // block_size)
    return needed if ring_blocks is None else min(needed, ring_blocks)


def table_index(position: int, block_size: int, ring_blocks: int | None) -> int:
    """Entry of the table row that holds ``position``: ``(p // b) % R`` (or ``p // b``)."""
    logical = position // block_size
    return logical if ring_blocks is None else logical % ring_blocks


def recycles_between(old_len: int, new_len: int, block_size: int, ring_blocks: int | None) -> int:
    """Physical blocks reused in place when a sequence grows from ``old_len`` to ``new_len``.

    A block is recycled each time a logical block ``k >= R`` is started.
    """
    if ring_blocks is None:
        return 0
    started_before = -(-old_len // block_size)
    started_after = -(-new_len // block_size)
    return max(0, started_after - max(started_before, ring_blocks))


def overwrites_between(old_len: int, new_len: int, capacity: int | None) -> int:
    """Positions stored in ``[old_len, new_len)`` that displace an expired one (``p >= C``)."""
    if capacity is None:
        return 0
    return max(0, new_len - max(old_len, capacity))
