"""llama.cpp's own `convert_hf_to_gguf.py`, run on the tiny checkpoints of `tests.tiny_models`.

Its sources come from the llama-cpp-python sdist (`make test` unpacks them, through
`benchmarks/peers/setup_llamacpp.py --sources`). The weights and metadata of the GGUF it
writes are its own; only its tokenizer step is steered: it recognises a byte-level BPE
tokenizer by a hash of how it splits a fixed text, and ours (trained by the tests) is in no
list of known ones, so every model class is told to store it as a plain GPT-2 BPE
vocabulary (`tokenizer.ggml.model = gpt2`, the pre-tokenizer `gpt-2`), which is what it is.

    python tests/llamacpp_convert.py HF_FOLDER OUT.gguf [--outtype f32|q8_0|...]
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ROOT / ".cache" / "peers" / "llamacpp" / "llama.cpp"


def sources() -> Path:
    """The unpacked llama.cpp sources; a clear error when `make test` has not fetched them."""
    if not (SOURCES / "convert_hf_to_gguf.py").is_file():
        raise FileNotFoundError(
            f"llama.cpp's convert_hf_to_gguf.py is not at {SOURCES}: run `make test` (or "
            "`.venv/bin/python benchmarks/peers/setup_llamacpp.py --sources`) to fetch it")
    return SOURCES


def convert(folder: Path, out: Path, outtype: str = "f32") -> Path:
    """Convert an HF folder into ``out`` with llama.cpp's converter (in a subprocess)."""
    cmd = [sys.executable, __file__, str(folder), str(out), "--outtype", outtype]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False,
                          env={**os.environ, "PYTHONPATH": ""})
    if proc.returncode != 0 or not out.is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py failed ({proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    return out


def _main() -> None:
    import importlib
    import inspect
    import pkgutil
    import runpy

    folder, out, *rest = sys.argv[1:]
    root = sources()
    sys.path[:0] = [str(root), str(root / "gguf-py")]  # its own gguf-py, not PyPI's
    import conversion
    from conversion import base

    def gpt2_vocab(self: base.TextModel) -> None:
        self._set_vocab_gpt2()

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    for info in pkgutil.iter_modules(conversion.__path__):
        module = importlib.import_module(f"conversion.{info.name}")
        for obj in vars(module).values():
            if (inspect.isclass(obj) and issubclass(obj, base.TextModel)
                    and "set_vocab" in vars(obj)):
                obj.set_vocab = gpt2_vocab
    script = root / "convert_hf_to_gguf.py"
    sys.argv = [str(script), folder, "--outfile", out, *rest]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    _main()
