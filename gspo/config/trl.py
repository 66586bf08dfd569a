"""TRL's names for gspo's options, in one table: what a GRPOConfig user writes, gspo understands.

    gspo train --num-generations 8 --learning-rate 1e-5 --loss-type dr_grpo    # the CLI
    num_generations: 8                                                          # a --config YAML file
    gspo.TrainConfig.from_trl(num_generations=8, importance_sampling_level="sequence")   # Python

- `TRL_NAMES`: the same option under another name (`num_generations` is `group_size`).
- `TRL_VALUES`: a TRL option whose values map onto a gspo option's (`loss_type: dr_grpo` is
  `loss_agg: seq-mean-token-sum-norm`); a value outside the map is refused with the reason.
- `NOT_MAPPED`: TRL options with no gspo meaning (most count optimizer updates or per-device
  batches, where gspo counts rollout steps): refused in one line that says what to use.

Options with the same name and meaning in both (beta, temperature, top_p, top_k, seed,
output_dir, reward_weights, mask_truncated_completions, max_prompt_length, weight_decay,
max_grad_norm, gradient_checkpointing, vllm_gpu_memory_utilization, dataset_config) need no
entry. A TRL name given with its gspo name (or two names for one option) must agree, else a
one-line error. As in TRL, `epsilon` alone sets both ends of the clip range. docs/trl.md is
the same table in prose, with the differences in defaults.
"""

from __future__ import annotations

import dataclasses

from gspo.config import SECTION_OF, ConfigError, TrainConfig
from gspo.config.checks import check_value, yaml_value
from gspo.io.words import did_you_mean as near

SKIP = object()  # a TRL value that changes nothing in gspo (bf16: false)

TRL_NAMES = {  # TRL name -> gspo field: the same meaning
    "num_generations": "group_size",
    "learning_rate": "lr",
    "max_completion_length": "max_new_tokens",
    "num_iterations": "epochs",  # TRL's μ: passes over each generation batch
    "steps_per_generation": "num_minibatches",  # updates per generation, with gradient_accumulation_steps 1
    "epsilon": "clip_low",
    "epsilon_high": "clip_high",
    "model_name_or_path": "model",
    "dataset_name": "dataset",
    "dataset_train_split": "dataset_split",
    "dataset_test_split": "eval_split",
    "sapo_temperature_pos": "sapo_tau_pos",
    "sapo_temperature_neg": "sapo_tau_neg",
    "off_policy_mask_threshold": "opsm_delta",
    "vllm_max_model_length": "vllm_max_model_len",
    "vllm_enable_sleep_mode": "vllm_sleep",
    "max_tool_calling_iterations": "max_turns",  # with environment_factory environments (gspo.agents.trlenv)
}

# TRL option -> (gspo field, {TRL value: gspo value}, why the other values do not map)
TRL_VALUES = {
    "loss_type": ("loss_agg", {"grpo": "seq-mean-token-mean", "dr_grpo": "seq-mean-token-sum-norm",
                               "dapo": "token-mean", "bnpo": "token-mean"},
                  "cispo and sapo are losses in gspo (--algorithm cispo|sapo, aggregation --loss-agg); "
                  "luspo is not in gspo"),
    "importance_sampling_level": ("algorithm", {"sequence": "gspo", "token": "grpo"},
                                  "gspo's token-level GSPO is --algorithm gspo_token"),
    "scale_rewards": ("adv_scale", {"group": "group", True: "group", "batch": "batch", "none": "none", False: "none"},
                      "the group-mean scaling (MaxRL) is not in gspo"),
    "lr_scheduler_type": ("lr_schedule", {"constant": "constant", "constant_with_warmup": "constant",
                                          "linear": "linear", "cosine": "cosine"},
                          "gspo has constant, linear and cosine, after --warmup-steps"),
    "bf16": ("dtype", {True: "bfloat16", False: SKIP}, "expected true or false"),
    "fp16": ("dtype", {True: "float16", False: SKIP}, "expected true or false"),
    "use_vllm": ("rollout_engine", {True: "vllm", False: "hf"}, "expected true or false"),
    "vllm_mode": ("rollout_engine", {"colocate": SKIP},
                  "gspo runs vLLM colocated, in the training process (--rollout-engine vllm)"),
    "gradient_accumulation_steps": ("num_minibatches", {1: SKIP},
                                    "gspo accumulates over micro-batches of --micro-batch-tokens; TRL's "
                                    "steps_per_generation / gradient_accumulation_steps is gspo's --num-minibatches"),
}

NOT_MAPPED = {  # TRL option -> why it does not map, and what to use
    "max_steps": "TRL counts optimizer updates; gspo's --steps counts rollout steps, each --num-minibatches x "
                 "--epochs updates (4 by default)",
    "num_train_epochs": "gspo trains for --steps rollout steps of --prompts-per-step prompts, not passes over the data",
    "per_device_train_batch_size": "a gspo step samples --prompts-per-step x --group-size completions; for memory "
                                   "use --micro-batch-tokens",
    "generation_batch_size": "a gspo step samples --prompts-per-step x --group-size completions",
    "logging_steps": "gspo logs every step to metrics.jsonl",
    "save_steps": "gspo's --save-every counts rollout steps",
    "eval_steps": "gspo's --eval-every counts rollout steps",
    "warmup_ratio": "use --warmup-steps (rollout steps)",
    "delta": "two-sided GRPO clipping (INTELLECT-2) is not in gspo",
    "vllm_importance_sampling_correction": "gspo's corrections are --rollout-is and --opsm-delta (docs/corrections.md)",
}


def is_trl(name: str) -> bool:
    return name in TRL_NAMES or name in TRL_VALUES or name in NOT_MAPPED


def fields() -> list[str]:
    return list(SECTION_OF)


def suggested() -> list[str]:
    """TRL's names that a did-you-mean may suggest, besides gspo's own."""
    return [*TRL_NAMES, *TRL_VALUES]


def did_you_mean(name: str, shown=str) -> str:
    """'; did you mean steps?' for a near miss among gspo's options and TRL's names, else ''."""
    return near(name, [*fields(), *suggested()], shown)


def to_gspo(values: dict, shown=str) -> dict:
    """gspo field -> value, from a mapping of gspo's and TRL's option names (hyphens or
    underscores) to values; each value checked against its field's type. `shown(name)` is how
    an option is named in errors (`--num-generations` on the CLI)."""
    out, source = {}, {}
    for key, value in values.items():
        name = str(key).replace("-", "_")
        target, value = _one(name, value, shown)
        if value is SKIP:
            continue
        value = check_value(target, value, shown(name))
        if target in out and out[target] != value:
            first = source[target]
            if target in (first, name):  # TRL's name with gspo's
                trl, (a, b) = (name, (value, out[target])) if first == target else (first, (out[target], value))
                raise ConfigError(f"{shown(trl)} is TRL's name for {shown(target)}: both given ({shown(trl)} {a!r}, "
                                  f"{shown(target)} {b!r}); give one")
            raise ConfigError(f"{shown(first)} and {shown(name)} both set {shown(target)}, to {out[target]!r} "
                              f"and {value!r}; give one")
        out[target], source[target] = value, name
    if source.get("clip_low") == "epsilon" and "clip_high" not in out:
        out["clip_high"] = out["clip_low"]  # TRL's epsilon_high defaults to epsilon
    return out


def _one(name: str, value, shown) -> tuple[str, object]:
    """(gspo field, value) for one option given by its gspo or TRL name."""
    if name in NOT_MAPPED:
        raise ConfigError(f"{shown(name)}: TRL's option has no gspo equivalent: {NOT_MAPPED[name]}")
    if name in TRL_NAMES:
        return TRL_NAMES[name], value
    if name in TRL_VALUES:
        target, table, why = TRL_VALUES[name]
        key = value.lower() if isinstance(value, str) else value
        for trl_value, gspo_value in table.items():
            if trl_value == key and type(trl_value) is type(key):  # True is not 1 here
                return target, gspo_value
        raise ConfigError(f"{shown(name)}: {value!r} does not map to gspo's {shown(target)}: {why}")
    if name not in fields():
        raise ConfigError(f"unknown option {shown(name)}{did_you_mean(name, shown)}")
    return name, value


def split_args(args: list[str]) -> tuple[dict, list[str]]:
    """TRL's flags taken out of a command line: ({name: value}, the other arguments). A value
    is read as YAML (`8`, `1e-5`, `true`); a flag without a value is true (`--bf16`)."""
    trl, rest, i = {}, [], 0
    while i < len(args):
        flag, _, inline = args[i].partition("=")
        name = flag[2:].replace("-", "_") if flag.startswith("--") else ""
        if not is_trl(name):
            rest.append(args[i])
            i += 1
            continue
        if "=" in args[i]:
            text, i = inline, i + 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            text, i = args[i + 1], i + 2
        else:
            text, i = "true", i + 1
        trl[name] = yaml_value(text)
    return trl, rest


def given_fields(args: list[str]) -> list[str]:
    """The TrainConfig fields a command line sets (`--group-size 4`, `--no-progress`)."""
    names = set(fields())
    out = []
    for a in args:
        if a.startswith("--"):
            name = a[2:].partition("=")[0].replace("-", "_")
            name = name[3:] if name.startswith("no_") and name[3:] in names else name
            if name in names:
                out.append(name)
    return out


def apply_args(cfg: TrainConfig, trl: dict, args: list[str]) -> TrainConfig:
    """`cfg` (parsed from `args`) with the TRL flags `trl` applied; a TRL flag and the gspo
    flag of the same option on one command line must agree."""
    if not trl:
        return cfg
    given = {name: getattr(cfg, name) for name in given_fields(args)}
    values = to_gspo({**trl, **given}, shown=lambda n: "--" + n.replace("_", "-"))
    return dataclasses.replace(cfg, **values)


__all__ = ["NOT_MAPPED", "TRL_NAMES", "TRL_VALUES", "apply_args", "did_you_mean", "split_args", "to_gspo"]
