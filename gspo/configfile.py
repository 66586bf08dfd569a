"""Configuration values as they arrive: type checks (pydantic) and YAML files.

    from gspo.configfile import check_value, load_yaml
    check_value("steps", "2", "steps")        # ConfigError: steps: expected an integer, got '2'
    cfg = load_yaml("run.yaml")               # a TrainConfig; keys are field names

Every value is checked against its TrainConfig field's annotation by pydantic, strictly
(`steps="2"` is an error, not 2): lists become tuples, a single value for a list option a
1-tuple, an int for a float field a float. YAML is read with YAML 1.2's numbers (`1e-5` is a
float; YAML 1.1 reads it as a string). The CLI's flags are tyro's; this is what YAML files
and the Python API go through (gspo.config.resolve). A YAML key may be TRL's name for an
option (`num_generations: 8`, gspo.aliases); an unknown one gets a did-you-mean, as an unknown
flag does (`unknown_flag`), and a flag whose value is not a number names the flag
(`flag_value_error`). `in_memory` / `eval_names`: the placeholders a run trained from Python
on objects records (`<train_dataset>`), and what `gspo eval` of it needs instead.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import typing
from pathlib import Path

import yaml

from gspo import config as _config

ConfigError = _config.ConfigError


@functools.cache
def _hint(name: str):
    return typing.get_type_hints(_config.TrainConfig)[name]


@functools.cache
def _adapter(name: str):
    from pydantic import TypeAdapter

    return TypeAdapter(_hint(name))


_PHRASES = {"int_type": "expected an integer", "float_type": "expected a number", "bool_type": "expected true or false",
            "string_type": "expected a string", "tuple_type": "expected a list"}


def check_value(name: str, value, where: str):
    """`value` checked against field `name`'s type (pydantic, strict) and returned converted:
    a list for a tuple field becomes a tuple (a single value, a 1-tuple), an int for a float
    field a float. Raises ConfigError naming `where`."""
    from pydantic import ValidationError

    hint = _hint(name)
    if "tuple" in str(hint):
        if isinstance(value, list):
            value = tuple(value)
        elif "..." in str(hint) and isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = (value,)  # one value for a list option
    try:
        return _adapter(name).validate_python(value, strict=True)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "literal_error":
            choices = re.findall(r"'([^']*)'", err["ctx"]["expected"])  # "'gspo', 'grpo' or 'ppo'"
            msg = f"expected one of {', '.join(choices)}"
        elif typing.get_origin(hint) is tuple and Ellipsis not in typing.get_args(hint) and \
                len(value if isinstance(value, tuple) else ()) != len(typing.get_args(hint)):
            msg = f"expected a list of {len(typing.get_args(hint))} values"
        else:
            msg = _PHRASES.get(err["type"], err["msg"])
        raise ConfigError(f"{where}: {msg}, got {value!r}") from None


def yaml_value(text: str):
    """A value written in YAML (`3e-4`, `true`, `[a, b]`), as a config file would give it."""
    return yaml.load(text, Loader=_Loader)


class _Loader(yaml.SafeLoader):
    """YAML with 1.2's numbers: `1e-5` is a float (YAML 1.1 reads it as a string)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def load_yaml(path: str | Path, base: _config.TrainConfig | None = None) -> _config.TrainConfig:
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
    from gspo.aliases import did_you_mean, is_trl, to_gspo

    fields = {f.name for f in dataclasses.fields(_config.TrainConfig)}
    for key in data:
        name = str(key).replace("-", "_")
        if name not in fields and not is_trl(name):
            raise ConfigError(f"{path}: unknown option {key!r}{did_you_mean(name)}")
    try:
        values = to_gspo(data)  # TRL's names (num_generations: 8) mapped to gspo's (gspo.aliases)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return dataclasses.replace(base or _config.TrainConfig(), **values)


def did_you_mean(name: str, candidates, shown=str) -> str:
    """'; did you mean steps?' when `name` is close to one of `candidates`, else ''.

    >>> did_you_mean("step", ["steps", "seed"]), did_you_mean("xyz", ["steps"])
    ('; did you mean steps?', '')
    """
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {shown(close[0])}?" if close else ""


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def unknown_flag(cls, args: list[str], extra=()) -> str | None:
    """'unknown option --step; did you mean --steps?' for the first flag in `args` that is no
    field of the dataclass `cls` (nor `--no-FIELD` of a bool field), else None. `extra`: more
    names to suggest (TRL's)."""
    hints = typing.get_type_hints(cls)
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
    expected = _expected(typing.get_type_hints(cls).get(flag[2:].replace("-", "_")))
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


def in_memory(cfg) -> dict[str, str]:
    """The options of a run trained from Python that held objects, not names: config.yaml keeps
    a placeholder for each (`dataset: <train_dataset>`, `reward: [<exact>]`). Option -> placeholders."""
    def held(v):
        return isinstance(v, str) and v.startswith("<") and v.endswith(">")

    out = {name: getattr(cfg, name) for name in ("model", "dataset", "eval_dataset", "env") if held(getattr(cfg, name))}
    if any(held(r) for r in cfg.reward):
        out["reward"] = ", ".join(r for r in cfg.reward if held(r))
    return out


def eval_names(run: str, cfg, given: dict) -> dict:
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
