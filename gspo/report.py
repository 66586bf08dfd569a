"""`gspo compare`'s report: report.md, and the plots of the runs against the training step.

    write_report(out, base, report, seeds, seconds, study=None)   # after gspo.compare.compare trained the runs

report.md: the table of every configuration's figures (means over seeds ± their 95% interval),
the plots (reward_accuracy.png, clip_fraction.png, drift.png, mismatch.png), the noise in words
(`noise_lines`), and the sections a comparison adds (a study against a factor: gspo.studies; the
ratio variance by length: gspo.variance).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from gspo import checkpoint as ckpt
from gspo.stats import eval_noise, outside_noise, paired_ci95

COLLAPSE_POINTS = 0.10  # "diverged": the final held-out accuracy this far below the run's best


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
    from gspo.plot import plot_panels

    rows = {n: [ckpt.read_jsonl(out / "runs" / f"{n}-seed{s}" / "metrics.jsonl") for s in seeds] for n in names}
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


def write_report(out: Path, base, report: dict, seeds: list[int], seconds: float, *, study=None) -> None:
    """The plots against the step, the study's tables and plots against its factor (gspo.studies),
    and report.md."""
    _plots(out, list(report), seeds)
    _report_md(out, base, report, seeds, seconds, study)


# the figures whose differences the noise lines judge, and how they name them
JUDGED = {"accuracy": "final accuracy", "accuracy_curve_mean": "accuracy averaged over the evaluations"}


def noise_lines(report: dict, pairs: list[tuple[str, str]] | None = None,
                figures: tuple[str, ...] = ("accuracy",)) -> list[str]:
    """The report's noise, in words: one evaluation's own, and which differences of `figures`
    (final accuracy by default) between configurations are outside the seeds' noise (paired over
    the seeds they share). pairs: the differences to judge (default: every pair of configurations)."""
    lines = ["## Noise", "",
             "Figures are means over seeds; ± is the half-width of their 95% interval (Student t over the seeds, "
             "`<name>_ci95` in compare.json)."]
    n = max((r.get("eval_n") or 0 for r in report.values()), default=0)
    accs = [r["accuracy"] for r in report.values() if r.get("accuracy") is not None]
    if n and accs:
        worst = max(eval_noise(a, int(n)) for a in accs)
        lines.append(f"One held-out accuracy is measured on {int(n)} problems: its own 95% interval is up to "
                     f"±{100 * worst:.1f} points (binomial, at these accuracies), whatever the training.")
    names = list(report)
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]] if pairs is None else pairs
    for key in figures:
        for a, b in pairs:
            if a not in report or b not in report:
                continue
            seeds = sorted(set(report[a]["seeds"]) & set(report[b]["seeds"]))
            mean, half = paired_ci95([report[a]["seeds"][s].get(key) for s in seeds],
                                     [report[b]["seeds"][s].get(key) for s in seeds])
            if mean is None:
                continue
            verdict = {True: "outside the noise", False: "within the noise",
                       None: "one seed: no interval"}[outside_noise(mean, half)]
            lines.append(f"- {a} - {b}: {100 * mean:+.1f}{_pm(half, True)} points of {JUDGED[key]} (paired over "
                         f"{len(seeds)} seeds): {verdict}.")
    return lines + [""]


def trained_minutes(out: Path, report: dict) -> tuple[int, float, float]:
    """(runs, the sum of their wall times in minutes, the share of it spent evaluating): the
    comparison's runs (trained by this invocation or an earlier one), a run directory linked to
    another's counted once."""
    runs = [v for name, r in report.items() for seed, v in r["seeds"].items()
            if not (out / "runs" / f"{name}-seed{seed}").is_symlink()]
    wall = sum(v["wall_seconds"] for v in runs)
    return len(runs), wall / 60, sum(v.get("eval_seconds") or 0.0 for v in runs) / wall if wall else 0.0


def _report_md(out: Path, base, report: dict, seeds: list[int], seconds: float, study) -> None:
    runs, minutes, eval_share = trained_minutes(out, report)
    lines = [
        "# gspo compare",
        "",
        f"Model `{base.policy.model or 'the task default'}`, task `{base.data.dataset or base.data.task}`, "
        f"{base.run.steps} steps of {base.sampling.prompts_per_step} prompts x {base.sampling.group_size} completions, {base.loss.num_minibatches} minibatches per rollout, seeds "
        f"{', '.join(map(str, seeds))}; {runs} runs trained in {minutes:.1f} minutes (their wall times; "
        f"{100 * eval_share:.0f}% of it evaluating), this report's invocation {seconds / 60:.1f} minutes.",
        "",
        "| configuration | held-out accuracy (before -> best -> after) | mean clip/frac | mean moe/drift | "
        "mean moe/drift_in_ratio | mean mismatch/token_abs | diverged | wall time |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in report.items():
        lines.append(f"| {name} | {_fmt(r['accuracy_before'], True)} -> {_fmt(r['accuracy_best'], True)} -> "
                     f"{_fmt(r['accuracy'], True)}{_pm(r.get('accuracy_ci95'), True)} | "
                     f"{_fmt(r['clip_frac_mean'])} | {_fmt(r['drift_mean'])} | {_fmt(r['drift_in_ratio_mean'])} | "
                     f"{_fmt(r.get('mismatch_mean'))} | "
                     f"{r.get('diverged_count', int(r['diverged']))}/{len(r['seeds'])} | {r['wall_seconds']:.0f} s |")
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
        "![reward and accuracy](reward_accuracy.png)",
        "",
        "![clip fraction](clip_fraction.png)",
        "",
        "![drift](drift.png)" if (out / "drift.png").exists() else "No drift plot: the model is dense (no routers).",
        "",
        "![mismatch](mismatch.png)" if (out / "mismatch.png").exists() else
        "No mismatch plot: every configuration samples with the policy itself (mismatch/token_abs is logged "
        "only with --old-logp recompute).",
        "",
    ]
    if study is not None:  # a comparison along a factor: its tables and plots (study.md, *_vs_*.png)
        from gspo.studies import write_study

        lines += write_study(study, report, out, len(seeds))
    lines += noise_lines(report, study.pairs() if study else None,
                         ("accuracy", "accuracy_curve_mean") if study else ("accuracy",))
    if (out / "variance.md").exists():  # the no-training measurement (gspo.variance)
        table = (out / "variance.md").read_text().split("\n", 2)[2]  # without its title
        lines += ["## Importance-ratio variance by response length", "", table, "![variance](variance.png)", ""]
    ckpt.atomic_write_text(out / "report.md", "\n".join(lines))
