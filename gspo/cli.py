"""`gspo` command line: a thin layer that parses flags into a config and calls the library.

    gspo train [--config run.yaml] [--resume RUN_DIR] [--algorithm grpo --steps 100 ...]
    gspo eval --model DIR [--task arithmetic --n 500 --k 8]

Every `gspo train` flag is a field of `gspo.config.TrainConfig` (its docstring is the help).
Errors in flags, config files or values print one line, `gspo <command>: error: ...`, and
exit with status 2, without a traceback (set GSPO_DEBUG=1 to see one).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Annotated

import tyro

from gspo.config import ConfigError, TrainConfig, load_yaml

USAGE = """usage: gspo <command> [options]

commands:
  train   train a policy with GSPO, GRPO or GSPO-token (gspo train --help)
  eval    greedy accuracy and pass@k of a model on a task's test split (gspo eval --help)
"""


class UsageError(Exception):
    pass


def _parse(fn_or_cls, args: list[str], prog: str, default=None):
    """Run tyro; turn its boxed parse errors into one line. --help still prints in full."""
    if any(a in ("-h", "--help") for a in args):
        return tyro.cli(fn_or_cls, args=args, prog=prog, default=default)
    buf = io.StringIO()
    try:
        with contextlib.redirect_stderr(buf), contextlib.redirect_stdout(buf):
            return tyro.cli(fn_or_cls, args=args, prog=prog, default=default)
    except SystemExit as e:
        if e.code in (0, None):
            raise
        raise UsageError(_first_error_line(buf.getvalue())) from None


def _first_error_line(text: str) -> str:
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
    sections = [sec for sec in sections if not sec.lower().startswith(("argument helptext", "for full helptext", "usage:"))]
    if not sections:
        return "invalid arguments"
    title, detail = sections[0], (sections[1] if len(sections) > 1 else "")
    if not detail or detail.lower().startswith(title.lower()):
        return detail or title
    return f"{title}: {detail}"


def _take(args: list[str], flag: str) -> tuple[str | None, list[str]]:
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


def cmd_train(args: list[str]) -> int:
    from gspo.trainer import train

    config_file, args = _take(args, "--config")
    resume, args = _take(args, "--resume")
    if resume is not None:
        if config_file is not None or args:
            raise UsageError("--resume continues a run with its saved config.yaml; give no other options with it")
        summary = train(TrainConfig(), resume=resume)
    else:
        base = load_yaml(config_file) if config_file else TrainConfig()
        if any(a in ("-h", "--help") for a in args):
            print("Options may also come from a YAML file: --config FILE (keys are option names with underscores).\n"
                  "Continue a run: gspo train --resume RUN_DIR\n")
        cfg = _parse(TrainConfig, args, "gspo train", default=base)
        summary = train(cfg)
    _print_summary(summary)
    return 0


def _print_summary(summary: dict) -> None:
    before, after = summary["eval_before"]["accuracy"], summary["eval_after"]["accuracy"]
    print(f"{summary['algorithm']} on {summary['task']}: held-out greedy accuracy "
          f"{100 * before:.1f}% -> {100 * after:.1f}% ({100 * (after - before):+.1f} points) "
          f"in {summary['wall_seconds']:.0f}s")
    if summary.get("final_checkpoint"):
        print(f"final checkpoint: {summary['final_checkpoint']}")


@dataclass
class EvalArgs:
    model: str
    """Built-in model name or a model directory (e.g. a run's checkpoints/step-000060)."""
    task: str = "arithmetic"
    """Built-in task."""
    n: int = 500
    """Test problems."""
    k: int = 8
    """Samples per problem for pass@k (0 = greedy accuracy only)."""
    temperature: float = 1.0
    """Sampling temperature for pass@k."""
    max_new_tokens: int = 8
    """Longest completion."""
    seed: int = 0
    """Seed for sampling (pass@k)."""
    device: str = "cpu"
    """Device."""


def cmd_eval(args: list[str]) -> int:
    from gspo.evaluation import evaluate
    from gspo.models import load_policy
    from gspo.tasks import get_task

    a = _parse(EvalArgs, args, "gspo eval")
    if a.n < 1 or a.k < 0 or a.temperature <= 0:
        raise ConfigError("n must be >= 1, k >= 0 and temperature > 0")
    task = get_task(a.task)
    model, tok = load_policy(a.model, device=a.device)
    res = evaluate(model, tok, task, n=a.n, k=a.k, temperature=a.temperature, max_new_tokens=a.max_new_tokens,
                   seed=a.seed)
    print(json.dumps({"model": a.model, "task": a.task, **res}))
    return 0


COMMANDS = {"train": cmd_train, "eval": cmd_eval}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"gspo: error: unknown command {name!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[name](rest)
    except (UsageError, ConfigError, FileNotFoundError, FileExistsError, ValueError) as e:
        if os.environ.get("GSPO_DEBUG"):
            raise
        msg = " ".join(str(e).split())  # one line, whatever the exception held
        print(f"gspo {name}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"gspo {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
