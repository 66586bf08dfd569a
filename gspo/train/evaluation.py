"""Held-out evaluation: greedy accuracy (and pass@k) on a task's evaluation rows.

    from gspo.train.evaluation import EvalOptions, evaluate
    evaluate(model, tokenizer, task, rewards, EvalOptions(n=500))        # {"accuracy": 0.62, "reward": 0.62, "n": 500}
    evaluate(model, tokenizer, task, rewards, EvalOptions(n=500, k=8))   # adds "pass@8" and "sample_accuracy"
    evaluate(model, tokenizer, task, rewards, EvalOptions(episode=EpisodeSpec(CalculatorEnv, max_turns=3)))

`accuracy` is the mean of the *first* reward over greedy completions (for a 0/1 verifier, the
fraction answered correctly; `binary` says whether every value was 0 or 1, `metric` names the
reward). Rows where it returned None (does not apply) are left out: `n_scored` counts the
rows it scored, and where it scored none `accuracy` is None, never 0. `reward` is the mean
episode reward as training computes it (`reward/mean`): the weighted sum of all rewards, plus,
with an environment, the sum of its turn rewards, whose own mean is `reward_env` (training's
`reward/env/mean`). `pass@k` is the fraction of rows where at least one of k samples
(at `temperature`) gets a first reward of 1; `sample_accuracy` the mean first reward over the
samples it scored.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gspo.agents.runner import play
from gspo.io.reporting import bar_wanted
from gspo.rewards.builtin import Reward, TrainerState, score_completions
from gspo.sampling.episodes import Draws, EpisodeSpec
from gspo.sampling.produce import score_episodes
from gspo.sampling.rollout import (
    PolicySampler,
    cut_at_stop_strings,
    decode_completions,
    encode_prompts,
    generate,
    sampling_params,
    stop_token_ids,
)


@dataclass(frozen=True)
class EvalOptions:
    """How an evaluation runs.

    n: evaluation rows (the task's first n). k: pass@k samples per row (0: greedy only), drawn at
    `temperature` from a CPU generator seeded with `seed` whatever the model's device (the
    sampler draws its uniforms on the CPU). max_new_tokens: longest completion (of each model
    turn). batch_size: rows per generation. progress: a progress bar on a terminal (stderr), else
    a line through `log` (None: none) each time the batches pass another tenth of the rows,
    `LABEL 256/1000 problems (25%)  3 s` (gspo.io.reporting.bar_wanted decides; `label` names it).
    stop: the stop token ids (default: the tokenizer's EOS and the model's generation config's,
    `stop_token_ids`). episode (gspo.sampling.episodes.EpisodeSpec): the prompt limit and stop strings,
    and with its `env` (an environment class, gspo.tasks.env) each row is an episode of up to
    `max_turns` model turns, scored on its final model turn, its reward that score plus the
    environment's turn rewards (gspo.train.trainer.score). trainer_state: what the rewards get as
    `trainer_state` (a training run's progress). cuda_graphs: on a CUDA device, decode in CUDA graphs where
    the model allows it (`--cuda-graphs`)."""

    n: int = 500
    k: int = 0
    temperature: float = 1.0
    max_new_tokens: int = 8
    batch_size: int = 128
    seed: int = 0
    progress: bool = False
    log: Callable[[str], None] | None = None
    label: str = "eval"
    stop: tuple[int, ...] | None = None
    episode: EpisodeSpec = EpisodeSpec()
    trainer_state: TrainerState | None = None
    cuda_graphs: bool = True


@torch.no_grad()
def evaluate(model, tokenizer, task, rewards: list[Reward], options: EvalOptions = EvalOptions(),
             dist=None) -> dict:
    """Evaluate on the task's first `options.n` evaluation rows (module docstring; EvalOptions).
    dist (gspo.processes.distributed.Dist): each process evaluates its contiguous share of the rows and
    the sums are added up; every process returns the same result."""
    o = options
    n, k, batch_size, trainer_state, episode = o.n, o.k, o.batch_size, o.trainer_state, o.episode
    all_examples = task.test_set(n)
    lo, hi = dist.share(len(all_examples)) if dist is not None else (0, len(all_examples))
    examples = all_examples[lo:hi]
    first = rewards[0].name if rewards else "environment"  # none: the environment's own reward (an agent's)
    sums = dict.fromkeys(("acc", "scored", "total", "env", "pass_k", "sample_acc", "sample_scored", "nonbinary",
                          "failed"), 0.0)
    gen = torch.Generator().manual_seed(o.seed)
    stop = o.stop or stop_token_ids(tokenizer, model)
    greedy = sampling_params(tokenizer, stop=stop, group_size=1, max_new_tokens=o.max_new_tokens, temperature=0.0,
                             cuda_graphs=o.cuda_graphs)
    sampled = sampling_params(tokenizer, stop=stop, group_size=k, max_new_tokens=o.max_new_tokens,
                              temperature=o.temperature, cuda_graphs=o.cuda_graphs)
    shown = _Shown(o, len(examples))
    for start in shown.bar(range(0, len(examples), batch_size)):
        chunk = examples[start:start + batch_size]
        texts, ids, env_reward, ep = _complete(model, tokenizer, chunk, greedy, None, episode)
        weighted, per = _score(rewards, chunk, (texts, ids, ep), 1, trainer_state)
        failed = ep.failed.tolist() if ep is not None and ep.failed is not None else [False] * len(texts)
        # NaN: does not apply; a failed episode (never scored) counts as wrong
        values = [0.0 if f else v for v, f in zip(per[first], failed) if f or v == v] if rewards else list(env_reward)
        sums["failed"] += sum(failed)
        sums["acc"] += sum(values)
        sums["scored"] += len(values)
        sums["total"] += sum(weighted) + sum(env_reward)
        sums["env"] += sum(env_reward)
        sums["nonbinary"] += sum(v not in (0.0, 1.0) for v in values)  # 0: a verifier, accuracy is a share correct
        if k > 0:
            texts, ids, env_k, ep = _complete(model, tokenizer, chunk, sampled, gen, episode)
            _, per = _score(rewards, chunk, (texts, ids, ep), k, trainer_state)
            r = torch.tensor(per[first] if rewards else list(env_k)).view(len(chunk), k)  # (rows, k); NaN: n/a
            if ep is not None and ep.failed is not None:  # a failed episode counts as a wrong sample
                r[ep.failed.view(len(chunk), k)] = 0.0
            sums["pass_k"] += float((r >= 1.0).any(1).sum())
            sums["sample_acc"] += float(r.nan_to_num(0.0).sum())
            sums["sample_scored"] += float((r == r).sum())
        shown.done(start + len(chunk))
    if dist is not None and dist.enabled:
        sums = dict(zip(sums, dist.all_sum(torch.tensor(list(sums.values()), dtype=torch.float64)).tolist()))
    return _result(sums, n=len(all_examples), k=k, metric=first, env=episode.env is not None)


class _Shown:
    """An evaluation's progress (EvalOptions.progress): a tqdm bar over the batches on a terminal,
    else a line through options.log at each tenth of the rows the batches pass; nothing without."""

    def __init__(self, o: EvalOptions, rows: int):
        self.o, self.rows, self.t0, self.tenth = o, rows, time.time(), 0
        self.lines = o.progress and o.log is not None and rows > 0 and not bar_wanted()

    def bar(self, starts: range):
        if self.o.progress and len(starts) > 1 and bar_wanted():
            from tqdm import tqdm

            return tqdm(starts, desc="gspo eval", unit="batch", leave=False)
        return starts

    def done(self, rows: int) -> None:
        if self.lines and (rows * 10 // self.rows > self.tenth or rows == self.rows):
            self.tenth = rows * 10 // self.rows
            self.o.log(f"{self.o.label} {rows}/{self.rows} problems ({100 * rows // self.rows}%)  "
                       f"{time.time() - self.t0:.0f} s")


def _result(sums: dict, *, n: int, k: int, metric: str, env: bool = False) -> dict:
    """The evaluation's numbers from its sums; a mean over no scored rows is None."""
    out = {"accuracy": sums["acc"] / sums["scored"] if sums["scored"] else None, "n_scored": int(sums["scored"]),
           "reward": sums["total"] / n, "n": n, "metric": metric, "binary": sums["nonbinary"] == 0}
    if env:
        out["reward_env"] = sums["env"] / n
    if sums.get("failed"):
        out["failed"] = int(sums["failed"])  # an agent's episodes that failed: counted wrong, never scored
    if k > 0:
        out[f"pass@{k}"] = sums["pass_k"] / n
        out["sample_accuracy"] = sums["sample_acc"] / sums["sample_scored"] if sums["sample_scored"] else None
    return out


def with_environments(state: TrainerState | None, envs: list | None) -> TrainerState:
    """The trainer state the rewards get, carrying the episodes' environments (`environments=`)."""
    return dataclasses.replace(state or TrainerState(), environments=envs)


def _score(rewards: list[Reward], examples: list, done: tuple, k: int, state: TrainerState | None):
    """(weighted, per reward) of completions `done` = (texts, ids, episodes or None), k per
    example: an agent's failed episodes never scored (gspo.sampling.produce.score_episodes)."""
    texts, ids, ep = done
    if ep is not None:
        return score_episodes(rewards, examples, ep, k, state or TrainerState())
    return score_completions(rewards, examples, texts, ids, k, with_environments(state, None))


def _complete(model, tokenizer, examples, params, generator, episode: EpisodeSpec) -> tuple:
    """(texts, token ids, environment reward, episodes): the texts and token ids the rewards
    score, the environment's reward of each, and the episodes (gspo.sampling.episodes.Episodes;
    None without an environment): single-turn completions (no environment: 0), or
    (episode.env) the final model turn of each episode and the sum of its turn rewards."""
    if episode.env is not None:
        _, ep = play(PolicySampler(model), tokenizer, examples, episode, params,  # an environment's or an agent's
                     Draws(generator_for=lambda turn: generator))
        return ep.final_texts, ep.final_ids, ep.env_reward.tolist(), ep
    prompts = encode_prompts(tokenizer, [ex.prompt for ex in examples], episode.max_prompt_length)
    ro = cut_at_stop_strings(generate(model, prompts, params, generator=generator), tokenizer, episode.stop_strings)
    texts, ids = decode_completions(tokenizer, ro)
    return texts, ids, [0.0] * len(texts), None
