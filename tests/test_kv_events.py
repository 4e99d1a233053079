"""KV events (issue 26, part 3): vLLM's stream, decoded with vLLM's own classes.

A server with ``--kv-events-config`` serves 200 requests (shared prefixes, a pool small
enough to evict) while a ZMQ subscriber listens; the batches it missed before connecting
come from the replay endpoint. Then, decoded by vLLM's `KVEventBatch` (its wheel's
`vllm/distributed/kv_events.py`, `tests/vllm_kv_events.py`):

- sequence numbers run 0, 1, 2, ... with no gap, and the first event is AllBlocksCleared;
- every BlockStored names a full block: its hash is the chain of its parent and its tokens,
  its group says what it serves (``sliding_window`` with the window, or ``full_attention``);
- per group, a name is stored, then maybe removed, then maybe stored again, never twice in
  a row; a removed name was stored;
- what is stored and not removed is exactly what the server's prefix cache holds (its
  ``prefix_cache_blocks`` gauge), and the removals are its evictions, one for one.
"""

from __future__ import annotations

import json
import pathlib
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from ringserve.block_manager.prefix import extend_chain
from ringserve.engine import InvalidRequestError
from ringserve.engine.kv_events import KVEventsConfig
from tests.server_utils import Server, free_port, run_server
from tests.tiny_models import B, W, make_checkpoint
from tests.vllm_kv_events import load

FLAGS = ("--dtype", "float32", "--block-size", str(B), "--kv-cache-memory", "256KiB",
         "--max-model-len", "96", "--max-num-seqs", "8")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_checkpoint("gemma3_text", tmp_path_factory.mktemp("ckpt"))


class Subscriber:
    """Collects (sequence number, payload) from the PUB socket in a thread."""

    def __init__(self, ctx: zmq.Context[Any], url: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(url)
        self.got: dict[int, bytes] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(50):
                _topic, seq, payload = self.sock.recv_multipart()
                self.got[int.from_bytes(seq, "big")] = payload


def replay(ctx: zmq.Context[Any], url: str, start: int) -> dict[int, bytes]:
    """vLLM's replay protocol: ask for every batch from ``start``; read until the end."""
    sock = ctx.socket(zmq.DEALER)
    sock.connect(url)
    sock.send_multipart((b"", start.to_bytes(8, "big")))
    out: dict[int, bytes] = {}
    while True:
        assert sock.poll(10_000), "no answer from the replay endpoint"
        _empty, _topic, seq, payload = sock.recv_multipart()
        number = int.from_bytes(seq, "big", signed=True)
        if number == -1:
            break
        out[number] = payload
    sock.close(0)
    return out


@pytest.fixture(scope="module")
def run(ckpt: pathlib.Path, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[tuple[Server, dict[int, bytes]]]:
    pub, rep = free_port(), free_port()
    config = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{rep}",
              "topic": "kv"}
    ctx: zmq.Context[Any] = zmq.Context()
    with run_server(ckpt, *FLAGS, "--kv-events-config", json.dumps(config),
                    log_dir=tmp_path_factory.mktemp("log")) as server:
        sub = Subscriber(ctx, f"tcp://127.0.0.1:{pub}")
        time.sleep(0.5)  # PUB/SUB: what was sent before the subscription is replayed below
        prompts = [f"system {i % 10} says: " + "the ring holds the window " * (1 + i % 4)
                   + f"question {i}" for i in range(200)]

        def complete(prompt: str) -> None:
            r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                           json={"prompt": prompt, "max_tokens": 3 + W // 2,
                                 "ignore_eos": True})
            assert r.status_code == 200, r.text

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(complete, prompts))
        time.sleep(1.0)  # the publisher thread sends what the last steps queued
        sub.stop.set()
        sub.thread.join()
        first_live = min(sub.got)
        batches = {**replay(ctx, f"tcp://127.0.0.1:{rep}", 0), **sub.got}
        assert set(range(first_live, max(sub.got) + 1)) <= set(sub.got)  # nothing lost live
        yield server, batches
    ctx.destroy(0)


def test_the_stream_decodes_with_vllms_classes_and_matches_the_cache(
        run: tuple[Server, dict[int, bytes]]) -> None:
    server, batches = run
    vllm = load()
    decoder = msgspec.msgpack.Decoder(type=vllm.KVEventBatch)
    assert sorted(batches) == list(range(len(batches)))  # sequence numbers: no gap
    events = [e for seq in sorted(batches) for e in decoder.decode(batches[seq]).events]
    assert isinstance(events[0], vllm.AllBlocksCleared)
    live: dict[tuple[int, bytes], bool] = {}
    kinds: dict[int, tuple[str, int | None]] = {}
    counts: Counter[str] = Counter()
    for event in events[1:]:
        counts[type(event).__name__] += 1
        [name] = event.block_hashes
        key = (event.group_idx, name)
        if isinstance(event, vllm.BlockStored):
            assert event.block_size == B and len(event.token_ids) == B
            chain = [] if event.parent_block_hash is None else [event.parent_block_hash]
            extend_chain(chain, [0] * (B * len(chain)) + list(event.token_ids), B)
            assert chain[-1] == name, "a block's name is its parent's and its tokens' chain"
            kind = (event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window)
            assert kinds.setdefault(event.group_idx, kind) == kind
            assert not live.get(key), f"stored twice: {key}"
            live[key] = True
        else:
            assert isinstance(event, vllm.BlockRemoved)
            assert live.get(key), f"removed but not stored: {key}"
            live[key] = False
    # gemma3's layer groups (several of sliding layers, one of full ones) each say theirs
    assert set(kinds.values()) == {("full_attention", None), ("sliding_window", W)}
    stats = server.stats()
    assert counts["BlockRemoved"] > 0, "the pool never evicted: the test is too gentle"
    assert counts["BlockRemoved"] == stats["prefix_cache_evictions_total"]
    assert sum(live.values()) == stats["prefix_cache_blocks"]


def test_the_config_is_vllms_and_is_checked() -> None:
    assert KVEventsConfig.parse(None) is None
    assert KVEventsConfig.parse('{"enable_kv_cache_events": false}') is None
    assert KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "null"}') is None
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true}')
    assert config is not None and (config.publisher, config.endpoint) == ("zmq", "tcp://*:5557")
    for bad, words in [('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
                       ('{"enable_kv_cache_events": true, "endpont": "x"}', "unknown keys"),
                       ("[1]", "JSON object"), ("{", "not JSON")]:
        with pytest.raises(InvalidRequestError, match=words) as err:
            KVEventsConfig.parse(bad)
        assert err.value.param == "kv_events_config"
