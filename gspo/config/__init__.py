"""The training configuration: TrainConfig, made of the sections of gspo.config.sections.

    cfg = TrainConfig(algorithm="grpo", steps=50)          # options by their names, as flags and YAML keys
    cfg.loss.clip_low, cfg.sampling.group_size             # each section is handed whole to what it configures
    cfg.group_size                                         # an option read (or set) by its name, for scripts

A run's configuration comes from, in order: the defaults, then a YAML file (`--config run.yaml`,
keys are the option names), then command-line flags (`--group-size 16`). Option names are
unique across sections, so flags and YAML keys carry no section prefix (tyro's
OmitArgPrefixes), and `config.yaml` is a flat mapping of them. Checking (types, bounds and the
rules between options) and the derived values (clip range from the algorithm's preset, the
run directory ...) are gspo.train.resolve's.

The room: this module and its sections import nothing else of gspo; beside them, a run's YAML
file (gspo.config.yamlfile), TRL's option names (gspo.config.trl) and the values checked
(gspo.config.checks). May import: gspo.algo (the losses' names), gspo.io.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field

from gspo.config.sections import (
    PPO,
    VLLM,
    AsyncRL,
    ConfigError,
    Corrections,
    Data,
    Distill,
    Episodes,
    Eval,
    LoRA,
    Loss,
    MoE,
    Optim,
    Policy,
    Rewards,
    RunOptions,
    Sampling,
    bounds_error,
    opt,
)

# the sections in the order of `gspo train --help` and config.yaml: attribute -> (class, help title)
SECTIONS: dict[str, tuple[type, str]] = {
    "policy": (Policy, "model"), "lora": (LoRA, "LoRA"), "data": (Data, "data"), "rewards": (Rewards, "rewards"),
    "loss": (Loss, "algorithm"), "corrections": (Corrections, "sampler/trainer mismatch corrections"),
    "ppo": (PPO, "PPO's value model"), "sampling": (Sampling, "sampling"), "vllm": (VLLM, "vLLM engine"),
    "episodes": (Episodes, "multi-turn episodes"),
    "async_rl": (AsyncRL, "asynchronous rollouts"), "moe": (MoE, "Mixture-of-Experts"),
    "distill": (Distill, "on-policy distillation: a teacher"), "optim": (Optim, "optimiser"),
    "eval": (Eval, "evaluation"), "run": (RunOptions, "run: length, seed, logging and devices"),
}
# every option: name -> its section's attribute (names are unique across sections)
SECTION_OF: dict[str, str] = {f.name: s for s, (cls, _) in SECTIONS.items() for f in dataclasses.fields(cls)}


def options() -> list[dataclasses.Field]:
    """Every option's field, section by section (its metadata: help, bounds, resume)."""
    return [f for cls, _ in SECTIONS.values() for f in dataclasses.fields(cls)]


@functools.cache
def option_types() -> dict[str, object]:
    """Option name -> its type annotation, resolved (once: treat the mapping as read-only)."""
    return {name: hint for cls, _ in SECTIONS.values() for name, hint in typing.get_type_hints(cls).items()}


RESUME_SAFE = tuple(f.name for f in options() if f.metadata["resume"])  # what --resume may change


@dataclass(init=False)
class TrainConfig:
    """A training configuration: one object per section; options also by their names (`cfg.steps`)."""

    policy: Policy = field(default_factory=Policy)
    lora: LoRA = field(default_factory=LoRA)
    data: Data = field(default_factory=Data)
    rewards: Rewards = field(default_factory=Rewards)
    loss: Loss = field(default_factory=Loss)
    corrections: Corrections = field(default_factory=Corrections)
    ppo: PPO = field(default_factory=PPO)
    sampling: Sampling = field(default_factory=Sampling)
    vllm: VLLM = field(default_factory=VLLM)
    episodes: Episodes = field(default_factory=Episodes)
    async_rl: AsyncRL = field(default_factory=AsyncRL)
    moe: MoE = field(default_factory=MoE)
    distill: Distill = field(default_factory=Distill)
    optim: Optim = field(default_factory=Optim)
    eval: Eval = field(default_factory=Eval)
    run: RunOptions = field(default_factory=RunOptions)

    def __init__(self, **options):
        """Sections by their attribute (`loss=Loss(...)`, copied) and/or options by name (`steps=5`,
        applied after the sections); an unknown name is a TypeError, as for any dataclass."""
        for name, (cls, _) in SECTIONS.items():
            given = options.pop(name, None)
            object.__setattr__(self, name, cls() if given is None else dataclasses.replace(given))
        for name, value in options.items():
            if name not in SECTION_OF:
                raise TypeError(f"TrainConfig got an unexpected option {name!r}")
            setattr(getattr(self, SECTION_OF[name]), name, value)

    def __getattr__(self, name):  # only called for names that are not sections
        if name not in SECTION_OF:
            raise AttributeError(f"TrainConfig has no option {name!r}")
        return getattr(object.__getattribute__(self, SECTION_OF[name]), name)

    def __setattr__(self, name, value):
        if name in SECTION_OF:
            setattr(getattr(self, SECTION_OF[name]), name, value)
        elif name in SECTIONS:
            object.__setattr__(self, name, value)
        else:
            raise AttributeError(f"TrainConfig has no option {name!r}")

    @classmethod
    def from_trl(cls, **options) -> TrainConfig:
        """A config from TRL's GRPOConfig names (num_generations=8, loss_type="dr_grpo") and gspo's
        (the table is gspo.config.trl's)."""
        from gspo.config.trl import to_gspo  # here: the table is read only when asked for

        return cls(**to_gspo(options))


def to_dict(cfg: TrainConfig) -> dict:
    """Option name -> plain YAML/JSON-able value (tuples become lists), section by section."""
    return {f.name: list(v) if isinstance(v := getattr(cfg, f.name), tuple) else v for f in options()}


__all__ = ["SECTIONS", "SECTION_OF", "RESUME_SAFE", "ConfigError", "TrainConfig", "bounds_error", "opt", "options",
           "option_types", "to_dict", "Corrections", "Data", "Distill", "Episodes", "Eval", "Loss", "LoRA", "MoE",
           "Optim", "PPO", "Policy", "Rewards", "RunOptions", "Sampling", "VLLM"]
