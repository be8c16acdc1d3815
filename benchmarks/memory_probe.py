"""What a benchmark step costs in memory and CPU on this machine: peak RSS sampled
during a step, the pages it touched for the first time, its user and system CPU, and what a GB
of fresh memory costs to touch right now. Used by ``scale.py``; run on its own, it prints what
fresh pages cost as a process grows:

    PYTHONPATH=$PWD .venv/bin/python benchmarks/memory_probe.py [--gb 4] [--step 0.5]
"""

from __future__ import annotations

import os
import resource
import threading
import time

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class Peak:
    """Peak RSS during a ``with`` block, above the RSS at its start."""

    def __enter__(self):
        self.faults_at_start = minor_faults()
        self.cpu_at_start = cpu_seconds()
        self.start = self.peak = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self.t0 = time.perf_counter()
        return self

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())
        self.above = self.peak - self.start
        self.faulted = (minor_faults() - self.faults_at_start) * PAGE
        self.cpu = tuple(b - a for a, b in zip(self.cpu_at_start, cpu_seconds()))

    def row(self) -> tuple[float, int, int, int]:
        return self.seconds, self.above, self.peak, self.faulted


def cpu_seconds() -> tuple[float, float]:
    """User and system CPU seconds of this process (all threads). A page fault is system time,
    the host's share of it included: on VMs whose host backs memory lazily a step's system time is mostly its faults."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def minor_faults() -> int:
    """Pages this process touched for the first time (or again after giving them back): on such a
    VM each costs what a fresh page costs, which swings several-fold with the host."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def first_touch_seconds_per_gb(gb: float = 1.0) -> tuple[float, float]:
    """Seconds per GB to write fresh pages, then the same pages again. On such a VM the host backs
    guest memory lazily and takes idle pages back within a minute: a step that touches new
    memory (create's copy, the first step's gradients) swings with that, not with our code."""
    import torch

    n = int(gb * (1 << 30)) // 4
    t0 = time.perf_counter()
    t = torch.empty(n)
    t.fill_(1.0)
    t1 = time.perf_counter()
    t.fill_(2.0)
    t2 = time.perf_counter()
    return (t1 - t0) / gb, (t2 - t1) / gb


def fresh_page_curve(total_gb: float = 4.0, step_gb: float = 0.5) -> list[tuple[float, float, float]]:
    """Seconds per GB to touch fresh pages as the process grows: for each ``step_gb`` block,
    (GB this process had touched before it, s/GB with one thread writing, s/GB with two). Every
    block is kept, as a training process keeps its model and gradients. On such VMs the first GB
    or so comes from pages the host still backs and is cheap; past it every page waits for the
    host, which is what a first training step's gradients meet at 250M and up."""
    import torch

    n = int(step_gb * (1 << 30))
    held, rows, threads = [], [], torch.get_num_threads()
    try:
        while len(held) * step_gb < total_gb:
            row = [len(held) * step_gb]
            for k in (1, 2):
                torch.set_num_threads(k)
                t = torch.empty(n, dtype=torch.uint8)
                t0 = time.perf_counter()
                t[::PAGE].fill_(1)  # one write per page: the fault, not the bandwidth
                row.append((time.perf_counter() - t0) / step_gb)
                held.append(t)
            rows.append(tuple(row))
    finally:
        torch.set_num_threads(threads)
    return rows


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="What fresh pages cost on this machine as a process grows")
    ap.add_argument("--gb", type=float, default=4.0, help="memory to touch in all (kept until the end)")
    ap.add_argument("--step", type=float, default=0.5, help="GB per block")
    args = ap.parse_args()
    print(f"{'held GB':>8}{'1 thread s/GB':>15}{'2 threads s/GB':>16}")
    for held, one, two in fresh_page_curve(args.gb, args.step):
        print(f"{held:>8.1f}{one:>15.2f}{two:>16.2f}")


if __name__ == "__main__":
    main()
