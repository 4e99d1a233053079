"""Greedy decoding's compiled pick (`kernels.cpu_sample.first_max`) against torch's own
``max(dim=-1).indices``: the first maximum of every row, ties, -inf, NaN, every variant."""

from __future__ import annotations

import pytest
import torch

from ringserve.kernels import cpu_build
from ringserve.kernels.cpu_sample import first_max

DTYPES = [torch.float32, torch.bfloat16]


def _check(x: torch.Tensor) -> None:
    got = first_max(x)
    assert got.dtype == torch.int64 and got.shape == x.shape[:1]
    torch.testing.assert_close(got, x.max(dim=-1).indices, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [1, 7, 16, 17, 16383, 16384, 16385, 262144, 100003])
def test_random_rows(cpu_variant: str, dtype: torch.dtype, cols: int) -> None:
    gen = torch.Generator().manual_seed(cols)
    _check(torch.randn(5, cols, generator=gen).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_take_the_first_maximum(cpu_variant: str, dtype: torch.dtype) -> None:
    """The maximum repeated in several lanes, in several chunks (16,384 elements each) and
    at the tail: the earliest index wins, as torch's."""
    cols = 3 * 16384 + 21
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, cols, generator=gen).to(dtype)
    spots = [[5, 21, 16384 + 2, cols - 1], [16384 + 7, 2 * 16384 + 7], [cols - 3, cols - 1],
             [0, 1, 2], [16, 32], [2 * 16384 - 1, 2 * 16384], [cols - 20, 17], [3, 16383]]
    for r, where in enumerate(spots):
        x[r, where] = 9.0
    _check(x)
    x = torch.zeros(3, cols, dtype=dtype)  # every value the maximum
    _check(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_infinite_rows(cpu_variant: str, dtype: torch.dtype) -> None:
    x = torch.full((4, 40000), float("-inf"), dtype=dtype)
    x[1, 39999] = -1e30
    x[2, 123] = float("inf")
    x[2, 30000] = float("inf")
    x[3, 16390] = 0.0
    _check(x)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_with_nan_is_torchs_answer(cpu_variant: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, 50000, generator=gen).to(dtype)
    x[1, 777] = float("nan")
    x[3, 49999] = float("nan")
    x[3, 20000] = float("nan")
    got = first_max(x)
    want = x.max(dim=-1).indices
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert int(got[1]) == 777  # the NaN's index, not the largest number's


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_op_itself_answers_nan_rows_as_torch(cpu_variant: str, dtype: torch.dtype) -> None:
    """The op (not only the wrapper) gives torch's answer for a row holding NaN (the first
    NaN's index: torch's max propagates it), whichever chunk the NaN is in, and its own
    for the other rows."""
    x = torch.randn(4, 40000, generator=torch.Generator().manual_seed(6)).to(dtype)
    x[1, 5] = float("nan")
    x[2, 39999] = float("nan")
    x[2, 20000] = float("nan")
    x[2, 30000] = 1e4
    got = cpu_build.ops(cpu_variant).first_max(x)
    assert got.tolist() == x.max(dim=-1).indices.tolist()
    assert got.tolist()[1:3] == [5, 20000]


def test_strided_rows_and_other_inputs() -> None:
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(6, 3000, generator=gen)
    _check(wide[:, 1000:2000])  # rows a stride apart
    _check(wide[::2])
    _check(wide.t().contiguous().t())  # non-unit last stride: copied first
    _check(torch.randn(0, 10))
    _check(torch.randn(4, 300, generator=gen).double())  # not compiled: torch's
    _check(torch.randn(4, 300, generator=gen).half())
