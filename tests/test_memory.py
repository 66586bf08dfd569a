"""gspo.processes.memory: large CPU tensors from the heap (glibc), said in the plan; off with --no-malloc-heap."""

import subprocess
import sys

import pytest

from gspo.processes import memory

PROBE = """
import sys, torch
from gspo.processes.memory import keep_large_on_heap

def rss():  # resident pages of this process, in MiB
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

if sys.argv[1] == "on":
    print(keep_large_on_heap(True))
x = torch.ones(64 * 2**20)  # 256 MiB, every page touched
before = rss()
del x
print(round(before - rss()))  # MiB given back to the system when the tensor was freed
"""


@pytest.mark.slow  # starts processes (the setting is the process's for its life)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_large_tensors_stay_in_the_process_with_the_heap_and_go_back_without():
    # glibc maps a 256 MiB tensor fresh and unmaps it when freed: RSS drops by ~256 MiB. From the heap (mmap
    # threshold 2 GiB, no trim below it) the memory stays for the next allocation: RSS drops by ~0
    out = {}
    for mode in ("off", "on"):
        proc = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        out[mode] = proc.stdout.split()
    assert int(out["off"][-1]) > 200  # returned to the system
    assert " ".join(out["on"][:-1]) == "large CPU tensors from the heap (glibc's mmap threshold 2 GiB)"
    assert int(out["on"][-1]) < 20  # kept


def test_what_the_plan_says_off_and_elsewhere(monkeypatch):
    _clean_env(monkeypatch)
    monkeypatch.setattr(memory, "_set", False)
    assert memory.keep_large_on_heap(False) == "large CPU tensors mapped fresh (--no-malloc-heap)"
    monkeypatch.setattr(memory.sys, "platform", "darwin")
    assert memory.keep_large_on_heap(True) == "large CPU tensors as darwin's allocator gives them"


def _clean_env(monkeypatch):
    for k in (*memory.ENV, "GLIBC_TUNABLES"):
        monkeypatch.delenv(k, raising=False)


def test_a_users_own_glibc_thresholds_are_kept_and_said(monkeypatch):
    # a user who tuned glibc in the environment keeps it, on or off, and the plan says whose setting it is (a
    # breaker found MALLOC_MMAP_THRESHOLD_=65536 silently raised to 2 GiB, and "mapped fresh" said where the
    # user's 1 GiB threshold served 131 MB tensors from the heap)
    _clean_env(monkeypatch)
    called = []
    monkeypatch.setattr(memory.ctypes, "CDLL", lambda name: called.append(name))
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    for on in (True, False):
        assert memory.keep_large_on_heap(on) == ("large CPU tensors as the environment's glibc settings give them "
                                                 "(MALLOC_MMAP_THRESHOLD_=65536)")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2:glibc.malloc.trim_threshold=0")
    assert memory.keep_large_on_heap(True).endswith("(GLIBC_TUNABLES glibc.malloc.trim_threshold=0)")
    assert called == []  # mallopt never reached


def test_once_set_the_heap_is_said_when_a_later_run_turns_it_off(monkeypatch):
    # a second Trainer in one notebook with --no-malloc-heap cannot undo mallopt: the plan must not say "mapped fresh"
    _clean_env(monkeypatch)
    monkeypatch.setattr(memory, "_set", False)

    class Libc:
        def mallopt(self, what, value):
            return 1

    monkeypatch.setattr(memory.ctypes, "CDLL", lambda name: Libc())
    assert memory.keep_large_on_heap(False) == "large CPU tensors mapped fresh (--no-malloc-heap)"
    assert memory.keep_large_on_heap(True) == "large CPU tensors from the heap (glibc's mmap threshold 2 GiB)"
    assert memory.keep_large_on_heap(False).startswith("large CPU tensors from the heap (set earlier in this process")


def test_a_rollout_worker_sets_its_own_allocator(monkeypatch):
    # worker_main (a --rollout-workers process, and a torchrun rollout rank through serve_rank) is a process of its
    # own: the trainer's mallopt does not reach it (a breaker saw a worker map its 131 MB tensors fresh)
    import types

    import torch

    from gspo.config import TrainConfig
    from gspo.sampling import pipeline

    seen = []
    monkeypatch.setattr(pipeline, "keep_large_on_heap", lambda on: seen.append(on) or "")
    end = types.SimpleNamespace(start=lambda: None, next=lambda timeout: ("stop",))
    side = types.SimpleNamespace(policy=torch.nn.Linear(1, 1))
    threads = torch.get_num_threads()
    for on in (True, False):
        cfg = TrainConfig()
        cfg.run.malloc_heap = on
        pipeline.worker_main(0, cfg, "cpu", [(0, 1, 0)], (threads, lambda c, d: side), end)
    assert seen == [True, False]
