"""The sampler: greedy picks on low-precision logits need no float32 copy; draws follow
the distribution (counted), from one uniform per row."""

from __future__ import annotations

import torch

from ringserve.engine.sampler import Sampler, inverse_cdf
from ringserve.engine.sampling_params import SamplingParams
from ringserve.engine.sequence import Sequence


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


def test_inverse_cdf_draws_the_distribution_and_never_a_zero_weight() -> None:
    """Chunked running sums over a 262,144-token row: draws follow the weights (counted),
    and tokens of weight 0 (masked, padding) are never drawn, even for u at the ends."""
    vocab = 262_144
    ids = torch.tensor([0, 1023, 1024, 5000, 131_071, vocab - 1])
    weights = torch.zeros(vocab)
    weights[ids] = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 5.0])
    n = 20_000
    uniform = torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    uniform[:2] = torch.tensor([0.0, 1.0 - 2**-53], dtype=torch.float64)
    drawn = inverse_cdf(weights.expand(n, -1), uniform)
    counts = torch.bincount(drawn, minlength=vocab)
    assert counts.sum() == counts[ids].sum()
    assert torch.allclose(counts[ids] / n, weights[ids] / weights.sum(), atol=0.01)
    odd = torch.zeros(3, 320)  # a vocabulary the chunk does not divide
    odd[:, 319] = 1.0
    assert inverse_cdf(odd, torch.tensor([0.0, 0.5, 0.99], dtype=torch.float64)).tolist() \
        == [319, 319, 319]


def test_temperature_sampling_follows_the_softmax() -> None:
    logits = torch.tensor([1.0, 0.0, -1.0, float("-inf")]).repeat(6000, 1)
    seqs = [Sequence(seq_id=i, request_id="r", index=0, token_ids=[1], num_prompt_tokens=1,
                     params=SamplingParams(temperature=0.7, seed=i), max_tokens=4,
                     detokenizer=None) for i in range(6000)]
    tokens, _ = Sampler()(logits, seqs)
    freq = torch.bincount(torch.tensor(tokens), minlength=4) / len(tokens)
    assert torch.allclose(freq, torch.softmax(logits[0] / 0.7, dim=0), atol=0.02)
    again, _ = Sampler()(logits, seqs)  # seeded rows draw the same again
    assert again == tokens
