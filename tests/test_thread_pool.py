"""The kernels' thread pool (`kernels/csrc/thread_pool.h`): at::parallel_for's chunks, errors
that reach the caller, calls from several threads, fork, and the choice to spin or sleep.

The pool's mode is read once a process (RINGSERVE_KERNEL_SPIN), so each mode runs in a
fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from ringserve.kernels import cpu_build

ROOT = Path(__file__).resolve().parents[1]


def _ops():  # type: ignore[no-untyped-def]
    assert cpu_build.available(), "the CPU kernels did not build"
    return cpu_build.ops()


def _run(code: str, env: dict[str, str], timeout: float = 300) -> str:
    """``code`` in a fresh interpreter whose torch threads sleep (as the engine's do), with
    ``env`` on top."""
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **env}
    env = {k: v for k, v in env.items() if v is not None}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize(("n", "grain"), [(1, 1), (2, 1), (7, 3), (100, 16), (100, 200),
                                          (100003, 16), (64, 64), (65, 64)])
def test_every_index_once(n: int, grain: int) -> None:
    ops = _ops()
    assert ops.pool_selftest(n, grain, 0, -1) == n * (n - 1) // 2


def test_parallel_calls_use_the_threads() -> None:
    ops = _ops()
    before = ops.kernel_threads()[2]
    ops.pool_selftest(1000, 16, 0, -1)
    threads, _, jobs, _, on, contention = ops.kernel_threads()
    assert on == 1  # the conftest made libgomp sleep
    assert 0 <= contention <= 1000
    assert threads == torch.get_num_threads() or torch.get_num_threads() == 1
    assert jobs == before + (torch.get_num_threads() > 1)


def test_an_error_in_a_chunk_reaches_the_caller_and_the_pool_goes_on() -> None:
    ops = _ops()
    for throw_at in (0, 999, 500):
        with pytest.raises(RuntimeError, match="throws"):
            ops.pool_selftest(1000, 16, 0, throw_at)
        assert ops.pool_selftest(1000, 16, 0, -1) == 1000 * 999 // 2


def test_calls_from_many_threads_at_once() -> None:
    """One job at a time: callers queue, nobody's chunks get lost or mixed."""
    ops = _ops()
    errors: list[str] = []

    def call(seed: int) -> None:
        for i in range(40):
            n = 1000 + 37 * seed + i
            got = ops.pool_selftest(n, 16, 20 if i % 5 == 0 else 0, -1)
            if got != n * (n - 1) // 2:
                errors.append(f"thread {seed} call {i}: {got}")

    threads = [threading.Thread(target=call, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a call hung"
    assert errors == []


def test_a_kernel_called_from_many_threads_matches_one_call() -> None:
    from ringserve.kernels import cpu_quant
    from ringserve.kernels.quant import quantize_int8

    torch.manual_seed(0)
    qw = quantize_int8(torch.randn(512, 256) * 0.05, 32)
    xs = [torch.randn(r, 256) for r in (1, 5, 16, 40)]
    want = [cpu_quant.quant_linear(x, qw, None) for x in xs]
    bad: list[int] = []

    def call(i: int) -> None:
        for _ in range(20):
            if not torch.equal(cpu_quant.quant_linear(xs[i % 4], qw, None), want[i % 4]):
                bad.append(i)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert bad == []


def test_thread_count_changes_resize_the_pool() -> None:
    ops = _ops()
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert ops.pool_selftest(1000, 1, 0, -1) == 1000 * 999 // 2
        assert ops.kernel_threads()[0] == 3
        torch.set_num_threads(1)  # inline: the pool is not used
        jobs = ops.kernel_threads()[2]
        assert ops.pool_selftest(1000, 1, 0, -1) == 1000 * 999 // 2
        assert ops.kernel_threads()[2] == jobs
    finally:
        torch.set_num_threads(old)
    assert ops.pool_selftest(1000, 1, 0, -1) == 1000 * 999 // 2


def test_a_forked_child_gets_its_own_pool() -> None:
    code = (
        "import os, torch\n"
        "torch.set_num_threads(2)\n"
        "from ringserve.kernels import cpu_build\n"
        "assert cpu_build.available()\n"
        "ops = cpu_build.ops()\n"
        "assert ops.pool_selftest(10000, 16, 0, -1) == 10000 * 9999 // 2\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    ok = ops.pool_selftest(10000, 16, 0, -1) == 10000 * 9999 // 2\n"
        "    os._exit(0 if ok and ops.kernel_threads()[0] == 2 else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print('child', os.waitstatus_to_exitcode(status))\n")
    assert "child 0" in _run(code, {}, timeout=120)


_MODE = (
    "import time, torch\n"
    "torch.set_num_threads(2)\n"
    "from ringserve.kernels import cpu_build\n"
    "assert cpu_build.available()\n"
    "ops = cpu_build.ops()\n"
    "for _ in range(50):\n"
    "    ops.pool_selftest(1000, 16, 100, -1)\n"
    "print(list(ops.kernel_threads()))\n")


@pytest.mark.parametrize(("mode", "spinning", "code"), [("always", 1, 1), ("never", 0, 2)])
def test_a_fixed_mode_holds(mode: str, spinning: int, code: int) -> None:
    info = eval(_run(_MODE, {"RINGSERVE_KERNEL_SPIN": mode}).strip().splitlines()[-1])
    assert info[1] == spinning and info[3] == code


def test_auto_sleeps_while_another_process_wants_the_cpus() -> None:
    """With a CPU-bound neighbour on every CPU the pool stops spinning within a fraction of a
    second; once they are gone it spins again (where it spun before they came: a machine
    busy with other work already keeps it sleeping)."""
    code = (
        "import os, subprocess, sys, time, torch\n"
        "torch.set_num_threads(2)\n"
        "from ringserve.kernels import cpu_build\n"
        "assert cpu_build.available()\n"
        "ops = cpu_build.ops()\n"
        "def spin_now(seconds):\n"
        "    end = time.monotonic() + seconds\n"
        "    while time.monotonic() < end:\n"
        "        ops.pool_selftest(1000, 16, 200, -1)\n"
        "    return ops.kernel_threads()[1]\n"
        "before = spin_now(0.5)\n"
        "hogs = [subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
        "        for _ in range(len(os.sched_getaffinity(0)))]\n"
        "try:\n"
        "    time.sleep(0.3)\n"
        "    during = spin_now(1.0)\n"
        "finally:\n"
        "    for h in hogs: h.kill()\n"
        "    for h in hogs: h.wait()\n"
        "after = max(spin_now(0.5) for _ in range(6))\n"
        "print(before, during, after)\n")
    before, during, after = map(int, _run(code, {"RINGSERVE_KERNEL_SPIN": "auto"})
                                .split()[-3:])  # fmt: skip
    assert during == 0
    if before == 1:
        assert after == 1


_NOW_AND_THEN = ("import time\n"
                 "while True:\n"
                 "    end = time.monotonic() + 0.006\n"
                 "    while time.monotonic() < end: pass\n"
                 "    time.sleep(0.014)\n")


def test_auto_keeps_spinning_beside_a_process_busy_now_and_then() -> None:
    """A served engine's neighbours (the API process, a load generator) are runnable a
    share of the time, not always: that must not stop the spinning (it did in bursts, and a
    served 32-row step took 80-90 ms instead of 74-76). The best of four 1-second windows:
    this host's own tasks sometimes keep a CPU busy for 100 ms and more, and then stopping is
    the rule's job (one 1.5-second window measured 0.51-1.0 over 24 runs; the old rule
    spun 21-31% of calls in every window)."""
    code = (
        "import subprocess, sys, time, torch\n"
        "torch.set_num_threads(2)\n"
        "from ringserve.kernels import cpu_build\n"
        "assert cpu_build.available()\n"
        "ops = cpu_build.ops()\n"
        f"side = subprocess.Popen([sys.executable, '-c', {_NOW_AND_THEN!r}])\n"
        "shares = []\n"
        "try:\n"
        "    time.sleep(0.3)\n"
        "    for _ in range(4):\n"
        "        seen = []\n"
        "        end = time.monotonic() + 1.0\n"
        "        while time.monotonic() < end:\n"
        "            ops.pool_selftest(1000, 16, 200, -1)\n"
        "            seen.append(ops.kernel_threads()[1])\n"
        "        shares.append(sum(seen) / len(seen))\n"
        "finally:\n"
        "    side.kill()\n"
        "    side.wait()\n"
        "print(max(shares), ops.kernel_threads()[5])\n")
    share, contention = map(float, _run(code, {"RINGSERVE_KERNEL_SPIN": "auto"}).split()[-2:])
    assert share >= 0.8, (share, contention)


def test_libgomp_sleeps_reads_what_libgomp_read() -> None:
    assert cpu_build.libgomp_sleeps({"OMP_WAIT_POLICY": "passive"})
    assert not cpu_build.libgomp_sleeps({})  # libgomp's default: spin 300,000 times
    assert not cpu_build.libgomp_sleeps({"OMP_WAIT_POLICY": "ACTIVE"})
    assert cpu_build.libgomp_sleeps({"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "0"})
    assert not cpu_build.libgomp_sleeps({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "1000"})


@pytest.mark.parametrize(("first", "policy", "pool"), [
    ("ringserve.engine", None, 1),   # the engine sets PASSIVE before torch loads
    ("torch", None, 0),              # libgomp spins: the kernels run on its threads
    ("torch", "PASSIVE", 1),
])
def test_the_pool_serves_only_where_libgomp_sleeps(first: str, policy: str | None,
                                                   pool: int) -> None:
    code = (f"import {first}\n"
            "import torch\n"
            "torch.set_num_threads(2)\n"
            "from ringserve.kernels import cpu_build\n"
            "assert cpu_build.available()\n"
            "ops = cpu_build.ops()\n"
            "assert ops.pool_selftest(10000, 16, 0, -1) == 10000 * 9999 // 2\n"
            "print(list(ops.kernel_threads()))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    info = eval(out.stdout.strip().splitlines()[-1])
    assert info[4] == pool
    assert info[2] == pool  # the call ran on the pool, or on libgomp's threads


def test_first_calls_from_many_threads_at_once() -> None:
    """The pool of a process is made by whichever thread calls first; racing first calls
    share one pool (and every result is right)."""
    code = (
        "import threading, torch\n"
        "torch.set_num_threads(2)\n"
        "from ringserve.kernels import cpu_build\n"
        "assert cpu_build.available()\n"
        "ops = cpu_build.ops()\n"
        "go, bad = threading.Barrier(8), []\n"
        "def call():\n"
        "    go.wait()\n"
        "    for _ in range(20):\n"
        "        if ops.pool_selftest(5000, 16, 0, -1) != 5000 * 4999 // 2: bad.append(1)\n"
        "threads = [threading.Thread(target=call) for _ in range(8)]\n"
        "for t in threads: t.start()\n"
        "for t in threads: t.join()\n"
        "print(len(bad), ops.kernel_threads()[2])\n")
    bad, jobs = map(int, _run(code, {}, timeout=120).split()[-2:])
    assert bad == 0 and jobs == 8 * 20  # every call ran on the one pool that won


_BACK_TO_BACK = (
    "import torch\n"
    "torch.set_num_threads(3)\n"
    "from ringserve.kernels import cpu_build\n"
    "assert cpu_build.available()\n"
    "ops = cpu_build.ops()\n"
    "for i in range(20000):\n"
    "    n = 2 + i % 5\n"
    "    assert ops.pool_selftest(n, 1, 0, -1) == n * (n - 1) // 2, i\n"
    "print('ok')\n")


@pytest.mark.parametrize("mode", ["always", "never"])
def test_back_to_back_jobs_while_workers_are_late(mode: str) -> None:
    """Chunks are claimed by whoever runs: with sleeping workers the caller often ends a
    tiny job alone before they wake, and a worker that wakes for an ended job must claim
    nothing of the next one (20,000 jobs of 2-6 one-index chunks, three threads)."""
    assert _run(_BACK_TO_BACK, {"RINGSERVE_KERNEL_SPIN": mode}, timeout=300).strip() == "ok"
