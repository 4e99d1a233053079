"""The real sliding-window model: gemma-3-270m (window 512, five sliding : one full).

A prompt longer than the window plus 200 greedy tokens, through our model over ring KV
caches (NaN-poisoned, every read checked against a shadow of slot owners), must be
token-identical to transformers' ``generate`` on the same converted folder, in float32.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.model_harness import RingHarness, load_ours
from tests.presets import preset_path

STORY = (
    "Once upon a time, there was a little girl named Lily who lived in a small house at the "
    "edge of a great forest. Every morning she walked to the river with her grandmother to "
    "fetch water, and every evening they sat by the fire and told each other stories about "
    "the animals they had seen: a fox with a white tail, an owl that never slept, and a "
    "family of deer that drank from the river at dawn. "
)


@pytest.mark.slow
def test_gemma_270m_past_the_window_matches_transformers() -> None:
    path = preset_path("gemma-3-270m")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    prompt = tokenizer(STORY * 8 + "One day, Lily")["input_ids"]
    assert len(prompt) > 512 + 64  # the ring has wrapped before the first new token
    new = 200
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa").eval()
    assert ref.config.sliding_window == 512
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False)
    expected = out[0, len(prompt):].tolist()
    del ref
    harness = RingHarness(load_ours(str(path)), 16, len(prompt) + new)
    assert harness.windows == [512, None]
    assert harness.greedy(prompt, new) == expected
    stats = harness.kv.stats()
    assert stats.ring_slot_overwrites > 0 and stats.read_misses == 0
