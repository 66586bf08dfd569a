"""`gspo` command line: a thin layer that parses flags into a config and calls the library.

    gspo train [--config run.yaml] [--resume RUN_DIR] [--algorithm grpo --steps 100 ...]
    gspo eval --model DIR|CHECKPOINT|RUN_DIR [--k 8] [--dataset ... --reward ...]
    gspo plot RUN_DIR [RUN_DIR ...] --metrics reward/mean,clip/frac --output plot.png
    gspo compare [--preset paper|length|staleness|precision|objectives] [--configs gspo grpo grpo-rr] [--seeds 0 1]
                 [--lags 0 2 8] [--precisions float32 bfloat16] [--steps 60 ...]
    gspo export RUN_DIR|CHECKPOINT OUT [--dtype bfloat16] [--step N] [--push-to-hub ORG/NAME [--private]]

Every `gspo train` flag is a field of `gspo.config.TrainConfig` (its docstring is the help).
Errors in flags, config files or values print one line, `gspo <command>: error: ...`, and
exit with status 2, without a traceback (set GSPO_DEBUG=1 to see one).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import tyro

# gspo's options (gspo.commands.argv, gspo.config, gspo.config.yamlfile) import no torch: `gspo --help`, `--version`,
# an unknown command and usage errors found while parsing answer without it; torch and transformers are
# imported by the command that uses them, once its options are known to be good (tests/test_cli_startup.py)
from gspo.commands.argv import UsageError
from gspo.commands.argv import list_flags as _list_flags
from gspo.commands.argv import merge_repeated as _merge_repeated
from gspo.commands.argv import parse as _parse
from gspo.commands.argv import take as _take
from gspo.commands.argv import take_many as _take_many
from gspo.commands.eval import cmd_eval
from gspo.commands.tasks import cmd_tasks
from gspo.config import ConfigError, TrainConfig
from gspo.config.checks import arguments_error, one_line
from gspo.config.yamlfile import in_memory, load_yaml
from gspo.io.words import plural

USAGE = """usage: gspo <command> [options]    (gspo --version)

commands:
  train   train a policy with GSPO, GSPO-token, GRPO, PPO, CISPO, SAPO or GMPO (gspo train --help)
  eval    greedy accuracy and pass@k of a model on a task's evaluation rows (gspo eval --help)
  plot    plot metrics of one or more runs against the step (gspo plot --help)
  compare the paper's comparisons at small scale: several configurations, one report (gspo compare --help)
  export  a run's trained policy as a plain Hugging Face model directory, LoRA merged (gspo export --help)
  tasks   the tasks --task can name: built-ins and reasoning-gym's generators, a task's options (gspo tasks NAME)
"""


def cmd_train(args: list[str]) -> int:
    if any(a in ("-h", "--help") for a in args):
        from gspo.commands.help import train_help

        print(train_help())
        return 0
    config_file, args = _take(args, "--config")
    resume, args = _take(args, "--resume")
    if resume is not None:  # its saved config.yaml; options given change it where that is safe
        if config_file is not None:
            raise UsageError("--resume continues a run with its saved config.yaml; --config cannot replace it")
        saved = _saved_config(resume)
        if held := [v for k, v in in_memory(saved).items() if k != "model"]:  # the checkpoint has the model
            raise UsageError(f"{resume} was trained from Python on objects ({', '.join(held)}): resume it from Python, "
                             "passing them again: gspo.Trainer(..., train_dataset=...).train(resume=RUN_DIR)")
        changed = _parse(TrainConfig, _merge_repeated(args, _list_flags(TrainConfig)), "gspo train", default=saved) \
            if args else None
        from gspo.api import Trainer  # torch and transformers: once the options are known to be good

        summary = Trainer(changed).train(resume=resume)
    else:
        base = load_yaml(config_file) if config_file else TrainConfig()
        cfg = _parse(TrainConfig, _merge_repeated(args, _list_flags(TrainConfig)), "gspo train", default=base)
        from gspo.api import Trainer  # torch and transformers: once the options are known to be good
        from gspo.train.run import check_processes

        if any(a.partition("=")[0] == "--parallel" for a in args):  # as given (ddp, the default, is refused here only)
            check_processes(cfg.run.parallel)
        summary = Trainer(cfg).train()
    _print_summary(summary)
    return 0


def _saved_config(run_dir: str) -> TrainConfig:
    from pathlib import Path

    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise UsageError(f"--resume {Path(run_dir).absolute()}: not a gspo run directory (no config.yaml)")
    return load_yaml(path)


def _print_summary(summary: dict) -> None:
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, rank 0 speaks for the run
        return
    before, after = summary["eval_before"], summary["eval_after"]
    head = f"{summary['algorithm']} on {summary['task']}"
    if not after.get("n"):
        print(f"{head}: {plural(summary['steps'], 'step')} in {summary['wall_seconds']:.0f}s "
              "(no evaluation: --eval-size 0)")
    elif None in (before["accuracy"], after["accuracy"]):  # the first reward scored no evaluated row: not 0%
        b, a = ("n/a" if v is None else f"{100 * v:.1f}%" if after.get("binary", True) else f"{v:.4g}"
                for v in (before["accuracy"], after["accuracy"]))
        when = "" if a == b else " before training" if b == "n/a" else " after training"
        print(f"{head}: held-out greedy accuracy: {'n/a' if a == b else f'{b} -> {a}'} (the reward "
              f"{after.get('metric')!r} returned None for every evaluated completion{when}) "
              f"in {summary['wall_seconds']:.0f}s")
    elif after.get("binary", True):  # a 0/1 verifier: a share of problems solved
        b, a = before["accuracy"], after["accuracy"]
        print(f"{head}: held-out greedy accuracy {100 * b:.1f}% -> {100 * a:.1f}% ({100 * (a - b):+.1f} points) "
              f"in {summary['wall_seconds']:.0f}s")
    else:  # a graded reward: its mean, named
        b, a = before["accuracy"], after["accuracy"]
        print(f"{head}: held-out greedy mean {after.get('metric', 'reward')} {b:.4g} -> {a:.4g} ({a - b:+.4g}) "
              f"in {summary['wall_seconds']:.0f}s")
    if summary.get("final_checkpoint"):
        print(f"final checkpoint: {summary['final_checkpoint']}")


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
    a = _parse(PlotArgs, args, "gspo plot")
    if not a.runs:
        raise UsageError("give at least one run directory")
    from gspo.lab.plot import plot_runs

    out = plot_runs(a.runs, [m.strip() for m in a.metrics.split(",") if m.strip()], a.output,
                    smooth_n=a.smooth, title=a.title)
    print(f"wrote {out}")
    return 0


def cmd_compare(args: list[str]) -> int:
    """Several configurations, same model/task/seeds; a report directory."""
    import dataclasses
    import time

    from gspo.lab.compare import COMPARE_PRESETS, CompareOptions, compare, compare_help

    configs, args = _take_many(args, "--configs")
    lags, args = _take_many(args, "--lags")
    precisions, args = _take_many(args, "--precisions")
    tasks, args = _take_many(args, "--tasks")
    seeds_arg, args = _take_many(args, "--seeds")
    config_file, args = _take(args, "--config")
    preset_name, args = _take(args, "--preset")
    responses, args = _take(args, "--variance-responses")
    jobs, args = _take(args, "--jobs")
    detect, args = _take_many(args, "--detect")
    pilot, args = _take(args, "--pilot")
    planning = "--plan" in args
    args = [a for a in args if a != "--plan"]
    preset = COMPARE_PRESETS.get(preset_name or "paper")
    if preset is None:
        raise UsageError(f"--preset: unknown preset {preset_name!r}; presets: {', '.join(COMPARE_PRESETS)}")
    try:
        seeds = [int(x) for x in seeds_arg] if seeds_arg else list(preset.seeds or COMPARE_SEEDS)
    except ValueError:
        raise UsageError(f"--seeds: expected integers, got {' '.join(seeds_arg)}") from None
    if responses is not None and not (responses.isdigit() and int(responses) > 0):
        raise UsageError(f"--variance-responses: expected a positive integer, got {responses!r}")
    if jobs is not None and not jobs.isdigit():
        raise UsageError(f"--jobs: expected a number of runs at once (0: auto), got {jobs!r}")
    if any(a in ("-h", "--help") for a in args):
        print(compare_help())
    base = load_yaml(config_file) if config_file else TrainConfig(**preset.base)
    cfg = _parse(TrainConfig, _merge_repeated(args, _list_flags(TrainConfig)), "gspo compare", default=base)
    out = cfg.run.output_dir or f"runs/compare-{time.strftime('%Y%m%d-%H%M%S')}"
    study = _study(preset, configs, {"--lags": lags, "--precisions": precisions, "--tasks": tasks}, args,
                   _given_options(args, config_file))
    if (detect or pilot) and not planning:
        raise UsageError(f"{'--detect' if detect else '--pilot'}: only with --plan")
    if planning:
        return _plan(dataclasses.replace(cfg, output_dir=None), study or list(configs or preset.configs),
                     preset_name or "paper", seeds, pilot, detect)
    report = compare(dataclasses.replace(cfg, output_dir=None), study or list(configs or preset.configs), seeds=seeds,
                     out_dir=out, options=CompareOptions(preset.variance_models, int(responses or 512),
                                                         int(jobs or 0)))
    for name, r in report.items():
        drift = "" if r["drift_mean"] is None else f"  moe/drift {r['drift_mean']:.4f}"
        print(f"{name:>20}: accuracy {100 * r['accuracy']:.1f}%  clip/frac {r['clip_frac_mean']:.4g}{drift}"
              f"{'  DIVERGED' if r['diverged'] else ''}")
    print(f"report: {out}/report.md")
    return 0


COMPARE_SEEDS = (0, 1, 2)


def _plan(base, configs, preset: str, seeds: list[int], pilot: str | None, detect: list[str]) -> int:
    """`gspo compare --plan`: the lines of gspo.lab.plan.plan; nothing trained or written."""
    from gspo.lab.plan import DETECT, plan

    try:
        points = tuple(float(x) / 100 for x in detect) if detect else DETECT
    except ValueError:
        raise UsageError(f"--detect: expected differences in points of accuracy, got {' '.join(detect)}") from None
    if not all(0 < p <= 1 for p in points):
        raise UsageError(f"--detect: each difference is in (0, 100] points, got {' '.join(detect)}")
    print("\n".join(plan(base, configs, preset=preset, seeds=seeds, pilot_dir=pilot, detect=points)))
    return 0


def _given_options(args: list[str], config_file: str | None) -> set[str]:
    """The options a comparison's command line and --config file set, by gspo's names (a TRL name
    mapped: --learning_rate is lr)."""
    from pathlib import Path

    import yaml

    from gspo.config.trl import TRL_NAMES

    names = {a[2:].partition("=")[0].replace("-", "_") for a in args if a.startswith("--")}
    names |= {n[3:] for n in names if n.startswith("no_")}
    if config_file:  # already read and checked as the base configuration
        names |= {str(k).replace("-", "_") for k in (yaml.safe_load(Path(config_file).read_text()) or {})}
    return {TRL_NAMES.get(n, n) for n in names}


def _study(preset, configs: list[str], given: dict[str, list[str]], args: list[str], options: set[str]):
    """The preset's study along its factor (gspo.lab.studies), its levels from --lags / --precisions /
    --tasks (`given`: flag -> values; the factor's own flag among the base options is refused: the study
    sets it). An option the comparison's command line or --config file sets (`options`) holds at every
    level, over a level's own."""
    from gspo.lab.compare import parse_config
    from gspo.lab.studies import AXES, Study, levels_arg

    for flag, values in given.items():
        if values and (preset.axis is None or AXES[preset.axis].flag != flag):
            wanted = next((n for n, a in AXES.items() if a.flag == flag), "")
            raise UsageError(f"{flag}: only with --preset {wanted}")
    if preset.axis is None:
        return None
    axis = AXES[preset.axis]
    own = "--" + axis.option.replace("_", "-")
    if any(a == own or a.startswith(own + "=") for a in args):
        raise UsageError(f"{own}: the {preset.axis} study varies it; choose its values with {axis.flag}")
    levels = levels_arg(axis, given[axis.flag]) if given[axis.flag] else preset.levels or axis.levels
    return Study(axis.leaving(options), levels, tuple(parse_config(c) for c in configs or preset.configs))


def cmd_export(args: list[str]) -> int:
    """A run (its newest checkpoint) or a checkpoint as a Hugging Face model directory; uploaded with --push-to-hub."""
    from pathlib import Path

    from gspo.export import ExportArgs, check_push, export, find_checkpoint, push_to_hub

    if msg := arguments_error(ExportArgs, args, "gspo export"):  # one line of gspo's own, not tyro's
        raise UsageError(msg)
    a = _parse(ExportArgs, args, "gspo export")
    if a.private and not a.push_to_hub:
        raise UsageError("--private applies to the repository --push-to-hub creates; give --push-to-hub ORG/NAME")
    if a.push_to_hub:
        check_push(a.push_to_hub)  # before the export's work
    checkpoint = find_checkpoint(Path(a.source), a.step)  # the run's newest, or --step's
    out = export(checkpoint, a.out, dtype=a.dtype, base_model=a.base_model, repo_id=a.push_to_hub)
    print(f"wrote {out}")
    if a.push_to_hub:
        print(f"pushed to {push_to_hub(out, a.push_to_hub, private=a.private)}")
    return 0


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "plot": cmd_plot, "compare": cmd_compare, "export": cmd_export,
            "tasks": cmd_tasks}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from gspo import __version__

        print(f"gspo {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"gspo: error: unknown command {name!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2

    try:
        return COMMANDS[name](rest)
    except (UsageError, ConfigError, OSError, ValueError) as e:
        if os.environ.get("GSPO_DEBUG"):
            raise
        _say_once(f"gspo {name}: error: {one_line(e)}")  # one line, whatever the exception held
        return 2
    except KeyboardInterrupt:
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun every process was interrupted
            print(f"gspo {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from gspo.train.lifecycle import Interrupted

        if not isinstance(e, Interrupted):
            raise
        if int(os.environ.get("RANK", "0")) == 0:  # every process stopped at this step: one says so
            from gspo.processes.distributed import command_line

            resume = command_line([name, "--resume", str(e.run_dir)])  # under torchrun, the torchrun line
            print(f"gspo {name}: {e.line(resume)}", file=sys.stderr, flush=True)
        return 128 + e.signum


def _say_once(line: str) -> None:
    """gspo.processes.distributed.say_once (it imports torch): only another rank under torchrun needs more
    than printing the line, as say_once does on rank 0."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(line, file=sys.stderr, flush=True)
        return
    from gspo.processes.distributed import say_once

    say_once(line)


def entry() -> None:
    """The `gspo` command (and `python -m gspo`, `python -m gspo.cli`): main's status as the exit code."""
    code = main()
    if "torch" not in sys.modules:  # help, --version, a usage error: no torch, no gloo threads to outlive
        sys.exit(code)
    from gspo.processes.distributed import exit_process

    exit_process(code)


if __name__ == "__main__":
    entry()
