"""Where metrics go: `metrics.jsonl` always, TensorBoard and Weights & Biases on request.

    reporter = Reporter(run_dir, ["tensorboard", "wandb"], config=cfg_dict, start_step=0)
    reporter.log({"step": 1, "reward/mean": 0.5, ...})
    reporter.close()

TensorBoard event files go to `run_dir/tensorboard/` (`tensorboard --logdir runs/`). W&B
logs to project `wandb_project` under the run directory's name; offline mode
(`WANDB_MODE=offline`) needs no network and no account. On resume, TensorBoard purges the
steps after the checkpoint and W&B continues the same run id (stored in `run_dir/wandb_id`),
so neither shows a step twice. Also here: samples.jsonl's rows (`samples_rows`) and the
progress of a run (`ProgressBar`: a bar on a terminal, else a line per 10% of the steps;
`progress_as_lines` for lines even on a terminal).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from gspo.io import files

REPORTERS = ("tensorboard", "wandb")


def warn(message: str) -> None:
    """One line on stderr, `gspo: warning: ...` (rank 0 only under torchrun)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"gspo: warning: {' '.join(message.split())}", file=sys.stderr)


class Reporter:
    def __init__(self, run_dir: Path, report_to: list[str] | tuple[str, ...], *, config: dict, start_step: int = 0,
                 wandb_project: str = "gspo"):
        self.run_dir = Path(run_dir)
        self.tb = None
        self.wandb = None
        if "tensorboard" in report_to:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError("--report-to tensorboard needs the tensorboard package: "
                                 "pip install 'gspo[logging]'") from None
            self.tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=start_step + 1)
        if "wandb" in report_to:
            try:
                import wandb
            except ImportError:
                raise ValueError("--report-to wandb needs the wandb package: pip install 'gspo[logging]'") from None
            id_file = self.run_dir / "wandb_id"
            run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
            files.atomic_write_text(id_file, run_id)
            try:
                self.wandb = wandb.init(project=wandb_project, name=self.run_dir.name, id=run_id, resume="allow",
                                        dir=str(self.run_dir), config=config, mode=os.environ.get("WANDB_MODE"))
            except Exception as e:  # no key, no network, a bad project...
                raise ValueError(f"--report-to wandb: W&B did not start ({type(e).__name__}: "
                                 f"{' '.join(str(e).split())[:200]}); run `wandb login`, set WANDB_API_KEY, "
                                 "or log offline with WANDB_MODE=offline") from None

    def log(self, metrics: dict) -> None:
        files.append_jsonl(self.run_dir / "metrics.jsonl", [metrics])
        step = int(metrics["step"])
        scalars = {k: float(v) for k, v in metrics.items()
                   if k != "step" and isinstance(v, (int, float)) and math.isfinite(float(v))}
        if self.tb is not None:
            for k, v in scalars.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def summary(self, values: dict) -> None:
        if self.wandb is not None:
            for k, v in values.items():
                self.wandb.summary[k] = v

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def samples_rows(step: int, batch, n: int, tokenizer=None) -> list[dict]:
    """The first `n` completions of a step's gspo.train.trainer.Batch, for samples.jsonl."""
    G, ro = batch.rollout.group_size, batch.rollout
    rows = []
    for i in range(min(n, len(batch.completions))):
        ex = batch.examples[i // G]
        seen = tokenizer.decode(ro.prompt_ids[i][ro.prompt_mask[i] > 0]) if tokenizer is not None else ex.prompt
        rows.append({"step": step, "prompt": seen,  # what the model saw: after the chat template, truncation
                     **({"messages": ex.prompt} if ex.is_chat else {}), "completion": batch.completions[i],
                     "answer": ex.answer, "reward": float(batch.rewards[i]),
                     "advantage": float(batch.advantages[i].flatten()[0]),
                     **({"episode": batch.episodes.transcripts[i], "turns": int(batch.episodes.turns[i]),
                         "turn_rewards": batch.episodes.turn_rewards[i]} if batch.episodes is not None else {}),
                     **({"failed": bool(batch.episodes.failed[i])}  # an agent's: reward 0, never scored
                        if batch.episodes is not None and batch.episodes.failed is not None else {})})
    return rows


_LINES = contextvars.ContextVar("gspo_progress_lines", default=False)


@contextlib.contextmanager
def progress_as_lines():
    """Within it, progress (a run's steps, an evaluation's problems) is log lines even on a terminal:
    the runs of `gspo compare`, whose bars would fight over it and could not say whose they are."""
    token = _LINES.set(True)
    try:
        yield
    finally:
        _LINES.reset(token)


def line_on_stdout(line: str) -> None:
    """A line (or several) on stdout in one flushed write: whole, never mixed into another process's."""
    sys.stdout.write(f"{line}\n")
    sys.stdout.flush()


def line_on_stderr(line: str) -> None:
    """line_on_stdout's twin on stderr."""
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()


def labelled(label: str, log):
    """log, with every line of a message (a run's plan is several) after `[LABEL] `, in one call."""
    return lambda text: log("\n".join(f"[{label}] {line}" for line in str(text).splitlines() or [""]))


def flushing(log):
    """log, then stdout flushed: a process's own lines (print: a pipe's buffer holds them) in their
    place among the flushed lines of the processes it started."""
    def said(line):
        log(line)
        sys.stdout.flush()
    return said


def bar_wanted() -> bool:
    """A tqdm bar (on stderr, a terminal), rather than log lines."""
    return sys.stderr.isatty() and not _LINES.get()


class ProgressBar:
    """A tqdm bar on a terminal; otherwise (or within progress_as_lines) a log line every ~10% of the run:
    `step 8/80 (10%)  reward 0.410  clip/frac 0.33  eval 0.452  12 s` (eval: the latest held-out
    accuracy, with its step when it is not this one; s: since the first step)."""

    def __init__(self, enabled: bool, total: int, start: int, log: Callable[[str], None], title: str = "gspo train"):
        """enabled: --progress; total: the run's steps; start: the step it starts after; log: where
        a line goes off a terminal; title: the bar's ("gspo train (gspo)")."""
        self.enabled, self.total, self.log = enabled, total, log
        self.bar, self.eval, self.t0 = None, None, time.time()
        self.every = max(1, total // 10)
        if self.enabled and bar_wanted():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc=title, unit="step",
                            dynamic_ncols=True)

    def update(self, m: dict) -> None:
        if not self.enabled:
            return
        step = m["step"]
        if m.get("eval/accuracy") is not None:
            self.eval = (step, m["eval/accuracy"])
        if self.bar is not None:
            self.bar.set_postfix(reward=f"{m['reward/mean']:.3f}", clip=f"{m['clip/frac']:.2g}")
            self.bar.update(1)
        elif step % self.every == 0 or step == self.total:
            ev = "" if self.eval is None else f"  eval {self.eval[1]:.3f}" + \
                ("" if self.eval[0] == step else f" (step {self.eval[0]})")
            self.log(f"step {step}/{self.total} ({100 * step // self.total}%)  reward {m['reward/mean']:.3f}  "
                     f"clip/frac {m['clip/frac']:.3g}{ev}  {time.time() - self.t0:.0f} s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
