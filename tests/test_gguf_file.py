"""A GGUF file read as stored: our header parser against gguf-py's, tensor bytes read one
at a time, and a GGUF model loaded without a folder of weights, its loader's peak the model
plus about one tensor (docs/design.md §12).

The files are llama.cpp's own conversions (`tests.llamacpp_convert`) of tiny checkpoints.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from ringserve.engine.loading import file_read, load_model
from ringserve.engine.loading.convert import resolve_model
from ringserve.engine.loading.errors import ModelLoadError
from ringserve.engine.loading.find import gguf_weights_file
from ringserve.engine.loading.gguf_blocks import repack, repack_rows
from ringserve.engine.loading.gguf_file import GgufFile
from ringserve.engine.memory_plan import MiB
from ringserve.engine.models.quant_linear import QuantEmbedding, QuantLinear
from ringserve.kernels import cpu_build
from tests import llamacpp_convert
from tests.test_memory_plan import LOADER, ROOT
from tests.tiny_models import make_checkpoint

LLAMA = dict(vocab_size=32768, hidden_size=1024, intermediate_size=1024,
             num_attention_heads=8, num_key_value_heads=2)


@pytest.fixture(scope="module")
def llama_q8(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """llama.cpp's Q8_0 GGUF of a llama with a 32k x 1024 embedding (untied: the head in its
    own Q8_0 tensor)."""
    root = tmp_path_factory.mktemp("gguf-file")
    folder = make_checkpoint("llama", root, overrides={**LLAMA, "tie_word_embeddings": False})
    return llamacpp_convert.convert(folder, root / "llama-q8_0.gguf", "q8_0")


def test_the_header_reads_as_gguf_py_reads_it(llama_q8: pathlib.Path) -> None:
    ours, theirs = GgufFile(llama_q8), gguf.GGUFReader(str(llama_q8))
    fields = {k: v.contents() for k, v in theirs.fields.items() if not k.startswith("GGUF.")}
    assert fields.keys() == ours.fields.keys()
    for key, value in fields.items():
        got = ours.fields[key].contents()
        assert got == pytest.approx(value) if isinstance(value, float) else got == value, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    kinds = set()
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        kinds.add(a.tensor_type.name)
        assert (a.tensor_type, list(a.shape), a.data_offset, a.n_bytes) == \
            (b.tensor_type, list(b.shape), b.data_offset, b.n_bytes), a.name
        assert a.data.shape == b.data.shape and np.array_equal(a.data, np.asarray(b.data))
    assert kinds == {"Q8_0", "F32"}


def test_blocks_repacked_a_few_rows_at_a_time_equal_the_whole(llama_q8: pathlib.Path,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    """`GgufTensor.row_chunks` in chunks that end mid-window and mid-row-group, through
    windows of `file_read.read_at` that start off any page: the same blocks as the tensor
    read whole and repacked at once, and the same bytes as gguf-py reads."""
    monkeypatch.setattr(file_read, "WINDOW", 3 * 4096 + 5)
    ours, theirs = GgufFile(llama_q8), gguf.GGUFReader(str(llama_q8))
    theirs_by_name = {t.name: t for t in theirs.tensors}
    checked = 0
    for tensor in ours.tensors:
        if tensor.tensor_type.name != "Q8_0" or len(tensor.shape) != 2:
            continue
        k, n = (int(d) for d in tensor.shape)
        chunks = list((first, rows.copy()) for first, rows in tensor.row_chunks(
            chunk_bytes=5 * 3 * 1088 + 17, multiple=3))  # 5 groups of 3 rows
        assert [first for first, _ in chunks] == list(range(0, n, 15))
        whole = np.asarray(theirs_by_name[tensor.name].data).reshape(n, -1)
        assert np.array_equal(np.concatenate([rows for _, rows in chunks]), whole)
        a = repack_rows(tensor.tensor_type, chunks, (n, k))
        b = repack(tensor.tensor_type, whole, (n, k))
        assert a is not None and b is not None
        assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales)
        checked += 1
    assert checked >= 7


def test_read_at_copies_across_windows_and_refuses_a_short_file(tmp_path: pathlib.Path,
                                                                monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    data = np.random.default_rng(0).integers(0, 256, 3 * 65536 + 123, dtype=np.uint8)
    path = tmp_path / "x.bin"
    path.write_bytes(data.tobytes())
    monkeypatch.setattr(file_read, "WINDOW", 65536 + 7)  # several windows, none aligned
    with path.open("rb") as handle:
        for offset, size in [(0, data.size), (5, 70000), (65535, 131073), (data.size - 1, 1)]:
            out = np.empty(size, np.uint8)
            assert file_read.read_at(handle.fileno(), offset, out)
            assert np.array_equal(out, data[offset:offset + size]), (offset, size)
        assert not file_read.read_at(handle.fileno(), data.size - 10, np.empty(11, np.uint8))


def test_a_truncated_or_foreign_file_is_refused(llama_q8: pathlib.Path,
                                                tmp_path: pathlib.Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(llama_q8.read_bytes()[: llama_q8.stat().st_size - 1000])
    with pytest.raises(ModelLoadError, match="is truncated: tensor"):
        GgufFile(cut)
    (tmp_path / "x.gguf").write_bytes(b"PK\3\4" + bytes(100))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        GgufFile(tmp_path / "x.gguf")


def test_the_model_folder_holds_no_weights(llama_q8: pathlib.Path,
                                           tmp_path: pathlib.Path) -> None:
    """resolve_model keeps what the metadata says, never the weights; the model is served
    from the file's own Q8_0 blocks (its untied embedding too)."""
    folder = resolve_model(llama_q8, cache_dir=tmp_path).path
    assert gguf_weights_file(folder) == llama_q8
    assert not list(folder.glob("**/*.safetensors"))
    on_disk = sum(p.stat().st_size for p in folder.glob("**/*") if p.is_file())
    assert on_disk < 2 * MiB  # config, tokenizer, the parameters' names
    model = load_model(folder, dtype=torch.float32, quantization="gguf")
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    assert model.model.embed_tokens.owned
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert linears and all((m.bits, m.group) == (8, 32) for m in linears)
    assert not any(type(m) is torch.nn.Linear for m in model.modules())


@pytest.mark.skipif(not cpu_build.available(), reason="needs the CPU kernels (a C++ compiler)")
def test_a_gguf_loads_peaking_at_the_model_plus_about_one_tensor(
        llama_q8: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """Loaded from the GGUF (not a folder of weights): the model holds the file's own bytes
    (Q8_0 repacked is the same 34 bytes a block), and the loader's peak is the model plus
    about its largest tensor (read, then repacked)."""
    folder = resolve_model(llama_q8, cache_dir=tmp_path).path
    out = subprocess.run([sys.executable, "-c", LOADER, str(folder), "gguf"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    stored = sum(t.n_bytes for t in GgufFile(llama_q8).tensors)
    assert stored * 0.95 <= m["held"] <= stored * 1.05, (m, stored)
    largest = max(t.n_bytes for t in GgufFile(llama_q8).tensors)
    slack = 48 * MiB  # libraries' own lazy allocations and the allocator's rounding
    assert m["peak"] - m["before"] <= m["held"] + largest + slack, m
    assert m["after"] - m["before"] <= m["held"] + slack, m
