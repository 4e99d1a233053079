"""The served default of ``--max-num-batched-tokens``: 512 on the CPU, 2048 on CUDA."""

from __future__ import annotations

import pytest
import torch

from ringserve.server import cli
from ringserve.server.state import CPU_STEP_TOKENS, ServeArgs


def _serve(*flags: str) -> ServeArgs:
    return cli._serve_args(cli.build_parser().parse_args(["serve", *flags]))


def test_unset_on_the_cpu_is_512_or_max_num_seqs() -> None:
    assert CPU_STEP_TOKENS == 512
    assert _serve("--device", "cpu").step_tokens() == 512
    assert _serve("--device", "cpu", "--max-num-seqs", "600").step_tokens() == 600
    assert _serve("--device", "cpu").engine_kwargs()["max_num_batched_tokens"] == 512


def test_a_flag_or_config_value_wins() -> None:
    assert _serve("--device", "cpu", "--max-num-batched-tokens", "2048").step_tokens() == 2048
    assert ServeArgs(model="m", device="cpu", max_num_batched_tokens=96).step_tokens() == 96


def test_cuda_keeps_vllms_2048(monkeypatch: pytest.MonkeyPatch) -> None:
    from ringserve.engine import startup
    from ringserve.server import state

    monkeypatch.setattr(state, "_nvidia_device_nodes", lambda: True)
    monkeypatch.setattr(startup, "pick_device", lambda name: torch.device("cuda"))
    assert _serve().step_tokens() == 2048
    # no NVIDIA device node: no CUDA, decided without asking torch (cli.serve starts the
    # engine core before this process imports torch)
    monkeypatch.setattr(state, "_nvidia_device_nodes", lambda: False)
    assert _serve().step_tokens() == CPU_STEP_TOKENS
