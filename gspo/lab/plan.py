"""`gspo compare --plan`: the power of a comparison before it runs, from a pilot.

    gspo compare --plan                                   # the paper preset: its MDD at 3 seeds, 500 problems
    gspo compare --preset moe --plan --seeds 0 1 2 3 4 5 --detect 10
    gspo compare --plan --pilot runs/compare-20261202-0801 --eval-size 2000 --detect 3

Nothing is trained or written. The plan counts the differences the report will judge (every pair of
configurations, or a study's pairs, on final accuracy and, for a study, the accuracy averaged over the
evaluations; a pair of the same runs not counted: gspo.lab.report.judge), takes the per-seed spread
of a paired difference from a pilot (`--pilot DIR`: a comparison already run, its compare.json judged
again; default: the preset's stored study in gspo/lab/pilots.json, written by scripts/pilots.py), and
gives (gspo.lab.power):

- the minimum detectable difference at the seeds and held-out problems asked for (80% power, Holm
  over all the judged differences at a familywise 5%), and the part the held-out sets alone leave;
- for each difference named with `--detect POINTS` (default 5 and 10), the seeds it needs at these
  held-out problems, and the held-out problems it needs at these seeds;
- what one more seed buys against the same CPU minutes spent on a larger held-out set, from the
  pilot's measured run and evaluation seconds;
- the CPU minutes the comparison will take (the pilot's seconds per run).

The pilot was measured at its own steps and sizes; a plan at others says so (the spread can differ).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gspo.config import ConfigError
from gspo.lab.power import POWER, Costs, floor, held_out_var, mdd, pooled_sd, problems_for, seeds_for, trade
from gspo.lab.stats import FAMILY_LEVEL

PILOTS = Path(__file__).with_name("pilots.json")
DETECT = (0.05, 0.10)
NAMES = {"accuracy": "final accuracy", "accuracy_curve_mean": "accuracy averaged over the evaluations"}


@dataclass(frozen=True)
class Pilot:
    """What a plan's spreads come from: `source` (a directory), the per-seed spread and degrees of freedom
    of a paired difference of each figure (`figures`: figure -> (sd, df)), and what it was measured at."""

    source: str
    figures: dict
    seeds: int
    steps: int
    eval_n: int
    accuracy: float
    run_seconds: float
    eval_seconds_per_problem: float | None


def stored_pilot(preset: str) -> Pilot:
    """The preset's stored study as a pilot (pilots.json); a preset without one is refused in one line."""
    pilots = json.loads(PILOTS.read_text())
    if preset not in pilots:
        raise ConfigError(f"--plan: no stored study of the {preset!r} preset to take a pilot from (stored: "
                          f"{', '.join(pilots)}); run a small comparison and give it as --pilot DIR")
    p = pilots[preset]  # steps null (the objectives study's) would read "measured at None steps"
    return Pilot(p["source"], {k: (v["sd"], v["df"]) for k, v in p["figures"].items()}, p["seeds"],
                 p["steps"] or 0, p["eval_n"] or 0, p["accuracy"], p["run_seconds"], p["eval_seconds_per_problem"])


def dir_pilot(path: Path) -> Pilot:
    """A comparison already run (its compare.json) as a pilot: its differences judged again (every pair,
    and for a study the pairs its names show), their spreads pooled."""
    from gspo.lab.report import aggregate, judge, trained_minutes
    from gspo.lab.studies import AXES, study_from_names

    file = path / "compare.json"
    if not file.is_file():
        raise ConfigError(f"--pilot {path}: no compare.json there (a `gspo compare` output directory)")
    try:
        stored = json.loads(file.read_text())
        report = {name: aggregate({int(s): v for s, v in r["seeds"].items()}) for name, r in stored.items()}
    except (ValueError, KeyError, TypeError, AttributeError, StopIteration) as e:
        raise ConfigError(f"--pilot {file}: not a gspo compare.json ({type(e).__name__}: {e})") from None
    study = None
    if all("@" in n for n in report):  # a study: the pairs it judges
        for axis in AXES.values():
            try:
                study = study_from_names(axis, list(report))
                break
            except ConfigError:
                continue
    judged = judge(report, study.pairs() if study else None,
                   ("accuracy", "accuracy_curve_mean") if study else ("accuracy",))
    figures = {}
    for key in NAMES:
        rows = [r for r in judged["differences"] if r["figure"] == key and r["verdict"] in ("outside the noise",
                                                                                           "within the noise")]
        if (pooled := pooled_sd(rows)) is not None:
            figures[key] = pooled
    if not figures:
        raise ConfigError(f"--pilot {file}: no paired difference over two seeds or more to take a spread from")
    runs = [v for r in report.values() for v in r["seeds"].values()]
    evals = [v["eval_seconds"] / v["eval_n"] for v in runs if v.get("eval_seconds") and v.get("eval_n")]
    accs = [r["accuracy"] for r in report.values() if r.get("accuracy") is not None]
    n_runs, minutes, _ = trained_minutes(path, report)
    steps = _steps(path, report)
    return Pilot(str(path), figures, len({s for r in report.values() for s in r["seeds"]}), steps,
                 min((int(v["eval_n"]) for v in runs if v.get("eval_n")), default=0),
                 sum(accs) / len(accs) if accs else 0.5, 60 * minutes / max(n_runs, 1),
                 sum(evals) / len(evals) if evals else None)


def _steps(path: Path, report: dict) -> int:
    from gspo.config.yamlfile import load_yaml

    for name, r in report.items():
        for seed in r["seeds"]:
            if (saved := path / "runs" / f"{name}-seed{seed}" / "config.yaml").exists():
                return load_yaml(saved).run.steps
    return 0


def judged_pairs(names: list[str], pairs: list[tuple[str, str]], same: dict[str, str]) -> int:
    """How many differences a report judges per figure: `pairs`, less those of the very same runs
    (`same`: configuration -> the first with its runs) and those repeating a pair of runs counted already."""
    seen = set()
    for a, b in pairs:
        ra, rb = same.get(a, a), same.get(b, b)
        if ra != rb:
            seen.add(tuple(sorted((ra, rb))))
    return len(seen)


@dataclass(frozen=True)
class Design:
    """A comparison as asked: its preset, configuration names, the pairs and figures its report will judge,
    `same` (configuration -> the first with its very runs), seeds, steps, held-out problems and the task's
    held-out split (`test_size`, None: unknown)."""

    preset: str
    names: list[str]
    pairs: list[tuple[str, str]]
    figures: tuple[str, ...]
    same: dict[str, str]
    seeds: int
    steps: int
    eval_n: int
    test_size: int | None = None


def plan_lines(design: Design, pilot: Pilot, detect: tuple[float, ...] = DETECT) -> list[str]:
    """The plan, in lines (module docstring)."""
    preset, names, pairs, figures, same = design.preset, design.names, design.pairs, design.figures, design.same
    seeds, steps, eval_n, test_size = design.seeds, design.steps, design.eval_n, design.test_size
    per_figure = judged_pairs(names, pairs, same)
    runs = len(set(same.get(n, n) for n in names)) * seeds
    family = per_figure * len(figures)
    lines = [f"plan: {preset} preset, {len(names)} configurations x {seeds} seeds ({runs} runs of {steps} steps), "
             f"{eval_n} held-out problems",
             f"judged: {family} differences ({' and '.join(NAMES[f] for f in figures)}, paired over the seeds), "
             f"Holm at a familywise {100 * FAMILY_LEVEL:g}%; power {100 * POWER:.0f}%"]
    measured = f"{pilot.seeds} seeds, {pilot.steps or 'unrecorded'} steps, {pilot.eval_n} held-out problems"
    lines.append(f"pilot: {pilot.source} ({measured})" + (
        "" if pilot.steps in (0, steps) else f"; measured at {pilot.steps} steps, planned at {steps}: the spread "
                                             "may differ"))
    if family == 0:
        return lines + ["nothing to judge: fewer than two configurations with runs of their own"]
    if seeds < 2:
        return lines + ["one seed: no interval, nothing detectable (give --seeds with two or more)"]
    known = held_out_var(pilot.accuracy, eval_n)
    run_seconds = pilot.run_seconds * (steps / pilot.steps if pilot.steps else 1.0)  # a run's time, at its steps
    for key in figures:
        if key not in pilot.figures:
            lines.append(f"{NAMES[key]}: the pilot has no spread for it")
            continue
        sd, df = pilot.figures[key]
        m = mdd(sd, seeds, family, known)
        lines.append(f"{NAMES[key]}: per-seed spread of a paired difference {100 * sd:.1f} points ({df} df); "
                     f"minimum detectable difference {100 * m:.1f} points (the held-out sets alone: "
                     f"{100 * floor(family, known):.1f})")
        for d in detect:
            need = seeds_for(d, sd, family, known)
            problems = problems_for(d, sd, seeds, family, pilot.accuracy)
            at_seeds = (f"{problems} held-out problems at {seeds} seeds" if problems is not None
                        else f"more than {seeds} seeds whatever the held-out problems")
            if problems is not None and test_size and problems > test_size:
                at_seeds += f" (the task has {test_size})"
            lines.append(f"  to detect {100 * d:g} points: " + (f"{need} seeds at {eval_n} problems" if need else
                         f"no number of seeds at {eval_n} problems (the held-out noise alone is above it)")
                         + f"; or {at_seeds}")
        if pilot.eval_seconds_per_problem is not None:
            t = trade(sd, seeds, family, pilot.accuracy, eval_n,
                      Costs(runs // seeds, run_seconds, pilot.eval_seconds_per_problem, test_size))
            capped = "" if test_size is None or eval_n + t.problems_instead < test_size else \
                f" (all the task's {test_size})"
            verdict = "the seed buys more" if t.better == "seeds" else "the problems buy more"
            lines.append(f"  per CPU minute: one seed more ({t.seed_minutes:.1f} min) -> {100 * t.one_seed_more:.1f} "
                         f"points; those minutes on {t.problems_instead} more held-out problems{capped} -> "
                         f"{100 * t.more_problems:.1f}: {verdict}")
        else:
            lines.append("  per CPU minute: the pilot did not record its evaluation seconds")
    scaled = ("; its steps not recorded" if pilot.steps == 0 else "" if pilot.steps == steps else
              f", scaled from {pilot.steps} steps to {steps}")
    lines.append(f"time: {runs} runs x {run_seconds:.0f} s = {runs * run_seconds / 60:.1f} CPU minutes (the pilot's "
                 f"seconds per run{scaled})")
    return lines


def plan(base, configs, *, preset: str, seeds: list[int], pilot_dir: str | None = None,
         detect: tuple[float, ...] = DETECT) -> list[str]:
    """The plan of `gspo compare` with this base configuration and these configurations (preset names,
    specs, (name, options) pairs, or a Study), every configuration resolved (a bad one refused as a
    comparison refuses it) and nothing trained or written."""
    import dataclasses

    from gspo.lab.compare import _configs, parse_config
    from gspo.lab.studies import Study
    from gspo.tasks import TASKS, get_task
    from gspo.train.resolve import resolve

    study = configs if isinstance(configs, Study) else None
    specs = study.expand() if study else [c if isinstance(c, tuple) else parse_config(c) for c in configs]
    names = [n for n, _ in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"configuration names repeat: {', '.join(names)}")
    cfgs = _configs(base, specs, seeds[:1], Path("plan"))  # resolved: a bad value is refused here
    same = {name: (twin.name.rsplit("-seed", 1)[0] if twin is not None else name)
            for (name, _), (_, twin) in cfgs.items()}
    pairs = study.pairs() if study else [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    figures = ("accuracy", "accuracy_curve_mean") if study else ("accuracy",)
    first = resolve(dataclasses.replace(next(iter(cfgs.values()))[0], output_dir=None))
    task = get_task(first.data.task) if first.data.dataset is None and first.data.task in TASKS else None
    test_size = getattr(task, "test_size", None)
    pilot = dir_pilot(Path(pilot_dir)) if pilot_dir else stored_pilot(preset)
    design = Design(preset, names, pairs, figures, same, len(seeds), first.run.steps,
                    min(first.eval.eval_size, test_size or first.eval.eval_size), test_size)
    lines = plan_lines(design, pilot, detect)
    if test_size and first.eval.eval_size > test_size:
        lines.append(f"note: the task has {test_size} held-out problems; --eval-size {first.eval.eval_size} "
                     "evaluates all of them")
    return lines
