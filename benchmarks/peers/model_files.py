"""The gemma-3-270m weights every row serves: the preset's GGUF dequantized once into an HF
folder of bf16 safetensors (what vLLM and llama.cpp's bf16 row read; ringserve serves the
GGUF itself), and how many bytes a decode step reads from each row's format."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from paths import MODEL


def hf_folder() -> Path:
    """The preset exported once by ringserve's loader (~1 min the first time)."""
    from ringserve.engine.loading.convert import export_hf_folder

    return export_hf_folder(MODEL)


def parameter_count(folder: Path) -> int:
    """Parameters in the folder's safetensors files, read from their headers only."""
    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for dim in entry["shape"]:
                    count *= dim
                total += count
    return total
