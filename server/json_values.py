"""What every JSON value of a request body must be, wherever it stands: checked once, before
any field is validated (`server.protocol.RequestModel`), so a whole class of bad input is a
400 naming its field rather than an error deep inside (a tokenizer, torch, a template).
"""

from __future__ import annotations

import math
import re
from typing import Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_JSON_DEPTH = 64
"""Nesting deeper than this is refused anywhere in a body (a JSON schema of tools or
response_format is the deepest a real client sends, a few levels): deeper values would
reach recursive code (json.dumps, jsonschema, xgrammar) past its limits."""

_SURROGATE = re.compile("[\ud800-\udfff]")


def show(value: Any, limit: int = 40) -> str:
    text = repr(value) if not isinstance(value, int) or value.bit_length() < 200 else (
        f"an integer of {len(str(abs(value)))} digits")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def json_value_problem(value: Any, root: str = "") -> tuple[str | None, str] | None:
    """The first problem (field path, message) of a parsed JSON value, in document order,
    or None. A body is refused when it holds anything the server could not honour or
    encode again as it got it:

    - text with a lone UTF-16 surrogate (JSON's ``"\\ud800"`` escape parses to one; no
      tokenizer, template or UTF-8 encoder accepts it),
    - an integer outside the signed 64-bit range (every integer field is one of torch's
      int64s or smaller: seed, token ids, counts),
    - NaN or +-Infinity (Python's parser reads the ``NaN``/``Infinity`` literals that JSON
      does not have, and ``1e999`` as infinity),
    - nesting deeper than `MAX_JSON_DEPTH`.

    Paths are pydantic's locations joined by dots (``messages.0.content``); the body's
    top level is ``None``. The walk is iterative, so any depth the JSON parser allowed
    is safe to look at.
    """
    stack: list[tuple[Any, str, int]] = [(value, root, 0)]
    while stack:
        v, path, depth = stack.pop()
        where = path or "body"
        if isinstance(v, str):
            bad = _SURROGATE.search(v)
            if bad is not None:
                return path or None, (
                    f"{where}: lone UTF-16 surrogate U+{ord(bad.group()):04X} at index "
                    f"{bad.start()} is not valid Unicode text (a character outside the Basic "
                    "Multilingual Plane is written as a high and low surrogate pair)")
        elif isinstance(v, bool) or v is None:
            continue
        elif isinstance(v, int):
            if not INT64_MIN <= v <= INT64_MAX:
                return path or None, (
                    f"{where}: {show(v)} is out of range; integers must fit in a signed "
                    f"64-bit integer, [{INT64_MIN}, {INT64_MAX}]")
        elif isinstance(v, float):
            if not math.isfinite(v):
                shown = "NaN" if math.isnan(v) else "Infinity" if v > 0 else "-Infinity"
                return path or None, (
                    f"{where}: {shown} is not a JSON number (NaN and Infinity are refused, "
                    "and so are numbers too large for a double)")
        elif isinstance(v, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                return path or None, f"{where}: nested deeper than {MAX_JSON_DEPTH} levels"
            if isinstance(v, list) and _plain_ints(v):
                continue  # a list of token ids: checked at C speed
            items = list(v.items()) if isinstance(v, dict) else list(enumerate(v))
            for key, _ in items:
                if isinstance(key, str) and _SURROGATE.search(key):
                    return path or None, (
                        f"{where}: the key {show(key)} holds a lone UTF-16 surrogate, "
                        "which is not valid Unicode text")
            stack.extend((item, f"{path}.{key}" if path else str(key), depth + 1)
                         for key, item in reversed(items))
    return None


def _plain_ints(values: list[Any]) -> bool:
    """True when ``values`` are all ints (not bools) in int64's range."""
    return (all(type(x) is int for x in values)
            and (not values or (min(values) >= INT64_MIN and max(values) <= INT64_MAX)))
