"""`gspo` command line: a thin layer that parses flags into a config and calls the library.

    gspo train [--config run.yaml] [--resume RUN_DIR] [--algorithm grpo --steps 100 ...]
    gspo eval --model DIR [--k 8] [any data/reward option of gspo train]
    gspo plot RUN_DIR [RUN_DIR ...] --metrics reward/mean,clip/frac --output plot.png
    gspo compare [--configs gspo grpo grpo-rr] [--seeds 0 1] [--steps 60 ...]

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

import tyro

from gspo.config import ConfigError, TrainConfig, load_yaml

USAGE = """usage: gspo <command> [options]

commands:
  train   train a policy with GSPO, GRPO or GSPO-token (gspo train --help)
  eval    greedy accuracy and pass@k of a model on a task's evaluation rows (gspo eval --help)
  plot    plot metrics of one or more runs against the step (gspo plot --help)
  compare the paper's comparisons at small scale: several configurations, one report (gspo compare --help)
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


def _list_flags(cls) -> set[str]:
    """Flags of tuple[X, ...] fields: they take several values."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(cls)
    out = set()
    for f in dataclasses.fields(cls):
        args = typing.get_args(hints[f.name])
        if typing.get_origin(hints[f.name]) is tuple and len(args) == 2 and args[1] is Ellipsis:
            out.add("--" + f.name.replace("_", "-"))
    return out


def _merge_repeated(args: list[str], list_flags: set[str]) -> list[str]:
    """`--reward a --reward b` -> `--reward a b` (tyro would keep only the last)."""
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


def cmd_train(args: list[str]) -> int:
    from gspo.trainer import train

    config_file, args = _take(args, "--config")
    resume, args = _take(args, "--resume")
    if resume is not None:  # its saved config.yaml; options given change it where that is safe
        if config_file is not None:
            raise UsageError("--resume continues a run with its saved config.yaml; --config cannot replace it")
        saved = _saved_config(resume)
        changed = _parse(TrainConfig, _merge_repeated(args, _list_flags(TrainConfig)), "gspo train", default=saved) \
            if args else None
        summary = train(changed, resume=resume)
    else:
        base = load_yaml(config_file) if config_file else TrainConfig()
        if any(a in ("-h", "--help") for a in args):
            print("Options may also come from a YAML file: --config FILE (keys are option names with underscores).\n"
                  "Continue a run: gspo train --resume RUN_DIR\n")
        cfg = _parse(TrainConfig, _merge_repeated(args, _list_flags(TrainConfig)), "gspo train", default=base)
        summary = train(cfg)
    _print_summary(summary)
    return 0


def _saved_config(run_dir: str) -> TrainConfig:
    from pathlib import Path

    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise UsageError(f"{Path(run_dir).absolute()}: not a gspo run directory (no config.yaml) to resume")
    return load_yaml(path)


def _print_summary(summary: dict) -> None:
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, rank 0 speaks for the run
        return
    before, after = summary["eval_before"]["accuracy"], summary["eval_after"]["accuracy"]
    print(f"{summary['algorithm']} on {summary['task']}: held-out greedy accuracy "
          f"{100 * before:.1f}% -> {100 * after:.1f}% ({100 * (after - before):+.1f} points) "
          f"in {summary['wall_seconds']:.0f}s")
    if summary.get("final_checkpoint"):
        print(f"final checkpoint: {summary['final_checkpoint']}")


def cmd_eval(args: list[str]) -> int:
    """Evaluate --model on the task's (or dataset's) evaluation rows with the run's rewards."""
    import dataclasses

    from gspo.config import resolve
    from gspo.evaluation import evaluate
    from gspo.models import DTYPES, load_policy, resolve_device
    from gspo.run import task_and_rewards

    config_file, args = _take(args, "--config")
    k_arg, args = _take(args, "--k")
    try:
        k = int(k_arg) if k_arg is not None else 8
    except ValueError:
        raise UsageError(f"--k: expected an integer, got {k_arg!r}") from None
    if k < 0:
        raise UsageError(f"--k: must be >= 0, got {k}")
    if any(a in ("-h", "--help") for a in args):
        print("gspo eval: greedy accuracy and pass@k of --model on the evaluation rows of --task or --dataset.\n"
              "Takes the data, reward, model and sampling options of gspo train, plus --k K (samples per\n"
              "problem for pass@k, default 8; 0 = greedy only). A LoRA adapter directory loads onto its base.\n")
    base = load_yaml(config_file) if config_file else TrainConfig()
    parsed = _parse(TrainConfig, _merge_repeated(args, _list_flags(TrainConfig)), "gspo eval", default=base)
    cfg = resolve(dataclasses.replace(parsed, output_dir="-"))
    task, rewards = task_and_rewards(cfg)
    model, tok = load_policy(cfg.model, dtype=DTYPES[cfg.dtype], device=resolve_device(cfg.device))
    res = evaluate(model, tok, task, rewards, n=cfg.eval_size, k=k, temperature=cfg.temperature,
                   max_new_tokens=cfg.max_new_tokens, seed=cfg.seed, progress=cfg.progress)
    print(json.dumps({"model": cfg.model, "task": cfg.dataset or cfg.task, **res}))
    return 0


@dataclass
class PlotArgs:
    runs: tyro.conf.Positional[tuple[str, ...]]
    """Run directories to compare."""
    metrics: str = "reward/mean,clip/frac"
    """Comma-separated metric names (see docs/metrics.md); eval/accuracy uses summary.json too."""
    output: str = "gspo-plot.png"
    """PNG file to write."""
    smooth: int = 1
    """Trailing moving average over N steps (1 = raw)."""
    title: str | None = None
    """Figure title."""


def cmd_plot(args: list[str]) -> int:
    from gspo.plot import plot_runs

    a = _parse(PlotArgs, args, "gspo plot")
    if not a.runs:
        raise UsageError("give at least one run directory")
    out = plot_runs(a.runs, [m.strip() for m in a.metrics.split(",") if m.strip()], a.output,
                    smooth_n=a.smooth, title=a.title)
    print(f"wrote {out}")
    return 0


def _take_many(args: list[str], flag: str) -> tuple[list[str] | None, list[str]]:
    """Remove `flag V1 V2 ...` (values up to the next --option) from args."""
    if flag not in args:
        return None, args
    i = args.index(flag)
    j = i + 1
    while j < len(args) and not args[j].startswith("--"):
        j += 1
    if j == i + 1:
        raise UsageError(f"{flag} needs at least one value")
    more, rest = _take_many(args[:i] + args[j:], flag)
    return args[i + 1:j] + (more or []), rest


def cmd_compare(args: list[str]) -> int:
    """Several configurations, same model/task/seeds; a report directory."""
    import dataclasses
    import time

    from gspo.compare import DEFAULT_CONFIGS, PRESETS, compare

    configs, args = _take_many(args, "--configs")
    seeds_arg, args = _take_many(args, "--seeds")
    config_file, args = _take(args, "--config")
    try:
        seeds = [int(x) for x in seeds_arg] if seeds_arg else list(COMPARE_SEEDS)
    except ValueError:
        raise UsageError(f"--seeds: expected integers, got {' '.join(seeds_arg)}") from None
    if any(a in ("-h", "--help") for a in args):
        print("gspo compare: train several configurations on the same model, task and seeds; write a report.\n"
              f"  --configs NAME ...   presets: {', '.join(PRESETS)}; or name:key=value,key=value\n"
              f"                       (default: {' '.join(DEFAULT_CONFIGS)})\n"
              "  --seeds N ...        seeds (default: 0 1 2); results are averaged over them\n"
              "  --output-dir DIR     report directory (default: runs/compare-<date>-<time>); an interrupted\n"
              "                       compare resumes when given the same directory\n"
              "Every gspo train option sets the base configuration; the defaults differ in --model tiny-moe,\n"
              "--steps 80 and --eval-every 10.\n")
    base = load_yaml(config_file) if config_file else COMPARE_DEFAULTS
    cfg = _parse(TrainConfig, _merge_repeated(args, _list_flags(TrainConfig)), "gspo compare", default=base)
    out = cfg.output_dir or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}"
    report = compare(dataclasses.replace(cfg, output_dir=None), list(configs or DEFAULT_CONFIGS), seeds=seeds,
                     out_dir=out)
    for name, r in report.items():
        drift = "" if r["drift_mean"] is None else f"  moe/drift {r['drift_mean']:.4f}"
        print(f"{name:>20}: accuracy {100 * r['accuracy']:.1f}%  clip/frac {r['clip_frac_mean']:.4g}{drift}"
              f"{'  DIVERGED' if r['diverged'] else ''}")
    print(f"report: {out}/report.md")
    return 0


COMPARE_DEFAULTS = TrainConfig(model="tiny-moe", steps=80, eval_every=10)
COMPARE_SEEDS = (0, 1, 2)

COMMANDS = {"train": cmd_train, "eval": cmd_eval, "plot": cmd_plot, "compare": cmd_compare}


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
    except (UsageError, ConfigError, OSError, ValueError) as e:
        if os.environ.get("GSPO_DEBUG"):
            raise
        msg = " ".join(str(e).split())  # one line, whatever the exception held
        if isinstance(e, OSError) and e.filename and str(e.filename) not in msg:
            msg = f"{e.filename}: {msg}"
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every process fails alike; say it once
            print(f"gspo {name}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"gspo {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from gspo.lifecycle import Interrupted

        if not isinstance(e, Interrupted):
            raise
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"gspo {name}: {e}", file=sys.stderr)
        return 128 + e.signum


if __name__ == "__main__":
    sys.exit(main())
