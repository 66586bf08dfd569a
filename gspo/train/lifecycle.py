"""A run's life: one writer per directory, a clean stop on a signal, nothing left behind by a false start.

    guard = Guard(run)             # takes the run directory's lock, catches SIGINT and SIGTERM
    ... after each step: guard.check(step) raises Interrupted once a signal came (checkpoint first)
    guard.failed(exc)              # a run that failed before its first step leaves no directory
    guard.release()

- **One writer**: an exclusive `flock` on `RUN_DIR/.lock` (rank 0), held while the run lives.
  A second `gspo train` on the same directory is refused in one line; the kernel drops the
  lock when a process dies, so a killed run never blocks `--resume`.
- **Signals** (Ctrl-C, a cluster's SIGTERM before preemption): the step under way finishes, a
  checkpoint is written, and `Interrupted` says how to resume (the CLI prints it and exits with
  128 + the signal's number). Under torchrun every process learns of a signal any process got
  (the flag is all-reduced after each step), so they stop at the same step; rank 0 alone says
  so, with the torchrun line that resumes the run (docs/distributed.md). A second Ctrl-C
  exits at once. A signal ignored when the run starts (a shell's `cmd &` ignores SIGINT) stays
  ignored, as Python itself leaves it, and `release` puts back whatever handler was there.
- **False starts**: a run that fails before its first step completes (a reward that raises, a
  logger that cannot start) removes the run directory it created, so the same command can
  simply be run again.
What a resumed run may change, and the absolute paths a run's config records, are
gspo.train.resolve's (`resume_config`, `absolute_paths`).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from gspo.io.files import read_jsonl
from gspo.train import checkpoint as ckpt

if TYPE_CHECKING:
    from gspo.processes.distributed import Dist


class Place(Protocol):
    """What a run's life reads of it (a gspo.train.run.Run is one): where it writes, and whether it
    is resumed."""

    run_dir: Path
    dist: Dist
    resume_from: Path | None
    progress: ckpt.Progress


class Interrupted(Exception):
    """The run stopped on a signal after `step`, with a checkpoint there."""

    def __init__(self, signum: int, step: int, run_dir: Path):
        self.signum, self.step, self.run_dir = signum, step, run_dir
        super().__init__(self.line(f"gspo train --resume {run_dir}"))

    def line(self, resume: str) -> str:
        """What to tell the user, `resume` the command that continues the run (the CLI's: under
        torchrun, the torchrun line; gspo.processes.distributed.command_line)."""
        name = signal.Signals(self.signum).name
        return f"interrupted by {name} after step {self.step}; checkpoint written; continue with: {resume}"


class RunLock:
    """One writer per run directory: an exclusive `flock` on `run_dir/.lock`, held while the run
    lives. The kernel drops it when the process dies, so a killed run never blocks `--resume`,
    while a second run on the same directory is refused at once."""

    def __init__(self, run_dir: Path):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / ckpt.LOCK
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(self.fd, 64).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise FileExistsError(f"{run_dir}: another gspo run is writing it (pid {holder}); wait for it to end, "
                                  "or use another --output-dir") from None
        os.ftruncate(self.fd, 0)
        os.write(self.fd, str(os.getpid()).encode())

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def check_no_writer(run_dir: Path) -> None:
    """Refuse at once (before any model is loaded) when a live run holds the directory's lock."""
    path = run_dir / ckpt.LOCK
    if not path.exists():
        return
    RunLock(run_dir).release()  # raises when another process holds it


class Guard:
    """The lock, the signal handlers and the clean-up of one run (see the module docstring)."""

    def __init__(self, run: Place):
        self.run, self.lock, self.signum, self.saved = run, None, 0, {}
        self.created = not run.run_dir.exists()
        if run.dist.is_main:
            self.lock = RunLock(run.run_dir)
            if run.resume_from is None and run.progress.start_step == 0 and not run.progress.restart and \
                    not ckpt.is_empty_run_dir(run.run_dir):  # someone wrote here between the check and the lock
                self.lock.release()
                raise FileExistsError(f"{run.run_dir}: output directory exists and is not empty "
                                      f"(use --resume {run.run_dir} to continue it)")
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                if signal.getsignal(s) is not signal.SIG_IGN:  # ignored at entry (`cmd &`, nohup): stays ignored
                    self.saved[s] = signal.signal(s, self._handler)

    def _handler(self, signum, frame) -> None:
        # the second Ctrl-C: at once; torchrun forwards it to its workers as SIGTERM, hence either
        # order. Two SIGTERMs are one request (a cluster's to every process and torchrun's relay)
        if self.signum and signal.SIGINT in (signum, self.signum):
            raise KeyboardInterrupt
        self.signum = signum

    def check(self, step: int, saved: bool, stop: bool = False) -> bool:
        """After a step: if any process got a signal, checkpoint (unless this step just was) and
        raise Interrupted; if a callback on any process asked to stop, checkpoint and return True."""
        signum, stop = self.run.dist.max_int(self.signum), self.run.dist.max_int(int(stop))
        if (signum or stop) and not saved:
            ckpt.save_run(self.run, step)
        if signum:
            raise Interrupted(signum, step, self.run.run_dir)
        return bool(stop)

    def failed(self) -> None:
        """A false start (no step done, no checkpoint) leaves no directory behind it."""
        run = self.run
        if run.dist.is_main and self.created and not read_jsonl(run.run_dir / "metrics.jsonl") \
                and ckpt.latest_checkpoint(run.run_dir) is None:
            shutil.rmtree(run.run_dir, ignore_errors=True)

    def release(self) -> None:
        for s, handler in self.saved.items():
            signal.signal(s, handler)
        self.saved = {}
        if self.lock is not None:
            self.lock.release()
            self.lock = None
