"""The integrity check in a training step: what the samplers drew is what is trained (gspo.sampling.integrity).

    found = check_tokens(run, step, batch, produced)     # before the updates: integrity/* metrics
    watch = first_minibatch(run, produced, step)         # the on-policy log-ratio check's tolerance, or None
    update(run, batch, generator, watch)                 # gspo.train.trainer: checked before the first optimizer step

A breach is one line naming the step, the row and the likely cause. `--integrity stop` (the
default) raises IntegrityError before the step's update: nothing of the step is written, and the
run can be resumed from its last checkpoint. `--integrity warn` says the line and goes on: rows
whose tokens breach are left out of the loss (completion_mask 0); a log-ratio breach trains on.

Metrics (every step): `integrity/rows_checked` (rows with trained tokens, checked against the
receipts), `integrity/breaches` (of which breached), `time/integrity_seconds` (the token check's
time), and, for an on-policy batch, `integrity/log_ratio_row_max` (the first minibatch's largest
per-row mean |log π_train − log π_sampler|) and `integrity/log_ratio_mean` (its mean over the
minibatch's trained tokens); the tolerances are the plan's (`integrity`): where the sampler and
the trainer compute in different precisions they are logged, not checked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gspo.io.reporting import warn
from gspo.sampling.integrity import Breach, Tolerance, check_rows, renormalises, tf32_matmuls, tolerance
from gspo.train.run import Run

if TYPE_CHECKING:
    from gspo.sampling.produce import Produced
    from gspo.train.batch import Batch


class IntegrityError(ValueError):
    """A breach of the integrity check under --integrity stop; one line."""


@dataclass(frozen=True)
class Watch:
    """The first on-policy minibatch's check: the step, the tolerance (None: logged, not
    checked), the engine and dtype it is the tolerance of, and what a breach does."""

    step: int
    tolerance: Tolerance | None
    what: str  # "hf, float32"
    on_breach: str  # "stop" or "warn"


def first_minibatch(run: Run, produced: Produced, step: int) -> Watch | None:
    """The log-ratio check of step `step`'s first minibatch: None when its batch was sampled by
    older weights (off-policy: nothing to compare)."""
    cfg = run.cfg
    if produced.version != step - 1:
        return None
    engine = cfg.sampling.rollout_engine
    sampler = cfg.policy.dtype if cfg.sampling.rollout_dtype == "same" else cfg.sampling.rollout_dtype
    if sampler == "float32" and run.dist.device.type == "cuda" and tf32_matmuls():
        sampler = "tf32"  # float32 matmuls in TensorFloat-32: its tolerance
    train = sampler if sampler == "tf32" and cfg.policy.dtype == "float32" else cfg.policy.dtype
    bound = None if renormalises(engine, cfg.sampling) else tolerance(engine, sampler, train)
    return Watch(step, bound, f"{engine}, {sampler}", cfg.sampling.integrity)


def check_tokens(run: Run, step: int, batch: Batch, produced: Produced) -> dict[str, float]:
    """The token check of the step's rows against the receipts of its samplers; a breach stops
    the run (IntegrityError) or, with --integrity warn, is said and its rows left out of the
    loss. Returns the step's integrity/ token metrics (over the global batch)."""
    t0 = time.perf_counter()
    receipts = getattr(produced, "receipts", None)
    breaches, checked = check_rows(batch.rollout, receipts) if receipts is not None else ([], 0)
    seconds = time.perf_counter() - t0
    counts = run.dist.all_sum(torch.tensor([float(checked), float(len(breaches))], dtype=torch.float64))
    if breaches:
        line = f"integrity: step {step}: {describe(breaches, batch)}"
        if run.cfg.sampling.integrity == "stop":
            raise IntegrityError(f"{line}; the step's update was not made (--integrity warn leaves such rows out and "
                                 "trains on)")
        warn(f"{line}; left out of the loss")
        bad = torch.tensor([b.row for b in breaches], device=batch.rollout.completion_mask.device)
        batch.rollout.completion_mask[bad] = 0
    elif int(counts[1]) and run.cfg.sampling.integrity == "stop":  # another process's rows breached
        raise IntegrityError(f"integrity: step {step}: {int(counts[1])} row(s) of another process breached")
    return {"integrity/rows_checked": float(counts[0]), "integrity/breaches": float(counts[1]),
            "time/integrity_seconds": seconds}


def describe(breaches: list[Breach], batch: Batch) -> str:
    """The first breach in words, with how many there are and their likely cause."""
    first = breaches[0]
    more = f" (and {len(breaches) - 1} more row(s))" if len(breaches) > 1 else ""
    return (f"row {first.row}{_whose(first.row, batch)}, completion column {first.column}: {first.why}{more}; "
            f"likely cause: {_cause(batch)}")


def _whose(row: int, batch: Batch) -> str:
    B = batch.rewards.shape[0]
    if batch.episode_of is not None and row >= B:
        return f" (a later sequence of episode {int(batch.episode_of[row])})"
    return f" (episode {row})" if batch.episodes is not None else ""


def _cause(batch: Batch) -> str:
    episodes = batch.episodes
    if episodes is None:
        return ("the rows were changed after sampling (a stop-string cut, a refill round, a batch from a rollout "
                "worker or a checkpoint) or a sampler returned rows out of order")
    if episodes.agent is not None:
        return ("an agent's calls laid into a row out of the context they were sampled in (gspo.agents.runner: "
                "concurrent or forked calls, an edited history), or a call that did not come from the run's agent")
    return ("a multi-turn episode laid out out of its turns' contexts (gspo.sampling.episodes: an environment's "
            "tokens, a cut turn)")


def check_ratio(run: Run, batch: Batch, watch: Watch) -> tuple[float, float]:
    """After the first minibatch's forward (`batch.log_gap` filled for its rows), before its
    optimizer step: its largest per-row mean |log π_train − log π_sampler| and its mean over the
    minibatch's trained tokens, over every process, checked against `watch.tolerance`:
    IntegrityError under --integrity stop, a line under warn. Returns (row max, mean); NaN: no
    trained token."""
    gap = batch.log_gap  # (B + E,) NaN off the minibatch
    seen = ~gap.isnan()
    n = batch.rollout.completion_mask.sum(1).to(gap)  # (B + E,) each row's trained tokens
    local = torch.tensor([float(gap[seen].max()) if seen.any() else -1.0], dtype=torch.float64)
    sums = torch.tensor([float((gap[seen] * n[seen]).sum()), float(n[seen].sum())], dtype=torch.float64)
    worst, (total, tokens) = float(run.dist.all_max(local)[0]), run.dist.all_sum(sums).tolist()
    if worst < 0:
        return float("nan"), float("nan")
    mean, tol = total / max(tokens, 1.0), watch.tolerance
    if tol is None or (worst <= tol.row and mean <= tol.mean):
        return worst, mean
    row = int(torch.nan_to_num(gap, nan=-1.0).argmax()) if seen.any() else -1
    what = (f"row {row}{_whose(row, batch) if row >= 0 else ''} has a mean |log π_train − log π_sampler| of "
            f"{worst:.3g} over its trained tokens, past the tolerance {tol.row:g}" if worst > tol.row else
            f"their mean |log π_train − log π_sampler| over its trained tokens is {mean:.3g}, past the tolerance "
            f"{tol.mean:g}")
    line = (f"integrity: step {watch.step}: the first on-policy minibatch's log-probs are not the sampler's: {what} "
            f"({watch.what}); likely cause: the sampler drew from other weights (a weight sync that failed), in "
            "another context, or in another precision than the plan says")
    if watch.on_breach == "stop":
        raise IntegrityError(f"{line}; the step's update was not made")
    warn(line)
    return worst, mean
