"""The sampler on low-precision logits: greedy picks need no float32 copy."""

from __future__ import annotations

import torch

from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def _seq(i: int, **params: object) -> Sequence:
    return Sequence(seq_id=i, request_id=str(i), index=0, token_ids=[1], num_prompt_tokens=1,
                    params=SamplingParams(**params), max_tokens=4, detokenizer=None)  # type: ignore[arg-type]


def test_greedy_on_bf16_logits_is_the_float32_argmax_first_on_ties() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 5000).to(torch.bfloat16)
    logits[0, 10] = logits[0, 20] = 50.0  # a tie: the first index wins, as torch.argmax
    logits[1] = 1.0  # all equal
    seqs = [_seq(i, temperature=0.0) for i in range(6)]
    tokens, logprobs = Sampler()(logits, seqs)
    assert tokens == torch.argmax(logits.float(), dim=-1).tolist()
    assert tokens[0] == 10 and tokens[1] == 0 and logprobs == [None] * 6


def test_logprobs_and_sampled_rows_are_widened_to_float32() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 300).to(torch.bfloat16)
    seqs = [_seq(0, temperature=0.0, logprobs=2), _seq(1, temperature=1.0, top_k=1, seed=3),
            _seq(2, temperature=0.0)]
    tokens, logprobs = Sampler()(logits, seqs)
    wide = logits.float()
    assert tokens == wide.argmax(-1).tolist()  # top_k=1 is greedy
    record = logprobs[0]
    assert record is not None and logprobs[1] is None and logprobs[2] is None
    expected = torch.log_softmax(wide[0], dim=-1)
    assert abs(record.logprob - float(expected[tokens[0]])) < 1e-6
    assert [t for t, _ in record.top] == expected.topk(2).indices.tolist()
