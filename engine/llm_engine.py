"""The engine: requests in, one scheduled step at a time, outputs out.

    batch = scheduler.schedule()
    plan = planner.plan(batch)          # the KV manager's appends, as data
    logits = runner.execute(plan)
    update(batch, sampler(logits))
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ringserve.block_manager import KVCacheManager, plan_num_blocks
from ringserve.engine import spec_decode
from ringserve.engine.config import EngineConfig
from ringserve.engine.cpu_threads import apply_threads
from ringserve.engine.detokenizer import IncrementalDetokenizer
from ringserve.engine.errors import InvalidRequestError
from ringserve.engine.kv_cache import allocate_kv_caches, kv_cache_spec, model_kv_sources
from ringserve.engine.kv_events import (
    ALL_BLOCKS_CLEARED,
    KVEventsConfig,
    ZmqPublisher,
    wire_events,
)
from ringserve.engine.loading import TokenizerLoad, load_hf_config, load_model, resolve_model
from ringserve.engine.loading.quantize import pick_quantization, weight_bytes
from ringserve.engine.memory_plan import (
    loading_allocations,
)
from ringserve.engine.model_runner import ModelRunner
from ringserve.engine.models.greedy_head import GreedyHead
from ringserve.engine.models.linear_copies import (
    auto_head_rows,
    auto_packed_rows,
    pack_head_copy,
    pack_linear_copies,
    pack_rounded_copies,
    place_on_huge_pages,
)
from ringserve.engine.models.quant_linear import QuantLinear
from ringserve.engine.outputs import Request
from ringserve.engine.request_check import (
    CheckedRequest,
    Prompt,
    RequestChecker,
    RequestLimits,
)
from ringserve.engine.sampler import Sampler
from ringserve.engine.sampling_params import SamplingParams
from ringserve.engine.scheduler import ScheduledSeq, Scheduler
from ringserve.engine.sequence import PromptLogprob, Sequence, SequenceStatus
from ringserve.engine.spec_decode import SpeculativeConfig
from ringserve.engine.startup import (
    check_fits,
    describe,
    describe_cpu_kernels,
    has_mxfp4,
    pick_device,
    pick_dtype,
    pick_numerics,
    plan_memory,
)
from ringserve.engine.step_plan import StepPlanner
from ringserve.engine.stopping import append_token
from ringserve.engine.structured_output import StructuredOutputs
from ringserve.kernels import cpu_build, cpu_isa

logger = logging.getLogger("ringserve.engine")


class LLMEngine:
    """Owns the model, the KV pool, the scheduler; not thread-safe (see `AsyncLLM`)."""

    def __init__(self, config: EngineConfig,
                 on_resolved: Callable[[Path], None] | None = None) -> None:
        """``on_resolved``: called with the folder served as soon as it is known, before the
        weights load (the API process reads its tokenizer meanwhile: `CoreClient.launch`)."""
        self.config = config
        self.owner_thread: int | None = None  # the thread an AsyncLLM loop steps it on
        self.device = pick_device(config.device)
        if self.device.type == "cpu":
            try:
                cpu_isa.info()
                apply_threads()
            except ValueError as err:  # RINGSERVE_CPU_ISA, _NUM_THREADS or _KERNEL_SPIN
                raise InvalidRequestError(str(err), param="environment") from None
        resolved = resolve_model(config.model, cache_dir=config.cache_dir)
        self.model_name = resolved.name
        self.model_path = resolved.path  # the folder served (a GGUF file's conversion)
        if on_resolved is not None:
            on_resolved(resolved.path)
        hf_config = load_hf_config(resolved.path)
        self.dtype, why = pick_dtype(config.dtype, self.device, hf_config)
        logger.info("dtype %s (%s)", str(self.dtype).removeprefix("torch."), why)
        if self.device.type == "cpu":
            cpu_build.available()  # build the CPU kernels now, not at the first request
        tokenizer = TokenizerLoad(resolved.path)  # read while the weights load
        self.quantization, why = pick_quantization(config.quantization, folder=resolved.path,
                                                   device=self.device, dtype=self.dtype)
        logger.info("quantization %s (%s)", self.quantization, why)
        self.int16_activations, self.kv_dtype = pick_numerics(
            config, self.quantization, self.dtype, self.device, mxfp4=has_mxfp4(hf_config))
        budget, self.runtime_bytes = check_fits(config, resolved.path, dtype=self.dtype,
                                                device=self.device,
                                                quantization=self.quantization)
        with loading_allocations():
            self._load(config, resolved.path, hf_config)
        self.weight_bytes = weight_bytes(self.model)
        logger.info("%s", self.weight_bytes.describe())
        if self.device.type == "cpu":
            logger.info("%s", describe_cpu_kernels(self.model, self.dtype))
        mcfg = self.model.config
        self.max_model_len = config.max_model_len or int(hf_config.max_position_embeddings)
        self.eos_token_ids = set(mcfg.eos_token_ids) | _generation_eos(resolved.path)
        self.speculative = SpeculativeConfig.parse(config.speculative_config)
        k = self.speculative.num_speculative_tokens if self.speculative else 0
        spec = kv_cache_spec(mcfg, config.block_size, self.kv_dtype,
                             prefix_caching=config.enable_prefix_caching, speculative_tokens=k)
        self.memory_plan = plan_memory(config, spec, budget, weights=self.weight_bytes,
                                       runtime=self.runtime_bytes, model=mcfg,
                                       max_model_len=self.max_model_len, dtype=self.dtype,
                                       device=self.device)
        memory = self.memory_plan.kv
        num_blocks = plan_num_blocks(spec, memory)
        self.kv = KVCacheManager(spec, num_blocks, max_model_len=self.max_model_len,
                                 debug=config.debug_kv,
                                 enable_prefix_caching=config.enable_prefix_caching,
                                 speculative_tokens=k)
        caches = allocate_kv_caches(spec, num_blocks, mcfg.num_layers, self.kv_dtype,
                                    self.device, model_kv_sources(mcfg))
        self.scheduler = Scheduler(self.kv, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_prefill_slowdown=config.max_prefill_slowdown,
                                   speculative=self.speculative,
                                   policy=config.scheduling_policy)
        self.accepted_per_position = [0] * k  # drafts kept at each position of a run
        self.planner = StepPlanner(self.kv, config.max_num_seqs)
        greedy = self.model.lm_head.greedy if isinstance(self.model.lm_head, QuantLinear) \
            else None
        self.runner = ModelRunner(self.model, caches, windows=[g.window for g in spec.groups],
                                  rings=list(self.kv.ring_blocks), block_size=spec.block_size,
                                  max_num_seqs=config.max_num_seqs,
                                  max_model_len=self.max_model_len, device=self.device,
                                  greedy_head=greedy)
        self.tokenizer = tokenizer.result()
        self.structured = StructuredOutputs(self.tokenizer, mcfg.vocab_size,
                                            self.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids, structured=self.structured)
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self.counters: Counter[str] = Counter()
        self.capacity = self.kv.capacity()
        if self.capacity.max_sequences < 1:
            raise InvalidRequestError(
                f"the KV cache ({memory} bytes) cannot hold one sequence of max_model_len "
                f"{self.max_model_len} tokens ({self.capacity.description}); raise "
                "kv_cache_memory or lower max_model_len", param="kv_cache_memory")
        logger.info("%s; %s", describe(spec, num_blocks, memory), self.capacity.description)
        self.kv_events: ZmqPublisher | None = None
        events = KVEventsConfig.parse(config.kv_events_config)
        if events is not None:
            self.kv.enable_events()
            self.kv_events = ZmqPublisher(events)
            self.kv_events.publish([ALL_BLOCKS_CLEARED])  # a new life: nothing is cached
        self.limits = RequestLimits(mcfg.vocab_size, self.max_model_len, spec, num_blocks,
                                    self.capacity.description)
        self.checker = RequestChecker(self.tokenizer, self.limits, self.structured)

    # -- start-up: loading within the memory plan (docs/design.md §12, engine/startup.py) -

    def _load(self, config: EngineConfig, path: Any, hf_config: Any) -> None:
        """The model, its copies (`--packed-*-rows`, `--rounded-copy-rows`), its huge-page
        arena and greedy head."""
        self.model = load_model(path, dtype=self.dtype, device=self.device,
                                hf_config=hf_config, quantization=self.quantization,
                                int16_activations=self.int16_activations)
        packed_rows: int | None
        head_rows = config.packed_head_rows
        if config.packed_rows == "auto":
            packed_rows, why = auto_packed_rows(self.model, self.dtype)
            logger.info("packed rows auto: %s (%s)", packed_rows or "off", why)
            if packed_rows is not None and head_rows is None:
                head_rows = auto_head_rows(self.model)
        else:
            packed_rows = None if config.packed_rows is None else int(config.packed_rows)
        for param, rows, pack in (("packed_head_rows", head_rows, pack_head_copy),
                                  ("packed_rows", packed_rows, pack_linear_copies),
                                  ("rounded_copy_rows", config.rounded_copy_rows,
                                   pack_rounded_copies)):
            if rows is not None:
                try:
                    logger.info("%s", pack(self.model, rows, self.dtype))
                except ValueError as err:
                    raise InvalidRequestError(str(err), param=param) from None
        if self.device.type == "cpu":
            logger.info("%s", place_on_huge_pages(self.model))
        self._greedy_head(config.greedy_head)

    # -- requests ----------------------------------------------------------------------

    def make_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> Request:
        """Tokenize and check a request (any thread), then build its sequences.

        Raises:
            InvalidRequestError: naming the parameter at fault.
        """
        return self.build(self.checker.check(request_id, prompt, params))

    def build(self, checked: CheckedRequest) -> Request:
        """The request's sequences, from a request `RequestChecker` passed (here or in the
        API process: a constraint then arrives as text)."""
        grammar = checked.grammar
        if isinstance(grammar, str):
            grammar = self.structured.deserialize(grammar)
        ids, params = checked.prompt_token_ids, checked.params
        seqs = [self._sequence(checked.request_id, i, ids, params, checked.max_tokens)
                for i in range(params.n)]
        for seq in seqs:
            seq.bad_words_ids = checked.bad_words_ids  # read only, shared
            if grammar is not None:  # compiled once, then a matcher per sequence
                seq.grammar = self.structured.matcher_for(grammar)
        return Request(checked.request_id, checked.prompt, ids, params, seqs)

    def add(self, request: Request) -> None:
        """Queue a request made by `make_request` (engine thread)."""
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is in use",
                                      param="request_id")
        self.requests[request.request_id] = request
        for seq in request.seqs:
            self.scheduler.add(seq)

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> Request:
        try:
            request = self.make_request(request_id, prompt, params)
        except InvalidRequestError:
            self.counters["requests_rejected"] += 1
            raise
        self.add(request)
        return request

    def abort_request(self, request_id: str) -> Request | None:
        """Stop a request now; its blocks return to the pool at once."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.status.is_finished:
                seq.status = SequenceStatus.FINISHED_ABORTED
                self._finish(seq)
        self._retire(request)
        return request

    # -- the step ----------------------------------------------------------------------

    def _greedy_head(self, mode: str) -> GreedyHead | None:
        """``greedy_head``: the output head's `GreedyHead` where "auto" finds it can serve;
        logged either way."""
        head = getattr(self.model, "lm_head", None)
        mcfg = self.model.config
        why = "off" if mode == "off" else GreedyHead.can_serve(head, self.dtype)
        if why is None and (mcfg.final_softcap is not None or mcfg.logit_scale != 1.0):
            # NOTE: the pick is the first maximum of the head's own output; a soft-cap or
            # scale after it could round two logits to one value and move the first maximum
            why = "the model soft-caps or scales its logits"
        if why is not None:
            logger.info("greedy head off (%s)", why)
            return None
        assert isinstance(head, QuantLinear)
        head.greedy = GreedyHead(head)
        logger.info("greedy head: greedy rows of steps of >= %d rows pick from an int8 pass "
                    "%sover a one-byte copy of the head and the exact logits of its candidates "
                    "(+%.1f MiB resident)", head.greedy.min_rows,
                    "by AMX tiles " if head.greedy.amx else "", head.greedy.nbytes() / 2**20)
        greedy: GreedyHead = head.greedy
        return greedy

    def step(self) -> list[Request]:
        """Run one scheduled step; returns the requests it changed (and publishes the KV
        events it made, `--kv-events-config`).

        Faults stay small (docs/design.md §4): an error while sampling or emitting one
        sequence's token (its logits processing, grammar, stop strings, detokenization)
        aborts that request with the error and no other (`_sample_apart`); only an error in
        the model's forward, which no one request owns, aborts the step's requests.
        """
        try:
            return self._step()
        finally:
            if self.kv_events is not None:
                self._publish_kv_events()

    def _step(self) -> list[Request]:
        scheduled = self.scheduler.schedule().scheduled
        if not scheduled:
            return []
        started = time.perf_counter()
        touched = {id(i.seq): self.requests[i.seq.request_id] for i in scheduled}
        try:
            plan = self.planner.plan(scheduled)
            try:
                logits, prompt_logprobs = self.runner.execute(plan, scheduled)
            except BaseException:
                self.kv.discard()  # what this step wrote is not to be found by later prompts
                raise
            self.kv.commit()
        except Exception as err:  # surface it to the requests of this step, keep serving
            logger.exception("step failed; aborting its %d requests", len(touched))
            for request in set(touched.values()):
                self._fail(request, err)
            return list({id(r): r for r in touched.values()}.values())
        rows: dict[int, tuple[int, int]] = {}  # id(item) -> its logits rows
        greedy: dict[int, int] = {}  # id(item) -> the token the greedy head picked
        row = at = 0  # the step's row; the row of `logits` (which lacks the picked ones)
        for item in (i for i in scheduled if i.samples):
            n = 1 + len(item.draft)
            if row in self.runner.picked:
                greedy[id(item)] = self.runner.picked[row]
            else:
                rows[id(item)] = (at, at + n)
                at += n
            row += n
        samplers = [i for i in scheduled if i.samples and id(i) not in greedy]
        saved = self.sampler.save_state([i.seq for i in samplers])
        try:
            picked = self._sample(samplers, logits, rows)
        except Exception as err:
            logger.warning("sampling failed (%r); sampling each sequence apart", err)
            self.sampler.restore_state(saved)
            picked = self._sample_apart(samplers, logits, rows)
        picked.update({key: ([token], [None]) for key, token in greedy.items()})
        elapsed = time.perf_counter() - started
        if self.config.max_prefill_slowdown is not None:
            chunks = [(i.num_new, i.seq.num_computed) for i in scheduled if i.seq.is_prefilling]
            self.scheduler.prefill_cost.observe(
                sum(i.num_new for i in scheduled) - sum(n for n, _ in chunks), chunks, elapsed)
        if self.speculative is not None:
            self.scheduler.step_cost.observe(sum(i.num_new for i in scheduled),
                                             sum(bool(i.draft) for i in scheduled), elapsed)
        live = [i for i in scheduled if not i.seq.status.is_finished]
        self._update(live, picked, prompt_logprobs)
        return list({id(r): r for r in touched.values()}.values())

    def _sample(self, items: list[ScheduledSeq], logits: torch.Tensor,
                rows: dict[int, tuple[int, int]]) -> dict[int, tuple[list[int], list[Any]]]:
        """Per item (id), its tokens and logprob records: one for a plain row, a run for a
        speculative decode (its drafts verified)."""
        out: dict[int, tuple[list[int], list[Any]]] = {}
        plain = [i for i in items if not i.draft]
        for item in (i for i in items if i.draft):
            lo, hi = rows[id(item)]
            out[id(item)] = self.sampler.verify(logits[lo:hi], item.seq, item.draft)
        if plain:
            at = [rows[id(i)][0] for i in plain]
            block = logits if len(at) == len(logits) else logits[at]
            tokens, logprobs = self.sampler(block, [i.seq for i in plain])
            for item, token, lp in zip(plain, tokens, logprobs, strict=True):
                out[id(item)] = ([token], [lp])
        return out

    def _sample_apart(self, items: list[ScheduledSeq], logits: torch.Tensor,
                      rows: dict[int, tuple[int, int]]
                      ) -> dict[int, tuple[list[int], list[Any]]]:
        """`_sample` one sequence at a time; a sequence that fails aborts its request."""
        out: dict[int, tuple[list[int], list[Any]]] = {}
        for item in items:
            if item.seq.status.is_finished:  # a sibling of a failed one (n > 1)
                continue
            try:
                out.update(self._sample([item], logits, rows))
            except Exception as err:
                self._fail(self.requests[item.seq.request_id], err)
        return out

    def _fail(self, request: Request, err: Exception) -> None:
        if request.error is None:
            logger.warning("request %s failed: %r", request.request_id, err)
            request.error = err
        self.abort_request(request.request_id)

    def _update(self, scheduled: list[ScheduledSeq],
                picked: dict[int, tuple[list[int], list[Any]]],
                prompt_logprobs: dict[int, list[PromptLogprob]]) -> None:
        for item in scheduled:
            item.seq.prompt_logprobs += prompt_logprobs.get(item.seq.seq_id, ())
            if item.seq.is_prefilling:
                self.counters["prompt_tokens"] += min(
                    item.num_new, item.seq.num_prompt_tokens - item.seq.num_computed)
            item.seq.num_computed += item.num_new - len(item.draft)
        for item in scheduled:
            if id(item) not in picked or item.seq.status.is_finished:
                continue
            tokens, logprobs = picked[id(item)]
            try:  # stop strings, detokenization, the grammar: this sequence's alone
                if item.draft:
                    self._update_run(item, tokens, logprobs)
                else:
                    self._emit(item.seq, tokens[0], logprobs[0])
            except Exception as err:
                self._fail(self.requests[item.seq.request_id], err)

    def _update_run(self, item: ScheduledSeq, tokens: list[int],
                    logprobs: list[Any]) -> None:
        """Emit a speculative decode's tokens up to the first that finishes the sequence,
        and keep the K/V of the drafts it kept (the rest roll back)."""
        seq = item.seq
        kept = len(tokens) - 1  # drafts kept; the last token is the model's own
        self.counters["spec_decode_num_drafts"] += 1
        self.counters["spec_decode_num_draft_tokens"] += len(item.draft)
        self.counters["spec_decode_num_accepted_tokens"] += kept
        for j in range(kept):
            self.accepted_per_position[j] += 1
        spec_decode.back_off(seq, kept, len(item.draft))
        for j, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            if self._emit(seq, token, lp):
                return
            if j < kept:
                seq.num_computed += 1
        self.kv.accept(seq.seq_id, seq.num_computed, list(item.draft[:kept]))

    def _emit(self, seq: Sequence, token: int, lp: Any) -> bool:
        """Append a sampled token; True if it finished the sequence."""
        now = time.monotonic()
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        if lp is not None:
            seq.logprobs.append(lp)
            seq.cumulative_logprob += lp.logprob
        append_token(seq, token, self.eos_token_ids)
        self.counters["generation_tokens"] += 1
        if not seq.status.is_finished:
            return False
        self._finish(seq)
        request = self.requests[seq.request_id]
        if request.finished:
            self._retire(request)
        return True

    def _publish_kv_events(self) -> None:
        assert self.kv_events is not None
        raw = self.kv.take_events()
        if raw:
            self.kv_events.publish(wire_events(raw, self.kv.spec))

    def close(self) -> None:
        """Let go of what outlives a step: the KV-event publisher's socket."""
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self.planner.release(seq.seq_id)
        self.sampler.forget(seq.seq_id)

    def _retire(self, request: Request) -> None:
        if self.requests.pop(request.request_id, None) is None:
            return
        reasons = [s.status.finish_reason for s in request.seqs]
        reason = "abort" if "abort" in reasons else reasons[0]
        self.counters[f"request_success:{reason}"] += 1

    # -- helpers -----------------------------------------------------------------------

    def _sequence(self, request_id: str, index: int, ids: list[int], params: SamplingParams,
                  max_tokens: int) -> Sequence:
        detok = IncrementalDetokenizer(self.tokenizer, ids,
                                       skip_special_tokens=params.skip_special_tokens)
        # prompt logprobs: the first sequence computes them for the request
        k = params.prompt_logprobs if index == 0 else None
        return Sequence(seq_id=next(self._seq_ids), request_id=request_id, index=index,
                        token_ids=list(ids), num_prompt_tokens=len(ids), params=params,
                        max_tokens=max_tokens, detokenizer=detok, prompt_logprobs_k=k,
                        prompt_logprobs=[None] if k is not None else [])

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def stats(self) -> dict[str, Any]:
        """Counters and gauges behind `/metrics` (docs/design.md §7), read live: call it on the
        thread that steps the engine (`AsyncLLM` publishes them as snapshots for others).

        Raises:
            RuntimeError: called off the thread an `AsyncLLM` loop steps it on.
        """
        owner = self.owner_thread
        if owner is not None and owner != threading.get_ident():
            raise RuntimeError("LLMEngine.stats() read off the engine thread: read "
                               "AsyncLLM.stats(), the snapshot the loop publishes")
        kv = self.kv.stats()
        total = kv.blocks_total
        out: dict[str, Any] = {
            "kv_blocks_total": total,
            "kv_blocks_used": kv.blocks_used,
            "kv_blocks_reserved": kv.blocks_reserved,
            "kv_cache_usage_perc": kv.blocks_used / total if total else 0.0,
            "ring_block_recycles": kv.ring_block_recycles,
            "ring_slot_overwrites": kv.ring_slot_overwrites,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "prefix_cache_blocks": kv.blocks_cached,
            "prefix_cache_evictions": kv.blocks_evicted,
            "kv_read_misses": kv.read_misses,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
            "max_concurrent_sequences": self.capacity.max_sequences,
            "max_concurrent_sequences_by_tokens": dict(self.capacity.by_tokens),
            "weight_bytes": self.weight_bytes.resident,
            "memory_plan_bytes": self.memory_plan.as_dict(),
            "decode_weight_bytes_per_token": self.weight_bytes.per_token,
            "prompt_tokens": self.counters["prompt_tokens"],
            "generation_tokens": self.counters["generation_tokens"],
            "requests_rejected": self.counters["requests_rejected"],
            "spec_decode_num_drafts": self.counters["spec_decode_num_drafts"],
            "spec_decode_num_draft_tokens": self.counters["spec_decode_num_draft_tokens"],
            "spec_decode_num_accepted_tokens":
                self.counters["spec_decode_num_accepted_tokens"],
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_position),
        }
        spec = self.kv.spec
        out["kv_block_size"] = spec.block_size
        out["enable_prefix_caching"] = self.kv.caching
        out["kv_group_ring_blocks"] = {name: spec.ring_blocks(members[0])
                                       for name, members in spec.names().items()
                                       if spec.ring_blocks(members[0]) is not None}
        out["kv_group_blocks_used"] = dict(zip(kv.group_names, kv.blocks_used_per_group,
                                               strict=True))
        out["kv_group_blocks_reserved"] = dict(zip(kv.group_names, kv.blocks_reserved_per_group,
                                                   strict=True))
        for reason in ("stop", "length", "abort"):
            out[f"request_success_{reason}"] = self.counters[f"request_success:{reason}"]
        out["admission_state"] = self.kv.admission_state(
            [(s.num_prompt_tokens, s.max_tokens) for s in self.scheduler.waiting],
            len(self.scheduler.running), self.scheduler.max_num_seqs, kv)
        return out


def _generation_eos(path: Any) -> set[int]:
    """End-of-sequence ids from generation_config.json, as transformers' generate uses."""
    import json

    file = path / "generation_config.json"
    if not file.is_file():
        return set()
    eos = json.loads(file.read_text()).get("eos_token_id")
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list) else {int(eos)}
