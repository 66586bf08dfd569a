"""The fast loop's guard: `pytest -m "not slow"` stays quick because an unmarked test that is not fails.

An unmarked test (no `slow` mark) fails when, in its setup and call:
- it started a process: `subprocess` (and so `asyncio`'s subprocesses), `multiprocessing` (and so
  `torch.multiprocessing.spawn` and process pools), `os.system`, `os.posix_spawn`. This is counted,
  not timed, so it holds on a loaded machine as on a quiet one;
- or it took over `--unmarked-limit` seconds of wall time (5 s), scaled up by the machine's load
  where it has more runnable processes than cores (load 6 on 2 cores: 15 s). The unmarked tests
  take well under 1.5 s on a quiet machine (the first model a process loads pays ~3 s of imports,
  whichever test that is), so the bound fails a test that does too much, not a quick test on a
  busy machine; a test that trains, even a few steps, is marked rather than raced against it.

A session- or module-scoped fixture is set up in the setup of the first test that uses it, so that
test pays for it: a fixture that trains or starts a server makes every test that uses it `slow`.
Teardown is not counted. `--unmarked-limit=0` turns the guard off (a profiling run, a debugger).

tests/conftest.py takes the hooks from here; tests/test_fastloop.py runs the guard on generated tests.
"""

import multiprocessing.process
import os
import platform
import subprocess
import time

import pytest

LIMIT_S = 5.0
MARK = "slow"

# What the running process has started, in order: a test's share is what was added since its setup began.
started: list[str] = []


def _short(args) -> str:
    words = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    text = " ".join(os.fsdecode(w) if isinstance(w, (bytes, os.PathLike)) else str(w) for w in words)
    return text if len(text) <= 80 else text[:77] + "..."


def _install_probe():
    """Wrap the points where a process starts (once per interpreter: an in-process inner pytest
    run, as tests/test_fastloop.py makes, finds them wrapped already)."""
    if getattr(subprocess.Popen._execute_child, "_fastloop", False):
        return
    # platform.processor() runs `uname -p` once per interpreter and keeps the answer; openai's client asks
    # for it on its first request, so the first test that makes one would be charged with that process
    platform.processor()

    def wrap(owner, name, describe):
        inner = getattr(owner, name)

        def probe(*args, **kwargs):
            started.append(describe(*args, **kwargs))
            return inner(*args, **kwargs)

        probe._fastloop = True
        setattr(owner, name, probe)

    wrap(subprocess.Popen, "_execute_child", lambda self, args, *a, **k: f"subprocess: {_short(args)}")
    wrap(multiprocessing.process.BaseProcess, "start", lambda self: f"multiprocessing: {self.name}")
    wrap(os, "system", lambda command: f"os.system: {_short(command)}")
    wrap(os, "posix_spawn", lambda path, argv, *a, **k: f"os.posix_spawn: {_short(argv)}")
    wrap(os, "posix_spawnp", lambda path, argv, *a, **k: f"os.posix_spawnp: {_short(argv)}")


def pytest_addoption(parser):
    parser.addoption("--unmarked-limit", type=float, default=LIMIT_S, metavar="SECONDS",
                     help=f"fail a test without the '{MARK}' mark that takes longer than this in its setup and "
                          f"call, or that starts a process (default {LIMIT_S:g}; 0 turns the guard off)")


def pytest_configure(config):
    if _limit(config) > 0:
        _install_probe()


def _limit(config) -> float:
    return config.getoption("unmarked_limit", default=LIMIT_S)


def load_factor() -> float:
    """How many times over the machine's cores are asked for (the last minute's load average), at least 1."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_since] = (len(started), time.perf_counter())
    yield


_since = pytest.StashKey[tuple]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    limit = _limit(item.config)
    if call.when != "call" or not report.passed or limit <= 0 or item.get_closest_marker(MARK) is not None:
        return
    first, t0 = item.stash.get(_since, (len(started), call.start))
    took = time.perf_counter() - t0  # setup (with the fixtures it built) and call
    spawned = started[first:]
    if spawned:
        more = f" and {len(spawned) - 1} more" if len(spawned) > 1 else ""
        why = f"started a process ({spawned[0]}{more})"
    elif took > limit * (load := load_factor()):
        why = f"took {took:.1f} s" + (f" (at load x{load:.1f}: bound {limit * load:.1f} s)" if load > 1 else "")
    else:
        return
    report.outcome = "failed"
    report.longrepr = (f"{item.nodeid} {why} unmarked: mark it @pytest.mark.{MARK} (it starts a process / trains / "
                       f"takes over {limit:g} s; see CONTRIBUTING.md, 'The fast loop')")
