"""Comparisons along one factor: every configuration at every level of it, tabled and plotted against it.

    gspo compare --preset staleness                      # GSPO, GRPO, GRPO + RR, CISPO, GSPO (behaviour) at K = 0, 2, 8
    gspo compare --preset staleness --lags 0 1 2 4 8 --configs gspo grpo cispo sapo gmpo gspo-tis gspo-opsm
    gspo compare --preset precision                      # GSPO, GRPO, +/- TIS, fp32 / bf16 / fp16 sampler and trainer
    gspo compare --preset precision --precisions bfloat16 float16

A study is a factor (an `Axis`: the option it sets, the levels a run takes by default) and the
configurations compared along it. `expand` makes `name@<level>` out of every configuration and
level (`gspo@K2`, `grpo-tis@bf16`), each an ordinary configuration of `gspo compare` (its run in
`OUT/runs/gspo@K2-seed0/`); `write_study` then writes `study.json` (figure -> configuration ->
level -> {"mean", "ci95"}), one table per figure in `study.md` (configurations down, levels
across) and the plots against the factor (`<figure>_vs_<axis>.png`, 95% intervals as error
bars). The noise lines compare, paired over seeds, each level with the first one within a
configuration, and each configuration with the first one at every level (`Study.pairs`), for
the final accuracy and the accuracy averaged over the evaluations: every one of those differences
is judged together with the others, Holm's correction at a familywise 5% (gspo.lab.report.judge).
`study_from_names` rebuilds a study from a stored compare.json's names (gspo.lab.report.rerender).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

from gspo.config import ConfigError
from gspo.io.files import atomic_write_text, json_clean


@dataclass(frozen=True)
class Axis:
    """A factor: `option` (a `gspo train` option name) takes each level (`levels`: the default
    ones, `flag` chooses others); `tags` names a level in configuration names (default: the
    axis name and the level, `K2`); `fixed`: options every run of the study takes, whatever the
    base configuration (a study's own definition, kept under --config)."""

    name: str
    flag: str
    option: str
    levels: tuple
    parse: type = str
    tags: dict = field(default_factory=dict)
    fixed: dict = field(default_factory=dict)
    level_options: dict = field(default_factory=dict)  # level -> options its runs take (a task's model, its sizes)
    within: bool = True  # judge each level against the first within a configuration (False: levels are not rivals)

    def tag(self, level) -> str:
        return self.tags.get(level, f"{self.name}{level}")

    def options(self, config: dict, level) -> dict:
        """A configuration's options at a level: the study's fixed ones, the level's own over them
        (`level_options`), the configuration's over those, the level last (a configuration that
        sets the factor itself is refused)."""
        if self.option in config:
            raise ConfigError(f"--{self.option.replace('_', '-')} is the factor this study varies ({self.flag}); "
                              f"a configuration cannot set it")
        return {**self.fixed, **self.level_options.get(level, {}), **config, self.option: level}

    def leaving(self, given: set[str]) -> Axis:
        """This axis without the level options named in `given` (the options a user set for the whole
        comparison: they hold at every level)."""
        return replace(self, level_options={lv: {k: v for k, v in opts.items() if k not in given}
                                            for lv, opts in self.level_options.items()})


# the staleness study: batch t sampled by version t-1-K (--rollout-workers 0: a fixed lag, deterministic)
STALENESS = Axis("K", "--lags", "max_staleness", (0, 2, 8), parse=int)
# the precision study: the trainer's compute dtype (float32 master weights, autocast), and the sampler's
# weights and compute in the same dtype (--rollout-dtype same: a copy of the policy in --dtype); the
# old log-probs recomputed by the trainer, so that the sampler/trainer gap is measured (mismatch/*)
PRECISION = Axis("precision", "--precisions", "dtype", ("float32", "bfloat16", "float16"),
                 tags={"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"},
                 fixed={"param_dtype": "float32", "rollout_dtype": "same", "old_logp": "recompute"})
# the objectives study: each task with the model that knows it and its run's sizes: the long-answer chains (55-217
# tokens, where token, prefix and sequence ratios part) on tiny-long-moe as the length preset runs them, and the
# paper's arithmetic (4-token answers) on tiny-moe, 20 steps. The tasks are not rivals: only the configurations
# are compared, at each task.
TASKS = Axis("task", "--tasks", "task", ("chain", "arithmetic"), tags={"chain": "chain", "arithmetic": "arithmetic"},
             level_options={
                 "chain": {"model": "tiny-long-moe", "steps": 10, "prompts_per_step": 8, "eval_every": 5,
                           "eval_size": 100, "lr": 2e-4, "samples_per_step": 2},
                 "arithmetic": {"model": "tiny-moe", "steps": 20, "eval_every": 5, "eval_size": 200}},
             within=False)
AXES = {"staleness": STALENESS, "precision": PRECISION, "task": TASKS}

# figure (a key of gspo.lab.compare.summarise) -> (what the table and plot call it, shown as a percentage)
FIGURES = {
    "accuracy": ("final held-out accuracy", True),
    "accuracy_best": ("best held-out accuracy", True),
    "accuracy_curve_mean": ("held-out accuracy averaged over the run's evaluations (learning speed)", True),
    "diverged_count": ("seeds diverged", False),
    "grad_norm_max": ("largest grad_norm (before clipping)", False),
    "clip_frac_mean": ("mean clip/frac", False),
    "seq_log_abs_mean": ("mean |log s_i| (ratio/seq_log_abs)", False),
    "token_spread_mean": ("mean |log w - log s| (ratio/token_spread)", False),
    "drift_mean": ("mean moe/drift", False),
    "mismatch_mean": ("mean mismatch/token_abs", False),
    "mismatch_seq_mean": ("mean mismatch/seq_log_ratio", False),
    "is_truncated_mean": ("mean is/truncated_frac (the correction's truncated tokens)", False),
    "staleness_mean": ("mean async/staleness_mean", False),
    "eps_high_mean": ("mean clip/eps_high (the upper clip range used; with --target-clip-frac, set by it)", False),
}
PLOTTED = ("accuracy", "accuracy_curve_mean", "clip_frac_mean", "seq_log_abs_mean", "mismatch_mean",
           "mismatch_seq_mean")


@dataclass(frozen=True)
class Study:
    """Configurations (name, options) compared at each of `levels` of `axis`."""

    axis: Axis
    levels: tuple
    configs: tuple[tuple[str, dict], ...]

    def expand(self) -> list[tuple[str, dict]]:
        """Every configuration at every level: (`name@<tag>`, its options with the level's)."""
        return [(f"{name}@{self.axis.tag(level)}", self.axis.options(options, level))
                for name, options in self.configs for level in self.levels]

    def cell(self, report: dict, name: str, level) -> dict | None:
        return report.get(f"{name}@{self.axis.tag(level)}")

    def pairs(self) -> list[tuple[str, str]]:
        """The differences the noise lines judge (all of them together: gspo.lab.report.judge): each
        level against the first one, within a configuration (unless the axis says its levels are not
        rivals: `within`); each configuration against the first one, at each level."""
        names = [n for n, _ in self.configs]
        tag = self.axis.tag
        within = [(f"{n}@{tag(lv)}", f"{n}@{tag(self.levels[0])}") for n in names for lv in self.levels[1:]
                  if self.axis.within]
        across = [(f"{n}@{tag(lv)}", f"{names[0]}@{tag(lv)}") for lv in self.levels for n in names[1:]]
        return within + across


def study_from_names(axis: Axis, names: list[str]) -> Study:
    """The study whose expansion is these `<config>@<tag>` names (a stored compare.json's keys),
    configurations and levels in the order they first appear; the configurations' options are not
    in the names (empty here): enough to table, plot and judge the study again, not to train it."""
    by_tag = {axis.tag(lv): lv for lv in axis.tags} if axis.tags else {}
    configs, levels = {}, {}
    for name in names:
        config, at, tag = name.rpartition("@")
        if not at:
            raise ConfigError(f"{name!r} is not a configuration of a study along {axis.name} (<config>@<level>)")
        if tag in by_tag:
            level = by_tag[tag]
        elif tag.startswith(axis.name) and tag[len(axis.name):]:
            level = axis.parse(tag[len(axis.name):])
        else:
            raise ConfigError(f"{name!r}: {tag!r} is not a level of {axis.name}")
        configs.setdefault(config, {})
        levels.setdefault(level, None)
    return Study(axis, tuple(levels), tuple(configs.items()))


def levels_arg(axis: Axis, values: list[str]) -> tuple:
    """--lags 0 2 8 / --precisions bfloat16 float16, checked (one line on a bad value)."""
    try:
        levels = tuple(axis.parse(v) for v in values)
    except ValueError:
        raise ConfigError(f"{axis.flag}: expected {axis.parse.__name__} values, got {' '.join(values)}") from None
    if not levels or len(set(levels)) != len(levels):
        raise ConfigError(f"{axis.flag}: expected distinct values, got {' '.join(values) or 'none'}")
    if axis.parse is str and any(lv not in axis.tags for lv in levels):
        raise ConfigError(f"{axis.flag}: each must be one of {', '.join(axis.tags)}, got {' '.join(values)}")
    if axis.parse is int and min(levels) < 0:
        raise ConfigError(f"{axis.flag}: each must be >= 0, got {' '.join(values)}")
    return levels


def study_figures(study: Study, report: dict) -> dict:
    """figure -> configuration -> level tag -> {"mean", "ci95"} (None where not measured)."""
    out = {}
    for key in FIGURES:
        out[key] = {}
        for name, _ in study.configs:
            row = {}
            for level in study.levels:
                r = study.cell(report, name, level) or {}
                row[study.axis.tag(level)] = {"mean": r.get(key), "ci95": r.get(f"{key}_ci95")}
            out[key][name] = row
    return out


def _cell(value, half, pct: bool) -> str:
    if value is None:
        return "n/a"
    if pct:
        return f"{100 * value:.1f}%" + ("" if half is None else f" ± {100 * half:.1f}")
    if isinstance(value, int):
        return str(value)
    return f"{value:.3g}" + ("" if half is None else f" ± {half:.2g}")


def study_tables(study: Study, figures: dict, seeds: int) -> list[str]:
    """One markdown table per figure: configurations down, levels across."""
    tags = [study.axis.tag(lv) for lv in study.levels]
    lines = [f"## Against {study.axis.name}", "",
             f"Means over {seeds} seeds, ± the half-width of their 95% interval (Student t over the seeds; for a "
             "held-out accuracy also the held-out set's binomial noise, which every seed shares: see Noise in "
             "report.md). Which differences are outside the noise, corrected for all those judged: report.md's "
             "Noise section.", ""]
    for key, (title, pct) in FIGURES.items():
        rows = figures[key]
        if all(c["mean"] is None for row in rows.values() for c in row.values()):
            continue  # not measured by any run (drift on a dense model, mismatch without recomputation)
        lines += [f"**{title}**", "", f"| configuration | {' | '.join(tags)} |", "| --- |" + " --- |" * len(tags)]
        for name, row in rows.items():
            lines.append(f"| {name} | " + " | ".join(_cell(row[t]["mean"], row[t]["ci95"], pct) for t in tags) + " |")
        lines.append("")
    return lines


def study_plots(study: Study, figures: dict, out: Path) -> list[str]:
    """`<figure>_vs_<axis>.png` for the plotted figures measured; their markdown image lines."""
    from gspo.lab.plot import plot_levels

    tags = [study.axis.tag(lv) for lv in study.levels]
    lines = []
    for key in PLOTTED:
        title, pct = FIGURES[key]
        scale = 100.0 if pct else 1.0
        series = {name: [(None if row[t]["mean"] is None else scale * row[t]["mean"],
                          None if row[t]["ci95"] is None else scale * row[t]["ci95"]) for t in tags]
                  for name, row in figures[key].items()}
        if all(m is None for s in series.values() for m, _ in s):
            continue
        path = out / f"{key.removesuffix('_mean')}_vs_{study.axis.name}.png"
        plot_levels(series, tags, path, labels=(study.axis.name, title + (" (%)" if pct else "")),
                    log_y=key == "clip_frac_mean")
        lines += [f"![{title} against {study.axis.name}]({path.name})", ""]
    return lines


def write_study(study: Study, report: dict, out: Path, seeds: int) -> list[str]:
    """study.json, study.md and the plots against the factor; report.md's lines for them."""
    figures = study_figures(study, report)
    atomic_write_text(out / "study.json", json.dumps(json_clean(
        {"axis": study.axis.name, "option": study.axis.option, "levels": list(study.levels), "figures": figures}),
        indent=2) + "\n")
    lines = study_tables(study, figures, seeds) + study_plots(study, figures, out)
    atomic_write_text(out / "study.md", "\n".join(lines))
    return lines
