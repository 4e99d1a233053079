"""Incremental detokenization that never emits half a character.

Byte-level tokenizers split multi-byte characters across tokens, and SentencePiece-style ones
decide a token's leading space from its neighbour. So text is produced by decoding a short
window of ids twice (with and without the newest tokens) and emitting the difference only
once it no longer ends in U+FFFD, the replacement character of an unfinished byte sequence.
"""

from __future__ import annotations

from typing import Any

# NOTE: how many ids before the first new one give a token its context (leading spaces).
CONTEXT_IDS = 5


class IncrementalDetokenizer:
    """Text of one sequence's generated tokens, built a token at a time.

    Args:
        tokenizer: a transformers tokenizer.
        prompt_ids: the prompt, whose last ids give the first generated token context.
        skip_special_tokens: drop special tokens from the text.
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int], *, skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-CONTEXT_IDS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one generated token; returns the new text it completes (maybe "")."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset],
                        skip_special_tokens=self.skip)
        full: str = decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            # NOTE: keep the list short; offsets are relative to what is kept.
            if self.prefix_offset > 4 * CONTEXT_IDS:
                drop = self.prefix_offset
                self.ids = self.ids[drop:]
                self.prefix_offset -= drop
                self.read_offset -= drop
            self.text += new
            return new
        return ""

    def flush(self) -> str:
        """At the end: the text of ids still held back (an unfinished byte sequence decodes
        to U+FFFD, as a whole-sequence decode would show it)."""
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset],
                        skip_special_tokens=self.skip)
        full: str = decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip)
        new = full[len(prefix) :]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += new
        return new
