"""A fuzzer of request bodies for every route, against one real server process.

Whatever a client sends, the answer is a 2xx or a 4xx with OpenAI's error body, never a
5xx; a 2xx stream ends with ``data: [DONE]`` (an error event before it is OpenAI's body,
and not an internal error); and once the fuzz is over the server still serves, holds no KV
block and has logged no traceback.

Bodies:

- a sweep (no randomness): a small valid body with one field, each field of the route and
  some inside messages and tools, set to one hostile value of each kind: integers past
  int64, ``NaN``/``Infinity``/``1e999``, subnormal floats, lone surrogates (escaped, and as
  CESU-8 bytes), invalid UTF-8, wrong types, deep nesting, huge lists; every failure of a
  route is listed at once;
- field-aware (Hypothesis): a small valid body with one hostile field, or a plausible body
  (hostile *combinations* of valid values: stream with n > 1, echo with logprobs, tools
  with response_format, ...) whose leaves at any depth and fields are made hostile or
  dropped;
- generic JSON of any shape, odd leaves included;
- raw tokens spliced into the JSON text where a value goes (``NaN``, integers of thousands
  of digits, invalid UTF-8 inside strings, nesting past the parser's recursion limit);
- raw bodies: random bytes, truncated or bit-flipped JSON, other encodings and content
  types; and other methods, unknown paths and odd query strings.

`test_every_route_has_a_fuzz_strategy` enumerates the app's routes, so a new route fails
until it is given a strategy here.

Randomness (what CI runs): Hypothesis's own, with no example database (``database=None``):
each run explores new inputs, and none depends on files an earlier run left. A failure
prints the request (method, path, body bytes) and the answer, enough to replay it with
curl, and a ``@reproduce_failure`` blob (``print_blob``) that replays the example;
``pytest --hypothesis-seed=N`` repeats a whole search. The sweep and the known cases
below are the deterministic floor every run covers.
"""

from __future__ import annotations

import copy
import json
import math
import pathlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_utils import Server, run_server
from tests.tiny_models import VOCAB, make_checkpoint

MODEL = "fuzz-model"
# max-model-len 512: a chat with tools carries the hermes preamble (~400 tokens here)
FLAGS = ("--block-size", "4", "--kv-cache-memory", "4MiB", "--max-model-len", "512",
         "--debug-kv", "--max-num-seqs", "32", "--max-num-batched-tokens", "256",
         "--served-model-name", MODEL)

pytestmark = pytest.mark.slow

FUZZ = settings(deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example,
                                       HealthCheck.filter_too_much])


# -- raw JSON text -----------------------------------------------------------------------


class Raw(bytes):
    """JSON text spliced into a body as is, where a value goes."""

    def __repr__(self) -> str:
        b = bytes(self)
        return f"Raw({b[:40]!r}{'...' if len(b) > 40 else ''} [{len(b)} bytes])"


def _nest(depth: int, leaf: bytes = b"1") -> Raw:
    return Raw(b"[" * depth + leaf + b"]" * depth)


def _nest_objects(depth: int) -> Raw:
    return Raw(b'{"a":' * depth + b"0" + b"}" * depth)


RAW_VALUES = [
    Raw(b"NaN"), Raw(b"Infinity"), Raw(b"-Infinity"), Raw(b"1e999"), Raw(b"-1e999"),
    Raw(b"1" + b"0" * 4000),        # parses: an int of 4001 digits
    Raw(b"-" + b"9" * 4300),        # parses: Python's most digits
    Raw(b"1" + b"0" * 5000),        # past Python's int-parsing limit
    Raw(b"1e-400"), Raw(b"-0"), Raw(b"0.0e0"),
    Raw(b'"\xed\xa0\x80"'),         # CESU-8 of U+D800: Python's json decodes it (surrogatepass)
    Raw(b'"a\xed\xbf\xbfb"'),       # CESU-8 of U+DFFF inside text
    Raw(b'"\xff\xfe"'), Raw(b'"\xc0\xaf"'), Raw(b'"\x80"'),  # invalid UTF-8
    Raw(b'"\\ud800"'), Raw(b'"\\udc00\\ud800"'), Raw(b'"x\\udbff"'),  # escaped lone halves
    Raw(b'"\\ud83d\\ude00"'),       # a valid pair
    Raw(b'"\\u0000"'), Raw(b'"\x01\x1f"'),  # control characters (raw ones are invalid JSON)
    _nest(200), _nest(900), _nest(5000), _nest_objects(300), _nest_objects(3000),
    _nest(60, b'{"type": "string"}'),
]

I64 = 2**63
HUGE_INTS = [I64 - 1, I64, -I64, -I64 - 1, 2**64 - 1, 2**64, 2**65, -(2**64), 2**70,
             -(2**70), 10**30, 2**31, -(2**31) - 1, 2**53 + 1, -1, 0]
ODD_TEXT = ["\ud800", "\udfff", "a\ud800b", "\udc00\ud800", "x" * 5 + "\udbff", "\x00",
            "\x00" * 3, "\ufffe", "\uffff", "\ufeff", "\u202e", "\U0010ffff", "²", "٣",
            "¹²³", "1\u0663", "0x10", "1e3", " 1", "-1", "+1", "", " ", "\n", "\t",
            "🚀" * 50, "<tool_call>", "</tool_call>", "<|assistant|>", "<eos>", "{", "}",
            "null", "NaN", "{{ 7*7 }}", "{% for x in y %}", "\\", '"', "x" * 20_000,
            "9" * 30, "9" * 5000]
ODD_FLOATS = [math.nan, math.inf, -math.inf, 1e308, -1e308, 5e-324, 1e-320, 1e-300,
              1e-40, 1e-30, 1e-8, -0.0, 2.0000001, -2.0000001, 100.0000001]

json_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), st.sampled_from(HUGE_INTS),
    st.sampled_from(ODD_FLOATS), st.sampled_from(ODD_TEXT),
    st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=20))
any_json = st.recursive(
    json_leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=6),
        st.dictionaries(st.one_of(st.sampled_from(ODD_TEXT[:20]), st.text(max_size=8)),
                        children, max_size=6)),
    max_leaves=30)
huge_lists = st.sampled_from([
    [0] * 100_000, [1] * 5_000, ["x"] * 5_000, [[1]] * 2_000, [{}] * 2_000, [None] * 1_000,
    [I64] * 100, list(range(VOCAB + 10)), [{"role": "user", "content": "hi"}] * 500])
hostile = st.one_of(
    st.sampled_from(RAW_VALUES), st.sampled_from(HUGE_INTS), st.sampled_from(ODD_FLOATS),
    st.sampled_from(ODD_TEXT), st.integers(), st.floats(), any_json, huge_lists,
    st.sampled_from([None, True, False, [], {}, [None], [[]], [{}], {"": None}]))


FLOAT_FIELDS = {"temperature", "top_p", "frequency_penalty", "presence_penalty",
                "repetition_penalty", "min_p"}
INT_FIELDS = {"seed", "top_k", "min_tokens", "prompt_logprobs", "logprobs", "max_tokens", "n",
              "top_logprobs", "max_completion_tokens"}
hostile_by_kind = {
    "float": st.one_of(st.floats(), st.sampled_from(ODD_FLOATS), st.sampled_from(HUGE_INTS),
                       st.floats(0.0, 1e-30), st.integers(-3, 200)),
    "int": st.one_of(st.sampled_from(HUGE_INTS), st.integers(), st.integers(-3, 600)),
}


def hostile_for(name: str) -> st.SearchStrategy[Any]:
    """Hostile values for the field ``name``: any, or mostly those of its own type."""
    kind = "float" if name in FLOAT_FIELDS else "int" if name in INT_FIELDS else None
    if kind is None:
        return hostile
    return st.one_of(hostile_by_kind[kind], hostile_by_kind[kind], hostile)


def encode(body: Any) -> bytes:
    """JSON text of ``body`` (non-ASCII and lone surrogates as \\u escapes, non-finite
    floats as NaN/Infinity, as Python writes them), `Raw` values spliced in."""
    raws: list[Raw] = []

    def mark(value: Any) -> Any:
        if isinstance(value, Raw):
            raws.append(value)
            return f"\x00raw{len(raws) - 1}\x00"
        if isinstance(value, dict):
            return {k: mark(v) for k, v in value.items()}
        if isinstance(value, list):
            return [mark(v) for v in value]
        return value

    text = json.dumps(mark(body), ensure_ascii=True, allow_nan=True).encode()
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00raw{i}\x00").encode(), bytes(raw), 1)
    return text


# -- plausible bodies ----------------------------------------------------------------------

short_text = st.text(max_size=12)
some_text = st.text(min_size=1, max_size=12)
token_ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8)
small_schema = st.sampled_from([
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "string", "maxLength": 3}, {"type": "array", "items": {"type": "boolean"},
                                         "maxItems": 2},
    {"enum": ["x", "y"]}, {}, {"type": "nope"}, {"type": "integer", "minimum": 2**70},
    {"type": "string", "pattern": "a{2,1}"}, {"$ref": "#/nowhere"},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 2**40}}},
    {"type": "array", "minItems": 9999}, {"anyOf": []}, {"const": "\x00"}])
response_formats = st.one_of(
    st.just({"type": "text"}), st.just({"type": "json_object"}),
    st.builds(lambda s, strict: {"type": "json_schema", "json_schema": {
        "name": "out", "schema": s, "strict": strict}}, small_schema, st.booleans()),
    st.just({"type": "json_schema", "json_schema": {"name": "out"}}))
structured = st.one_of(
    st.builds(lambda s: {"json": s}, small_schema),
    st.builds(lambda s: {"json": json.dumps(s)}, small_schema),
    st.just({"json_object": True}), st.just({"json_object": False}),
    st.sampled_from([{"regex": r"[a-c]{1,3}"}, {"regex": "a{2,1}"}, {"regex": "(a*)*b"},
                     {"regex": ""}, {"regex": "(?P<x>a)"}, {"regex": "\\"}]),
    st.builds(lambda c: {"choice": c}, st.lists(short_text, max_size=3)),
    st.sampled_from([{"grammar": 'root ::= "a" | "b"'}, {"grammar": "root ::="},
                     {"grammar": "nonsense"}, {"grammar": 'x ::= "a"'}]),
    st.just({}), st.just({"regex": "a", "choice": ["a"]}))

SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "seed": st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    "stop": st.one_of(st.none(), short_text, st.lists(short_text, max_size=5)),
    "stream": st.booleans(),
    "stream_options": st.one_of(st.none(), st.builds(lambda b: {"include_usage": b},
                                                     st.booleans())),
    "temperature": st.floats(0.0, 2.0),
    "top_p": st.floats(0.01, 1.0),
    "user": short_text,
    "frequency_penalty": st.floats(-2.0, 2.0),
    "presence_penalty": st.floats(-2.0, 2.0),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB + 5).map(str), st.floats(-100, 100),
                                  max_size=3),
    "top_k": st.integers(-1, 50),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, VOCAB + 5), max_size=3),
    "repetition_penalty": st.floats(0.5, 2.0),
    "min_p": st.floats(0.0, 1.0),
    "min_tokens": st.integers(0, 3),
    "bad_words": st.lists(short_text, max_size=3),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 3)),
    "response_format": response_formats,
    "structured_outputs": structured,
}
prompts = st.one_of(some_text, token_ids, st.lists(some_text, min_size=1, max_size=3),
                    st.lists(token_ids, min_size=1, max_size=3))

COMPLETION = {
    **SAMPLING,
    "prompt": prompts,
    "model": st.sampled_from([None, MODEL, "other-model"]),
    "echo": st.booleans(),
    "logprobs": st.one_of(st.none(), st.integers(0, 5)),
    "max_tokens": st.integers(1, 6),
    "n": st.integers(1, 3),
    "suffix": st.sampled_from([None, ""]),
}
tool_names = st.sampled_from(["f", "get_weather", "a.b-c", "x" * 64])
tools = st.lists(st.builds(
    lambda name, params, desc: {"type": "function", "function": {
        "name": name, "parameters": params, **({"description": desc} if desc else {})}},
    tool_names, st.one_of(st.none(), small_schema), st.one_of(st.none(), short_text)),
    max_size=2)
tool_calls = st.lists(st.builds(
    lambda name, args: {"id": "call_1", "type": "function",
                        "function": {"name": name, "arguments": args}},
    tool_names, st.sampled_from(['{"a": 1}', "{", "", "null", '"\\ud800"'])),
    min_size=1, max_size=2)
content = st.one_of(short_text, st.lists(st.builds(lambda t: {"type": "text", "text": t},
                                                   short_text), max_size=2))
message = st.one_of(
    st.builds(lambda r, c: {"role": r, "content": c},
              st.sampled_from(["system", "developer", "user", "assistant"]), content),
    st.builds(lambda calls: {"role": "assistant", "content": None, "tool_calls": calls},
              tool_calls),
    st.builds(lambda c: {"role": "tool", "content": c, "tool_call_id": "call_1"}, content),
    st.builds(lambda c, n: {"role": "user", "content": c, "name": n}, content, short_text))
messages = st.lists(message, min_size=1, max_size=3)
CHAT = {
    **SAMPLING,
    "messages": messages,
    "model": st.sampled_from([None, MODEL, "other-model"]),
    "logprobs": st.booleans(),
    "top_logprobs": st.one_of(st.none(), st.integers(0, 3)),
    "max_completion_tokens": st.integers(1, 6),
    "max_tokens": st.integers(1, 6),
    "n": st.integers(1, 3),
    "tools": tools,
    "tool_choice": st.one_of(
        st.sampled_from(["none", "auto", "required"]),
        st.builds(lambda n: {"type": "function", "function": {"name": n}}, tool_names)),
    "parallel_tool_calls": st.booleans(),
    "add_generation_prompt": st.booleans(),
}
TOKENIZE = {"model": st.sampled_from([None, MODEL, "other-model"]), "prompt": short_text,
            "messages": messages, "add_special_tokens": st.booleans(),
            "add_generation_prompt": st.booleans()}
DETOKENIZE = {"model": st.sampled_from([None, MODEL, "other-model"]), "tokens": token_ids}

# route -> (its required fields, all its fields): a plausible body has the one and a few of
# the other; max_tokens is always there in generation bodies (small), unless the fuzz drops
# it. Any name here may also be given a hostile value.
POST_FIELDS: dict[str, tuple[st.SearchStrategy[dict[str, Any]],
                             dict[str, st.SearchStrategy[Any]]]] = {
    "/v1/completions": (st.fixed_dictionaries({"prompt": prompts,
                                               "max_tokens": st.integers(1, 6)}), COMPLETION),
    "/v1/chat/completions": (st.fixed_dictionaries({"messages": messages,
                                                    "max_tokens": st.integers(1, 6)}), CHAT),
    "/tokenize": (st.one_of(st.fixed_dictionaries({"prompt": short_text}),
                            st.fixed_dictionaries({"messages": messages})), TOKENIZE),
    "/detokenize": (st.fixed_dictionaries({"tokens": token_ids}), DETOKENIZE),
}
EXTRA_KEYS = ["unknown_field", "functions", "best_of", "", "\ud800", "prompt ", "PROMPT"]


@st.composite
def fuzzed_bodies(draw: st.DrawFn, path: str) -> Any:
    """A body for ``path``: a small valid one with one field made hostile (30%), a
    plausible one (any combination of valid values) with leaves and fields made hostile
    or dropped (60%), or any JSON value at all (10%)."""
    mode = draw(st.integers(0, 9))
    if mode == 0:
        return draw(st.one_of(any_json, hostile))
    required, fields = POST_FIELDS[path]
    body = draw(required)
    if mode <= 3:  # one field at a time: a small valid body and one hostile field
        name = draw(st.sampled_from([*sorted(fields), *EXTRA_KEYS]))
        return {**copy.deepcopy(body), name: draw(hostile_for(name))}
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=6, unique=True)):
        body[name] = draw(fields[name])
    if "stream" in fields and draw(st.integers(0, 2)) == 0:  # a third of them stream
        body["stream"] = True
    body = copy.deepcopy(body)  # strategies may share objects: mutate a copy
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 2]))):  # a leaf at any depth
        _poison_leaf(draw, body)
    if draw(st.integers(0, 4)) == 0:  # hostile values one level down: in a message, a tool
        _poison_nested(draw, body)
    names = [*sorted(fields), *EXTRA_KEYS]
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 1, 2, 3]))):
        name = draw(st.sampled_from(names))
        if draw(st.integers(0, 7)) == 0:
            body.pop(name, None)
        else:
            body[name] = draw(hostile_for(name))
    return body


with_surrogate = st.builds(lambda text, at, half: text[:at] + half + text[at:],
                          short_text, st.integers(0, 12),
                          st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff"]))
hostile_like = {
    str: st.one_of(with_surrogate, st.sampled_from(ODD_TEXT)),
    int: st.one_of(st.sampled_from(HUGE_INTS), st.integers()),
    float: st.one_of(st.sampled_from(ODD_FLOATS), st.floats()),
}


def _poison_leaf(draw: st.DrawFn, body: dict[str, Any]) -> None:
    """Replace one leaf of ``body`` (a prompt, a message's content, a stop string, a token
    id, ...) by a hostile value of its own type: text with a lone surrogate, an integer
    past int64, a non-finite float."""
    leaves: list[tuple[Any, Any, type]] = []
    stack: list[Any] = [body]
    while stack:
        node = stack.pop()
        pairs = list(node.items()) if isinstance(node, dict) else list(enumerate(node))
        for key, value in pairs:
            if isinstance(value, (dict, list)):
                stack.append(value)
            elif type(value) in hostile_like:
                leaves.append((node, key, type(value)))
    if leaves:
        node, key, kind = draw(st.sampled_from(leaves))
        node[key] = draw(hostile_like[kind])


def _poison_nested(draw: st.DrawFn, body: dict[str, Any]) -> None:
    holders: list[dict[str, Any]] = []
    for value in body.values():
        items = value if isinstance(value, list) else [value]
        for item in items:
            if isinstance(item, dict):
                holders.append(item)
                holders.extend(v for v in item.values() if isinstance(v, dict))
    if holders:
        target = draw(st.sampled_from(holders))
        key = draw(st.sampled_from([*sorted(target), "extra", "content", "name"]))
        target[key] = draw(hostile)


# -- checking answers ----------------------------------------------------------------------


def check_error_body(r: httpx.Response, sent: str) -> None:
    try:
        body = r.json()
    except ValueError:
        raise AssertionError(f"{sent}\nanswered {r.status_code}, not JSON: "
                             f"{r.text[:500]!r}") from None
    assert isinstance(body, dict) and set(body) == {"error"}, f"{sent}\n{r.text[:1000]}"
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, f"{sent}\n{r.text[:1000]}"
    assert isinstance(err["message"], str) and err["message"], f"{sent}\n{r.text[:1000]}"
    assert isinstance(err["type"], str) and err["type"], f"{sent}\n{r.text[:1000]}"
    assert err["param"] is None or isinstance(err["param"], str), f"{sent}\n{r.text[:1000]}"


def check_stream(text: str, sent: str) -> None:
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", f"{sent}\nstream did not end with [DONE]: " \
                                              f"{text[-1000:]!r}"
    for event in events[:-1]:
        chunk = json.loads(event)
        if "error" in chunk:
            err = chunk["error"]
            assert set(err) == {"message", "type", "param", "code"}, f"{sent}\n{event}"
            assert err["type"] != "server_error", f"{sent}\nan internal error event: {event}"


def send(client: httpx.Client, method: str, path: str, content: bytes | None = None,
         headers: dict[str, str] | None = None, params: Any = None) -> None:
    """Send one request and check its answer as the module docstring says."""
    shown = content if content is None or len(content) <= 3000 else (
        content[:1500] + b" ... " + content[-500:])
    sent = f"{method} {path} params={params!r} headers={headers!r}\nbody={shown!r}"
    # NOTE: a connection each: after a 500 the server drops its connection, which would
    # fail the next request instead of this one
    with client.stream(method, path, content=content,
                       headers={**(headers or {}), "connection": "close"},
                       params=params) as r:
        text = r.read().decode("utf-8", "replace")
    assert r.status_code < 500, f"{sent}\nanswered {r.status_code}: {text[:2000]}"
    if r.status_code >= 400 and path != "/health":  # /health's 503 is its own body
        check_error_body(r, sent)
    elif 200 <= r.status_code < 300 and r.headers.get("content-type", "").startswith(
            "text/event-stream"):
        check_stream(text, sent)
    elif 200 <= r.status_code < 300 and "json" in r.headers.get("content-type", ""):
        json.loads(text)


# -- the routes ----------------------------------------------------------------------------

GET_ROUTES = ["/v1/models", "/health", "/version", "/metrics", "/openapi.json", "/docs",
              "/docs/oauth2-redirect", "/redoc", "/v1/admission"]
POST_ROUTES = sorted(POST_FIELDS)
FUZZED = {("GET", p) for p in GET_ROUTES} | {("POST", p) for p in POST_ROUTES}


def app_routes() -> set[tuple[str, str]]:
    """(method, path) of every route the app serves (HEAD aside)."""
    from ringserve.server.app import create_app
    from ringserve.server.state import ServeArgs

    out: set[tuple[str, str]] = set()

    def visit(routes: list[Any], prefix: str) -> None:
        for route in routes:
            if hasattr(route, "original_router"):  # FastAPI's included router
                visit(route.original_router.routes,
                      prefix + getattr(route.include_context, "prefix", ""))
            elif hasattr(route, "path"):
                for method in getattr(route, "methods", None) or {"GET"}:
                    if method != "HEAD":
                        out.add((method, prefix + route.path))

    app = create_app(ServeArgs(model="unused"))
    visit(list(app.routes), "")
    out |= {(m.upper(), p) for p, ops in app.openapi()["paths"].items() for m in ops}
    return out


def test_every_route_has_a_fuzz_strategy() -> None:
    missing = app_routes() - FUZZED
    assert not missing, f"routes with no fuzz strategy in tests/test_fuzz_api.py: {missing}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    ckpt = make_checkpoint("gemma3_text", tmp_path_factory.mktemp("ckpt"), eos=True)
    with run_server(ckpt, *FLAGS, log_dir=tmp_path_factory.mktemp("log")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


EXAMPLES = {"/v1/completions": 500, "/v1/chat/completions": 500, "/tokenize": 300,
            "/detokenize": 200}


def _body_test(path: str) -> Callable[[httpx.Client], None]:
    @settings(FUZZ, max_examples=EXAMPLES[path])
    @given(data=st.data())
    def run(client: httpx.Client, data: st.DataObject) -> None:
        body = data.draw(fuzzed_bodies(path), label="body")
        send(client, "POST", path, encode(body), {"content-type": "application/json"})

    return run


# One of each kind of hostile value, for the sweep of every field.
SWEEP_VALUES: list[Any] = [
    I64, -I64 - 1, 2**64, 2**70, -(2**70), Raw(b"1" + b"0" * 4000), Raw(b"1" + b"0" * 5000),
    Raw(b"NaN"), Raw(b"Infinity"), Raw(b"-Infinity"), Raw(b"1e999"), 5e-324, 1e-40, 1e308,
    -1, 0, 1.5, "\ud800", "a\udfffb", Raw(b'"\xed\xa0\x80"'), Raw(b'"\xff"'), "", "x" * 20_000,
    "²", "\x00", None, True, [], {}, ["\ud800"], [2**64], [Raw(b"NaN")], {"\ud800": 1},
    {"5": Raw(b"NaN")}, {"5": 2**64}, _nest(100), _nest_objects(100), [0] * 10_000]


# fields inside fields, swept too (see `_with`): a message's, a content part's, a tool's
NESTED_FIELDS = {
    "/v1/chat/completions": ["messages.0.content", "messages.0.name",
                             "messages.0.content.0.text", "tools.0.function.parameters"],
    "/tokenize": ["messages.0.content"],
}


def _with(base: dict[str, Any], name: str, value: Any) -> dict[str, Any]:
    """``base`` with the field ``name`` (dotted: into a message or a tool) set to ``value``."""
    if "." not in name:
        return {**base, name: value}
    if name.startswith("tools."):
        return {**base, "tools": [{"type": "function", "function": {"name": "f",
                                                                    "parameters": value}}],
                "tool_choice": "required"}
    message: dict[str, Any] = {"role": "user", "content": "hi"}
    if name == "messages.0.content.0.text":
        message["content"] = [{"type": "text", "text": value}]
    else:
        message[name.rsplit(".", 1)[1]] = value
    return {**{k: v for k, v in base.items() if k != "prompt"}, "messages": [message]}


@pytest.mark.parametrize("path", POST_ROUTES)
def test_every_field_with_every_kind_of_hostile_value(client: httpx.Client, path: str) -> None:
    """The systematic part: a small valid body with one field (each the route has, and an
    unknown one) set to one hostile value of each kind; every failure is listed."""
    base = {"/v1/completions": {"prompt": "hi", "max_tokens": 2},
            "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}],
                                     "max_tokens": 2},
            "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [5, 6]}}[path]
    names = [*sorted(POST_FIELDS[path][1]), "unknown_field", *NESTED_FIELDS.get(path, [])]
    failures = []
    for name in names:
        for value in SWEEP_VALUES:
            try:
                send(client, "POST", path, encode(_with(base, name, value)),
                     {"content-type": "application/json"})
            except AssertionError as err:
                answer = " ".join(str(err).splitlines()[2:3])[:200]
                failures.append(f"{name} = {value!r:.50}: {answer}")
    assert not failures, f"{len(failures)} failures on {path}:\n" + "\n".join(failures)


@pytest.mark.parametrize("path", POST_ROUTES)
def test_fuzzed_bodies_never_answer_5xx(client: httpx.Client, path: str) -> None:
    _body_test(path)(client)


CONTENT_TYPES = [None, "application/json", "application/json; charset=utf-8",
                 "application/json; charset=latin-1", "application/vnd.x+json", "text/plain",
                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                 "application/octet-stream", "application/json\x7f", ";;;"]


@st.composite
def raw_bodies(draw: st.DrawFn, path: str) -> bytes:
    """Bytes that are not the JSON of a body, or are it in an odd way."""
    valid = encode(draw(POST_FIELDS[path][0]))
    kind = draw(st.integers(0, 6))
    if kind == 0:
        return draw(st.binary(max_size=200))
    if kind == 1:
        return valid[: draw(st.integers(0, max(0, len(valid) - 1)))]
    if kind == 2:  # a byte changed
        at = draw(st.integers(0, len(valid) - 1))
        return valid[:at] + bytes([draw(st.integers(0, 255))]) + valid[at + 1:]
    if kind == 3:
        return draw(st.sampled_from([b"", b"null", b"[]", b"{}", b'"x"', b"1", b"NaN",
                                     b"\xef\xbb\xbf" + valid, b"{" * 100_000,
                                     b"[" * 5000 + b"]" * 5000, valid + b"garbage",
                                     valid + valid, valid.replace(b"{", b"{,", 1)]))
    if kind == 4:
        return valid.decode().encode(draw(st.sampled_from(
            ["utf-16", "utf-16-le", "utf-32", "latin-1", "cp500"])))
    if kind == 5:  # a raw value in place of a field's
        fields = json.loads(valid)
        return encode({**fields, draw(st.sampled_from(sorted(fields))):
                       draw(st.sampled_from(RAW_VALUES))})
    return valid


@settings(FUZZ, max_examples=300)
@given(data=st.data())
def test_raw_bodies_never_answer_5xx(client: httpx.Client, data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(POST_ROUTES), label="path")
    body = data.draw(raw_bodies(path), label="body")
    content_type = data.draw(st.sampled_from(CONTENT_TYPES), label="content-type")
    send(client, "POST", path, body,
         {"content-type": content_type} if content_type is not None else None)


odd_query = st.sampled_from([*ODD_TEXT[:30], "model", "stream", "x" * 5000]).map(
    lambda t: t.encode("utf-8", "surrogatepass").decode("utf-8", "replace"))


@settings(FUZZ, max_examples=150)
@given(data=st.data())
def test_other_methods_and_queries_never_answer_5xx(client: httpx.Client,
                                                    data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(GET_ROUTES + POST_ROUTES + ["/v1/nope", "/v1/x/%ff"]),
                     label="path")
    method = data.draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
                       label="method")
    if method == "GET" and path in POST_ROUTES:
        method = "POST"
    params = data.draw(st.dictionaries(odd_query, odd_query, max_size=3), label="query")
    body = data.draw(st.one_of(st.none(), st.binary(max_size=50)), label="body")
    send(client, method, path, body, None, params)


admission_value = st.one_of(
    st.integers(-2**70, 2**70), st.integers(-3, 600), odd_query,
    st.sampled_from(["1e3", "0x10", "\uff11\uff12", " 5", "5.0", "", "nan"]))


@settings(FUZZ, max_examples=150)
@given(prompt=admission_value, out=admission_value, drop=st.integers(0, 2))
def test_admission_queries_never_answer_5xx(client: httpx.Client, prompt: Any, out: Any,
                                            drop: int) -> None:
    params = {"prompt_tokens": str(prompt), "max_tokens": str(out)}
    if drop:
        params.pop("prompt_tokens" if drop == 1 else "max_tokens")
    r = client.get("/v1/admission", params=params)
    assert r.status_code in (200, 400), (params, r.status_code, r.text[:300])
    if r.status_code == 200:
        body = r.json()
        assert body["fit_now"] <= body["fit_empty"] and isinstance(body["admit_now"], bool)
    else:
        assert r.json()["error"]["param"] in ("prompt_tokens", "max_tokens")


C, CHAT = "/v1/completions", "/v1/chat/completions"


def _nested(depth: int) -> Any:
    value: Any = {"type": "integer"}
    for _ in range(depth):
        value = {"a": value}
    return value


# the inputs found by hand and by this fuzzer: 400 naming the field
KNOWN_BAD: list[tuple[str, str, Any, str | None]] = [
    ("seed past int64", C, {"prompt": "x", "seed": 2**70}, "seed"),
    ("seed just past int64", C, {"prompt": "x", "seed": 2**63}, "seed"),
    ("seed below int64", C, {"prompt": "x", "seed": -(2**63) - 1}, "seed"),
    ("lone surrogate prompt", C, {"prompt": "\ud800"}, "prompt"),
    ("lone surrogate in a prompt list", C, {"prompt": ["ok", "a\udfffb"]}, "prompt.1"),
    ("lone surrogate chat content", CHAT, {"messages": [{"role": "user", "content": "\ud800"}]},
     "messages.0.content"),
    ("lone surrogate content part", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "\udc00"}]}]}, "messages.0.content.0.text"),
    ("lone surrogate tokenize", "/tokenize", {"prompt": "x\ud800"}, "prompt"),
    ("lone surrogate tokenize message", "/tokenize", {"messages": [
        {"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    ("lone surrogate stop", C, {"prompt": "x", "stop": ["\ud800"]}, "stop.0"),
    ("lone surrogate bad_words", C, {"prompt": "x", "bad_words": ["\ud800"]}, "bad_words.0"),
    ("lone surrogate in a key", C, {"prompt": "x", "\ud800": 1}, None),
    ("CESU-8 surrogate bytes", C, {"prompt": Raw(b'"\xed\xa0\x80"')}, "prompt"),
    ("NaN temperature", C, {"prompt": "x", "temperature": Raw(b"NaN")}, "temperature"),
    ("Infinity top_p", C, {"prompt": "x", "top_p": Raw(b"Infinity")}, "top_p"),
    ("1e999 frequency_penalty", C, {"prompt": "x", "frequency_penalty": Raw(b"1e999")},
     "frequency_penalty"),
    ("-Infinity min_p", CHAT, {"messages": [{"role": "user", "content": "x"}],
                               "min_p": Raw(b"-Infinity")}, "min_p"),
    ("NaN logit_bias value", C, {"prompt": "x", "logit_bias": {"5": Raw(b"NaN")}},
     "logit_bias.5"),
    ("NaN in a JSON schema", C, {"prompt": "x", "structured_outputs": {
        "json": {"type": "number", "maximum": Raw(b"NaN")}}}, "structured_outputs.json.maximum"),
    ("logit_bias key a superscript digit", C, {"prompt": "x", "logit_bias": {"²": 1}},
     "logit_bias"),
    ("logit_bias key past int64", C, {"prompt": "x", "logit_bias": {"9" * 30: 1}},
     "logit_bias"),
    ("token id past int64", C, {"prompt": [1, 2**64]}, "prompt.1"),
    ("max_tokens past int64", C, {"prompt": "x", "max_tokens": 2**64}, "max_tokens"),
    ("top_k past int64", C, {"prompt": "x", "top_k": 2**63}, "top_k"),
    ("n past int64", CHAT, {"messages": [{"role": "user", "content": "x"}], "n": -(2**70)}, "n"),
    ("an int of 4001 digits", C, {"prompt": "x", "min_tokens": Raw(b"1" + b"0" * 4000)},
     "min_tokens"),
    ("detokenize past int64", "/detokenize", {"tokens": [2**63]}, "tokens.0"),
    ("nesting past the limit", C, {"prompt": "x", "structured_outputs": {"json": _nested(70)}},
     "structured_outputs.json" + ".a" * 62),  # the value 64 levels under the body
]


def _check_400(r: httpx.Response, param: str | None) -> None:
    assert r.status_code == 400, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param, body
    assert body["error"]["message"] and body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("path", "body", "param"), [k[1:] for k in KNOWN_BAD],
                         ids=[k[0] for k in KNOWN_BAD])
def test_known_bad_inputs_are_400s_naming_the_field(client: httpx.Client, path: str,
                                                    body: Any, param: str | None) -> None:
    _check_400(client.post(path, content=encode(body),
                           headers={"content-type": "application/json"}), param)


# valid at the edges: served
KNOWN_GOOD: list[tuple[str, str, Any]] = [
    ("seed int64 max, n 3", C, {"prompt": "x", "max_tokens": 2, "seed": 2**63 - 1, "n": 3}),
    ("seed int64 min", C, {"prompt": "x", "max_tokens": 2, "seed": -(2**63)}),
    ("a subnormal temperature", C, {"prompt": "x", "max_tokens": 2, "temperature": 5e-324}),
    ("a subnormal repetition_penalty", C, {"prompt": "x x x", "max_tokens": 2,
                                            "repetition_penalty": 1e-300}),
    ("a surrogate pair", C, {"prompt": "\ud83d\ude80", "max_tokens": 2}),
    ("a lone surrogate escaped in tool call arguments", CHAT, {"max_tokens": 2, "messages": [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
         "function": {"name": "f", "arguments": '"\\ud800"'}}]},
        {"role": "tool", "content": "ok", "tool_call_id": "c"}]}),
    # the arguments are passed on as text when they do not parse (/tokenize: no length cap)
    ("deep and huge tool call arguments", "/tokenize", {"messages": [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {
                "name": "f", "arguments": "[" * 3000 + "]" * 3000}},
            {"id": "d", "type": "function", "function": {"name": "f", "arguments": "1" * 5000}},
            {"id": "e", "type": "function", "function": {"name": "f", "arguments": "[NaN]"}}]}]}),
]


@pytest.mark.parametrize(("path", "body"), [k[1:] for k in KNOWN_GOOD],
                         ids=[k[0] for k in KNOWN_GOOD])
def test_valid_edge_inputs_are_served(client: httpx.Client, path: str, body: Any) -> None:
    r = client.post(path, content=encode(body), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_the_server_still_serves_after_the_fuzz(server: Server, client: httpx.Client) -> None:
    r = client.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    assert client.get("/health").status_code == 200
    stats: dict[str, float] = {}
    for _ in range(200):  # aborted streams give their blocks back on the loop's next turn
        stats = server.stats()
        if stats["kv_blocks_used"] == 0 and stats["num_requests_running"] == 0:
            break
        time.sleep(0.05)
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_reserved"] == 0, stats
    assert stats["num_requests_running"] == 0 and stats["kv_read_misses_total"] == 0, stats
    log = pathlib.Path(server.log).read_text(errors="replace")
    assert "Traceback" not in log, log[-6000:]
