"""The `gspo train` command that makes a configuration, as short as it can be (the model card's).

    from gspo.commands.train_command import train_command
    train_command(load_yaml("runs/r/config.yaml"))   # 'gspo train --lr 0.0001 --steps 3'

A run records its resolved configuration (config.yaml), not the flags it was given: the clip
range is filled from the algorithm's preset, --critic-lr from --lr, the model, the steps and the
completion length from the task. The command names an option only where it is needed to get the
run's value back: a value that differs from the default, or a derived value that differs from
what gspo.train.resolve derives from the rest (a --critic-lr that is not 10 x --lr). An option that
the run's algorithm does not read (PPO's value model for another loss, SAPO's gate temperatures
for the clipped losses, the clip range for SAPO) is left out. Parsed back and resolved, the
command gives the run's configuration, less the options left out and where it ran
(--output-dir, --progress, --threads); tests/test_export.py checks that.
"""

from __future__ import annotations

import shlex

from gspo.algo.losses import LOSSES, own_options
from gspo.config import SECTION_OF, ConfigError, TrainConfig, options
from gspo.train.resolve import checked, resolve

NOT_IN_COMMAND = ("output_dir", "progress", "threads")  # where the run wrote, how it showed progress, its CPU threads


def applies(name: str, cfg: TrainConfig) -> bool:
    """Whether the run's algorithm reads option `name`."""
    info = LOSSES.get(cfg.loss.algorithm)
    if info is None:
        return True
    if SECTION_OF[name] == "ppo":  # the value model and GAE: a loss whose advantages are a critic's (PPO)
        return not info.group_advantages
    if name in ("clip_low", "clip_high"):
        return not info.gate  # a gate (SAPO) has no clip range
    return name in info.options or name not in own_options()  # another loss's own option: not this one's


def needed(cfg: TrainConfig) -> dict:
    """Option name -> value: the options a `gspo train` command needs to make `cfg` (see above)."""
    cfg, default = checked(cfg), TrainConfig()
    given = {f.name: getattr(cfg, f.name) for f in options() if f.name not in NOT_IN_COMMAND
             and applies(f.name, cfg) and getattr(cfg, f.name) != getattr(default, f.name)}
    for name in [n for n in given if getattr(default, n) in (None, "auto")]:  # what resolve may derive
        rest = {k: v for k, v in given.items() if k != name}
        try:
            if getattr(resolve(TrainConfig(**rest)), name) == given[name]:
                given = rest
        except ConfigError:  # needed to pass a rule (a --min-new-tokens over the task's length)
            pass
    return given


def train_command(cfg: TrainConfig) -> str:
    """`gspo train` with the options `needed` names, in the order of `gspo train --help`."""
    parts = ["gspo", "train"]
    for name, value in needed(cfg).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parts.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            parts += [flag, *(shlex.quote(str(v)) for v in value)] if value else []
        else:
            parts += [flag, shlex.quote(str(value))]
    return " ".join(parts)


__all__ = ["NOT_IN_COMMAND", "applies", "needed", "train_command"]
