"""Large CPU tensors from the heap: glibc's malloc told not to map fresh memory for each one.

    said = keep_large_on_heap(True)   # "large CPU tensors come from the heap (glibc mmap threshold 2 GiB)"

Why. glibc's malloc serves an allocation above its mmap threshold (at most 32 MiB, adjusted as the
program runs) with a fresh mmap, and returns it to the system when freed; the next allocation of
that size maps again, and every page faults on first touch. A training step allocates such tensors
by the hundred: a minibatch's LM-head logits (1,024 tokens x a 32k vocabulary: 131 MB), their
softmax, the head's gradient, the activations of a larger model. On the 2-core development VM an
elementwise op over a fresh 131 MB tensor took 79 ms, 16 ms once its memory came from the heap
(a multiply; softmax 98 -> 31 ms, logsumexp 119 -> 54 ms), and the mid-size model's update
(benchmarks/update_parts.py's batch) 14.1-14.2 s -> 10.9-11.4 s, its peak RSS 1835 -> 2000 MiB:
freed memory stays in the process for the next step rather than going back to the system. A
process that needs its memory back between phases can turn it off (`--no-malloc-heap`).

How. `mallopt(M_MMAP_THRESHOLD, 2 GiB - 1)` and `mallopt(M_TRIM_THRESHOLD, 2 GiB - 1)`: allocations
up to 2 GiB come from the heap, and the heap's top is not trimmed below 2 GiB. Linux with glibc only
(elsewhere, or where mallopt refuses, nothing changes and the plan says so). It is the process's,
for the rest of its life: `gspo train` sets it at the start, a rollout worker too; a notebook that
builds a gspo.Trainer gets it for the notebook's process.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
LIMIT = 2**31 - 1  # mallopt takes an int


def keep_large_on_heap(on: bool) -> str:
    """Serve large allocations from the heap (module docstring) when `on`; what was done, in words."""
    if not on:
        return "large CPU tensors mapped fresh (--no-malloc-heap)"
    if not sys.platform.startswith("linux"):
        return f"large CPU tensors as {sys.platform}'s allocator gives them"
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, LIMIT) == 1 and libc.mallopt(M_TRIM_THRESHOLD, LIMIT) == 1
    except (OSError, AttributeError):  # not glibc (musl: no libc.so.6)
        ok = False
    return ("large CPU tensors from the heap (glibc's mmap threshold 2 GiB)" if ok
            else "large CPU tensors as this libc's allocator gives them (no glibc mallopt)")
