"""The engine core in its own process (issue 25, part 1; docs/design.md §11).

- The same requests give the same answers, token for token, whether the engine loop runs in
  the core process or in a thread of the API process: greedy and seeded sampling, ``n``,
  logprobs, stop strings, a JSON-schema constraint (compiled in the API process, sent as
  text), streaming.
- Killing the core mid-stream ends every open stream with an error within seconds, /health
  says the engine died, and the server exits 1 (for its supervisor to restart it).
- The core ignores the Ctrl-C that reaches the whole process group, and goes with the server
  on SIGTERM: no orphan holds the model's memory.
- A core that cannot start says why on /health, as the in-process engine did, and the server
  exits 1 within seconds: killed while it loads, a truncated shard, a KV cache too small.
- A core whose API process is SIGKILLed while the engine loads exits at once, instead of
  loading on, holding the model's memory, until it says "ready" to nobody.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from tests.server_utils import Server, free_port, run_server
from tests.tiny_models import make_checkpoint

FLAGS = ("--dtype", "float32", "--block-size", "4", "--kv-cache-memory", "4MiB",
         "--max-model-len", "256", "--max-num-batched-tokens", "64", "--debug-kv")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_checkpoint("gemma3_text", tmp_path_factory.mktemp("ckpt"), eos=True)


def core_pids(server: Server) -> list[int]:
    """The server's engine core processes (multiprocessing's spawned children)."""
    return _spawned(server.process.pid)


def _spawned(pid: int) -> list[int]:
    """The children of any thread of ``pid`` that multiprocessing spawned."""
    children: list[str] = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            children += (task / "children").read_text().split()
        except FileNotFoundError:
            continue
    out = []
    for child in map(int, children):
        try:
            cmdline = pathlib.Path(f"/proc/{child}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if b"spawn_main" in cmdline:
            out.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
    except FileNotFoundError:
        return False
    return state != "Z"


def answers(url: str) -> list[Any]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    out: list[Any] = []
    for prompt, extra in [
        ("The ring holds", dict(temperature=0.0, max_tokens=24)),
        ("A sliding window", dict(temperature=0.9, seed=11, n=2, max_tokens=16, logprobs=3)),
        ("Stop here", dict(temperature=0.0, max_tokens=40, stop=["e", "a"])),
    ]:
        c = client.completions.create(model=model, prompt=prompt, **extra)  # type: ignore[call-overload]
        out.append([(ch.text, ch.finish_reason, ch.logprobs and ch.logprobs.token_logprobs)
                    for ch in c.choices])
        out.append(c.usage.completion_tokens if c.usage else None)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    c = client.completions.create(model=model, prompt="JSON:", max_tokens=40, temperature=0.0,
                                  extra_body={"structured_outputs": {"json": schema}})
    out.append(c.choices[0].text)
    json.loads(c.choices[0].text)  # the constraint held across the process boundary
    stream = client.completions.create(model=model, prompt="Streams", max_tokens=20,
                                       temperature=0.0, stream=True)
    out.append("".join(chunk.choices[0].text for chunk in stream if chunk.choices))
    return out


def test_the_core_process_answers_as_the_engine_thread_does(ckpt: pathlib.Path,
                                                            tmp_path: pathlib.Path) -> None:
    with run_server(ckpt, *FLAGS, log_dir=tmp_path) as server:
        assert len(core_pids(server)) == 1
        served = answers(server.url)
        metrics = server.stats()
    with run_server(ckpt, *FLAGS, "--engine-core", "thread", log_dir=tmp_path) as server:
        assert core_pids(server) == []
        assert answers(server.url) == served
    # the snapshot crossed the pipe: the API process's /metrics saw the core's counters
    assert metrics["generation_tokens_total"] > 0 and metrics["kv_blocks_used"] == 0


def _stream_until_end(url: str, model: str, started: threading.Event,
                      results: list[Any]) -> None:
    body = {"model": model, "prompt": "Long", "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    events: list[Any] = []
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()
    except httpx.HTTPError as err:  # the connection itself ended: also an ending
        events.append(f"transport: {err!r}")
    results.append((time.monotonic(), events))


def test_killing_the_core_ends_every_stream_and_the_server(ckpt: pathlib.Path,
                                                           tmp_path: pathlib.Path) -> None:
    with run_server(ckpt, *FLAGS, "--max-num-seqs", "8", log_dir=tmp_path) as server:
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        [core] = core_pids(server)
        results: list[Any] = []
        started = [threading.Event() for _ in range(4)]
        threads = [threading.Thread(target=_stream_until_end,
                                    args=(server.url, model, e, results)) for e in started]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started)
        killed = time.monotonic()
        os.kill(core, signal.SIGKILL)
        for t in threads:
            t.join(30)
        assert len(results) == 4
        for ended, events in results:
            assert ended - killed < 10
            assert events[-1] == "[DONE]" or events[-1].startswith("transport")
            errors = [json.loads(e)["error"] for e in events if e.startswith('{"error"')]
            assert errors and errors[0]["code"] == "engine_unavailable", events[-3:]
            assert "died" in errors[0]["message"]
        health = httpx.get(f"{server.url}/health", timeout=5)
        assert health.status_code == 503 and "died" in health.json()["error"]
        assert server.process.wait(20) == 1  # for a supervisor to restart it


def test_the_core_ignores_ctrl_c_and_goes_with_the_server(ckpt: pathlib.Path,
                                                         tmp_path: pathlib.Path) -> None:
    with run_server(ckpt, *FLAGS, log_dir=tmp_path) as server:
        [core] = core_pids(server)
        os.kill(core, signal.SIGINT)  # as a terminal's Ctrl-C reaches the process group
        time.sleep(1)
        r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                       json={"prompt": "still there", "max_tokens": 4})
        assert r.status_code == 200 and alive(core)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0
        deadline = time.monotonic() + 10
        while alive(core) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(core)


def test_a_core_that_cannot_start_says_why(ckpt: pathlib.Path, tmp_path: pathlib.Path) -> None:
    flags = [f for f in FLAGS if f not in ("--kv-cache-memory", "4MiB")]
    with pytest.raises(RuntimeError, match=r"failed to start: .*cannot hold one sequence"), \
            run_server(ckpt, *flags, "--kv-cache-memory", "1KiB", log_dir=tmp_path):
        pass


def _exits_after_failing(cmd: list[str], log: pathlib.Path,
                         kill_core: bool = False) -> tuple[int, float, str]:
    """Run a server that cannot start: its exit code, the seconds from the failure (the
    core's kill, or the log's "failed to start" line) to its exit, and its log."""
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
    try:
        failed = None
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            if kill_core and failed is None:
                found = _spawned(proc.pid)
                if found:  # killed while it starts, long before it could be ready
                    os.kill(found[0], signal.SIGKILL)
                    failed = time.monotonic()
            elif failed is None and "the engine failed to start" in log.read_text():
                failed = time.monotonic()
            time.sleep(0.01)
        code = proc.poll()
        exited = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    text = log.read_text()
    assert code is not None and failed is not None, text[-3000:]
    return code, exited - failed, text


@pytest.mark.parametrize("fault", ["killed", "truncated shard", "does not fit"])
def test_a_server_whose_engine_cannot_start_exits_non_zero(
        fault: str, ckpt: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """A supervisor (compose, systemd, Kubernetes) sees the server exit 1 within seconds of
    the failure, with the reason in its log, instead of a 503 "loading" until killed."""
    model = ckpt
    flags = list(FLAGS)
    if fault == "truncated shard":
        model = tmp_path / "truncated"
        model.mkdir()
        for file in ckpt.iterdir():
            data = file.read_bytes()
            (model / file.name).write_bytes(
                data[: len(data) // 2] if file.suffix == ".safetensors" else data)
    elif fault == "does not fit":
        flags[flags.index("4MiB")] = "1KiB"
    cmd = [sys.executable, "-m", "ringserve.server.cli", "serve", "--model", str(model),
           "--port", str(free_port()), "--log-level", "warning", *flags]
    code, after, text = _exits_after_failing(cmd, tmp_path / "server.log",
                                             kill_core=fault == "killed")
    assert code == 1, text[-3000:]
    assert after < 10, (after, text[-3000:])
    reason = {"killed": "exited with code -9 before it was ready",
              "truncated shard": "safetensors",
              "does not fit": "cannot hold one sequence"}[fault]
    assert reason in text and "exiting in" in text, text[-3000:]


# An API process reduced to its launch: it waits for the core's "ready" (a script for
# `python -c`, whose spawned child re-imports no main module).
LAUNCHER = """
import sys
import ringserve
from ringserve.engine import EngineConfig
from ringserve.engine.core_client import CoreClient
CoreClient.launch(EngineConfig(model=sys.argv[1], dtype="float32", kv_cache_memory="4MiB",
                               max_model_len=64))
print("ready", flush=True)
"""


def test_a_core_whose_api_process_is_killed_while_it_loads_exits(
        ckpt: pathlib.Path, tmp_path: pathlib.Path) -> None:
    log = tmp_path / "launcher.log"
    with log.open("w") as out:
        launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(ckpt)], stdout=out,
                                    stderr=subprocess.STDOUT)
    children = pathlib.Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children")
    deadline = time.monotonic() + 60
    core = None
    while core is None and time.monotonic() < deadline:
        found = children.read_text().split() if children.exists() else []
        core = int(found[0]) if found else None
        time.sleep(0.01)
    assert core is not None, log.read_text()
    # frozen while it starts (its interpreter is still importing), so that the API process
    # is surely gone before the engine could load
    os.kill(core, signal.SIGSTOP)
    launcher.kill()
    launcher.wait(10)
    os.kill(core, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while alive(core) and time.monotonic() < deadline:
        time.sleep(0.1)
    text = log.read_text()
    assert not alive(core), text
    assert f"the API process {launcher.pid} is gone: exiting" in text
    # it went before the engine was built (the greedy head's line comes once the model is
    # loaded, on or off), and never said "ready" into the broken pipe
    assert "greedy head" not in text and "BrokenPipeError" not in text


# What `ringserve serve` runs before it starts the core (server/cli.py: `serve`): none of it
# may load torch, or the two processes' imports run one after the other again
BEFORE_SPAWN = """
import sys
from ringserve.server.cli import _serve_args, build_parser
from ringserve.engine.config import EngineConfig
from ringserve.engine.core_spawn import spawn_core
args = _serve_args(build_parser().parse_args(["serve", "--model", "x", "--device", "cpu"]))
EngineConfig(**args.engine_kwargs())
print(sorted(m for m in ("torch", "transformers", "numpy", "fastapi") if m in sys.modules))
"""


def test_the_server_starts_its_core_before_it_imports_torch() -> None:
    out = subprocess.run([sys.executable, "-c", BEFORE_SPAWN], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]", out
