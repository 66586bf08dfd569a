"""`gspo compare`: the paper's comparisons at small scale, in one command.

    gspo compare                                   # GSPO, GRPO, GRPO + Routing Replay on tiny-moe
    gspo compare --preset length                   # long answers (chain task), + the ratio variance by length
    gspo compare --configs gspo grpo --seeds 0 1 --steps 40
    gspo compare --configs gspo "grpo-hot:algorithm=grpo,lr=3e-4"
    from gspo.compare import compare; compare(base_config, ["gspo", "grpo"], seeds=[0], out_dir="runs/cmp")

Every configuration trains from the same model on the same task with the same seeds (so the
same prompts), each in `OUT/runs/<name>-seed<k>/` (an ordinary run directory). Then:

- `compare.json`: configuration name -> {"accuracy", "accuracy_before", "accuracy_best", "clip_frac_mean",
  "drift_mean", "drift_in_ratio_mean", "mismatch_mean", "wall_seconds", "eval_n", "diverged",
  "diverged_count", "seeds": {...}}, averaged over seeds, each averaged `<name>` with a sibling
  `<name>_ci95`, the half-width of its 95% interval (Student t over the seeds: gspo.stats; null with
  one seed); drift values are null for dense models.
- `report.md`: the same as a table, the clip-fraction ratio of GSPO to GRPO, the plots, and the
  noise in words: one evaluation's own (binomial over the held-out problems), and which
  differences of final accuracy are outside the seeds' noise (paired over the seeds).
- `reward_accuracy.png` (Fig. 1 in miniature), `clip_fraction.png` (Fig. 2, log scale),
  `drift.png` (expert drift per update; Fig. 3's subject), `mismatch.png` (the sampler/trainer
  log-prob gap, when a configuration recomputes the old log-probs).
- with `variance_models` (the `length` preset): `variance.md`, `variance.json`, `variance.png`,
  the importance-ratio variance by response length of one update (gspo.variance), also in report.md.

"Diverged": a non-finite loss, or a final held-out accuracy more than 10 points below the
best held-out accuracy the run reached (an irreversible collapse).

Configurations are named presets (`PRESETS`) or `name:key=value,key=value` over the base
configuration (keys are `gspo train` option names).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from gspo import checkpoint as ckpt
from gspo.checks import check_value, yaml_value
from gspo.config import SECTION_OF, ConfigError, TrainConfig
from gspo.resolve import resolve
from gspo.stats import ci95, eval_noise, outside_noise, paired_ci95

PRESETS: dict[str, dict] = {
    "gspo": {"algorithm": "gspo"},
    "grpo": {"algorithm": "grpo"},
    "grpo-rr": {"algorithm": "grpo", "routing_replay": True},
    "gspo-rr": {"algorithm": "gspo", "routing_replay": True},
    "gspo_token": {"algorithm": "gspo_token"},
    "ppo": {"algorithm": "ppo"},
    "gspo-bf16-sampling": {"algorithm": "gspo", "old_logp": "sampling", "rollout_dtype": "bfloat16"},
    "grpo-bf16-sampling": {"algorithm": "grpo", "old_logp": "sampling", "rollout_dtype": "bfloat16"},
    "cispo": {"algorithm": "cispo"},
    "sapo": {"algorithm": "sapo"},
    "gmpo": {"algorithm": "gmpo"},
    # sampler/trainer mismatch corrections, for a base with --rollout-dtype bfloat16 or --rollout-engine vllm
    "gspo-tis": {"algorithm": "gspo", "rollout_is": "token"},
    "gspo-icepop": {"algorithm": "gspo", "rollout_is": "token", "rollout_is_mode": "mask"},
    "gspo-seq-mask": {"algorithm": "gspo", "rollout_is": "geometric", "rollout_is_mode": "mask",
                      "rollout_is_low": 0.999, "rollout_is_high": 1.001},  # the per-token geometric gap within ±0.1%
    "gspo-opsm": {"algorithm": "gspo", "opsm_delta": 1e-3},
}
DEFAULT_CONFIGS = ("gspo", "grpo", "grpo-rr")
COLLAPSE_POINTS = 0.10


@dataclasses.dataclass(frozen=True)
class ComparePreset:
    """A named comparison: its configurations, its base `gspo train` options (flags override
    them) and the models of its no-training ratio-variance measurement (gspo.variance)."""

    configs: tuple[str, ...]
    base: dict
    variance_models: tuple[str, ...] = ()
    about: str = ""


COMPARE_PRESETS = {
    "paper": ComparePreset(DEFAULT_CONFIGS, {"model": "tiny-moe", "steps": 80, "eval_every": 10},
                           about="GSPO, GRPO, GRPO + Routing Replay on tiny-moe, arithmetic (4-token answers)"),
    # long answers (55-217 tokens): where token and sequence ratios part ways; docs/length.md
    "length": ComparePreset(
        ("gspo", "grpo", "grpo-rr", "gspo_token"),
        {"model": "tiny-long-moe", "task": "chain", "steps": 10, "prompts_per_step": 8, "eval_every": 5,
         "eval_size": 100, "lr": 2e-4, "samples_per_step": 2},
        variance_models=("tiny-long-moe", "tiny-long"),
        about="GSPO, GRPO, GRPO + RR, GSPO-token on tiny-long-moe, chain (long answers); ratio variance"),
}


def _flags(options: dict) -> str:
    """`{"model": "tiny-moe", "lr": 2e-4}` -> `--model tiny-moe --lr 0.0002` (as gspo train takes them)."""
    return " ".join(f"--{k.replace('_', '-')} {v:g}" if isinstance(v, float) else f"--{k.replace('_', '-')} {v}"
                    for k, v in options.items())


def compare_help() -> str:
    """`gspo compare --help`'s own part (the base options follow it)."""
    presets = "\n".join(f"                       {name}: {p.about}\n                         ({_flags(p.base)})"
                        for name, p in COMPARE_PRESETS.items())
    return ("gspo compare: train several configurations on the same model, task and seeds; write a report.\n"
            "  --preset NAME        a named comparison (default: paper), with its base options:\n"
            f"{presets}\n"
            f"  --configs NAME ...   presets: {', '.join(PRESETS)}; or name:key=value,key=value\n"
            "                       (default: the preset's)\n"
            "  --seeds N ...        seeds (default: 0 1 2); results are averaged over them\n"
            "  --variance-responses N  responses sampled for the length preset's ratio variance (default 512)\n"
            "  --output-dir DIR     report directory (default: runs/compare-<date>-<time>); an interrupted\n"
            "                       compare resumes when given the same directory\n"
            "Every gspo train option sets the base configuration over the preset's (stress length with\n"
            "--num-minibatches 8 or 16, a higher --lr, or a --model built with more experts).\n")


def parse_config(spec: str) -> tuple[str, dict]:
    """A preset name, or `name:key=value,key=value` (values parsed as YAML, checked by type)."""
    if ":" not in spec:
        if spec not in PRESETS:
            raise ConfigError(f"unknown configuration {spec!r}; presets: {', '.join(PRESETS)}, "
                              "or name:key=value,key=value")
        return spec, dict(PRESETS[spec])
    name, _, body = spec.partition(":")
    fields = set(SECTION_OF)
    out = {}
    for item in filter(None, body.split(",")):
        key, eq, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or key not in fields:
            raise ConfigError(f"configuration {name!r}: {item!r} is not key=value with a gspo train option as key")
        out[key] = check_value(key, yaml_value(raw), f"configuration {name!r}: {key}")
    return name, out


def _mean(xs):
    xs = [x for x in xs if x is not None and isinstance(x, (int, float)) and math.isfinite(x)]
    return statistics.fmean(xs) if xs else None


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


def summarise(run_dir: Path) -> dict:
    rows = ckpt.read_jsonl(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    evals = [e["accuracy"] for e in summary.get("evals", []) if e.get("accuracy") is not None]
    final = summary["eval_after"]["accuracy"]  # None: no evaluation, or the reward scored no completion
    def bad(v):  # NaN/inf are written to metrics.jsonl as null
        return v is None or (isinstance(v, float) and not math.isfinite(v))

    nonfinite = any(k in r and bad(r[k]) for r in rows for k in ("loss/policy", "grad_norm"))
    return {
        "accuracy": final,
        "accuracy_before": summary["eval_before"]["accuracy"],
        "accuracy_best": max(evals + [final], default=None, key=lambda a: -1 if a is None else a),  # the best reached
        "clip_frac_mean": _mean([r.get("clip/frac") for r in rows]),
        "drift_mean": _mean([r.get("moe/drift") for r in rows]),
        "drift_in_ratio_mean": _mean([r.get("moe/drift_in_ratio") for r in rows]),
        "mismatch_mean": _mean([r.get("mismatch/token_abs") for r in rows]),
        "reward_last10_mean": _mean([r.get("reward/mean") for r in rows[-10:]]),
        "diverged": bool(nonfinite or (evals and final is not None and final < max(evals) - COLLAPSE_POINTS)),
        "wall_seconds": summary["wall_seconds"],
        "eval_n": summary["eval_after"].get("n") or 0,  # held-out problems each accuracy is measured on
    }


def aggregate(per_seed: dict[int, dict]) -> dict:
    """One configuration's figures over its seeds: each the mean, with `<name>_ci95` the half-width
    of its 95% interval (Student t over the seeds, gspo.stats; None with one seed); `diverged`:
    whether any seed diverged, `diverged_count`: how many; `seeds`: every seed's own figures."""
    agg = {}
    for k in next(iter(per_seed.values())):
        values = [v[k] for v in per_seed.values()]
        if k == "diverged":
            agg.update(diverged=any(values), diverged_count=sum(map(bool, values)))
        else:
            agg[k], agg[f"{k}_ci95"] = ci95(values)
    return {**agg, "seeds": {str(s): v for s, v in per_seed.items()}}


@dataclass(frozen=True)
class VarianceRun:
    """The ratio-variance measurement a comparison adds (gspo.variance): the ratio variance by
    response length of each of `models` under the base configuration, from `responses` sampled
    responses per model."""

    models: tuple[str, ...] = ()
    responses: int = 512


def compare(base: TrainConfig, configs: list[str], *, seeds: list[int], out_dir: str | Path, log=print,
            variance: VarianceRun = VarianceRun()) -> dict:
    """Train every configuration for every seed; write compare.json, report.md and the plots.
    variance: with models, also measure the ratio variance by response length (variance.md,
    .json, .png)."""
    from gspo.trainer import train

    out = Path(out_dir)
    specs = [parse_config(c) for c in configs]
    names = [n for n, _ in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"configuration names repeat: {', '.join(names)}")
    if out.exists() and any(out.iterdir()) and not (out / "runs").is_dir():
        raise FileExistsError(f"{out}: exists, is not empty, and is not a gspo compare directory")
    # validate every configuration before training any of them
    cfgs = {}
    for name, overrides in specs:
        for seed in seeds:
            cfg = dataclasses.replace(base, **{**overrides, "seed": seed,
                                               "output_dir": str(out / "runs" / f"{name}-seed{seed}")})
            resolve(cfg)  # raises on a bad value before anything trains
            cfgs[(name, seed)] = cfg
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    results: dict[str, dict] = {}
    for (name, seed), cfg in cfgs.items():
        run = Path(cfg.run.output_dir)
        if (run / "summary.json").exists():
            log(f"[compare] {name} seed {seed}: already done, reusing {run}")
        else:
            log(f"[compare] {name} seed {seed}: training ({cfg.loss.algorithm}, {cfg.run.steps} steps)")
            resume = run if ckpt.latest_checkpoint(run) is not None else None
            train(cfg, resume=resume, log=log)
        results.setdefault(name, {})[seed] = summarise(run)

    report = {name: aggregate(per_seed) for name, per_seed in results.items()}
    ckpt.atomic_write_text(out / "compare.json", json.dumps(ckpt.json_clean(report), indent=2) + "\n")
    if variance.models and not (out / "variance.json").exists():
        from gspo.variance import ratio_variance, write_variance

        log(f"[compare] ratio variance by response length: {', '.join(variance.models)}")
        write_variance([ratio_variance(dataclasses.replace(base, model=m), responses=variance.responses, log=log)
                        for m in variance.models], out)
    _plots(out, names, seeds)
    _report_md(out, base, report, seeds, time.time() - t0)
    return report


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


def noise_lines(report: dict) -> list[str]:
    """The report's noise, in words: one evaluation's own, and which final-accuracy differences
    between configurations are outside the seeds' noise (paired over the seeds they share)."""
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
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            seeds = sorted(set(report[a]["seeds"]) & set(report[b]["seeds"]))
            mean, half = paired_ci95([report[a]["seeds"][s]["accuracy"] for s in seeds],
                                     [report[b]["seeds"][s]["accuracy"] for s in seeds])
            if mean is None:
                continue
            verdict = {True: "outside the noise", False: "within the noise",
                       None: "one seed: no interval"}[outside_noise(mean, half)]
            lines.append(f"- {a} - {b}: {100 * mean:+.1f}{_pm(half, True)} points of final accuracy (paired over "
                         f"{len(seeds)} seeds): {verdict}.")
    return lines + [""]


def _report_md(out: Path, base: TrainConfig, report: dict, seeds: list[int], seconds: float) -> None:
    lines = [
        "# gspo compare",
        "",
        f"Model `{base.policy.model or 'the task default'}`, task `{base.data.dataset or base.data.task}`, "
        f"{base.run.steps} steps of {base.sampling.prompts_per_step} prompts x {base.sampling.group_size} completions, {base.loss.num_minibatches} minibatches per rollout, seeds "
        f"{', '.join(map(str, seeds))}; {seconds / 60:.1f} minutes in all.",
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
    lines += noise_lines(report)
    if (out / "variance.md").exists():  # the no-training measurement (gspo.variance)
        table = (out / "variance.md").read_text().split("\n", 2)[2]  # without its title
        lines += ["## Importance-ratio variance by response length", "", table, "![variance](variance.png)", ""]
    ckpt.atomic_write_text(out / "report.md", "\n".join(lines))
