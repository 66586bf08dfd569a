"""Independent runs side by side, each in a process of its own: `gspo compare --jobs N`.

    from gspo.jobs import for_job, in_processes, plan_jobs
    jobs, threads = plan_jobs(base_config, pending=12)    # (2, 1) on a 2-core CPU machine
    in_processes([(label, fn, (for_job(cfg, threads), ...)), ...], jobs)   # fn: a module-level function
    # gspo.compare's train_runs and ratio_variances are built on these

Why. A comparison's runs share nothing: on a small CPU model one run keeps two cores only
half busy (a decode step is many small operations), so two runs of one thread each finish the
work of two runs of two threads in about two thirds of the time.

What stays exact. Each run trains in its own spawned process with `threads` torch threads, and
gives bit for bit what `gspo train` gives alone with the same `--threads` (tests/test_jobs.py).
The thread count itself is part of the arithmetic: torch splits a reduction across threads, so
one thread and two round differently (~1e-6 on a log-prob) and seeded runs then drift apart.
That is why the thread count is written into every run's configuration (`threads`), where a
re-run reads it.

Errors. The first run that fails stops the others from starting; those already training finish
(each is resumable), and its error is raised with the run's name.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait

MAX_AUTO_JOBS = 4  # a tiny run holds ~1 GiB; more processes than this rarely pay on a laptop


def plan_jobs(cfg, pending: int, jobs: int = 0, cores: int | None = None) -> tuple[int, int]:
    """(jobs, torch threads per job; 0: torch's default) for `pending` runs of `cfg`. jobs 0 (auto):
    one on a GPU (runs would share it), else one per core up to MAX_AUTO_JOBS (one per
    `cfg.run.threads` cores when the configuration sets its threads). Several jobs share the cores
    out (at least one thread each) unless the configuration sets its threads; one job keeps them."""
    cores = cores or os.cpu_count() or 1
    if jobs == 0:
        on_cpu = cfg.run.device == "cpu"
        jobs = max(1, min(pending, MAX_AUTO_JOBS, cores // (cfg.run.threads or 1))) if on_cpu else 1
    jobs = max(1, min(jobs, pending))
    return jobs, cfg.run.threads or (max(1, cores // jobs) if jobs > 1 else 0)


def in_processes(calls: list[tuple[str, object, tuple]], jobs: int, log=print) -> list:
    """Each (label, module-level function, its arguments) in up to `jobs` spawned processes; their
    results, in order. The first call that fails stops the calls not yet started (those running
    finish) and its error is raised, after a `[compare] LABEL: failed` line."""
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(fn, *args) for _, fn, args in calls]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [i for i, f in enumerate(futures) if f in done and f.exception() is not None]
        if failed:
            for f in futures:
                f.cancel()  # calls not started stay unstarted; runs training finish (and are resumable)
            wait(futures)
            log(f"[compare] {calls[failed[0]][0]}: failed")
            raise futures[failed[0]].exception()
        return [f.result() for f in futures]


def for_job(cfg, threads: int):
    """The run as one job of several: its thread count set (it shapes the arithmetic, so the
    run's config.yaml keeps it), no progress bar (several would fight over the terminal)."""
    return dataclasses.replace(cfg, threads=threads, progress=False)
