"""Shared pytest set-up.

NOTE: Triton's CPU interpreter must be chosen before any module that defines a `@triton.jit`
kernel is imported, or a launch fails with "0 active drivers". Without a CUDA device the
kernels run under the interpreter; with one, they run for real.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

# NOTE: before torch loads OpenMP (see engine/__init__.py): passive waits keep tests and
# the servers they start from spinning against each other on a shared machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

# NOTE: first, so that no test module's transformers import finds the repository's
# kernels/ folder as Hugging Face's `kernels` package (ringserve/__init__.py says why).
import ringserve  # noqa: F401

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # block_manager tests need no torch
    _HAS_CUDA = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _HAS_CUDA:
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # NOTE: the marker, not the keyword: a parametrize id "gpu" is a keyword too.
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


@pytest.fixture
def engines() -> Iterator[list[Any]]:
    """Register `engine.LLM`s here; after the test each must have missed no ring read,
    preempted nothing and given every block back."""
    made: list[Any] = []
    yield made
    for llm in made:
        stats = llm.stats()
        assert stats["kv_read_misses"] == 0 and stats["num_preemptions"] == 0
        assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_reserved"] == 0


def _variants() -> list[str]:
    try:
        from ringserve.kernels import cpu_build
    except ImportError:  # block_manager tests need no torch
        return []
    return cpu_build.tested_variants()


@pytest.fixture(params=_variants())
def cpu_variant(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each kernel variant this CPU can execute (`kernels.cpu_isa`), as if the process ran
    on a CPU of that class: every op, the oneDNN packing choice and the auto dtype follow.
    On an AMX machine this tests the AVX2 and portable paths an AVX2-only machine serves;
    on an AVX2 machine, the AVX-512 variants too, in software (`cpu_build.emulated`), with
    oneDNN's choices those of the real CPU.

    A test may also ask for "amx" (only on a CPU with AMX): the avx512_bf16 build with its
    AMX tiles on, as the amx class runs."""
    from ringserve.kernels import cpu_build, cpu_isa

    variant: str = request.param
    real = cpu_isa.info()
    monkeypatch.setattr(cpu_isa, "info", lambda: dataclasses.replace(real, cls=variant))
    build = cpu_isa.info().variant
    if not cpu_build.available(build):
        pytest.fail(f"the {build} CPU kernels did not build")
    was = cpu_build.amx(build)
    if was != (variant == "amx"):  # the avx512_bf16 class has no AMX: its dpbf16 tiles
        assert cpu_build.set_amx(variant == "amx", build) == (variant == "amx")
        request.addfinalizer(lambda: cpu_build.set_amx(was, build))
    return variant
