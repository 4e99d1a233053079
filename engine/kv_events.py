"""KV events: vLLM's stream of what the prefix cache gained and lost, for a fleet's router
(``--kv-events-config``; docs/metrics.md, "KV events").

The block pool records each block that becomes findable under a name (`BlockStored`: its
name, its parent's, its tokens) and each name it evicts (`BlockRemoved`); the engine takes
them after every step and, if any, publishes one batch. The wire is vLLM's, so routers built
for it (llm-d's KV-cache indexer, Dynamo's) read it as they read vLLM's:

- ZMQ PUB (bound for ``tcp://*:port``, connected otherwise), multipart frames ``[topic,
  sequence number (8 bytes, big-endian, from 0), msgpack(batch)]``;
- a batch is the array ``[timestamp, events, data_parallel_rank]``, an event a map tagged by
  ``"type"``: ``BlockStored`` (``block_hashes``, ``parent_block_hash``, ``token_ids``,
  ``block_size``, ``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``,
  ...), ``BlockRemoved`` (``block_hashes``, ``group_idx``), ``AllBlocksCleared``;
- an optional ROUTER ``replay_endpoint``: a subscriber that saw a gap in the sequence numbers
  sends ``[b"", start (8 bytes)]`` and gets every batch it still holds from ``start`` on,
  then an end frame whose sequence number is -1.

Each layer group publishes its own blocks (``group_idx``): a sliding group's block serves
only queries within its window of the block's end (``kv_cache_spec_sliding_window``), so a
router scores a prefix hit per group as our admission does (docs/design.md §9). The first
batch of an engine's life is ``AllBlocksCleared``: a restarted server starts empty, and a
router's index of its previous life must go.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

from ringserve.block_manager.budget import KVCacheSpec
from ringserve.engine.config import json_object
from ringserve.engine.errors import InvalidRequestError

logger = logging.getLogger("ringserve.engine")

# NOTE: vLLM's name for the engine's own KV cache tier, whatever the device (its CPU
# backend says "GPU" too); "CPU" there means a CPU offload tier, which we do not have.
MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (the same keys and defaults)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; default: zmq when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, value: str | dict[str, Any] | None) -> KVEventsConfig | None:
        """The config from its JSON text (or a dict); None when events are off.

        Raises:
            InvalidRequestError: not a JSON object, an unknown key, or a bad value.
        """
        if value is None:
            return None
        raw = json_object(value, "kv_events_config", {f.name for f in fields(cls)})
        config = cls(**raw)
        publisher = config.publisher or ("zmq" if config.enable_kv_cache_events else "null")
        if publisher not in ("zmq", "null"):
            raise InvalidRequestError(f"kv_events_config.publisher must be zmq or null, got "
                                      f"{publisher!r}", param="kv_events_config")
        if not config.enable_kv_cache_events or publisher == "null":
            return None
        return cls(**{**raw, "publisher": publisher})


def block_stored(name: bytes, parent: bytes | None, tokens: list[int], block_size: int,
                 group: int, window: int | None) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": [name], "parent_block_hash": parent,
            "token_ids": tokens, "block_size": block_size, "lora_id": None,
            "medium": MEDIUM, "lora_name": None, "group_idx": group,
            "kv_cache_spec_kind": "full_attention" if window is None else "sliding_window",
            "kv_cache_spec_sliding_window": window}


def block_removed(name: bytes, group: int) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": [name], "medium": MEDIUM,
            "group_idx": group}


ALL_BLOCKS_CLEARED: dict[str, Any] = {"type": "AllBlocksCleared"}


def wire_events(raw: list[tuple[Any, ...]], spec: KVCacheSpec) -> list[dict[str, Any]]:
    """The block pool's events (`KVCacheManager.take_events`) as vLLM's, each BlockStored
    with its group's window."""
    out = []
    for event in raw:
        group, name = event[1]
        if event[0] == "stored":
            parent, tokens = event[2]
            out.append(block_stored(name, parent, tokens, spec.block_size, group,
                                    spec.groups[group].window))
        else:
            out.append(block_removed(name, group))
    return out


class ZmqPublisher:
    """Publishes event batches from a thread (the engine's step only queues them).

    Raises:
        InvalidRequestError: the endpoint cannot be bound or connected.
    """

    def __init__(self, config: KVEventsConfig) -> None:
        import zmq

        self.config = config
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            _open(self._pub, config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as err:
            self._ctx.destroy(linger=0)
            raise InvalidRequestError(f"kv_events_config: cannot open "
                                      f"{config.endpoint!r}: {err}",
                                      param="kv_events_config") from None
        self._topic = config.topic.encode()
        self._queue: queue.Queue[list[dict[str, Any]] | None] = queue.Queue(
            config.max_queue_size)
        self._sent: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._thread = threading.Thread(target=self._run, name="ringserve-kv-events",
                                        daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s%s", config.endpoint,
                    f" (replay on {config.replay_endpoint})" if self._replay else "")

    def publish(self, events: list[dict[str, Any]]) -> None:
        """Queue one step's events (waits while ``max_queue_size`` batches are queued, as
        vLLM's does: an event is never dropped here)."""
        self._queue.put(events)

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (for up to ``timeout`` seconds), then close."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._ctx.destroy(linger=int(timeout * 1000))

    def _run(self) -> None:
        import msgpack

        seq = 0
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._answer_replay()
            try:
                events = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if events is None:
                return
            payload = msgpack.packb([time.time(), events, 0], use_bin_type=True)
            number = seq.to_bytes(8, "big")
            self._pub.send_multipart((self._topic, number, payload))
            self._sent.append((seq, payload))
            seq += 1

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._sent):
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"),
                                             payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


def _open(socket: Any, endpoint: str) -> None:
    """Bind a wildcard, ipc or inproc endpoint; connect to any other (as vLLM does)."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        socket.bind(endpoint)
    else:
        socket.connect(endpoint)
