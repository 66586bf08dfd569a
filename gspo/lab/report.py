"""`gspo compare`'s report: report.md, and the plots of the runs against the training step.

    write_report(out, base, report, seeds, seconds, study=None)   # after gspo.lab.compare.compare trained the runs
    rerender(Path("docs/compare-staleness"), base, axis=STALENESS)  # from a stored compare.json, no runs

report.md: the table of every configuration's figures (means over seeds ± their 95% interval),
the plots (reward_accuracy.png, clip_fraction.png, drift.png, mismatch.png), the noise in words
(`noise_lines`), and the sections a comparison adds (a study against a factor: gspo.lab.studies; the
ratio variance by length: gspo.lab.variance). The differences the noise lines judge (`judge`: every
pair of configurations, or a study's pairs) are judged together, Holm's step-down at a familywise
5%, and compare.json gets them (`with_judged`: under each configuration, "judged": the family's
size and level, and each difference it is the first term of, with its p-value, its adjusted
p-value and its verdict).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from gspo.io.files import atomic_write_text, json_clean, read_jsonl
from gspo.lab.power import POWER, mdd, pooled_sd
from gspo.lab.stats import FAMILY_LEVEL, ci95, eval_noise, holm, is_number, paired_test

COLLAPSE_POINTS = 0.10  # "diverged": the final held-out accuracy this far below the run's best
# the held-out accuracies: measured on the same eval_n problems by every seed, so their intervals
# hold that set's binomial noise as well as the seeds' (gspo.lab.stats; `aggregate`)
HELD_OUT = ("accuracy", "accuracy_before", "accuracy_best", "accuracy_curve_mean")
# the figures whose differences the noise lines judge, and how they name them
JUDGED = {"accuracy": "final accuracy", "accuracy_curve_mean": "accuracy averaged over the evaluations"}
VERDICTS = ("outside the noise", "within the noise", "one seed: no interval", "the same runs: not judged")


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def _seed_mean(series: list[tuple[list, list]]) -> tuple[list, list]:
    """Average several (steps, values) series over the steps they share."""
    by_step: dict[int, list[float]] = {}
    for xs, ys in series:
        for x, y in zip(xs, ys):
            by_step.setdefault(x, []).append(y)
    steps = sorted(s for s, v in by_step.items() if len(v) == len(series))
    return steps, [statistics.fmean(by_step[s]) for s in steps]


def _plots(out: Path, names: list[str], seeds: list[int]) -> None:
    from gspo.lab.plot import plot_panels

    rows = {n: [read_jsonl(out / "runs" / f"{n}-seed{s}" / "metrics.jsonl") for s in seeds] for n in names}
    evals = {n: [json.loads((out / "runs" / f"{n}-seed{s}" / "summary.json").read_text())["evals"] for s in seeds]
             for n in names}

    def mean_of(metric):
        return {n: _seed_mean([_series(r, metric) for r in rows[n]]) for n in names}

    acc = {n: _seed_mean([([e["step"] for e in ev], [e["accuracy"] for e in ev]) for ev in evals[n]]) for n in names}
    smooth = max(1, len(next(iter(rows.values()))[0]) // 20)
    plot_panels({"reward/mean": mean_of("reward/mean"), "held-out accuracy": acc}, out / "reward_accuracy.png",
                smooth_n=smooth, title="training reward and held-out accuracy")
    # a moving average: single steps of GRPO often clip nothing, and a log axis cannot show 0
    plot_panels({"clip/frac": mean_of("clip/frac")}, out / "clip_fraction.png", log_y=["clip/frac"],
                smooth_n=max(5, smooth), title=f"fraction of clipped tokens (log scale, {max(5, smooth)}-step average)")
    gap = {n: v for n, v in mean_of("mismatch/token_abs").items() if v[0]}
    if gap:  # a sampler in another precision or engine: how far its log-probs are from the trainer's
        plot_panels({"mismatch/token_abs": gap}, out / "mismatch.png", smooth_n=smooth,
                    title="sampler/trainer mismatch: mean |log π_rollout - log π_old| per token")
    else:
        (out / "mismatch.png").unlink(missing_ok=True)
    drift = {n: v for n, v in mean_of("moe/drift").items() if v[0]}
    if not drift:  # a dense model: no routers, no drift (report.md says so)
        (out / "drift.png").unlink(missing_ok=True)
        return
    drift_used = {f"{n} (experts used in the ratio)": v for n, v in mean_of("moe/drift_in_ratio").items()
                  if v[0] and any(y == 0 for y in v[1])}
    plot_panels({"moe/drift": {**drift, **drift_used}}, out / "drift.png",
                title="expert drift: share of (token, layer) top-k sets changed vs the old policy")


def _fmt(x, pct=False):
    if x is None:
        return "n/a"
    return f"{100 * x:.1f}%" if pct else f"{x:.4g}"


def _pm(half, pct=False) -> str:
    """' ± half' of a 95% interval (points for an accuracy); '' without one."""
    return "" if half is None else f" ± {100 * half:.1f}" if pct else f" ± {half:.2g}"


def write_report(out: Path, base, report: dict, seeds: list[int], seconds: float, *, study=None) -> dict:
    """The plots against the step, the study's tables and plots against its factor (gspo.lab.studies),
    the differences judged (`judge`; in compare.json, each configuration's "judged": `with_judged`)
    and report.md; the judged differences."""
    _plots(out, list(report), seeds)
    return _write(_Written(out, base, report, seeds, seconds, study))


def aggregate(per_seed: dict[int, dict], eval_n: int | None = None) -> dict:
    """One configuration's figures over its seeds: each the mean, with `<name>_ci95` the half-width
    of its 95% interval (Student t over the seeds, gspo.lab.stats; None with one seed); for the held-out
    accuracies (gspo.lab.report.HELD_OUT) the interval also holds the held-out set's binomial noise,
    the seeds' `eval_n` problems (the fewest any seed was scored on; `eval_n` given here where the
    seeds' figures predate it); `diverged`: whether any seed diverged, `diverged_count`: how many;
    `seeds`: every seed's own figures."""
    counts = [v.get("eval_n") for v in per_seed.values() if v.get("eval_n")]
    problems = int(min(counts)) if counts else eval_n
    agg = {}
    for k in dict.fromkeys(k for v in per_seed.values() for k in v):  # every seed's keys (the first may lack one)
        values = [v.get(k) for v in per_seed.values()]
        if k == "diverged":
            agg.update(diverged=any(values), diverged_count=sum(map(bool, values)))
        else:
            agg[k], agg[f"{k}_ci95"] = ci95(values, problems if k in HELD_OUT else None)
    return {**agg, "seeds": {str(s): v for s, v in per_seed.items()}}


def rerender(out: Path, base, *, axis=None, eval_n: int | None = None) -> dict:
    """report.md again from a stored `out/compare.json`, without its runs and without training
    (with a study's `axis`, gspo.lab.studies.AXES, also study.md, study.json and the plots against its
    factor, the study read off the names): every configuration's figures aggregated again from
    its seeds' own (`aggregate`, so with today's intervals), the differences judged
    again, and compare.json rewritten with both (every seed's figures as they were). base: the
    comparison's base configuration (its preset's, with the options it ran with), for report.md's
    first line; eval_n: the held-out problems where the stored figures predate `eval_n` (the base
    configuration's --eval-size). The plots against the step need the runs' metrics and are left
    as they are. Returns the configurations' figures."""
    from gspo.lab.studies import study_from_names

    stored = json.loads((out / "compare.json").read_text())
    study = None if axis is None else study_from_names(axis, list(stored))
    report = {name: aggregate({int(s): v for s, v in r["seeds"].items()}, eval_n) for name, r in stored.items()}
    seeds = sorted({int(s) for r in stored.values() for s in r["seeds"]})
    _write(_Written(out, base, report, seeds, None, study, eval_n))
    return report


@dataclass(frozen=True)
class _Written:
    """What compare.json and report.md are written from: the comparison's directory, its base
    configuration, figures and seeds, the invocation's seconds (None: re-rendered), its Study or
    None, and the held-out problems where the figures predate `eval_n`."""

    out: Path
    base: object
    report: dict
    seeds: list[int]
    seconds: float | None
    study: object = None
    eval_n: int | None = None


def _write(w: _Written) -> dict:
    judged = judge(w.report, w.study.pairs() if w.study else None,
                   ("accuracy", "accuracy_curve_mean") if w.study else ("accuracy",), eval_n=w.eval_n)
    atomic_write_text(w.out / "compare.json", json.dumps(json_clean(with_judged(w.report, judged)),
                                                              indent=2) + "\n")
    _report_md(w, judged)
    return judged


def _same_runs(report: dict) -> dict[str, str]:
    """configuration -> the first configuration with the very same runs (every seed's figures
    equal, wall time included: one run directory linked from the other, as gspo@K0 and
    gspo-behaviour@K0 are)."""
    first: dict[str, str] = {}
    return {name: first.setdefault(repr(r.get("seeds")), name) for name, r in report.items()}


def _problems(report: dict, names: tuple[str, str], seeds: list[str], fallback: int | None) -> int | None:
    counts = [report[n]["seeds"][s].get("eval_n") for n in names for s in seeds]
    counts = [int(c) for c in counts if c]
    return min(counts) if counts else fallback


def judge(report: dict, pairs: list[tuple[str, str]] | None = None, figures: tuple[str, ...] = ("accuracy",),
          *, level: float = FAMILY_LEVEL, eval_n: int | None = None) -> dict:
    """Every difference a report judges, and its verdict corrected for all of them.

    For each figure and pair (a, b) (default: every pair of configurations): the mean over their
    common seeds of a - b, paired seed by seed, its 95% interval and two-sided p-value (Student t,
    gspo.lab.stats.paired_test; for a held-out accuracy with the held-out set's binomial noise, the
    seeds' eval_n problems, or `eval_n` where the figures predate it). The p-values of all the
    differences judged are adjusted together by Holm's step-down, and a difference is "outside
    the noise" when its adjusted p-value is at most `level`: the chance that a report calls any
    difference outside the noise when none is real is at most `level`. Not judged, and not
    counted: a pair of the very same runs (linked), a difference between the same runs as one
    judged already (counted once, its verdict repeated), one seed (no interval).

    Returns {"method": "holm", "level", "judged": how many, "outside": how many outside the noise,
    "outside_seeds_only", "differences": [{"a", "b", "figure", "seeds", "eval_n", "mean", "ci95",
    "df", "p", "p_holm", "verdict", "same_as", "p_seeds", "p_seeds_holm"}]}: ci95 the difference's
    own (uncorrected) half-width, same_as the difference (a, b) it repeats or None; p_seeds and
    p_seeds_holm (and outside_seeds_only) the same without the held-out set's noise, the seeds'
    alone: what they say about these eval_n problems rather than the task (the verdict's are p
    and p_holm)."""
    names = list(report)
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]] if pairs is None else pairs
    runs = _same_runs(report)
    rows, first = [], {}
    for key in figures:
        for a, b in pairs:
            if a in report and b in report and (row := _difference(report, a, b, key, eval_n)) is not None:
                if runs[a] == runs[b]:
                    row.update(verdict=VERDICTS[3], p=None, p_seeds=None)
                elif row["p"] is None:
                    row["verdict"] = VERDICTS[2]
                else:  # a - b and b - a are one test
                    row["same_as"] = first.setdefault((*sorted((runs[a], runs[b])), key), (a, b))
                    if row["same_as"] == (a, b):
                        row["same_as"] = None
                rows.append(row)
    tested = [r for r in rows if r["verdict"] is None and r["same_as"] is None]
    for r, adjusted, seeds_only in zip(tested, holm([r["p"] for r in tested]), holm([r["p_seeds"] for r in tested])):
        r.update(p_holm=adjusted, p_seeds_holm=seeds_only, verdict=VERDICTS[0] if adjusted <= level else VERDICTS[1])
    detectable = _detectable(tested, level)
    by_pair = {(r["a"], r["b"], r["figure"]): r for r in tested}
    for r in rows:
        if r["same_as"] is not None:
            judged = by_pair[(*r["same_as"], r["figure"])]
            r.update(p_holm=judged["p_holm"], p_seeds_holm=judged["p_seeds_holm"], verdict=judged["verdict"],
                     same_as=list(r["same_as"]), mdd=judged["mdd"])
    return {"method": "holm", "level": level, "judged": len(tested), "mdd": detectable,
            "outside": sum(r["verdict"] == VERDICTS[0] for r in tested),
            "outside_seeds_only": sum(r["p_seeds_holm"] <= level for r in tested), "differences": rows}


def _detectable(tested: list[dict], level: float) -> dict:
    """Each tested row's minimum detectable difference (gspo.lab.power.mdd: 80% power, Holm over all
    `tested`), from its figure's per-seed spread pooled over the report's differences of that figure
    (gspo.lab.power.pooled_sd), its own seeds and its own held-out variance; figure -> {"sd", "df",
    "differences", "power", "low", "high"} (the rows' smallest and largest)."""
    out = {}
    for key in dict.fromkeys(r["figure"] for r in tested):
        rows = [r for r in tested if r["figure"] == key]
        pooled = pooled_sd(rows)
        for r in rows:
            r["mdd"] = None if pooled is None else mdd(pooled[0], r["seeds"], len(tested), r["known_var"],
                                                        level=level)
        found = [r["mdd"] for r in rows if r["mdd"] is not None]
        out[key] = {"sd": None if pooled is None else pooled[0], "df": None if pooled is None else pooled[1],
                    "differences": len(rows), "power": POWER, "low": min(found, default=None),
                    "high": max(found, default=None)}
    return out


def _difference(report: dict, a: str, b: str, key: str, eval_n: int | None) -> dict | None:
    """The paired difference a - b of figure `key` over the seeds both have, not yet judged (None:
    no seed with both figures)."""
    seeds = sorted(set(report[a]["seeds"]) & set(report[b]["seeds"]), key=int)
    problems = _problems(report, (a, b), seeds, eval_n) if key in HELD_OUT else None
    xs, ys = [report[a]["seeds"][s].get(key) for s in seeds], [report[b]["seeds"][s].get(key) for s in seeds]
    est = paired_test(xs, ys, problems)
    if est is None:
        return None
    return {"a": a, "b": b, "figure": key, "seeds": est.n, "eval_n": problems, "mean": est.mean,
            "ci95": est.half, "df": est.df, "p": est.p, "p_holm": None, "verdict": None, "same_as": None,
            "p_seeds": paired_test(xs, ys).p if problems else est.p, "p_seeds_holm": None,
            "sd": None if est.seeds_var is None else math.sqrt(est.seeds_var * est.n), "known_var": est.known_var,
            "mdd": None}


def with_judged(report: dict, judged: dict) -> dict:
    """compare.json's content: each configuration's figures and its "judged" section, the report's
    family (`judge`'s method, level, judged, outside, outside_seeds_only) with the differences it
    is the first term of (a - b: under a). The top level stays configuration -> figures."""
    family = {k: v for k, v in judged.items() if k != "differences"}
    return {name: {**r, "judged": {**family, "differences": [d for d in judged["differences"] if d["a"] == name]}}
            for name, r in report.items()}


def _p(p: float) -> str:
    return "1" if p >= 0.995 else f"{p:.2g}" if p >= 1e-4 else "< 0.0001"


def noise_lines(report: dict, judged: dict, eval_n: int | None = None) -> list[str]:
    """The report's noise, in words: the intervals, one evaluation's own noise, how many
    differences were judged at what familywise level, and each difference with its verdict."""
    lines = ["## Noise", "",
             "Figures are means over seeds; ± is the half-width of their 95% interval (`<name>_ci95` in "
             "compare.json): Student t over the seeds, and for a held-out accuracy also the held-out set's own "
             "noise, which the seeds cannot see (every seed is scored on the same problems): its binomial "
             "variance p(1-p)/n, its own 95% half-width added to the seeds' in quadrature (docs/compare.md)."]
    counts = sorted({int(c) for r in report.values() for c in [r.get("eval_n") or eval_n] if c})
    n = counts[0] if counts else 0
    on = f"{n} problems" if len(counts) < 2 else f"{n} to {counts[-1]} problems (the configurations differ)"
    accs = [r["accuracy"] for r in report.values() if r.get("accuracy") is not None]
    if n and accs:
        worst = max(eval_noise(a, n) for a in accs)
        lines.append(f"One held-out accuracy is measured on {on}: that alone is up to ±{100 * worst:.1f} "
                     "points (binomial, at these accuracies), whatever the training; a difference of two "
                     "configurations counts both evaluations' (as if independent: conservative).")
    if missing := _unrecorded(report):
        lines += ["", *missing]
    figures = list(dict.fromkeys(JUDGED[r["figure"]] for r in judged["differences"]))
    level = 100 * judged["level"]
    if judged["judged"]:
        many = f"{judged['judged']} difference{'s' * (judged['judged'] != 1)}"
        lines += ["", f"**{many} judged** ({' and '.join(figures)}, paired over the seeds), "
                  f"at a familywise level of {level:g}%: "
                  + (f"Holm's step-down over all {judged['judged']}, so a " if judged["judged"] > 1 else
                     "one alone, which Holm's step-down leaves as it is, so a ") +
                  f"difference is outside the noise when its Holm-adjusted p-value is at most {judged['level']:g} "
                  f"(the chance of calling any difference outside the noise when none is real: at most {level:g}%). "
                  f"**{judged['outside']} outside the noise.** Each line gives the difference ± its own 95% "
                  "interval (not corrected), its p-value (the level at which that interval reaches 0: paired t "
                  "with the held-out noise) and the adjusted one."
                  + (f" Without the held-out set's noise (the seeds' alone, which speaks of these held-out "
                     "problems rather than the task; `p_seeds_holm` in compare.json's \"judged\"), "
                     f"{judged['outside_seeds_only']} would be." if n and any(
                         r["eval_n"] for r in judged["differences"]) else "")]
        lines += ["", *_detectable_lines(judged)]
    else:
        why = {VERDICTS[2]: "one seed gives no interval", VERDICTS[3]: "the same runs (linked) are not compared"}
        reasons = [why[v] for v in dict.fromkeys(r["verdict"] for r in judged["differences"])]
        lines += ["", "No difference judged: " + ("; ".join(reasons) if reasons else "nothing to compare") + "."]
    lines.append("")
    for r in judged["differences"]:
        head = f"- {r['a']} - {r['b']}: "
        what = f"points of {JUDGED[r['figure']]}"
        if r["verdict"] == VERDICTS[3]:
            lines.append(head + f"the same runs (trained once, linked): {100 * r['mean']:+.1f} {what}, not judged.")
        elif r["verdict"] == VERDICTS[2]:
            lines.append(head + f"{100 * r['mean']:+.1f} {what} (one seed): no interval, not judged.")
        else:
            again = "" if r["same_as"] is None else f"; the same runs as {r['same_as'][0]} - {r['same_as'][1]}, " \
                                                    "counted once"
            seen = "" if r["verdict"] != VERDICTS[1] or r.get("mdd") is None else \
                f" (the smallest difference it could see: {100 * r['mdd']:.1f})"
            p = _p(r["p"])
            lines.append(head + f"{100 * r['mean']:+.1f}{_pm(r['ci95'], True)} {what} (paired over {r['seeds']} "
                         f"seeds; p {p if p.startswith('<') else '= ' + p}, Holm-adjusted {_p(r['p_holm'])}{again}): "
                         f"{r['verdict']}{seen}.")
    return lines + [""]


def _detectable_lines(judged: dict) -> list[str]:
    """The minimum detectable difference of each figure judged, in words (judged["mdd"])."""
    parts = []
    for key, m in (judged.get("mdd") or {}).items():
        if m["low"] is None:
            continue
        size = f"{100 * m['low']:.1f}" if round(100 * m["low"], 1) == round(100 * m["high"], 1) else \
            f"{100 * m['low']:.1f} to {100 * m['high']:.1f}"
        over = "the report's one difference of it" if m["differences"] == 1 else \
            f"pooled over the report's {m['differences']} differences of it"
        parts.append(f"{size} points of {JUDGED[key]} (its paired per-seed spread, {over}: {100 * m['sd']:.1f} "
                     f"points on {m['df']} degrees of freedom)")
    if not parts:
        return []
    family = f"Holm over all {judged['judged']} judged" if judged["judged"] > 1 else "the one difference judged"
    return [f"**Minimum detectable difference**: {'; '.join(parts)}. That is the true difference these seeds and "
            f"held-out problems find outside the noise {100 * POWER:.0f}% of the time, {family} (gspo.lab.power, "
            "docs/compare.md \"Power\"); a difference within the noise "
            "and smaller than it is not evidence of no difference. `gspo compare --plan` gives the seeds a smaller "
            "one needs."]


def trained_minutes(out: Path, report: dict) -> tuple[int, float, float | None]:
    """(runs, the sum of their wall times in minutes, the share of it spent evaluating, None
    where no run recorded it): the comparison's runs (trained by this invocation or an earlier
    one), a run directory linked to another's counted once (by the link, or, without the runs
    at hand, by its figures: the same as the other's to the wall time)."""
    same = _same_runs(report)
    runs = [v for name, r in report.items() for seed, v in r["seeds"].items()
            if same[name] == name and not (out / "runs" / f"{name}-seed{seed}").is_symlink()]
    wall = sum(w for v in runs if is_number(w := v.get("wall_seconds")))  # a run without one counts 0 (report.md says)
    timed = [v["eval_seconds"] for v in runs if is_number(v.get("eval_seconds"))]
    return len(runs), wall / 60, (sum(timed) / wall if wall else 0.0) if timed else None


def _unrecorded(report: dict) -> list[str]:
    """Lines naming the seeds whose final accuracy or wall time is missing or not a number: left out of
    their configuration's mean, its differences and the minutes (a diverged run's NaN would otherwise
    make its configuration look as good as its surviving seeds)."""
    lines = []
    for name, r in report.items():
        for key, what, left in (("accuracy", "final accuracy", "its mean and its differences"),
                                ("wall_seconds", "wall time", "the minutes trained")):
            missing = [s for s, v in r["seeds"].items() if not is_number(v.get(key))]
            if missing:
                lines.append(f"- {name}: seed{'s' * (len(missing) > 1)} {', '.join(missing)} of {len(r['seeds'])} "
                             f"recorded no {what} (left out of {left}).")
    return ["**Seeds with a figure missing:**", "", *lines, ""] if lines else []


def _setting(cfg) -> str:
    return (f"model `{cfg.policy.model or 'the task default'}`, task `{cfg.data.dataset or cfg.data.task}`, "
            f"{cfg.run.steps} steps of {cfg.sampling.prompts_per_step} prompts x {cfg.sampling.group_size} "
            f"completions, {cfg.loss.num_minibatches} minibatches per rollout")


def _settings(w: _Written) -> str:
    """What the runs trained: the base configuration's model, task and sizes; a study whose levels bring
    their own (the objectives preset's tasks), each level's, as its first run's config.yaml says."""
    study = w.study
    if study is None or not study.axis.level_options:
        text = _setting(w.base)
        return text[0].upper() + text[1:]
    from gspo.config.yamlfile import load_yaml

    parts = []
    for level in study.levels:
        tag = study.axis.tag(level)
        saved = next((path for name, _ in study.configs for seed in w.seeds
                      if (path := w.out / "runs" / f"{name}@{tag}-seed{seed}" / "config.yaml").exists()), None)
        parts.append(f"at {study.axis.name} {tag}: " + (_setting(load_yaml(saved)) if saved else
                                                        "its runs' settings not found"))
    return "Each level its own settings; " + "; ".join(parts)


def _report_md(w: _Written, judged: dict) -> None:
    out, report, seeds, seconds, study = w.out, w.report, w.seeds, w.seconds, w.study
    runs, minutes, eval_share = trained_minutes(out, report)
    evaluating = "" if eval_share is None else f"; {100 * eval_share:.0f}% of it evaluating"
    invocation = ("this report re-rendered from compare.json (gspo.lab.report.rerender: no training)" if seconds is None
                  else f"this report's invocation {seconds / 60:.1f} minutes")
    lines = [
        "# gspo compare",
        "",
        f"{_settings(w)}, seeds {', '.join(map(str, seeds))}; {runs} runs trained in {minutes:.1f} minutes (their "
        f"wall times{evaluating}), {invocation}.",
        "",
        "| configuration | held-out accuracy (before -> best -> after ± 95%) | mean clip/frac | mean moe/drift | "
        "mean moe/drift_in_ratio | mean mismatch/token_abs | diverged | wall time |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in report.items():
        diverged = r.get("diverged_count", int(bool(r.get("diverged"))))
        lines.append(f"| {name} | {_fmt(r.get('accuracy_before'), True)} -> {_fmt(r.get('accuracy_best'), True)} "
                     f"-> {_fmt(r['accuracy'], True)}{_pm(r.get('accuracy_ci95'), True)} | "
                     f"{_fmt(r.get('clip_frac_mean'))} | {_fmt(r.get('drift_mean'))} | "
                     f"{_fmt(r.get('drift_in_ratio_mean'))} | {_fmt(r.get('mismatch_mean'))} | "
                     f"{diverged}/{len(r['seeds'])} | {r['wall_seconds']:.0f} s |")
    if "gspo" in report and "grpo" in report and report["grpo"]["clip_frac_mean"]:
        ratio = report["gspo"]["clip_frac_mean"] / report["grpo"]["clip_frac_mean"]
        lines += ["", f"GSPO clips {ratio:.0f}x the fraction of tokens GRPO clips (the paper: about 100x)."]
    lines += [
        "",
        "`moe/drift`: share of (token, layer) top-k expert sets the current router picks that differ from "
        "the old policy's, averaged over updates; `moe/drift_in_ratio`: the same for the experts actually "
        "used to compute the ratio (0 under Routing Replay). \"Diverged\": a non-finite loss, or the final "
        f"held-out accuracy more than {100 * COLLAPSE_POINTS:.0f} points below the run's best; counted per "
        "seed (`diverged_count`), and `diverged` if any seed did.",
        "",
        *[line for png, title in (("reward_accuracy.png", "reward and accuracy"),
                                  ("clip_fraction.png", "clip fraction"))
          if (out / png).exists() for line in (f"![{title}]({png})", "")],  # re-rendered: the plots kept
        "![drift](drift.png)" if (out / "drift.png").exists() else "No drift plot: the model is dense (no routers).",
        "",
        "![mismatch](mismatch.png)" if (out / "mismatch.png").exists() else
        "No mismatch plot: every configuration samples with the policy itself (mismatch/token_abs is logged "
        "only with --old-logp recompute).",
        "",
    ]
    if study is not None:  # a comparison along a factor: its tables and plots (study.md, *_vs_*.png)
        from gspo.lab.studies import write_study

        lines += write_study(study, report, out, len(seeds))
    lines += noise_lines(report, judged, w.eval_n)
    if (out / "variance.md").exists():  # the no-training measurement (gspo.lab.variance)
        table = (out / "variance.md").read_text().split("\n", 2)[2]  # without its title
        lines += ["## Importance-ratio variance by response length", "", table, "![variance](variance.png)", ""]
    atomic_write_text(out / "report.md", "\n".join(lines))
