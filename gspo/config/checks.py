"""Option values as they arrive, checked against their TrainConfig option's type (pydantic,
strict), and YAML's numbers.

    from gspo.config.checks import check_value, yaml_value
    check_value("steps", "2", "steps")        # ConfigError: steps: expected an integer, got '2'
    yaml_value("3e-4")                        # 0.0003 (YAML 1.2's numbers; 1.1 reads a string)

Every value is checked against its option's annotation (gspo.config.sections) strictly (`steps="2"`
is an error, not 2): lists become tuples, a single value for a list option a 1-tuple, an int
for a float option a float. The CLI's flags are tyro's; YAML files, TRL's names and the Python
API come here (gspo.train.resolve checks every option of a config with it, then the bounds). The
algorithm is the name of a registered loss (gspo.algo.losses.LOSSES).
"""

from __future__ import annotations

import functools
import json
import re
import typing

import yaml

from gspo.config import ConfigError, option_types


@functools.cache
def _hint(name: str):
    return option_types()[name]


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

    if name == "algorithm" and isinstance(value, str):  # a registered loss's name
        from gspo.algo.losses import LOSSES  # here, not at the top: the CLI's help and usage errors import no torch

        if value not in LOSSES:
            raise ConfigError(f"{where}: expected one of {', '.join(LOSSES)}, got {value!r}")
    hint = _hint(name)
    if name == "task_options" and isinstance(value, dict):  # YAML / Python: a mapping, as KEY=VALUE (JSON is YAML)
        value = tuple(f"{k}={json.dumps(v)}" for k, v in value.items())
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


def one_line(e: BaseException) -> str:
    """An error's message on one line; an OSError's as `FILE: what` (`runs/x: Not a directory`)."""
    if isinstance(e, OSError) and e.filename and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return " ".join(str(e).split())


def arguments_error(cls, args: list[str], prog: str) -> str | None:
    """One line for `args` that give dataclass `cls` too few or too many positional arguments
    (its fields marked tyro.conf.Positional, one value each) or a non-integer to an integer flag;
    None otherwise (tyro then parses them). Every other field's flag takes one value, a bool's none.

    >>> from gspo.export import ExportArgs
    >>> arguments_error(ExportArgs, ["runs/a"], "gspo export")
    'OUT: missing (usage: gspo export RUN_DIR|CHECKPOINT OUT [options]; gspo export --help)'
    """
    import tyro

    if any(a in ("-h", "--help") for a in args):
        return None
    hints = typing.get_type_hints(cls, include_extras=True)
    marks = {name: getattr(hint, "__metadata__", ()) for name, hint in hints.items()}
    names = [next((m.metavar for m in ms if getattr(m, "metavar", None)), name.upper())
             for name, ms in marks.items() if tyro.conf.Positional in ms]
    flags = {"--" + name.replace("_", "-"): hint for name, hint in hints.items()
             if tyro.conf.Positional not in marks[name]}
    flags.update({"--no-" + f[2:]: bool for f, hint in flags.items() if hint is bool})
    usage = f"(usage: {prog} {' '.join(names)} [options]; {prog} --help)"
    given, i = [], 0
    while i < len(args):
        key, eq, value = args[i].partition("=")
        if args[i].startswith("-") and key not in flags:
            return None  # an unknown option: tyro's did-you-mean says it
        if key in flags and flags[key] is not bool:
            if not eq and i + 1 >= len(args):
                return f"{key}: needs a value"
            value, i = (value, i) if eq else (args[i + 1], i + 1)
            if int in typing.get_args(flags[key]) and not value.lstrip("-").isdigit():
                return f"{key}: expected an integer, got {value!r}"
        elif key not in flags:
            given.append(args[i])
        i += 1
    if len(given) < len(names):
        return f"{' and '.join(names[len(given):])}: missing {usage}"
    return f"unexpected argument {given[len(names)]!r} {usage}" if len(given) > len(names) else None
