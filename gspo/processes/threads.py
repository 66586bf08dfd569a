"""How many CPU threads torch gets: `--threads N`, or with `--threads 0` (the default) half the cores, fewer when busy.

    threads, why = choose_threads(0)     # (1, 'half of 2 cores, 2.0 busy') beside a busy process on 2 cores

Why not all cores. torch runs an operation on N threads that meet at a barrier when it ends. On a
machine where another process holds some of the cores, a thread of ours waits for the scheduler
at every barrier, and decoding is thousands of small operations a step. Measured on 2 cores
(benchmarks/threads.py, docs/performance.md "Threads on a shared machine"): beside a busy
process per core, all-cores steps took 1.9x (the tiny model) and 3.4x (a 35M model) the time of
one thread's; two trainings started side by side with all cores, 4.1x. One thread never waits for
another: it only gets its share of a core.

The default: the cores this process may use (its CPU affinity), less those other processes keep
busy now, and at most half of them (rounded up), at least 1. The half leaves room for what the
machine does next, a second training or a browser: a count chosen at the start cannot follow the
load (changing it mid-run would change the arithmetic), and two runs started together each see
the other idle. The price on an idle machine: on 2 cores the tiny model's steps take 1.2x, a 35M
model's 1.7x, what all cores take; `--threads N` sets any count. "Busy now" is measured over
`SAMPLE_S` from /proc/stat on those cores (Linux), else the 1-minute load average. With
OMP_NUM_THREADS in the environment the user has chosen: torch's default (which reads it) is kept.
The count is written into the run's config.yaml (a resumed run keeps it: it shapes the
arithmetic) and said in the plan. Left out: CPU quotas (cgroups) narrower than the affinity.
"""

from __future__ import annotations

import contextlib
import os
import time

SAMPLE_S = 0.25  # how long the cores' busy time is measured before a run picks its threads


def choose_threads(asked: int) -> tuple[int, str]:
    """(threads, why in words) for `--threads asked`: asked when > 0, else the cores free now."""
    if asked > 0:
        return asked, "--threads"
    if "OMP_NUM_THREADS" in os.environ:
        import torch

        return torch.get_num_threads(), f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    busy = busy_cores(cpus)
    half = (len(cpus) + 1) // 2  # room for another run, or the user's other work, on the rest
    return max(1, min(half, len(cpus) - int(busy + 0.5))), f"half of {len(cpus)} cores, {busy:.1f} busy"


@contextlib.contextmanager
def restored():
    """Torch's thread count as it was before the block (a run or an evaluation sets its own: a
    Python caller gets its count back)."""
    import torch

    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


def busy_cores(cpus: list[int], seconds: float = SAMPLE_S) -> float:
    """How many of `cpus` other processes keep busy: their busy share over `seconds` (/proc/stat),
    or the 1-minute load average where there is no /proc/stat."""
    first = _cpu_times(cpus)
    if first is None:
        return min(float(len(cpus)), os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0.0
    time.sleep(seconds)
    second = _cpu_times(cpus)
    busy = 0.0
    for (idle0, total0), (idle1, total1) in zip(first, second):
        total = total1 - total0
        busy += 1.0 - (idle1 - idle0) / total if total > 0 else 0.0
    return busy


def _cpu_times(cpus: list[int]) -> list[tuple[int, int]] | None:
    """(idle + iowait, total) jiffies of each of `cpus`, from /proc/stat; None where it cannot be read."""
    try:
        lines = open("/proc/stat").read().splitlines()
    except OSError:
        return None
    rows = {}
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit():
            values = [int(v) for v in fields]
            rows[int(name[3:])] = (values[3] + (values[4] if len(values) > 4 else 0), sum(values[:8]))
    if any(c not in rows for c in cpus):
        return None
    return [rows[c] for c in cpus]
