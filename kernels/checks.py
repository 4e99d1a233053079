"""Argument checks of the kernel entry points: shapes, dtypes, settings.

Cheap by design: they read only shapes, dtypes, devices and Python numbers, never tensor
values, so they cost no host sync on CUDA tensors. Every failure is a ValueError that names
the argument.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
BACKENDS = ("triton", "cpu", "torch")


def _ndim(name: str, t: torch.Tensor, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")


def _dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{name} has dtype {t.dtype}; expected one of {allowed}")


def _shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


def pick_backend(backend: str | None, query: torch.Tensor) -> str:
    """Resolve `backend`: None means Triton for CUDA tensors, the compiled CPU kernel for
    CPU tensors it supports (`kernels.cpu_attention.supports`), torch otherwise.

    Args:
        backend: "triton", "cpu", "torch" or None.
        query: a tensor of the call, whose device decides when backend is None.

    Returns:
        "triton", "cpu" or "torch".
    """
    if backend is None:
        if query.is_cuda:
            return "triton"
        from ringserve.kernels.cpu_attention import supports

        return "cpu" if supports(query) else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    return backend


def check_sinks(sinks: torch.Tensor | None, query: torch.Tensor) -> None:
    """Sinks, when given, are one floating logit per query head on query's device."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point():
        raise ValueError("sinks must be None or a floating tensor of shape [num_heads]")
    if sinks.shape != (query.shape[1],):
        raise ValueError(f"sinks must have shape [num_heads] = [{query.shape[1]}], "
                         f"got {list(sinks.shape)}")
    if sinks.device != query.device:
        raise ValueError(f"sinks are on {sinks.device}, query on {query.device}")


def check_window(
    sliding_window: int | None, ring_blocks: int | None, block_size: int, table_width: int
) -> None:
    """Check the window / ring settings against each other and the table.

    Args:
        sliding_window: window w or None (full attention).
        ring_blocks: ring length R or None (table indexed by p // b).
        block_size: tokens per cache block.
        table_width: columns of the block table.
    """
    if sliding_window is not None and (isinstance(sliding_window, bool) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if ring_blocks is None:
        return
    if isinstance(ring_blocks, bool) or ring_blocks < 1:
        raise ValueError(f"ring_blocks must be None or an int >= 1, got {ring_blocks!r}")
    if sliding_window is None:
        raise ValueError("ring_blocks needs a sliding_window: a ring cannot serve full attention")
    if ring_blocks * block_size < sliding_window:
        raise ValueError(
            f"ring_blocks * block_size = {ring_blocks * block_size} < sliding_window = "
            f"{sliding_window}: the ring would overwrite positions the window still sees"
        )
    if table_width < ring_blocks:
        raise ValueError(f"block_tables has {table_width} columns < ring_blocks = {ring_blocks}")


def check_attention_args(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """Check the tensors of `paged_attention` (see there for the shapes)."""
    for name, t, nd in (
        ("query", query, 3), ("key", key, 3), ("value", value, 3), ("key_cache", key_cache, 4),
        ("value_cache", value_cache, 4), ("block_tables", block_tables, 2),
        ("query_start_loc", query_start_loc, 1), ("context_lens", context_lens, 1),
    ):  # fmt: skip
        _ndim(name, t, nd)
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, query on {query.device}")
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    _shape("key", key, (num_tokens, num_kv_heads, head_dim))
    _shape("value", value, (num_tokens, num_kv_heads, head_dim))
    num_blocks, block_size = key_cache.shape[:2]
    _shape("key_cache", key_cache, (num_blocks, block_size, num_kv_heads, head_dim))
    _shape("value_cache", value_cache, tuple(key_cache.shape))
    num_seqs = context_lens.shape[0]
    _shape("block_tables", block_tables, (num_seqs, block_tables.shape[1]))
    _shape("query_start_loc", query_start_loc, (num_seqs + 1,))
    _dtype("query", query, FLOAT_DTYPES)
    for name, t in (("key", key), ("value", value)):
        _dtype(name, t, (query.dtype,))
    # NOTE: on the CPU a float32 model may keep its cache in bf16 (kv_cache_dtype).
    cache_dtypes = ((torch.float32, torch.bfloat16)
                    if query.dtype == torch.float32 and not query.is_cuda else (query.dtype,))
    _dtype("key_cache", key_cache, cache_dtypes)
    _dtype("value_cache", value_cache, (key_cache.dtype,))
    for name, t in (("block_tables", block_tables), ("query_start_loc", query_start_loc),
                    ("context_lens", context_lens)):  # fmt: skip
        _dtype(name, t, INDEX_DTYPES)
    if out is not None:
        _ndim("out", out, 3)
        _shape("out", out, tuple(query.shape))
        _dtype("out", out, (query.dtype,))
        if out.device != query.device:
            raise ValueError(f"out is on {out.device}, query on {query.device}")


def check_write_args(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Check the tensors of `write_kv` (see there for the shapes)."""
    for name, t, nd in (("key", key, 3), ("value", value, 3), ("key_cache", key_cache, 4),
                        ("value_cache", value_cache, 4), ("slot_mapping", slot_mapping, 1)):
        _ndim(name, t, nd)
        if t.device != key.device:
            raise ValueError(f"{name} is on {t.device}, key on {key.device}")
    _shape("value", value, tuple(key.shape))
    _shape("key_cache", key_cache, (*key_cache.shape[:2], *key.shape[1:]))
    _shape("value_cache", value_cache, tuple(key_cache.shape))
    _shape("slot_mapping", slot_mapping, (key.shape[0],))
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache),
                    ("value_cache", value_cache)):  # fmt: skip
        _dtype(name, t, FLOAT_DTYPES)
    _dtype("slot_mapping", slot_mapping, INDEX_DTYPES)


def check_unit_stride(name: str, t: torch.Tensor) -> None:
    """The Triton kernels address a cache's last dim as contiguous; a copy would lose writes."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dim, got {t.stride()}")
