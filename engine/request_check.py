"""A request checked and tokenized where it arrives, as plain data for the engine to run.

The checks read only facts fixed at start-up (`RequestLimits`: the vocabulary, the longest
sequence, the pool's size), so they run in the API process, or in any thread, with the
answer the engine would give; the engine builds the request's sequences from the
`CheckedRequest` (`LLMEngine.build`). A constraint compiles here too; across processes it
travels as xgrammar's serialized JSON (docs/design.md §11).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ringserve.block_manager import RequestTooLargeError
from ringserve.block_manager.budget import KVCacheSpec, check_fits_pool
from ringserve.engine.errors import InvalidRequestError
from ringserve.engine.sampling_params import SamplingParams
from ringserve.engine.structured_output import StructuredOutputs

Prompt = str | list[int] | dict[str, Any]


@dataclass(frozen=True)
class RequestLimits:
    """What checking a request needs to know of the engine (fixed once it has started)."""

    vocab_size: int
    max_model_len: int
    spec: KVCacheSpec
    num_blocks: int
    capacity_description: str


@dataclass(frozen=True)
class CheckedRequest:
    """A request that passed every check: its ids, resolved max_tokens, tokenized bad words
    and compiled constraint (an xgrammar ``CompiledGrammar``; its JSON text in transit)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    bad_words_ids: list[list[int]]
    grammar: Any = None

    @property
    def num_seqs(self) -> int:
        return self.params.n

    def portable(self, structured: StructuredOutputs) -> CheckedRequest:
        """This request with its constraint as text, to cross a process boundary."""
        if self.grammar is None or isinstance(self.grammar, str):
            return self
        return replace(self, grammar=structured.serialize(self.grammar))


class RequestChecker:
    """Tokenizes and checks requests against `RequestLimits`; any thread, any process."""

    def __init__(self, tokenizer: Any, limits: RequestLimits,
                 structured: StructuredOutputs) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.structured = structured

    def check(self, request_id: str, prompt: Prompt, params: SamplingParams) -> CheckedRequest:
        """Raises:
            InvalidRequestError: naming the parameter at fault.
        """
        text, ids = self._tokenize(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        lim = self.limits
        vocab = lim.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})",
                                      param="prompt")
        if any(t >= vocab for t in params.logit_bias or {}):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})",
                                      param="logit_bias")
        n = len(ids)
        if n >= lim.max_model_len:
            raise InvalidRequestError(
                f"prompt is {n} tokens; max_model_len is {lim.max_model_len}, which must "
                "also leave room for at least one generated token", param="prompt")
        max_tokens = params.max_tokens or lim.max_model_len - n
        if n + max_tokens > lim.max_model_len:
            raise InvalidRequestError(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds "
                f"max_model_len {lim.max_model_len}, the longest sequence the KV pool is "
                f"sized for ({lim.capacity_description})", param="max_tokens")
        try:
            check_fits_pool(lim.spec, lim.num_blocks, n, max_tokens)
        except RequestTooLargeError as err:
            raise InvalidRequestError(str(err), param="max_tokens") from None
        bad_words = self._bad_words_ids(params.bad_words) if params.bad_words else []
        grammar = (self.structured.compile(params.structured_outputs)
                   if params.structured_outputs is not None else None)
        return CheckedRequest(request_id, text, ids, params, max_tokens, bad_words, grammar)

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as err:  # a lone surrogate: no tokenizer takes it
                raise InvalidRequestError(
                    f"prompt is not valid Unicode text: {err.reason} at index {err.start}",
                    param="prompt") from None
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return None, list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'",
                                      param="prompt")
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError("prompt must be a string or a list of token ids",
                                  param="prompt")

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's tokenization of bad_words: each word as is (left-stripped) and with a
        leading space, the latter kept only where it gives other tokens of the same count
        (a new word token)."""
        out: list[list[int]] = []
        vocab = self.limits.vocab_size
        for word in words:
            plain = list(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = list(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            out.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        if any(not 0 <= t < vocab for ids in out for t in ids):
            raise InvalidRequestError(f"bad_words tokenize to ids outside [0, {vocab})",
                                      param="bad_words")
        return out
