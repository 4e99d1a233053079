"""The offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from ringserve.engine.config import EngineConfig
from ringserve.engine.llm_engine import LLMEngine
from ringserve.engine.outputs import RequestOutput
from ringserve.engine.request_check import Prompt
from ringserve.engine.sampling_params import SamplingParams


class LLM:
    """Generate for a batch of prompts with continuous batching over the ring KV cache.

    Args:
        model: a preset name ("gemma-3-270m"), an HF folder or a .gguf file.
        **kwargs: any `EngineConfig` field (dtype, device, block_size, kv_cache_memory,
            max_num_seqs, max_num_batched_tokens, max_model_len, ...).
    """

    def __init__(self, model: str, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of ``prompts``.

        Args:
            prompts: a string, a list of token ids, a ``{"prompt_token_ids": [...]}`` dict,
                or a list of those.
            sampling_params: one for all prompts, or one per prompt (default: vLLM's).
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError("need one SamplingParams per prompt, or a single one")
        requests = []
        try:
            for prompt, params in zip(prompt_list, params_list, strict=True):
                requests.append(self.engine.add_request(str(next(self._ids)), prompt, params))
            while self.engine.has_unfinished:
                self.engine.step()
        except BaseException:
            for request in requests:
                self.engine.abort_request(request.request_id)
            raise
        for request in requests:
            if request.error is not None:
                raise RuntimeError(f"request {request.request_id} failed") from request.error
        return [r.output() for r in requests]

    def stats(self) -> dict[str, Any]:
        """Counters and gauges: kv_blocks_total/used/reserved, ring_block_recycles,
        ring_slot_overwrites, kv_read_misses, num_preemptions, request counts..."""
        return self.engine.stats()
