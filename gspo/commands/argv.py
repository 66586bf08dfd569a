"""Command-line flags as they arrive: tyro's parse with one-line errors, and the flags gspo
takes out before tyro sees them.

    from gspo.commands.argv import parse, take, merge_repeated, list_flags
    cfg = parse(TrainConfig, merge_repeated(args, list_flags(TrainConfig)), "gspo train")

`parse` runs tyro and turns its boxed errors into one line (an unknown flag gets a
did-you-mean, a value that is not a number names the flag), and takes TRL's names for
TrainConfig's options (gspo.config.trl). `--reward a --reward b` means `--reward a b`
(`merge_repeated`); `--config`, `--resume`, `--configs` ... are taken out by `take` /
`take_many`. The commands themselves are gspo.cli's.
"""

from __future__ import annotations

import contextlib
import io
import re
import typing

import tyro

from gspo.config import TrainConfig, option_types
from gspo.config import trl as aliases
from gspo.config.checks import check_value
from gspo.config.yamlfile import flag_value_error, unknown_flag


class UsageError(Exception):
    pass


def parse(fn_or_cls, args: list[str], prog: str, default=None):
    """Run tyro; turn its boxed parse errors into one line (an unknown flag gets a did-you-mean,
    a value that is not a number names the flag). --help still prints in full. TrainConfig also
    takes TRL's names for its options (gspo.config.trl: --num-generations 8)."""
    target = tyro.conf.OmitArgPrefixes[TrainConfig] if fn_or_cls is TrainConfig else fn_or_cls  # flat flags
    if any(a in ("-h", "--help") for a in args):
        return tyro.cli(target, args=args, prog=prog, default=default)
    trl, args = aliases.split_args(args) if fn_or_cls is TrainConfig else ({}, args)
    if unknown := unknown_flag(fn_or_cls, args, extra=aliases.suggested() if fn_or_cls is TrainConfig else ()):
        raise UsageError(unknown)
    buf = io.StringIO()
    try:
        with contextlib.redirect_stderr(buf), contextlib.redirect_stdout(buf):
            parsed = tyro.cli(target, args=args, prog=prog, default=default)
    except SystemExit as e:
        if e.code in (0, None):
            raise
        bad = re.search(r"Error parsing (--[\w-]+)", buf.getvalue())
        raise UsageError((bad and flag_value_error(fn_or_cls, bad[1], args)) or first_error_line(buf.getvalue())) \
            from None
    if fn_or_cls is TrainConfig:  # a registered loss's name (tyro takes any string)
        check_value("algorithm", parsed.algorithm, "--algorithm")
    return aliases.apply_args(parsed, trl, args) if trl else parsed


def first_error_line(text: str) -> str:
    """tyro's error box -> 'Title: detail' on one line.

    The box is a title, then sections separated by rules (the detail, the argument's help,
    a pointer to --help); rules and borders are box-drawing characters on a terminal and
    dashes otherwise.
    """
    sections: list[list[str]] = [[]]
    for raw in text.splitlines():
        line = re.sub(r"[│┃╭╮╰╯]", " ", raw).strip()
        if line and set(line) <= set("─━-"):
            sections.append([])
        elif line:
            sections[-1].append(line)
    sections = [" ".join(sec) for sec in sections if sec]
    sections = [sec for sec in sections
                if not sec.lower().startswith(("argument helptext", "for full helptext", "usage:"))]
    if not sections:
        return "invalid arguments"
    title, detail = sections[0], (sections[1] if len(sections) > 1 else "")
    if not detail or detail.lower().startswith(title.lower()):
        return detail or title
    return f"{title}: {detail}"


def take(args: list[str], flag: str) -> tuple[str | None, list[str]]:
    """Remove `flag VALUE` (or `flag=VALUE`) from args."""
    out, value, i = [], None, 0
    while i < len(args):
        a = args[i]
        if a == flag:
            if i + 1 >= len(args):
                raise UsageError(f"{flag} needs a value")
            value = args[i + 1]
            i += 2
            continue
        if a.startswith(flag + "="):
            value = a.split("=", 1)[1]
        else:
            out.append(a)
        i += 1
    return value, out


def list_flags(cls) -> set[str]:
    """Flags of tuple[X, ...] fields: they take several values."""
    hints = option_types() if cls is TrainConfig else typing.get_type_hints(cls)
    out = set()
    for name, hint in hints.items():
        if type(None) in typing.get_args(hint):  # `tuple[str, ...] | None` (gspo eval's options) is a list flag too
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        args = typing.get_args(hint)
        if typing.get_origin(hint) is tuple and len(args) == 2 and args[1] is Ellipsis:
            out.add("--" + name.replace("_", "-"))
    return out


_SINGULAR = {"--task-option": "--task-options"}


def _singular(arg: str) -> str:
    flag, eq, value = arg.partition("=")
    return _SINGULAR[flag] + eq + value if flag in _SINGULAR else arg


def merge_repeated(args: list[str], list_flags: set[str]) -> list[str]:
    """`--reward a --reward b` -> `--reward a b` (tyro would keep only the last); a singular
    name (--task-option KEY=VALUE, repeated) is its list flag's."""
    args = [_singular(a) for a in args]
    values: dict[str, list[str]] = {}
    out: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a in list_flags:
            j = i + 1
            while j < len(args) and not args[j].startswith("--"):
                j += 1
            if a not in values:
                values[a] = []
                out.append(a)
                out.append(values[a])  # placeholder, filled below
            values[a].extend(args[i + 1:j])
            i = j
            continue
        out.append(a)
        i += 1
    flat: list[str] = []
    for x in out:
        flat.extend(x if isinstance(x, list) else [x])
    return flat


def take_many(args: list[str], flag: str) -> tuple[list[str] | None, list[str]]:
    """Remove `flag V1 V2 ...` (values up to the next --option) from args."""
    if flag not in args:
        return None, args
    i = args.index(flag)
    j = i + 1
    while j < len(args) and not args[j].startswith("--"):
        j += 1
    if j == i + 1:
        raise UsageError(f"{flag} needs at least one value")
    more, rest = take_many(args[:i] + args[j:], flag)
    return args[i + 1:j] + (more or []), rest
