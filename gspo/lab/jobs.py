"""Independent runs side by side, each in a process of its own: `gspo compare --jobs N`.

    from gspo.lab.jobs import for_job, in_processes, plan_jobs
    jobs, threads = plan_jobs(base_config, pending=12)    # (2, 1) on a 2-core CPU machine
    in_processes([(label, fn, (for_job(cfg, threads), ...)), ...], jobs)   # fn: a module-level function
    # gspo.lab.compare's train_runs and ratio_variances are built on these
    saved, why = saved_config(run_dir, cfg)   # why None: the run asked for (reuse or resume); else set_aside(run_dir)

Why. A comparison's runs share nothing: on a small CPU model one run keeps two cores only
half busy (a decode step is many small operations), so two runs of one thread each finish the
work of two runs of two threads in about two thirds of the time.

What stays exact. Each run trains in its own spawned process with `threads` torch threads, and
gives bit for bit what `gspo train` gives alone with the same `--threads` (tests/test_jobs.py).
The thread count itself is part of the arithmetic: torch splits a reduction across threads, so
one thread and two round differently (~1e-6 on a log-prob) and seeded runs then drift apart.
That is why the thread count is written into every run's configuration (`threads`), where a
re-run reads it: a resumed run keeps the count it began with, whatever the resuming compare's
`--jobs` (`for_job(cfg, None)`).

Reuse. A run directory is reused (finished) or resumed (a checkpoint, or a config.yaml alone)
only when its saved configuration is the one asked for, both resolved (`differences`), apart
from `NOT_THE_RUN`, and it was trained from what it would be now: this gspo version, the same
content in the files its options name (its fingerprint.json: gspo.train.fingerprint; a run
without one, an older gspo's, is not known to be). Otherwise it is set aside as
`<run>.replaced-<k>` (`set_aside`) and trained again.

Errors. The first run that fails stops the others from starting; those already training finish
(each is resumable), and its error is raised with the run's name.

Ends. A job dies with its comparison: when the `gspo compare` process is gone (killed, even by
SIGKILL), each job is sent SIGTERM (Linux: the kernel's PR_SET_PDEATHSIG; elsewhere a thread that
watches the parent), which a training run answers as `gspo train` does (gspo.train.lifecycle):
the step under way finishes, a checkpoint is written, the run's lock is released. Before, the jobs
trained on, orphaned, holding their run directories' locks, so the next `gspo compare` on the
directory was refused until they ended.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from gspo.config import ConfigError, TrainConfig, options
from gspo.config.yamlfile import load_yaml
from gspo.processes.links import on_parent_death
from gspo.train.fingerprint import changed_since
from gspo.train.lifecycle import check_no_writer
from gspo.train.resolve import absolute_paths, resolve

MAX_AUTO_JOBS = 4  # a tiny run holds ~1 GiB; more processes than this rarely pay on a laptop


def plan_jobs(cfg: TrainConfig, pending: int, jobs: int = 0, cores: int | None = None) -> tuple[int, int]:
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


def in_processes(calls: list[tuple[str, object, tuple]], jobs: int, log=print, done=None) -> list:
    """Each (label, module-level function, its arguments) in up to `jobs` spawned processes; their
    results, in order. done(label, result), if given, is called as each call ends, in the order
    they end (a run's `done in N s` line when that run ends). The first call that fails stops the
    calls not yet started (those running finish, `done` still said of them) and its error is
    raised, after a `[compare] LABEL: failed` line."""
    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_job_process, initargs=(os.getpid(),)) as pool:
        futures = [pool.submit(_in_job, os.getpid(), fn, *args) for _, fn, args in calls]
        label = {f: name for f, (name, _, _) in zip(futures, calls)}
        failed = None
        for f in as_completed(futures):
            if f.cancelled() or f.exception() is not None:
                if failed is None:
                    failed = f
                    for other in futures:
                        other.cancel()  # calls not started stay unstarted; runs training finish (and are resumable)
            elif done is not None:
                done(label[f], f.result())
        if failed is not None:
            log(f"[compare] {label[failed]}: failed")
            raise failed.exception()
        return [f.result() for f in futures]


WATCH_S = 1.0  # where the kernel cannot tell a job of its parent's death: how often it looks


def _job_process(parent: int) -> None:
    """In a job's process, before its first call: SIGTERM to it when the comparison's process dies
    (the module docstring's "Ends")."""
    if not on_parent_death(signal.SIGTERM):
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="gspo-job-parent-watch").start()
    if os.getppid() != parent:  # gone before the kernel was asked
        os.kill(os.getpid(), signal.SIGTERM)


def _in_job(parent: int, fn, *args):
    """fn(*args) in a job's process of the comparison `parent`; once that is gone, the process ends
    with the call (it would wait for the next call for ever: its siblings hold the call queue open)."""
    try:
        return fn(*args)
    except BaseException as exc:
        if os.getppid() != parent:
            print(f"[compare] the comparison's process is gone: {exc} (or the same `gspo compare` again)",
                  file=sys.stderr, flush=True)
        raise
    finally:
        if os.getppid() != parent:
            os._exit(1)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(WATCH_S)
    os.kill(os.getpid(), signal.SIGTERM)


def for_job(cfg: TrainConfig, threads: int | None):
    """The run as one job of several: its thread count set (it shapes the arithmetic, so the
    run's config.yaml keeps it; None: the configuration's own, as a resumed run keeps the count it
    began with); its progress as the configuration asks (gspo.lab.compare's jobs log it as lines, a bar
    apiece would fight over the terminal: gspo.io.reporting.progress_as_lines)."""
    return dataclasses.replace(cfg, threads=cfg.run.threads if threads is None else threads)


# What a run directory's saved configuration may differ in from the one asked for and still be
# that run (reused when finished, resumed when not, with these taken from the one asked for): how
# the run is carried out, never a number it computes or the report reads. Each is an option a
# resume may change (`resume=True` in gspo.config.sections; tests/test_compare_reuse.py checks
# it), output_dir excepted. Not here, so compared: steps and eval_every (the report reads the
# evaluations), device and the other devices (they round differently). `threads` is apart: it
# shapes the arithmetic, but plan_jobs chooses it from --jobs and the cores, so it is compared only
# when asked for (--threads N), and a resumed run keeps its own (for_job(cfg, None)).
NOT_THE_RUN = (
    "output_dir",  # where it is: a compare directory may be moved
    "progress", "report_to", "wandb_project", "samples_per_step",  # what it shows and logs besides metrics.jsonl
    "save_every", "keep_checkpoints",  # how often it checkpoints
    "vllm_gpu_memory_utilization", "vllm_kv_cache_gib", "vllm_sleep", "reward_model_batch_size",  # memory
    "rollout_workers",  # which process samples: the batches are the same
)


def differences(saved, asked) -> list[tuple[str, object, object]]:
    """(option, the run's value, the asked one) for each option in which a run's saved configuration
    (its config.yaml) is not `asked`, both resolved (gspo.train.resolve: defaults resolved the same way
    are no difference), NOT_THE_RUN left out. Two values a run derives from its model as it starts
    are not known before: max_new_tokens left to the task's default may be capped to the model's
    positions (a smaller saved value is taken for that), and max_episode_tokens 0 is what they leave."""
    old, new = resolve(saved), absolute_paths(resolve(asked))
    out = []
    for name in (f.name for f in options()):
        a, b = getattr(old, name), getattr(new, name)
        if a == b or name in NOT_THE_RUN or (name == "threads" and not asked.run.threads) or \
                (name == "max_new_tokens" and asked.sampling.max_new_tokens is None and a < b) or \
                (name == "max_episode_tokens" and not asked.episodes.max_episode_tokens):
            continue
        out.append((name, a, b))
    return out


def saved_config(run: Path, asked):
    """(the run's saved configuration or None, None when it is the run asked for, else why not in
    words: `was trained with lr=0.0003, steps=1; asked: lr=0.01, steps=3`, the options asked for,
    not those derived from them: critic_lr from lr, the clip range from the algorithm). The same
    configuration is the run asked for when its fingerprint is this gspo's and these files'
    (gspo.train.fingerprint): `was trained before --reward file rewards.py changed`."""
    try:
        saved = load_yaml(run / "config.yaml")
        diff = differences(saved, asked)
    except ConfigError as e:  # no config.yaml, or one this version cannot read
        return None, f"has no configuration to compare ({e})"
    if not diff:
        return saved, changed_since(run, absolute_paths(resolve(asked)))
    shown = [d for d in diff if getattr(asked, d[0]) is not None] or diff  # not those derived from the others

    def said(values):
        return ", ".join(f"{name}={v if isinstance(v, str) else list(v) if isinstance(v, tuple) else v!r}"
                         for name, v in values)

    return saved, (f"was trained with {said((n, a) for n, a, _ in shown)}; "
                   f"asked: {said((n, b) for n, _, b in shown)}")


def set_aside(run: Path) -> Path:
    """Move a run directory out of the way, not deleted: to `<run>.replaced-<k>`, k one more than any
    earlier set-aside run's (none is overwritten). Refused while a live run writes it."""
    check_no_writer(run)
    prefix = f"{run.name}.replaced-"
    taken = [int(p.name[len(prefix):]) for p in run.parent.iterdir()
             if p.name.startswith(prefix) and p.name[len(prefix):].isdigit()]
    aside = run.with_name(f"{prefix}{max(taken, default=0) + 1}")
    run.rename(aside)
    return aside


def resumed(saved, asked):
    """The configuration a resumed run continues with: its saved one (its threads included), with
    the asked values of NOT_THE_RUN."""
    return dataclasses.replace(saved, **{name: getattr(asked, name) for name in NOT_THE_RUN})
