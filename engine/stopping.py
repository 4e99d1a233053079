"""After a token is sampled: extend the text, and decide whether the sequence is done."""

from __future__ import annotations

from collections.abc import Collection

from ringserve.engine.sequence import Sequence, SequenceStatus


def append_token(seq: Sequence, token_id: int, eos_token_ids: Collection[int]) -> None:
    """Add a sampled token to ``seq`` and finish it if a stop condition holds.

    Order, as in vLLM: end-of-sequence and stop token ids (the token's text is left out),
    then stop strings (the text is cut before the match), then max_tokens. A sequence
    under structured outputs first feeds the token to its grammar: a stop token that
    completes the grammar ends it with ``stop`` (even with ``ignore_eos``: nothing may
    follow), and a token the grammar refuses (the sampler masked it, so never) aborts it.
    """
    seq.token_ids.append(token_id)
    params = seq.params
    if seq.grammar is not None and not seq.grammar.accept_token(token_id):
        seq.status, seq.stop_reason = SequenceStatus.FINISHED_ABORTED, None
    elif ((seq.grammar is not None and seq.grammar.is_terminated())
          or (not params.ignore_eos and token_id in eos_token_ids)):
        seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, None
    elif token_id in params.stop_token_ids:
        seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, token_id
    else:
        if seq.detokenizer is not None:
            before = len(seq.text)
            seq.text += seq.detokenizer.add(token_id)
            if params.stop and _cut_at_stop(seq, before):
                return
        if seq.num_output_tokens < seq.max_tokens:
            return
        seq.status = SequenceStatus.FINISHED_LENGTH
    if seq.detokenizer is not None:  # finished: let out what waited for more bytes
        seq.text += seq.detokenizer.flush()


def _cut_at_stop(seq: Sequence, before: int) -> bool:
    """Find a stop string that ends in the new text; cut the text before it."""
    stops = seq.params.stop
    assert isinstance(stops, list)
    longest = max(len(s) for s in stops)
    start = max(0, before - longest + 1)
    best = -1
    for stop in stops:
        at = seq.text.find(stop, start)
        if at != -1 and (best == -1 or at < best):
            best, seq.stop_reason = at, stop
    if best == -1:
        return False
    seq.text = seq.text[:best]
    seq.status = SequenceStatus.FINISHED_STOPPED
    return True


def stream_text(seq: Sequence) -> str:
    """Text not yet streamed, holding back a tail that could still begin a stop string."""
    stops = seq.params.stop
    hold = 0
    if stops and not seq.status.is_finished:
        hold = max(len(s) for s in stops) - 1
    end = max(seq.sent_text_len, len(seq.text) - hold)
    delta = seq.text[seq.sent_text_len : end]
    seq.sent_text_len = end
    return delta
