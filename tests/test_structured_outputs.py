"""Structured outputs on a random tiny model at temperature 1: whatever the model would say,
the output parses and validates, every time.

The reference for "valid" is not ours: `jsonschema` validates the JSON, Python's `re`
matches the regexes. A random model at temperature 1 wanders over its whole vocabulary, so
any token the grammar wrongly allowed would show up here; the schemas are bounded (string
lengths, item counts) so that every output completes within its token budget.
"""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import jsonschema
import pytest
import torch

from ringserve.engine import LLM, InvalidRequestError, SamplingParams, StructuredOutputsParams
from ringserve.engine.sampler import Sampler
from ringserve.engine.sequence import Sequence
from ringserve.engine.structured_output import StructuredOutputs, unpack
from tests.tiny_models import VOCAB, B, byte_bpe_tokenizer, make_checkpoint

SAMPLES = 8  # continuations per constraint (n), each from its own seed

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested objects": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 6},
                               "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
            },
        },
        "required": ["name", "address"],
    },
    "array with min and max items": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 2, "maxItems": 4,
    },
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}},
        "required": ["color", "size"],
    },
    "required and optional fields": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 1000},
                       "tag": {"type": "string", "maxLength": 4},
                       "ok": {"type": "boolean"}},
        "required": ["id", "ok"],
    },
    "string pattern": {"type": "string", "pattern": "^[A-Z][a-z]{1,6}-[0-9]{2}$"},
    "numbers with bounds": {
        "type": "object",
        "properties": {"i": {"type": "integer", "minimum": -5, "maximum": 5},
                       "x": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["i", "x"],
    },
    "array of objects, anyOf and null": {
        "type": "object",
        "properties": {
            "items": {"type": "array", "maxItems": 3, "items": {
                "type": "object",
                "properties": {"k": {"type": "string", "maxLength": 3},
                               "v": {"anyOf": [{"type": "integer", "minimum": 0,
                                                "maximum": 9}, {"type": "null"}]}},
                "required": ["k", "v"]}},
        },
        "required": ["items"],
    },
}

REGEXES = {
    "date": r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]",
    "email": r"[a-z]{1,8}@[a-z]{1,6}\.(com|org)",
    "ipv4": r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])",
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    """A tiny random gemma3 (sliding and full layers) whose end-of-sequence is `<eos>`."""
    path: pathlib.Path = make_checkpoint("gemma3_text", tmp_path_factory.mktemp("ckpt"),
                                         eos=True)
    return LLM(str(path), dtype="float32", block_size=B, kv_cache_memory="8MiB",
               max_num_seqs=16, max_num_batched_tokens=64, max_model_len=512, debug_kv=True)


def sample(llm: LLM, constraint: StructuredOutputsParams, **kwargs: Any) -> list[Any]:
    params = SamplingParams(n=SAMPLES, temperature=1.0, seed=kwargs.pop("seed", 1),
                            max_tokens=kwargs.pop("max_tokens", 400),
                            structured_outputs=constraint, **kwargs)
    [out] = llm.generate("Answer in the format asked for:", params)
    return out.outputs


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_output_validates_against_its_json_schema(llm: LLM, name: str) -> None:
    schema = SCHEMAS[name]
    outputs = sample(llm, StructuredOutputsParams(json=schema))
    for out in outputs:
        assert out.finish_reason == "stop", (name, out.text)
        jsonschema.validate(json.loads(out.text), schema)
    assert len({o.text for o in outputs}) > 1  # sampled, not one forced string


@pytest.mark.parametrize("name", list(REGEXES))
def test_every_output_matches_its_regex(llm: LLM, name: str) -> None:
    outputs = sample(llm, StructuredOutputsParams(regex=REGEXES[name]))
    for out in outputs:
        assert out.finish_reason == "stop"
        assert re.fullmatch(REGEXES[name], out.text), out.text


def test_json_object_and_schema_as_text(llm: LLM) -> None:
    for out in sample(llm, StructuredOutputsParams(json_object=True), max_tokens=480):
        if out.finish_reason == "stop":  # an unbounded object may run out of tokens
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.finish_reason == "length" and out.text.lstrip().startswith("{")
    schema = SCHEMAS["enums"]
    for out in sample(llm, StructuredOutputsParams(json=json.dumps(schema))):
        jsonschema.validate(json.loads(out.text), schema)


def test_choice_is_one_of_the_strings(llm: LLM) -> None:
    choices = ["yes", "no", 'a "quoted" word', "back\\slash", "café ☕"]
    outputs = sample(llm, StructuredOutputsParams(choice=choices), seed=3)
    assert all(o.text in choices and o.finish_reason == "stop" for o in outputs)
    assert len({o.text for o in outputs}) > 1


def test_ebnf_grammar(llm: LLM) -> None:
    grammar = """
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]?
"""
    for out in sample(llm, StructuredOutputsParams(grammar=grammar), seed=5):
        assert out.finish_reason == "stop"
        assert re.fullmatch(r"[0-9()+\-]+", out.text), out.text
        eval(compile(out.text, "<grammar output>", "eval"), {"__builtins__": {}})  # parses


def test_the_grammar_wins_over_min_tokens_and_ignore_eos(llm: LLM) -> None:
    """A complete grammar allows only the stop token: min_tokens may not mask it into an
    empty distribution, and ignore_eos may not carry the sequence past it."""
    outputs = sample(llm, StructuredOutputsParams(choice=["ab", "cd"]), min_tokens=20,
                     ignore_eos=True, max_tokens=40)
    assert all(o.text in ("ab", "cd") and o.finish_reason == "stop" for o in outputs)


def test_structured_and_free_requests_share_a_batch(llm: LLM) -> None:
    schema = SCHEMAS["enums"]
    prompts = ["one", "two", "three", "four"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=400,
                             structured_outputs=StructuredOutputsParams(json=schema)
                             if i % 2 == 0 else None) for i in range(4)]
    outs = llm.generate(prompts, params)
    for i, out in enumerate(outs):
        if i % 2 == 0:
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
    stats = llm.stats()
    assert stats["kv_read_misses"] == 0
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_reserved"] == 0


def test_a_schema_compiles_once(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"only": {"type": "boolean"}},
              "required": ["only"]}
    before = llm.engine.structured.compiled
    for seed in range(3):
        sample(llm, StructuredOutputsParams(json=dict(schema)), seed=seed, max_tokens=60)
    assert llm.engine.structured.compiled == before + 1


@pytest.mark.parametrize(("constraint", "param"), [
    (dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}),
     "structured_outputs.json"),
    (dict(json="{not json"), "structured_outputs.json"),
    (dict(regex="(unclosed"), "structured_outputs.regex"),
    (dict(grammar='root ::= "a" |'), "structured_outputs.grammar"),
    (dict(grammar='start ::= "a"'), "structured_outputs.grammar"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(regex="a", choice=["a"]), "structured_outputs"),
])
def test_bad_constraints_are_refused_with_the_field(llm: LLM, constraint: dict[str, Any],
                                                    param: str) -> None:
    with pytest.raises(InvalidRequestError) as err:
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(
            **constraint)))
    assert err.value.param == param
    ok = llm.generate("x", SamplingParams(max_tokens=3, temperature=0.0))  # still serving
    assert ok[0].outputs[0].finish_reason in ("stop", "length")


# -- the sampler's lazy mask -------------------------------------------------------------


def _grammar_rows(n: int, regex: str, **params: Any) -> tuple[list[Any], StructuredOutputs]:
    """``n`` sequences under ``regex`` on the tiny tokenizer, ready for the sampler."""
    tok = byte_bpe_tokenizer()
    so = StructuredOutputs(tok, VOCAB, [tok.eos_token_id])
    constraint = StructuredOutputsParams(regex=regex)
    seqs = []
    for i in range(n):
        seq = Sequence(seq_id=i, request_id="r", index=0, token_ids=[1], num_prompt_tokens=1,
                       params=SamplingParams(structured_outputs=constraint, **params),
                       max_tokens=8, detokenizer=None)
        seq.grammar = so.matcher(constraint)
        seqs.append(seq)
    return seqs, so


def _allowed(so: StructuredOutputs, seqs: list[Any]) -> torch.Tensor:
    bitmask = so.fill(seqs, list(range(len(seqs))))
    return unpack(bitmask, VOCAB)


def test_lazy_greedy_equals_masking_first() -> None:
    """Whatever the unmasked argmax, the pick is the masked row's first maximum."""
    seqs, so = _grammar_rows(64, "[a-c]x", temperature=0.0)
    allowed = _allowed(so, seqs)
    logits = torch.randn(64, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[::2] += 5.0 * ~allowed[::2]  # even rows: the best token is refused
    logits[1::4, :] = 0.0  # ties everywhere: the first allowed token
    expected = logits.masked_fill(~allowed, float("-inf")).max(dim=-1).indices
    with torch.inference_mode():  # the model's logits are inference tensors
        model_logits = logits.clone()
    tokens, _ = Sampler(structured=so)(model_logits, seqs)
    assert tokens == expected.tolist()
    assert torch.equal(model_logits, logits)  # masked in a copy: the logprobs' source stays


@pytest.mark.parametrize("top_k", [0, 2])
def test_lazy_sampling_draws_from_the_masked_distribution(top_k: int) -> None:
    """A draw refused by the grammar is redrawn from the masked weights; the result is the
    masked distribution exactly (pinned by counting 12,000 draws). With top-k the mask
    comes first, so top-k keeps the best allowed tokens, not the best of all."""
    seqs, so = _grammar_rows(4000, "[a-c]", temperature=1.0, top_k=top_k)
    allowed = _allowed(so, seqs[:1])[0]
    ids = allowed.nonzero().squeeze(1)
    assert len(ids) == 3
    logits = torch.full((VOCAB,), 3.0)  # refused tokens hold almost all the mass
    logits[ids] = torch.tensor([0.0, 1.0, 2.0])
    sampler = Sampler(structured=so)
    counts = torch.zeros(VOCAB)
    for _ in range(3):
        tokens, _ = sampler(logits.expand(len(seqs), -1).clone(), seqs)
        counts += torch.bincount(torch.tensor(tokens), minlength=VOCAB)
    assert counts[~allowed].sum() == 0
    freq = counts[ids] / counts.sum()
    weights = torch.tensor([0.0, 1.0, 2.0]) if top_k == 0 else torch.tensor(
        [float("-inf"), 1.0, 2.0])
    expected = torch.softmax(weights, dim=0)
    assert torch.allclose(freq, expected, atol=0.02), (freq, expected)
