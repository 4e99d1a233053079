"""What else the machine is doing: the share of its CPUs that processes other than the server
under test and this load generator use, so that a load measured beside someone else's work
says so, and a load can wait for a quiet machine first."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
from paths import log

TICK = os.sysconf("SC_CLK_TCK")


def _busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (steal included: another VM's work)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9])
    return (user + nice + system + irq + softirq + steal) / TICK


def _our_seconds(server_pid: int | None) -> float:
    """CPU seconds of this process and of the server's process tree (if one runs)."""
    own = os.times()
    total = own.user + own.system
    if server_pid is None:
        return total
    try:
        server = psutil.Process(server_pid)
        procs = [server, *server.children(recursive=True)]
    except psutil.NoSuchProcess:
        return total
    for proc in procs:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


class OthersMeter:
    """`with OthersMeter(pid) as m: ...` then `m.share`: others' CPU / all CPUs, 0..1."""

    def __init__(self, server_pid: int | None) -> None:
        self.server_pid = server_pid
        self.share = 0.0

    def __enter__(self) -> OthersMeter:
        self._start = (time.monotonic(), _busy_seconds(), _our_seconds(self.server_pid))
        return self

    def __exit__(self, *exc: object) -> None:
        wall, busy, ours = self._start
        wall = time.monotonic() - wall
        others = (_busy_seconds() - busy) - (_our_seconds(self.server_pid) - ours)
        self.share = max(0.0, others / (wall * (os.cpu_count() or 1)))


def wait_quiet(server_pid: int | None, timeout: float, threshold: float = 0.15,
               window: float = 5.0) -> None:
    """Until others use less than `threshold` of the CPUs over `window` seconds, for at most
    `timeout` seconds (then the load runs anyway and its others' share says so)."""
    deadline = time.monotonic() + timeout
    while True:
        with OthersMeter(server_pid) as meter:
            time.sleep(window)
        if meter.share < threshold:
            return
        if time.monotonic() >= deadline:
            log(f"machine still busy (others use {meter.share:.0%}); measuring anyway")
            return
        log(f"waiting for a quiet machine: others use {meter.share:.0%} of the CPUs")
