"""Configuration files and flags as they arrive: YAML files, unknown flags, flag values.

    from gspo.config.yamlfile import load_yaml
    cfg = load_yaml("run.yaml")               # a TrainConfig; keys are option names

A YAML key may be TRL's name for an option (`num_generations: 8`, gspo.config.trl); an unknown
one gets a did-you-mean, as an unknown flag does (`unknown_flag`), and a flag whose value is
not a number names the flag (`flag_value_error`). Values are checked by gspo.config.checks.
`in_memory` / `eval_names`: the placeholders a run trained from Python on objects records
(`<train_dataset>`), and what `gspo eval` of it needs instead.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import yaml

from gspo.config import SECTION_OF, ConfigError, TrainConfig, option_types
from gspo.config.checks import yaml_value
from gspo.config.trl import did_you_mean as trl_did_you_mean
from gspo.config.trl import is_trl, to_gspo
from gspo.io.words import did_you_mean


def load_yaml(path: str | Path, base: TrainConfig | None = None) -> TrainConfig:
    """A TrainConfig from a YAML mapping of field names to values, over `base` (or the defaults)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    try:
        data = yaml_value(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}:{line} not valid YAML ({getattr(e, 'problem', None) or e})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of option names to values, got {type(data).__name__}")
    for key in data:
        name = str(key).replace("-", "_")
        if name not in SECTION_OF and not is_trl(name):
            raise ConfigError(f"{path}: unknown option {key!r}{trl_did_you_mean(name)}")
    try:
        values = to_gspo(data)  # TRL's names (num_generations: 8) mapped to gspo's (gspo.config.trl)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return dataclasses.replace(base or TrainConfig(), **values)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _hints(cls) -> dict:
    """Option name -> type of a command's dataclass (TrainConfig: its options, across sections)."""
    return option_types() if cls is TrainConfig else typing.get_type_hints(cls)


def unknown_flag(cls, args: list[str], extra=()) -> str | None:
    """'unknown option --step; did you mean --steps?' for the first flag in `args` that is no
    field of the dataclass `cls` (nor `--no-FIELD` of a bool field), else None. `extra`: more
    names to suggest (TRL's)."""
    hints = _hints(cls)
    known = set(hints) | {"no_" + n for n, h in hints.items() if h is bool}
    for a in args:
        if a.startswith("--") and len(a) > 2:
            name = a[2:].partition("=")[0].replace("-", "_")
            if name not in known:
                return f"unknown option {a.partition('=')[0]}{did_you_mean(name, [*hints, *extra], _flag)}"
    return None


def flag_value_error(cls, flag: str, args: list[str]) -> str | None:
    """"--steps: expected an integer, got 'five'" for a value tyro could not parse as the
    number (or numbers) that field `flag` of dataclass `cls` holds; None for other types."""
    expected = _expected(_hints(cls).get(flag[2:].replace("-", "_")))
    at = [i for i, a in enumerate(args) if a.partition("=")[0].replace("_", "-") == flag]
    if expected is None or not at:
        return None
    i = at[-1]
    if "=" in args[i]:
        return f"{flag}: expected {expected}, got {args[i].partition('=')[2]!r}"
    values = []
    for a in args[i + 1:]:
        if a.startswith("--"):
            break
        values.append(a)
    return f"{flag}: expected {expected}, got {' '.join(values)!r}"


def _expected(hint) -> str | None:
    """What a field of type `hint` takes, in words: for int and float fields and lists of them."""
    if typing.get_origin(hint) is tuple:
        kinds = {t for t in typing.get_args(hint) if t is not Ellipsis}
        return {int: "integers", float: "numbers"}.get(kinds.pop()) if len(kinds) == 1 else None
    kinds = [t for t in typing.get_args(hint) or (hint,) if t is not type(None)]
    return {int: "an integer", float: "a number"}.get(kinds[0]) if len(kinds) == 1 else None


def in_memory(cfg: TrainConfig) -> dict[str, str]:
    """The options of a run trained from Python that held objects, not names: config.yaml keeps
    a placeholder for each (`dataset: <train_dataset>`, `reward: [<exact>]`). Option -> placeholders."""
    def held(v):
        return isinstance(v, str) and v.startswith("<") and v.endswith(">")

    out = {name: getattr(cfg, name) for name in ("model", "dataset", "eval_dataset", "env") if held(getattr(cfg, name))}
    if any(held(r) for r in cfg.rewards.reward):
        out["reward"] = ", ".join(r for r in cfg.rewards.reward if held(r))
    return out


def eval_names(run: str, cfg: TrainConfig, given: dict) -> dict:
    """For `gspo eval` of a run trained from Python with objects: the changes that replace its
    placeholders (its data, when --dataset or --task replaces it), or a one-line ConfigError
    saying what to pass. `given`: the options given on the command line."""
    held, out = in_memory(cfg), {}
    if "dataset" in held and "dataset" not in given:
        if "task" not in given:
            raise ConfigError(f"{run} was trained on an in-memory dataset ({held['dataset']}): pass --dataset FILE|ID "
                              "or --task NAME")
        out["dataset"] = None
    if "eval_dataset" in held and "eval_dataset" not in given:
        if not ({"dataset", "task"} & set(given)):
            raise ConfigError(f"{run} was evaluated on an in-memory dataset ({held['eval_dataset']}): pass "
                              "--eval-dataset FILE, or --dataset or --task")
        out["eval_dataset"] = None
    if "reward" in held and "reward" not in given:
        raise ConfigError(f"{run}: reward {held['reward']} was a Python callable: pass --reward NAME|file.py:fn")
    if "env" in held and "env" not in given:
        raise ConfigError(f"{run}: env {held['env']} was a Python class: pass --env path.py:Class")
    return out
