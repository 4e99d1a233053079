"""Continuous batching, FCFS, against the exact KV budget: admission is the only gate.

A waiting sequence starts only when its whole reservation (prompt + max_tokens, capped at
the ring per sliding group) fits beside every running one, so a running sequence always
gets its next block and nothing is ever preempted.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

from ringserve.block_manager import KVCacheManager
from ringserve.engine import spec_decode
from ringserve.engine.prefill_cost import PrefillCost
from ringserve.engine.sequence import Sequence, SequenceStatus

PROBE_BLOCKS = 4  # a first prompt chunk beside decodes, before prompt tokens' cost is known
# --scheduling-policy: fcfs (vLLM's default) admits in arrival order; lpm (SGLang's longest
# prefix match) admits first the waiting prompt that finds the most tokens cached, so that
# under memory pressure a session whose blocks survived runs before a miss evicts them.
POLICIES = ("fcfs", "lpm")
LPM_WINDOW = 16  # waiting sequences an lpm choice compares (each costs a prefix lookup)
LPM_MAX_PASSES = 8  # admissions that may pass a waiting sequence over before it goes next


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens fed this step: a prefill chunk, 1 for a decode, 1 + drafts
    draft: tuple[int, ...] = ()  # speculative tokens fed after the sequence's last one

    @property
    def samples(self) -> bool:
        """True when this step completes the fed tokens, so a token is sampled."""
        return self.seq.num_computed + self.num_new - len(self.draft) == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)


class Scheduler:
    """Decides, each step, which sequences run and how many tokens each feeds.

    Args:
        kv: the KV cache manager (admission, block tables).
        max_num_seqs: sequences running at once.
        max_num_batched_tokens: tokens fed per step (decodes and prefill chunks together).
        max_prefill_slowdown: while sequences decode, the prefill tokens of a step are capped
            so its predicted time stays within this factor of the decode-only step's
            (`prefill_room`, `engine.prefill_cost`); None = no cap.
        speculative: drafts decodes by prompt lookup (`engine.spec_decode`).
    """

    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, max_prefill_slowdown: float | None = None,
                 speculative: spec_decode.SpeculativeConfig | None = None,
                 policy: str = "fcfs") -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling policy {policy!r} is not one of {POLICIES}")
        self.policy = policy
        self.kv = kv
        self.speculative = speculative
        self.step_cost = spec_decode.StepCost()
        self.prefill_cost = PrefillCost()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_prefill_slowdown = max_prefill_slowdown
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # stays 0 by construction; exported as a metric

    def add(self, seq: Sequence) -> None:
        """Queue a sequence (its size was checked against the pool by the engine)."""
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        """Running sequences first (decodes and unfinished prefills), then admissions."""
        budget = self.max_num_batched_tokens
        out: list[ScheduledSeq] = []
        # NOTE: decodes before prefill chunks, so that with max_num_batched_tokens >=
        # max_num_seqs (the engine checks it) every running decode gets its token each step.
        decoding = [s for s in self.running if not s.is_prefilling]
        prefilling = [s for s in self.running if s.is_prefilling]
        for rank, seq in enumerate(decoding):
            if budget == 0:
                break
            n = min(seq.num_tokens - seq.num_computed, budget)
            draft: tuple[int, ...] = ()
            if self.speculative is not None:
                # drafts take only budget no later decode needs for its own token
                room = budget - n - (len(decoding) - rank - 1)
                draft = self._draft(seq, room, len(decoding))
            out.append(ScheduledSeq(seq, n + len(draft), draft))
            budget -= n + len(draft)
        fed = self.max_num_batched_tokens - budget  # the decodes' tokens, drafts included
        capped = self.max_prefill_slowdown is not None and bool(out)
        share = _PromptShare(self, self.prefill_room(fed, len(out)) if capped else None, capped,
                             closed=capped and self.prefill_cost.wants_decode_step())
        for seq in prefilling:
            n = share.take(seq, budget)
            if n == 0:
                break
            out.append(ScheduledSeq(seq, n))
            budget -= n
        while (self.waiting and budget > 0 and len(self.running) < self.max_num_seqs
               and share.left()):
            at = self._next_waiting()
            seq = self.waiting[at]
            prompt = seq.token_ids[: seq.num_prompt_tokens]
            reuse = _reuses(seq)
            chain = self._chain(seq)
            # The next one (FCFS: the head) waits for room, or for a running sequence to
            # finish computing the prefix it shares (then it reuses it); others do not jump it.
            if (reuse and self.kv.waits_for_prefix(prompt, chain)) or not self.kv.can_admit(
                    seq.num_prompt_tokens, seq.max_tokens, prompt, reuse=reuse, chain=chain):
                break
            for passed in itertools.islice(self.waiting, at):
                passed.times_passed += 1
            del self.waiting[at]
            seq.num_computed = self.kv.admit(seq.seq_id, seq.num_prompt_tokens, seq.max_tokens,
                                             prompt, reuse=reuse, chain=chain)
            seq.prompt_chain = None  # the manager keeps its own copy from here
            seq.num_cached_tokens = seq.num_computed
            seq.status = SequenceStatus.RUNNING
            seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            n = share.take(seq, budget)
            if n:
                out.append(ScheduledSeq(seq, n))
                budget -= n
        return SchedulerOutput(out)

    def _chain(self, seq: Sequence) -> list[bytes] | None:
        if seq.prompt_chain is None:  # its blocks' names: hashed once, not every step
            seq.prompt_chain = self.kv.prompt_chain(seq.token_ids[: seq.num_prompt_tokens])
        return seq.prompt_chain

    def _next_waiting(self) -> int:
        """The waiting sequence to admit next, by its index in the queue: the head (fcfs),
        or (lpm, with prefix caching) of the first `LPM_WINDOW` the one whose prompt finds
        the most tokens cached, the earliest on a tie; one passed over `LPM_MAX_PASSES`
        times goes next whatever it finds (nothing waits for ever behind cached ones)."""
        if self.policy == "fcfs" or not self.kv.caching or len(self.waiting) == 1:
            return 0
        best, most = 0, -1
        for i, seq in enumerate(itertools.islice(self.waiting, LPM_WINDOW)):
            if seq.times_passed >= LPM_MAX_PASSES:
                return i
            found = self.kv.cached_prompt_tokens(seq.token_ids[: seq.num_prompt_tokens],
                                                 self._chain(seq)) if _reuses(seq) else 0
            if found > most:
                best, most = i, found
        return best

    def prefill_room(self, decode_tokens: int, decodes: int) -> float | None:
        """Seconds a step of ``decodes`` decodes (``decode_tokens`` tokens) may spend on
        prompt chunks under ``max_prefill_slowdown``: (slowdown - 1) times its predicted
        decode-only time; None for no cap (no slowdown set, nothing decoding, or nothing
        learned yet)."""
        if self.max_prefill_slowdown is None or decodes == 0:
            return None
        base = self.prefill_cost.decode_time(decode_tokens)
        return None if base is None else (self.max_prefill_slowdown - 1.0) * base

    def _draft(self, seq: Sequence, room: int, decodes: int) -> tuple[int, ...]:
        """A decode's drafted tokens: at most ``room``, none past its last output token,
        none while its drafts fail (back-off) or are kept too rarely to pay for the
        tokens they add to a step of ``decodes`` decodes (`spec_decode.StepCost`)."""
        spec = self.speculative
        assert spec is not None
        k = min(spec.num_speculative_tokens, room,
                seq.max_tokens - seq.num_output_tokens - 1)
        if k <= 0 or not spec_decode.speculates(seq):
            return ()
        if seq.spec_wait > 0:  # drafts kept failing: decode plainly for a while
            seq.spec_wait -= 1
            return ()
        draft = spec_decode.propose(seq.token_ids, k, spec.prompt_lookup_min,
                                    spec.prompt_lookup_max)
        if draft and spec.cost_gate and not self.step_cost.worth(seq.spec_acceptance, decodes,
                                                                  len(draft)):
            # NOTE: let the estimate recover: it only changes when the sequence drafts
            seq.spec_acceptance = min(1.0, seq.spec_acceptance + 0.02)
            return ()
        return tuple(draft)

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's blocks at once."""
        if seq.seq_id in self.kv:
            seq.blocks_held = sum(len(row) for row in self.kv.block_tables(seq.seq_id))
            self.kv.release(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)


class _PromptShare:
    """What one step's prompt chunks may take beside its decodes (`Scheduler.schedule`).

    Uncapped, a chunk takes what the token budget allows. Capped (sequences decode under
    ``max_prefill_slowdown``), the chunks take the tokens that fit the step's spare seconds
    (`PrefillCost.chunk_tokens`), or `PROBE_BLOCKS` blocks in all while their cost is not
    known yet; and at least one block a step (prompts always advance), except in the
    decode-only steps that measure what the share is relative to.
    """

    def __init__(self, scheduler: Scheduler, spare: float | None, capped: bool, *,
                 closed: bool = False) -> None:
        self.cost = scheduler.prefill_cost
        self.block = scheduler.kv.spec.block_size
        self.spare = spare
        self.capped = capped
        self.closed = closed  # a decode-only step, measured (`PrefillCost.wants_decode_step`)
        self.tokens = 0  # prompt tokens taken this step

    def _probing(self) -> bool:
        return self.spare is None or self.cost.chunks.solve() is None

    def left(self) -> bool:
        """Whether another chunk may start this step."""
        if self.closed:
            return False
        if not self.capped or self.tokens == 0:
            return True
        if self._probing():
            return self.tokens < PROBE_BLOCKS * self.block
        return self.spare is not None and self.spare > 0

    def take(self, seq: Sequence, budget: int) -> int:
        """Tokens of ``seq``'s prompt this step feeds (0: the step's share is spent)."""
        left = min(seq.num_tokens - seq.num_computed, budget)
        if self.closed:
            n = 0
        elif not self.capped:
            n = left
        elif self._probing():
            n = min(left, max(PROBE_BLOCKS * self.block - self.tokens, 0))
        else:
            assert self.spare is not None
            fits = self.cost.chunk_tokens(self.spare, seq.num_computed) or 0
            n = min(left, fits if fits or self.tokens else self.block)
            self.spare -= self.cost.chunk_seconds(n, seq.num_computed)
        self.tokens += n
        return n


def _reuses(seq: Sequence) -> bool:
    """Prompt logprobs need the logits of every prompt position: no cached prefix."""
    return seq.prompt_logprobs_k is None
