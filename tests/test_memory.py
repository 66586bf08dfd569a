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
    assert memory.keep_large_on_heap(False) == "large CPU tensors mapped fresh (--no-malloc-heap)"
    monkeypatch.setattr(memory.sys, "platform", "darwin")
    assert memory.keep_large_on_heap(True) == "large CPU tensors as darwin's allocator gives them"
