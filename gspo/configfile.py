"""Configuration values as they arrive: type checks (pydantic) and YAML files.

    from gspo.configfile import check_value, load_yaml
    check_value("steps", "2", "steps")        # ConfigError: steps: expected an integer, got '2'
    cfg = load_yaml("run.yaml")               # a TrainConfig; keys are field names

Every value is checked against its TrainConfig field's annotation by pydantic, strictly
(`steps="2"` is an error, not 2): lists become tuples, a single value for a list option a
1-tuple, an int for a float field a float. YAML is read with YAML 1.2's numbers (`1e-5` is a
float; YAML 1.1 reads it as a string). The CLI's flags are tyro's; this is what YAML files
and the Python API go through (gspo.config.resolve).
"""

from __future__ import annotations

import dataclasses
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
    fields = {f.name for f in dataclasses.fields(_config.TrainConfig)}
    values = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in fields:
            raise ConfigError(f"{path}: unknown option {key!r}")
        values[name] = check_value(name, value, f"{path}: {key}")
    return dataclasses.replace(base or _config.TrainConfig(), **values)
