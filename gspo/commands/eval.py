"""`gspo eval`: its options and the command (gspo.cli dispatches to it).

    gspo eval --model DIR|CHECKPOINT|RUN_DIR [--k 8] [--dataset ... --reward ...] [--threads N]

A run directory or checkpoint brings its run's configuration (data, rewards, lengths, stop
tokens); the options given replace its values. The result is one JSON line on stdout.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from gspo.commands.argv import UsageError
from gspo.commands.argv import list_flags as _list_flags
from gspo.commands.argv import merge_repeated as _merge_repeated
from gspo.commands.argv import parse as _parse
from gspo.config import TrainConfig
from gspo.config.yamlfile import eval_names, load_yaml


@dataclass
class EvalArgs:
    """gspo eval: greedy accuracy (and pass@k) of a model on a task's evaluation rows."""

    model: str
    (
        "A model directory, a .gguf file, a Hugging Face Hub id (Qwen/Qwen2.5-0.5B-Instruct), a built-in name "
        "(tiny, tiny-moe, tiny-moe-wide, tiny-long, tiny-long-moe, tiny-tool), a checkpoint, or a run directory "
        "(its newest "
        "checkpoint). A checkpoint or run directory brings its run's data, rewards and sampling settings; "
        "the options below change them."
    )
    revision: str | None = None
    (
        "Hub revision of --model (a branch, tag or commit hash; default: the run's, else main); "
        "for a LoRA checkpoint, of its base model."
    )
    k: int = 8
    """Samples per problem for pass@k at --temperature (0 = greedy accuracy only)."""
    eval_size: int | None = None
    """Evaluation rows (default: the run's, else 500)."""
    task: str | None = None
    """Built-in task, or reasoning_gym:NAME (default: the run's, else arithmetic; `gspo tasks` lists them)."""
    task_options: tuple[str, ...] | None = None
    """A reasoning_gym task's generator options, KEY=VALUE; repeat --task-option (default: the run's)."""
    answer_from: Literal["tag", "tag_only", "last_line", "last_number"] | None = None
    (
        "What a reasoning_gym task's verifier scores: tag, tag_only, last_line or last_number "
        "(default: the run's, else tag)."
    )
    system_prompt: str | None = None
    """A system message before every prompt (default: the run's, else the task's)."""
    dataset: str | None = None
    """Dataset whose held-out slice is evaluated: a file, directory or Hub dataset id (default: the run's)."""
    dataset_config: str | None = None
    """Configuration (subset) of a Hub dataset, e.g. main for openai/gsm8k (default: the run's)."""
    eval_dataset: str | None = None
    """Evaluation data file, directory or Hub dataset id."""
    eval_split: str | None = None
    """Split of a dataset directory or Hub dataset to evaluate (e.g. test)."""
    prompt_column: str | None = None
    """Prompt column of the data."""
    answer_column: str | None = None
    """Answer column of the data."""
    reward: tuple[str, ...] | None = None
    """Rewards; the first is the one reported as `accuracy` (default: the run's)."""
    max_new_tokens: int | None = None
    """Longest completion (default: the run's, else the task's)."""
    temperature: float | None = None
    """Sampling temperature of the pass@k samples (default: the run's, else 1.0)."""
    stop_token: tuple[str, ...] | None = None
    """More tokens that end a completion."""
    env: str | None = None
    """Environment of multi-turn episodes, path.py:Class (default: the run's, else the task's)."""
    max_turns: int | None = None
    """Model turns per episode at most (default: the run's, else the task's)."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Dtype to load the model in (default: float32)."""
    device: str | None = None
    """cpu, cuda, cuda:N or auto (default: cpu)."""
    seed: int = 0
    """Seed of the pass@k samples."""
    progress: bool = True
    """Show progress: a bar on a terminal, else a line on stderr each tenth of the problems."""
    threads: int = 0
    """CPU threads, as gspo train takes them: 0 = half the cores, fewer when other processes keep them busy
    (OMP_NUM_THREADS, if set, is kept); the count is in the output's "threads"."""


def eval_config(a: EvalArgs) -> tuple[TrainConfig, str]:
    """The configuration to evaluate with: a run's (from a run directory or checkpoint) or the
    defaults, with the options given; and the model to load."""
    import dataclasses
    from pathlib import Path

    from gspo.train import checkpoint as ckpt

    path, model = Path(a.model), a.model
    if (path / "config.yaml").exists() and ckpt.latest_checkpoint(path) is not None:  # a run directory
        model = str(ckpt.latest_checkpoint(path))
        path = Path(model)
    base = load_yaml(path / "config.yaml") if (path / "config.yaml").exists() else TrainConfig()
    keep = {"dtype": "float32", "param_dtype": "float32"} if base.policy.dtype != "float32" else {}
    given = {f.name: getattr(a, f.name) for f in dataclasses.fields(a)
             if f.name not in ("model", "k", "threads") and getattr(a, f.name) is not None}
    if "dtype" in given:
        keep["param_dtype"] = given["dtype"]
    keep.update(eval_names(a.model, base, given))  # a run trained from Python on objects: what replaces them
    if base.policy.model is None:  # not a run's: the model evaluated is the one named (a reasoning_gym task needs one)
        keep.setdefault("model", model)
    return dataclasses.replace(base, **keep, **given, output_dir="-"), model


def cmd_eval(args: list[str]) -> int:
    """Evaluate a model, checkpoint or run on its task's evaluation rows with its rewards."""

    a = _parse(EvalArgs, _merge_repeated(args, _list_flags(EvalArgs)), "gspo eval")
    if a.k < 0:
        raise UsageError(f"--k: must be >= 0, got {a.k}")
    if a.threads < 0:
        raise UsageError(f"--threads: must be >= 0 (0: half the cores, fewer when busy), got {a.threads}")
    import torch

    from gspo.processes.threads import choose_threads, restored

    threads, _ = choose_threads(a.threads)
    with restored():  # gspo.cli.main called from Python: the caller's count back
        torch.set_num_threads(threads)
        return _evaluate(a, threads)


def _evaluate(a: EvalArgs, threads: int) -> int:
    """cmd_eval on `threads` CPU threads: the JSON line of results on stdout."""
    from gspo.agents.side import episodes_for, task_and_rewards
    from gspo.io.reporting import line_on_stderr
    from gspo.models.loading import DTYPES, load_policy, quiet_peft, resolve_device
    from gspo.sampling.episodes import EpisodeSpec
    from gspo.sampling.rollout import stop_token_ids
    from gspo.tasks.base import for_tokenizer
    from gspo.train.evaluation import EvalOptions, evaluate
    from gspo.train.resolve import resolve

    cfg, model_path = eval_config(a)
    cfg = resolve(cfg)
    task, rewards = task_and_rewards(cfg)
    with quiet_peft():  # a LoRA checkpoint: peft's deprecation warning is not the user's
        model, tok = load_policy(model_path, dtype=DTYPES[cfg.policy.dtype], device=resolve_device(cfg.run.device),
                                 revision=cfg.policy.revision)
    task = for_tokenizer(task, tok)
    env, max_turns, _ = episodes_for(cfg.episodes.env, task, cfg.episodes.max_turns, tok)
    sampling = cfg.sampling
    options = EvalOptions(n=cfg.eval.eval_size, k=a.k, temperature=sampling.temperature,
                          max_new_tokens=sampling.max_new_tokens, seed=a.seed, progress=cfg.run.progress,
                          stop=stop_token_ids(tok, model, sampling.stop_token), log=line_on_stderr,
                          episode=EpisodeSpec.from_config(cfg, env, max_turns),
                          cuda_graphs=sampling.cuda_graphs)  # progress: a bar, else lines
    res = evaluate(model, tok, task, rewards, options)
    print(json.dumps({"model": model_path, "task": cfg.data.dataset or cfg.data.task,
                      "max_new_tokens": sampling.max_new_tokens, "threads": threads, **res}))
    return 0
