"""The embedded default, gemma-3-270m, served for real; and the one-shot CLI."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import httpx
import openai
import pytest

from tests.presets import preset_path
from tests.server_utils import ROOT, run_server
from tests.tiny_models import make_checkpoint


@pytest.mark.slow
def test_gemma_270m_serves_a_coherent_completion(tmp_path: pathlib.Path) -> None:
    path = preset_path("gemma-3-270m")
    flags = ("--served-model-name", "gemma-3-270m", "--max-model-len", "2048",
             "--kv-cache-memory", "512MiB", "--dtype", "float32",
             "--kv-cache-dtype", "float32")  # auto is bf16 where int16 activations are on
    with run_server(path, *flags, log_dir=tmp_path) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
        r = client.completions.create(
            model="gemma-3-270m", prompt="Once upon a time, there was a little girl named",
            max_tokens=12, temperature=0)
        assert r.choices[0].text.startswith(" Lily")  # what transformers gives, too
        stream = client.completions.create(
            model="gemma-3-270m", prompt="Once upon a time, there was a little girl named",
            max_tokens=12, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == r.choices[0].text
        with pytest.raises(openai.BadRequestError) as err:  # a base model: no chat template
            client.chat.completions.create(model="gemma-3-270m",
                                           messages=[{"role": "user", "content": "hi"}])
        assert "chat template" in str(err.value)
        metrics = httpx.get(f"{s.url}/metrics").text
        # One KV pool for its 15 sliding (w=512) and 3 full layers: 2 KiB per token and layer
        # in float32, so 512 MiB hold 56 requests of 256 tokens (15 x 256 + 3 x 256 KiB x 2
        # each), 28 of 512 and 18 of 2048 (15 x 512 + 3 x 2048 tokens x 2 KiB each).
        for tokens, fits in ((256, 56), (512, 28), (2048, 18)):
            assert (f'ringserve:max_concurrent_sequences{{model_name="gemma-3-270m",'
                    f'tokens="{tokens}"}} {float(fits)}') in metrics


def test_cli_generate_prints_the_completion(tmp_path: pathlib.Path) -> None:
    path = make_checkpoint("llama", tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "ringserve.server.cli", "generate", "Once upon a time", "--model",
         str(path), "--max-tokens", "5", "--kv-cache-memory", "8MiB", "--max-model-len", "64",
         "--log-level", "warning"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("Once upon a time") and len(out.stdout.strip()) > 16


def test_cli_reports_a_bad_model_without_a_traceback(tmp_path: pathlib.Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ringserve.server.cli", "generate", "hi", "--model",
         str(tmp_path / "missing")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    assert "neither a preset" in out.stderr and "Traceback" not in out.stderr
