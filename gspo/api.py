"""The Python API: a trainer object over models, datasets and reward functions as they are.

    import gspo
    trainer = gspo.Trainer(gspo.TrainConfig(steps=60), model=model_or_path, tokenizer=tok,
                           train_dataset=ds, eval_dataset=ds_eval, reward_funcs=[fn1, "exact_match"],
                           callbacks=[on_step])
    summary = trainer.train()           # what `gspo train` prints and writes to summary.json
    trainer.model                       # the trained policy
    trainer.merged_model()              # ... as a plain transformers model, LoRA merged (a CPU copy)
    trainer.save_model("out/")          # what `gspo export` writes (docs/export.md)
    trainer.push_to_hub("me/model")     # ... uploaded to the Hugging Face Hub

In the spirit of TRL's `GRPOTrainer(model=..., reward_funcs=[...], train_dataset=...)`:
- `model`: a Hugging Face Hub id ("Qwen/Qwen2.5-0.5B-Instruct", at `config.revision`), a
  local directory, a built-in name, or a transformers causal LM object (then `tokenizer` is
  required; the critic of PPO and the frozen reference copy it);
- `train_dataset` / `eval_dataset`: a Hub dataset id (with `config.dataset_config`), a file or
  dataset directory, a `datasets.Dataset` or `DatasetDict` (its `config.dataset_split` /
  `config.eval_split`), or a list of dicts (the prompt column as `config.prompt_column`, the
  answer as `config.answer_column`; every column reaches the rewards);
- `reward_funcs`: callables called by keyword as TRL calls them (`prompts=`, `completions=`,
  `completion_ids=`, every column; return None where a reward does not apply), reward names
  (gspo.rewards.builtin), and/or learned reward models by directory or Hub id (gspo.rewards.model);
- `env`: the environment of multi-turn episodes, a class (gspo.tasks.env; one instance per episode)
  or its `path.py:Class` name; or agent code, an `async def rollout(client, example)` talking to
  the policy through an OpenAI client (gspo.agents.runner);
- `env` also takes a verifiers environment (a `verifiers.v1` Env object): its tasks are the
  prompts, its agent program plays each episode through the endpoint, its rewards score them
  (gspo.agents.vfenv);
- `environment_factory`: TRL's environments, a class with `reset(**row)` whose other methods are
  tools (gspo.agents.trlenv), as GRPOTrainer takes it; `env` takes such a class too;
- `callbacks`: each a callable `(step, metrics) -> bool | None`, or an object with such an
  `on_step_end` method; it sees every step's metrics (the row of metrics.jsonl) and stops the
  run by returning True (a checkpoint is written at that step, then the final evaluation).

TRL's names work too: `args=` for the config (`gspo.TrainConfig.from_trl(num_generations=8)`
takes GRPOConfig's options, gspo.config.trl) and `processing_class=` for the tokenizer.
The configuration is type-checked when the trainer is made (`steps="2"` is a one-line
ConfigError naming the field). Objects cannot be written to `config.yaml`: it records a
placeholder (`<train_dataset>`), and resuming such a run (`trainer.train(resume=run_dir)`)
needs the same objects again; a trainer made without a config then continues with the run's
saved one. The CLI (`gspo train`) is a thin caller of this class.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from gspo.agents.trlenv import adapted, trl_environment
from gspo.agents.vfenv import VerifiersTask, is_verifiers_env
from gspo.config import ConfigError, TrainConfig, options
from gspo.config.checks import check_value
from gspo.config.yamlfile import in_memory, load_yaml
from gspo.sampling.samplers import Inputs


class Trainer:
    def __init__(self, config: TrainConfig | None = None, *, model=None, tokenizer=None, train_dataset=None,
                 eval_dataset=None, reward_funcs=None, env=None, callbacks=(), args=None, processing_class=None,
                 environment_factory=None):
        config = _either(config, args, "config", "args")  # TRL's names: args, processing_class
        tokenizer = _either(tokenizer, processing_class, "tokenizer", "processing_class")
        if config is not None and not isinstance(config, TrainConfig):
            trl = " (TRL's options: gspo.TrainConfig.from_trl(**options))" \
                if type(config).__name__ == "GRPOConfig" else ""
            raise ConfigError(f"{'config' if args is None else 'args'}: expected a gspo.TrainConfig, "
                              f"got {type(config).__name__}{trl}")
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
        if environment_factory is not None:  # TRL's: an environment class whose methods are tools
            if env is not None:
                raise ConfigError("env and environment_factory: pass one (environment_factory is TRL's name for a "
                                  "class with reset and tool methods; env takes it too)")
            env = trl_environment(environment_factory)
        elif env is not None and not isinstance(env, str) and not is_verifiers_env(env):
            env = adapted(env)
        source = None
        if is_verifiers_env(env):  # its tasks are the prompts, its agent program plays them (gspo.agents.vfenv)
            if train_dataset is not None:
                raise ConfigError("env: a verifiers environment brings its own tasks; drop train_dataset")
            source = VerifiersTask.from_env(env, test_size=cfg.eval.eval_size)
            changes["task"], env = source.name, None
        if env is not None:
            changes["env"] = env if isinstance(env, str) else f"<{getattr(env, '__name__', 'env')}>"
        checked = {f.name: check_value(f.name, getattr(cfg, f.name), f.name) for f in options()}
        self.config = dataclasses.replace(cfg, **{**checked, **changes})  # TrainConfig(steps="2") fails here
        self._given, self._changes, self._start = config is not None, changes, dataclasses.replace(self.config)
        self.inputs = Inputs(model=model if isinstance(model, torch.nn.Module) else None, tokenizer=tokenizer,
                             train_dataset=None if isinstance(train_dataset, (str, Path)) else train_dataset,
                             eval_dataset=None if isinstance(eval_dataset, (str, Path)) else eval_dataset,
                             reward_funcs=reward_funcs, env=None if isinstance(env, str) else env, task=source)
        self.callbacks = [_step_end(cb) for cb in callbacks]

    _trained = None  # after train(): the trained policy (gspo.export.Trained), None under FSDP
    _final = None  # after train(): the run's final checkpoint

    def train(self, resume: str | Path | None = None, log=print) -> dict:
        """Train; returns the run's summary. resume: a run directory to continue (its saved
        configuration; the options of this trainer's config that are safe to change apply)."""
        from gspo.export import from_run
        from gspo.train.trainer import train

        cfg = self.config
        if resume is not None and not self._given:  # the run's saved config, with the objects and any edits since
            cfg = _resumed(resume, {**self._changes, **_edits(self._start, self.config)})
        self._trained = self._final = None
        summary = train(cfg, resume=resume, log=log, inputs=self.inputs, callbacks=self.callbacks,
                        keep=lambda run: setattr(self, "_trained", from_run(run)))
        self._final = summary.get("final_checkpoint")
        return summary

    @property
    def model(self):
        """The policy. After train(): the trained one (a PEFT model with --lora-r), on the training
        device in its master-weight dtype; None where this process holds no whole policy (FSDP
        shards it; a resumed run that was complete loads none): save_model exports the final
        checkpoint then. Before train(): the model object passed, or None."""
        if self._trained is not None:
            return self._trained.model
        return None if self._final else self.inputs.model_object

    def merged_model(self, dtype: str | None = None):
        """The trained policy as a plain transformers model on the CPU: LoRA merged into its base
        (a copy: `trainer.model` keeps its adapters), parameters in `dtype` (default: the run's
        --dtype), as `save_model` writes it. None where this process holds no whole policy (FSDP)."""
        from gspo.export import plain_model
        from gspo.models.loading import DTYPES

        if self._trained is None:
            return None
        return plain_model(self._trained.model, DTYPES[dtype or self._trained.cfg.dtype], copy_model=True)

    def save_model(self, output_dir: str | Path, merge_lora: bool = True, dtype: str | None = None) -> Path:
        """Write the trained policy as `gspo export` writes a run (gspo.export.write): a plain
        Hugging Face directory, LoRA merged (merge_lora=False: the adapter alone), in the run's
        --dtype unless `dtype` says otherwise; `trainer.model` itself is left as it is. Under
        torchrun the main process writes. Returns the directory."""
        return self._save(output_dir, merge_lora, dtype, None)

    def push_to_hub(self, repo_id: str, private: bool = False, *, commit_message: str | None = None,
                    merge_lora: bool = True, dtype: str | None = None, token: str | None = None) -> str | None:
        """Upload what save_model writes to the hub repository `repo_id` (created if missing,
        `private` then); returns its URL (None on the other processes under torchrun)."""
        import tempfile

        from gspo.export import check_push, push_to_hub

        check_push(repo_id, token)
        with tempfile.TemporaryDirectory() as tmp:
            folder = self._save(Path(tmp) / repo_id.split("/")[-1], merge_lora, dtype, repo_id)
            if not _is_main():
                return None
            return push_to_hub(folder, repo_id, private=private, commit_message=commit_message, token=token)

    def _save(self, output_dir, merge_lora: bool, dtype: str | None, repo_id: str | None) -> Path:
        from gspo.export import ExportError, export, write

        if self._trained is None and not self._final:
            raise ExportError("save_model: nothing trained yet; call trainer.train() first")
        if not _is_main():
            return Path(output_dir)
        if self._trained is not None:
            return write(self._trained, output_dir, dtype=dtype, merge_lora=merge_lora, copy_model=True,
                         repo_id=repo_id)
        return export(self._final, output_dir, dtype=dtype, merge_lora=merge_lora, repo_id=repo_id)


def _is_main() -> bool:
    """Rank 0 under torchrun (or a single process): the one that writes."""
    return int(os.environ.get("RANK", "0")) == 0


def _either(value, trl_value, name: str, trl_name: str):
    """`value`, or TRL's name for it (`processing_class` for `tokenizer`); not both."""
    if value is not None and trl_value is not None and value is not trl_value:
        raise ConfigError(f"{name} and {trl_name} (TRL's name for it) both given: pass one")
    return trl_value if value is None else value


def _edits(start: TrainConfig, now: TrainConfig) -> dict:
    """The options changed on `trainer.config` since the trainer was made."""
    return {f.name: getattr(now, f.name) for f in options()
            if getattr(now, f.name) != getattr(start, f.name)}


def _resumed(run_dir, changes: dict) -> TrainConfig | None:
    """The configuration of a run resumed by a trainer made without one: the run's saved
    config.yaml with `changes` (its objects' placeholders, options set since); a run trained
    with objects needs them again. None where there is no config.yaml (train() says so)."""
    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        return None
    saved = load_yaml(path)
    args = {"dataset": "train_dataset", "eval_dataset": "eval_dataset", "reward": "reward_funcs", "env": "env"}
    missing = [f"{args[k]}= ({v})" for k, v in in_memory(saved).items() if k in args and k not in changes]
    if missing:
        raise ConfigError(f"{run_dir} was trained with Python objects: pass {', '.join(missing)} to gspo.Trainer "
                          "again to resume it")
    return dataclasses.replace(saved, **changes)


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
