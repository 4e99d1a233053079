"""`kernels.hugepages`: the greedy head's copies (`huge_copy`), the quantized layers' weights
and copies (`HugeArena`, `engine.models.linear_copies.place_on_huge_pages`) and the KV slabs
(`huge_zeros`) on 2 MiB pages where Linux offers transparent huge pages. References: the
tensors copied, the kernel's own account of each mapping (/proc/self/smaps: its VmFlags say
`hg` for memory advised MADV_HUGEPAGE), and the same model on ordinary pages
(``RINGSERVE_HUGE_PAGES=0``), whose tokens and logprobs must be the same bits."""

from __future__ import annotations

import mmap
import pathlib
import re

import pytest
import torch

from ringserve.engine import LLM, SamplingParams
from ringserve.engine.models.quant_linear import QuantLinear
from ringserve.kernels import cpu_isa, cpu_quant, hugepages
from ringserve.kernels.hugepages import HUGE_PAGE, HugeArena, huge_copy, huge_zeros
from tests.tiny_models import make_checkpoint, random_tokens

THP = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    try:
        found = re.search(r"\[(\w+)\]", THP.read_text())
    except OSError:
        return None
    return found.group(1) if found else None


def _mapping_of(address: int) -> tuple[int, str, set[str]]:
    """The start, permissions (`rw-p`: private) and VmFlags of the mapping that holds
    ``address``."""
    current: tuple[int, int, str] | None = None
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) ", line)
        if head:
            current = (int(head.group(1), 16), int(head.group(2), 16), head.group(3))
        elif line.startswith("VmFlags:") and current and current[0] <= address < current[1]:
            return current[0], current[2], set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def _flags_of(address: int) -> tuple[str, set[str]]:
    _, perms, flags = _mapping_of(address)
    return perms, flags


NO_THP = pytest.mark.skipif(_thp_mode() not in ("always", "madvise"),
                            reason="this kernel offers no transparent huge pages "
                                   "(/sys/kernel/mm/transparent_hugepage/enabled is never "
                                   "or absent)")


def test_a_copy_holds_the_same_values_in_the_same_shape() -> None:
    t = torch.arange(3 * HUGE_PAGE // 4, dtype=torch.int32).view(3, -1)
    view = t.t()  # not contiguous: copied in its own order
    out = huge_copy(view)
    assert out.is_contiguous() and out.shape == view.shape and out.dtype == view.dtype
    assert torch.equal(out, view)
    out[0, 0] = -1  # its own memory, writable
    assert int(t[0, 0]) == 0
    small = torch.arange(10)
    assert torch.equal(huge_copy(small), small)


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"),
                    reason="this kernel offers no transparent huge pages "
                           "(/sys/kernel/mm/transparent_hugepage/enabled is never or absent)")
def test_the_copy_is_advised_for_huge_pages_and_aligned_to_them() -> None:
    out = huge_copy(torch.ones(4 * HUGE_PAGE, dtype=torch.int8))
    assert out.data_ptr() % HUGE_PAGE == 0
    perms, flags = _flags_of(out.data_ptr())
    # private: Linux gives shared anonymous memory huge pages only by shmem_enabled
    assert "hg" in flags and perms.endswith("p")
    # a private map of the same size not advised says no `hg` (so the check can fail)
    # NOTE: not a plain tensor: in a full test run torch's own large allocations came
    # advised too (`hg`), whoever asked for it.
    bare = mmap.mmap(-1, 4 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = torch.frombuffer(bare, dtype=torch.int8)
    view[0] = 1  # touched, so that the mapping is there
    assert "hg" not in _flags_of(view.data_ptr())[1]


def test_an_arena_holds_copies_aligned_one_after_another() -> None:
    parts = [torch.arange(1000, dtype=torch.int8), torch.randn(3, 700).t(),
             torch.randn(5, 64).to(torch.bfloat16), torch.arange(7, dtype=torch.int16)]
    arena = HugeArena(sum(HugeArena.span(t) for t in parts))
    placed = [arena.place(t) for t in parts]
    for got, want in zip(placed, parts, strict=True):
        assert got.is_contiguous() and got.dtype == want.dtype and torch.equal(got, want)
        assert got.data_ptr() % HugeArena.ALIGN == 0
    ptrs = [t.data_ptr() for t in placed]
    assert ptrs == sorted(ptrs) and ptrs[-1] - ptrs[0] < arena.nbytes  # one run of memory
    placed[0][0] = 99  # their own memory
    assert int(parts[0][0]) == 0
    with pytest.raises(ValueError, match="bytes left"):
        arena.place(torch.ones(1))


@NO_THP
def test_the_arena_is_one_mapping_advised_for_huge_pages() -> None:
    parts = [torch.ones(3 << 20, dtype=torch.int8), torch.ones(100, dtype=torch.float32)]
    arena = HugeArena(sum(HugeArena.span(t) for t in parts))
    a, b = (arena.place(t) for t in parts)
    assert a.data_ptr() % HUGE_PAGE == 0
    start_a, perms, flags = _mapping_of(a.data_ptr())
    assert "hg" in flags and perms.endswith("p")
    assert _mapping_of(b.data_ptr())[0] == start_a


@NO_THP
def test_zeros_on_huge_pages_and_the_knob_that_keeps_ordinary_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    t = huge_zeros((4, HUGE_PAGE // 8), torch.bfloat16)
    assert t.shape == (4, HUGE_PAGE // 8) and t.dtype == torch.bfloat16
    assert not t.any() and t.data_ptr() % HUGE_PAGE == 0
    assert "hg" in _flags_of(t.data_ptr())[1]
    monkeypatch.setenv("RINGSERVE_HUGE_PAGES", "0")
    assert not hugepages.offered()

    def refused(nbytes: int) -> None:
        raise AssertionError("asked for huge pages under RINGSERVE_HUGE_PAGES=0")

    monkeypatch.setattr(hugepages, "_advised", refused)
    plain = huge_zeros((4, HUGE_PAGE // 8), torch.bfloat16)
    assert not plain.any() and plain.shape == (4, HUGE_PAGE // 8)


def _greedy(path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
            huge: bool) -> tuple[list[list[int]], list[list[float]], LLM]:
    monkeypatch.setenv("RINGSERVE_HUGE_PAGES", "1" if huge else "0")
    # the layers' tiles too where this CPU keeps them (AVX512-BF16 or AMX, with oneDNN's
    # bf16 packing, which `--packed-rows` asks for); elsewhere the quantized weights alone
    copies = 2 if cpu_quant.has_tiles() and cpu_isa.onednn_bf16_linear() else None
    llm = LLM(str(path), dtype="bfloat16", quantization="int8", packed_rows=copies,
              kv_cache_memory="8MiB", max_model_len=96, max_num_seqs=4)
    prompts = [random_tokens(n, seed=n) for n in (3, 11, 30, 17)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[v for lp in o.outputs[0].logprobs for v in (lp.logprob, *(p for _, p in lp.top))]
                for o in outs]
    return tokens, logprobs, llm


@NO_THP
def test_a_model_on_huge_pages_gives_the_same_bits(tmp_path: pathlib.Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_checkpoint("gemma3_text", tmp_path)
    tokens, logprobs, llm = _greedy(path, monkeypatch, huge=True)
    model = llm.engine.model
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert layers
    placed = [t for m in layers for t in (m.qweight, m.scale_bits, m.qw.qweight,
                                          *(m.tiles or ()), *(m.tiles8 or ()))
              if t.numel()]
    if cpu_quant.has_tiles() and cpu_isa.onednn_bf16_linear():  # copies made, moved too
        assert all(m.tiles is not None for m in layers)
    starts = {_mapping_of(t.data_ptr())[0] for t in placed}
    assert len(starts) == 1  # one mapping, advised
    assert "hg" in _flags_of(placed[0].data_ptr())[1]
    key_cache = llm.engine.runner.caches[0][0]
    assert "hg" in _flags_of(key_cache.data_ptr())[1]
    del llm, model, layers, placed, key_cache
    plain_tokens, plain_logprobs, plain = _greedy(path, monkeypatch, huge=False)
    weight = next(m for m in plain.engine.model.modules() if isinstance(m, QuantLinear))
    assert "hg" not in _flags_of(weight.qweight.data_ptr())[1]
    assert (tokens, logprobs) == (plain_tokens, plain_logprobs)
