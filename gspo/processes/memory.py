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
for the rest of its life: `gspo train` sets it at the start, each rollout worker and rollout rank
too; a notebook that builds a gspo.Trainer gets it for the notebook's process. A user who set
glibc's thresholds in the environment keeps them. glibc applies the threshold to the main thread's
heap; a thread's own arena (a non-main thread's allocations) still maps tensors over 64 MiB fresh.
What it costs: the process's memory stays at its peak (the mid model's peak RSS +9%; in a synthetic
pattern of varying logits sizes a breaker measured +37%, and resident memory at rest held at the
peak, 1934 MiB against 230 without).
"""

from __future__ import annotations

import ctypes
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
LIMIT = 2**31 - 1  # mallopt takes an int


ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")  # glibc's own settings, which a user's environment keeps
_set = False  # mallopt was called in this process: it cannot be taken back


def _users_own() -> str | None:
    """The user's own glibc malloc thresholds, from the environment, in words; None when there are none."""
    tunables = [t for t in os.environ.get("GLIBC_TUNABLES", "").split(":")
                if t.startswith(("glibc.malloc.mmap_threshold=", "glibc.malloc.trim_threshold="))]
    given = [f"{k}={os.environ[k]}" for k in ENV if k in os.environ] + [f"GLIBC_TUNABLES {t}" for t in tunables]
    return ", ".join(given) or None


def keep_large_on_heap(on: bool) -> str:
    """Serve large allocations from the heap (module docstring) when `on`; what was done, in words.

    A user's own thresholds in the environment (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ or
    GLIBC_TUNABLES) are theirs: nothing is changed, and the words say so, on or off. Once set, the
    setting stays for the process's life (a second run in a notebook with it off is told so)."""
    global _set
    if not sys.platform.startswith("linux"):
        return f"large CPU tensors as {sys.platform}'s allocator gives them"
    if (own := _users_own()) is not None:
        return f"large CPU tensors as the environment's glibc settings give them ({own})"
    if not on:
        return ("large CPU tensors from the heap (set earlier in this process: --no-malloc-heap cannot undo it)"
                if _set else "large CPU tensors mapped fresh (--no-malloc-heap)")
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (musl: no libc.so.6)
        mallopt = None
    if mallopt is None or mallopt(M_MMAP_THRESHOLD, LIMIT) != 1:
        return ("large CPU tensors from the heap, freed memory returned as glibc trims (its trim threshold refused)"
                if _set else "large CPU tensors as this libc's allocator gives them (no glibc mallopt)")
    _set = True
    if mallopt(M_TRIM_THRESHOLD, LIMIT) != 1:
        return "large CPU tensors from the heap, freed memory returned as glibc trims (its trim threshold refused)"
    return "large CPU tensors from the heap (glibc's mmap threshold 2 GiB)"
