"""Argument checks of `kernels.paged_attention` / `kernels.write_kv`: clear ValueErrors."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from ringserve import kernels
from tests.kernel_utils import Case, make_case


@pytest.fixture
def case() -> Case:
    return make_case([(9, 2), (4, 1)], seed=1)


def _call(case: Case, **changes: object) -> None:
    names = ["query", "key", "value", "key_cache", "value_cache", "block_tables",
             "query_start_loc", "context_lens"]
    tensors = dict(zip(names, case.tensors(), strict=True))
    kwargs: dict[str, object] = {**case.kwargs(), "backend": "torch"}
    for name, value in changes.items():
        (tensors if name in tensors else kwargs)[name] = value
    kernels.paged_attention(*tensors.values(), **kwargs)  # type: ignore[arg-type]


BAD: list[tuple[str, Callable[[Case], dict[str, object]], str]] = [
    ("backend", lambda c: {"backend": "cuda"}, "backend"),
    ("gqa", lambda c: {"query": torch.zeros(3, 3, 16)}, "multiple of num_kv_heads"),
    ("query_ndim", lambda c: {"query": c.query[0]}, "query must have 3 dims"),
    ("key_shape", lambda c: {"key": c.key[..., :8]}, "key must have shape"),
    ("cache_heads", lambda c: {"key_cache": c.key_cache[:, :, :1]}, "key_cache must have shape"),
    ("value_cache", lambda c: {"value_cache": c.value_cache[1:]}, "value_cache must have shape"),
    ("qsl_len", lambda c: {"query_start_loc": c.query_start_loc[:-1]}, "query_start_loc"),
    ("table_rows", lambda c: {"block_tables": c.block_tables[:1]}, "block_tables"),
    ("dtype_mix", lambda c: {"key": c.key.half()}, "key has dtype"),
    ("int_query", lambda c: {"query": c.query.long()}, "query has dtype"),
    ("float_table", lambda c: {"block_tables": c.block_tables.float()}, "block_tables has dtype"),
    ("window_0", lambda c: {"sliding_window": 0, "ring_blocks": None}, "sliding_window"),
    ("ring_no_window", lambda c: {"sliding_window": None}, "ring_blocks needs"),
    ("ring_too_small", lambda c: {"sliding_window": 9}, "overwrite"),
    ("ring_wider_than_table", lambda c: {"ring_blocks": 3, "sliding_window": 8}, "columns"),
    ("softcap_0", lambda c: {"softcap": 0.0}, "softcap"),
    ("sinks_shape", lambda c: {"sinks": torch.zeros(c.query.shape[1] + 1)}, "sinks must have"),
    ("sinks_int", lambda c: {"sinks": torch.zeros(c.query.shape[1], dtype=torch.int64)},
     "floating"),
    ("out_shape", lambda c: {"out": c.query[:1]}, "out must have shape"),
    ("out_dtype", lambda c: {"out": c.query.half()}, "out has dtype"),
]


@pytest.mark.parametrize(("name", "change", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_raise(
    case: Case, name: str, change: Callable[[Case], dict[str, object]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _call(case, **change(case))


def test_triton_on_cpu_needs_interpreter(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        _call(case, backend="triton")


def test_write_kv_bad_arguments() -> None:
    key = torch.zeros(3, 2, 8)
    cache = torch.zeros(4, 2, 2, 8)
    with pytest.raises(ValueError, match="slot_mapping must have shape"):
        kernels.write_kv(key, key, cache, cache, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="key_cache must have shape"):
        kernels.write_kv(key, key, cache[:, :, :1], cache[:, :, :1],
                         torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="slot_mapping has dtype"):
        kernels.write_kv(key, key, cache, cache, torch.zeros(3))
