"""The Python API: a trainer object over models, datasets and reward functions as they are.

    import gspo
    trainer = gspo.Trainer(gspo.TrainConfig(steps=60), model=model_or_path, tokenizer=tok,
                           train_dataset=ds, eval_dataset=ds_eval, reward_funcs=[fn1, "exact_match"],
                           callbacks=[on_step])
    summary = trainer.train()           # what `gspo train` prints and writes to summary.json

In the spirit of TRL's `GRPOTrainer(model=..., reward_funcs=[...], train_dataset=...)`:
- `model`: a local directory (or a built-in name) or a transformers causal LM object (then
  `tokenizer` is required; the critic of PPO and the frozen reference copy it);
- `train_dataset` / `eval_dataset`: a file or dataset directory, a `datasets.Dataset`, or a
  list of dicts (the prompt column as `config.prompt_column`, the answer as
  `config.answer_column`; every column reaches the rewards);
- `reward_funcs`: callables `(completions, **columns) -> list[float | None]` (TRL's
  convention: None where a reward does not apply) and/or reward names (gspo.rewards);
- `env`: the environment of multi-turn episodes, a class (gspo.env; one instance per episode)
  or its `path.py:Class` name;
- `callbacks`: each a callable `(step, metrics) -> bool | None`, or an object with such an
  `on_step_end` method; it sees every step's metrics (the row of metrics.jsonl) and stops the
  run by returning True (a checkpoint is written at that step, then the final evaluation).

The configuration is type-checked (`steps="2"` is a one-line ConfigError naming the field).
Objects cannot be written to `config.yaml`: it records a placeholder (`<train_dataset>`), and
resuming such a run (`trainer.train(resume=run_dir)`) needs the same objects again. The CLI
(`gspo train`) is a thin caller of this class.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from gspo.config import ConfigError, TrainConfig
from gspo.run import Inputs


class Trainer:
    def __init__(self, config: TrainConfig | None = None, *, model=None, tokenizer=None, train_dataset=None,
                 eval_dataset=None, reward_funcs=None, env=None, callbacks=()):
        if config is not None and not isinstance(config, TrainConfig):
            raise ConfigError(f"config: expected a gspo.TrainConfig, got {type(config).__name__}")
        cfg = config or TrainConfig()
        changes = {}
        if model is not None:
            changes["model"] = _name(model, "model", "<model object>")
        if train_dataset is not None:
            changes["dataset"] = _name(train_dataset, "train_dataset", "<train_dataset>")
        if eval_dataset is not None:
            changes["eval_dataset"] = _name(eval_dataset, "eval_dataset", "<eval_dataset>")
        if reward_funcs is not None:
            funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
            changes["reward"] = tuple(f if isinstance(f, str) else f"<{getattr(f, '__name__', 'reward')}>"
                                      for f in funcs)
            reward_funcs = funcs
        if env is not None:
            changes["env"] = env if isinstance(env, str) else f"<{getattr(env, '__name__', 'env')}>"
        self.config = dataclasses.replace(cfg, **changes)
        self._configured = config is not None or bool(changes)  # else a resume keeps the run's saved config
        self.inputs = Inputs(model=model if isinstance(model, torch.nn.Module) else None, tokenizer=tokenizer,
                             train_dataset=None if isinstance(train_dataset, (str, Path)) else train_dataset,
                             eval_dataset=None if isinstance(eval_dataset, (str, Path)) else eval_dataset,
                             reward_funcs=reward_funcs, env=None if isinstance(env, str) else env)
        self.callbacks = [_step_end(cb) for cb in callbacks]

    def train(self, resume: str | Path | None = None, log=print) -> dict:
        """Train; returns the run's summary. resume: a run directory to continue (its saved
        configuration; the options of this trainer's config that are safe to change apply)."""
        from gspo.trainer import train

        cfg = self.config if resume is None or self._configured else None
        return train(cfg, resume=resume, log=log, inputs=self.inputs, callbacks=self.callbacks)


def _name(value, field: str, placeholder: str) -> str:
    """What the config records for an object given by value: its path, or a placeholder."""
    if isinstance(value, (str, Path)):
        return str(value)
    if field == "model" and not isinstance(value, torch.nn.Module):
        raise ConfigError(f"model: expected a directory, a built-in model name or a transformers model, "
                          f"got {type(value).__name__}")
    return placeholder


def _step_end(cb):
    fn = getattr(cb, "on_step_end", cb)
    if not callable(fn):
        raise ConfigError(f"callbacks: expected callables (step, metrics) -> bool or objects with on_step_end, "
                          f"got {type(cb).__name__}")
    return fn
