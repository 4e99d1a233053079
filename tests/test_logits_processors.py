"""Penalties, biases, min-p, min-tokens and bad words against transformers' logits
processors.

The same logits go through ours (`engine.logits_processors`, batched) and through
transformers' own processors (or, for OpenAI's frequency and presence penalties, which
transformers does not have, the formula of OpenAI's documentation in float64).
"""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from ringserve.engine import LLM, logits_processors
from ringserve.engine.sampler import Sampler
from ringserve.engine.sampling_params import SamplingParams
from ringserve.engine.sequence import Sequence
from tests.tiny_models import hf_reference, make_checkpoint, random_tokens

VOCAB = 64
EOS = 2


def _seq(prompt: list[int], output: list[int], **params: object) -> Sequence:
    return Sequence(seq_id=0, request_id="r", index=0, token_ids=prompt + output,
                    num_prompt_tokens=len(prompt), params=SamplingParams(**params),  # type: ignore[arg-type]
                    max_tokens=32, detokenizer=None)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _ours(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    out = logits.clone()
    logits_processors.apply(out, seqs, [EOS])
    return out


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_equals_transformers(penalty: float) -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    prompt, output = _tokens(12, 2), _tokens(7, 3)
    ids = torch.tensor([prompt + output])
    expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    got = _ours(logits, [_seq(prompt, output, repetition_penalty=penalty)])
    torch.testing.assert_close(got, expected)


def test_frequency_and_presence_penalties_follow_openai() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(4))
    prompt, output = _tokens(10, 5), [7, 7, 7, 9, 9, 11]
    got = _ours(logits, [_seq(prompt, output, frequency_penalty=0.7, presence_penalty=-1.1)])
    ref = logits.double().clone()
    for token in set(output):  # OpenAI: mu[j] - c[j] * a_freq - float(c[j] > 0) * a_pres
        ref[0, token] -= output.count(token) * 0.7 + 1.0 * -1.1
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=1e-6)
    assert got[0, prompt[0]] == logits[0, prompt[0]] or prompt[0] in output  # prompt: free


def test_logit_bias_equals_transformers_sequence_bias() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(6))
    bias = {5: 100.0, 9: -100.0, 30: 2.5}
    ids = torch.tensor([_tokens(4, 7)])
    expected = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])(
        ids, logits.clone())
    got = _ours(logits, [_seq(ids[0].tolist(), [], logit_bias=bias)])
    torch.testing.assert_close(got, expected)


def test_min_tokens_equals_transformers_min_new_tokens() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(8))
    prompt = _tokens(5, 9)
    for made in range(5):
        output = _tokens(made, 10)
        ids = torch.tensor([prompt + output])
        expected = MinNewTokensLengthLogitsProcessor(len(prompt), 3, EOS)(ids, logits.clone())
        got = _ours(logits, [_seq(prompt, output, min_tokens=3)])
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_equals_transformers(min_p: float) -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(11)) * 2
    scaled = logits / 0.7
    expected = MinPLogitsWarper(min_p)(torch.tensor([[1], [1]]), scaled.clone())
    seqs = [_seq([1], [], min_p=min_p, temperature=0.7) for _ in range(2)]
    got = logits_processors.min_p_mask(scaled, seqs)
    assert torch.equal(torch.isinf(got), torch.isinf(expected))
    torch.testing.assert_close(got[~torch.isinf(got)], expected[~torch.isinf(expected)])


def test_a_batch_of_rows_is_each_row_alone() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(12))
    seqs = [
        _seq(_tokens(6, 13), _tokens(3, 14), repetition_penalty=1.5, presence_penalty=0.5),
        _seq(_tokens(6, 15), _tokens(2, 16)),  # nothing asked: unchanged
        _seq(_tokens(6, 17), _tokens(1, 18), logit_bias={3: 4.0}, min_tokens=2),
        _seq(_tokens(6, 19), _tokens(5, 20), frequency_penalty=2.0),
    ]
    together = _ours(logits, seqs)
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(together[i : i + 1], _ours(logits[i : i + 1], [seq]))
    torch.testing.assert_close(together[1], logits[1])


def test_greedy_rows_pick_from_processed_logits_and_report_raw_logprobs() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 10] = 5.0
    seqs = [_seq([1], [], temperature=0.0, logit_bias={20: 100.0}, logprobs=0),
            _seq([1], [], temperature=0.0)]
    tokens, logprobs = Sampler([EOS])(logits.to(torch.bfloat16), seqs)
    assert tokens == [20, 10]
    record = logprobs[0]
    assert record is not None  # vLLM's default: logprobs of the model, before processing
    assert abs(record.logprob - float(torch.log_softmax(logits[0], -1)[20])) < 1e-5


# -- bad_words ----------------------------------------------------------------------------

BAD_WORDS = [[5], [7, 8], [9, 10, 11], [12, 8]]  # one token; two; three; another ending in 8
# the prompt holds none of their tokens, so transformers (which also looks at the prompt)
# and vLLM (only at generated tokens) agree on every history below
BAD_PROMPT = [20, 21, 22, 23]
HISTORIES = [[], [7], [3, 7], [9], [4, 9, 10], [9, 10, 7], [10], [12], [9, 10, 11, 5],
             [7, 8, 12]]


@pytest.mark.parametrize("output", HISTORIES)
def test_bad_words_equal_transformers_no_bad_words(output: list[int]) -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(21))
    ids = torch.tensor([BAD_PROMPT + output])
    expected = NoBadWordsLogitsProcessor(BAD_WORDS)(ids, logits.clone())
    seq = _seq(BAD_PROMPT, output, bad_words=["unused: the ids are set below"])
    seq.bad_words_ids = BAD_WORDS
    got = _ours(logits, [seq])
    torch.testing.assert_close(got, expected)
    assert bool(torch.isneginf(got[0, 5]))  # a one-token word is always banned
    assert bool(torch.isneginf(got[0, 8])) == (output[-1:] in ([7], [12]))
    assert bool(torch.isneginf(got[0, 11])) == (output[-2:] == [9, 10])


def test_bad_words_in_a_batch_touch_only_their_rows() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(22))
    outputs = [[3, 7], [9, 10], [7]]
    seqs = [_seq(BAD_PROMPT, out, bad_words=["w"]) for out in outputs]
    seqs[0].bad_words_ids, seqs[1].bad_words_ids = BAD_WORDS, [[9, 10, 11]]
    got = _ours(logits, seqs)
    for row, out in enumerate(outputs):
        words = seqs[row].bad_words_ids
        ids = torch.tensor([BAD_PROMPT + out])
        expected = NoBadWordsLogitsProcessor(words)(ids, logits[row : row + 1].clone()) \
            if words else logits[row : row + 1]
        torch.testing.assert_close(got[row : row + 1], expected)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_checkpoint("mistral", tmp_path_factory.mktemp("ckpt"))


def single_token_word(tok: Any, tokens: list[int]) -> tuple[str, list[list[int]]]:
    """The first of ``tokens`` whose text is a word of that one token, and what vLLM bans
    for it: the word's token, and its token with a leading space if that is one too."""
    for t in tokens:
        word = tok.decode([t]).strip()
        if not word:
            continue
        plain = tok.encode(word, add_special_tokens=False)
        spaced = tok.encode(" " + word, add_special_tokens=False)
        banned = [plain] + ([spaced] if len(spaced) == 1 and spaced != plain else [])
        if len(plain) == 1 and [t] in banned:
            return word, banned
    raise AssertionError("no generated token is a one-token word")


def test_a_bad_word_never_comes_under_greedy_as_in_transformers(
        mistral: pathlib.Path) -> None:
    llm = LLM(str(mistral), dtype="float32", block_size=4, kv_cache_memory="4MiB",
              max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, debug_kv=True)
    prompt = random_tokens(10, seed=23)
    greedy = dict(temperature=0.0, ignore_eos=True, max_tokens=16)
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(**greedy))[0]
    word, banned = single_token_word(llm.tokenizer, plain.outputs[0].token_ids)
    out = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(bad_words=[word], **greedy))[0].outputs[0].token_ids
    assert not {ids[0] for ids in banned} & set(out)
    assert out != plain.outputs[0].token_ids
    model = hf_reference(mistral)
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16,
                             do_sample=False, bad_words_ids=banned)
    assert out == ref[0, len(prompt):].tolist()
