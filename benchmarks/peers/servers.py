"""The rows of the table: how each server starts, when it is ready, and how it stops.

Every server runs alone on the machine, in its own process group (vLLM forks an engine
process), and is stopped with its whole group before the next one starts.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import setup_llamacpp
import setup_vllm
from paths import LOGS, MODEL, ROOT, log

PORT = 8765
URL = f"http://127.0.0.1:{PORT}"
PARALLEL = 32  # llama.cpp slots: the highest concurrency of the load
SLOT_TOKENS = 512  # context per llama.cpp slot: 128 prompt + 128 output, with room to spare


@dataclass(frozen=True)
class Row:
    """One server configuration. `command` is built lazily: it may need a setup step."""

    name: str
    kind: str  # what --only selects: ringserve, vllm, llamacpp-q4, llamacpp-bf16
    # the weights' format: "float32", "bfloat16", "float16", "gguf" (the file's size), or
    # "auto" (ringserve's choice, read from its start-up log)
    weights: str
    command: Callable[[], list[str]]
    env: Callable[[], dict[str, str]] = dict
    gguf: Callable[[], Path] | None = None
    start_timeout: float = 300.0


def ringserve_row(extra: str) -> Row:
    args = shlex.split(extra)
    dtype = args[args.index("--dtype") + 1] if "--dtype" in args else "auto"
    dtype = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(dtype, dtype)
    return Row(name=f"ringserve {extra}".strip(), kind="ringserve", weights=dtype,
               command=lambda: [str(ROOT / ".venv" / "bin" / "ringserve"), "serve",
                                "--port", str(PORT), *args])


def vllm_row(hf_folder: Callable[[], Path]) -> Row:
    return Row(name="vLLM bf16", kind="vllm", weights="bfloat16",
               command=lambda: [str(setup_vllm.install()), "-m",
                                "vllm.entrypoints.openai.api_server", "--model",
                                str(hf_folder()), "--served-model-name", MODEL,
                                "--dtype", "bfloat16", "--max-model-len", "4096",
                                "--host", "127.0.0.1", "--port", str(PORT)],
               env=setup_vllm.server_env, start_timeout=600.0)


def llamacpp_row(name: str, kind: str, gguf: Callable[[], Path]) -> Row:
    return Row(name=name, kind=kind, weights="gguf", gguf=gguf,
               command=lambda: [str(setup_llamacpp.build()), "-m", str(gguf()),
                                "--alias", MODEL, "--host", "127.0.0.1", "--port", str(PORT),
                                "--parallel", str(PARALLEL),
                                "--ctx-size", str(PARALLEL * SLOT_TOKENS),
                                "--threads", "2", "--threads-batch", "2"])


def default_rows(ringserve_args: list[str], hf_folder: Callable[[], Path]) -> list[Row]:
    return [*(ringserve_row(extra) for extra in ringserve_args), vllm_row(hf_folder),
            llamacpp_row("llama.cpp Q4_K_M", "llamacpp-q4", setup_llamacpp.q4_gguf),
            llamacpp_row("llama.cpp bf16", "llamacpp-bf16",
                         lambda: setup_llamacpp.bf16_gguf(hf_folder()))]


class Server:
    """A started row: `with Server(row) as s:` waits for /health and stops the group after."""

    def __init__(self, row: Row) -> None:
        self.row = row
        self.argv = row.command()
        self.env = row.env()
        self.log_path = LOGS / f"serve-{row.kind}-{int(time.time())}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.weights = row.weights  # "auto" resolved once the server is up
        self.decode_bytes = 0  # ringserve: the weight bytes a decode step reads, as it logs

    def __enter__(self) -> Server:
        LOGS.mkdir(parents=True, exist_ok=True)
        _refuse_busy_port()
        log(f"starting {self.row.name}: {self.describe()}  (log: {self.log_path.name})")
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, env={**os.environ, **self.env},
                                         stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        try:
            self._wait_healthy()
            if self.row.kind == "ringserve":
                self._read_ringserve_log()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def describe(self) -> str:
        env = " ".join(f"{k}={v}" for k, v in self.env.items())
        return f"{env} {shlex.join(self.argv)}".strip()

    def _wait_healthy(self) -> None:
        assert self.proc is not None
        start = time.monotonic()
        while time.monotonic() - start < self.row.start_timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited {self.proc.returncode} while starting; "
                                   f"{self.log_tail()}")
            try:
                r = httpx.get(f"{URL}/health", timeout=5)
            except httpx.HTTPError:
                r = None
            if r is not None and r.status_code == 200:
                log(f"{self.row.name} healthy after {time.monotonic() - start:.0f} s")
                return
            # ringserve's /health says {"status": "failed", "error": ...} after a failed start
            if r is not None and r.headers.get("content-type") == "application/json" and \
                    r.json().get("status") == "failed":
                raise RuntimeError(f"failed to start: {r.json().get('error')}; "
                                   f"{self.log_tail()}")
            time.sleep(2)
        raise RuntimeError(f"not healthy after {self.row.start_timeout:.0f} s; "
                           f"{self.log_tail()}")

    def _read_ringserve_log(self) -> None:
        """The dtype and quantization ringserve chose and the weight bytes a decode step
        reads, from its start-up lines (`dtype bfloat16 (...)`, `quantization int8 (...)`,
        `... a decode step reads 123.4 MiB of them`)."""
        text = self.log_path.read_text()
        dtype = re.search(r"ringserve\.engine: dtype (\w+) \(", text)
        quant = re.search(r"ringserve\.engine: quantization (\w+) \(", text)
        reads = re.search(r"a decode step reads ([\d.]+) MiB", text)
        if not (dtype and quant and reads):
            log(f"warning: {self.row.name} logged no dtype, quantization or weight bytes; "
                "its read limit is left out")
            return
        method = quant.group(1)
        self.weights = dtype.group(1) if method == "none" else f"{dtype.group(1)}+{method}"
        self.decode_bytes = int(float(reads.group(1)) * 2**20)

    def log_tail(self, lines: int = 12) -> str:
        """The log's last lines, health checks left out."""
        kept = [line for line in self.log_path.read_text(errors="replace").splitlines()
                if "/health" not in line]
        return f"log {self.log_path.name} ends:\n" + "\n".join(kept[-lines:])

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 30 s."""
        if self.proc is None or (self.proc.poll() is not None and not _group_alive(self.proc)):
            return
        for sig, grace in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                if self.proc.poll() is not None and not _group_alive(self.proc):
                    return
                time.sleep(0.5)
        log(f"warning: process group {self.proc.pid} of {self.row.name} did not stop")


def _group_alive(proc: subprocess.Popen[bytes]) -> bool:
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True


def _refuse_busy_port() -> None:
    try:
        httpx.get(f"{URL}/health", timeout=2)
    except httpx.HTTPError:
        return
    raise RuntimeError(f"something already answers on {URL}; stop it first")
